"""Prefill padding rows skipped by the GEMM kernels (``aotlm.kernels.padding``, ``kernels/live.h``):
inside ``padding_rows(pad)`` a GEMM whose rows are the call's ``[B,T]`` multiplies only the live rows and
writes each padding row as the product of a row of zeros would come out (``act(bias)``), so every
output equals that of the same call on x with its padding rows zeroed; a model's prefill logits are
those of a prefill that computes every row."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import peaked_checkpoint, run_with_kernels
from test_q4 import quantized

import aotlm.kernels
from aotlm import kernels
from aotlm.models import lowp, packing

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")


def pad_mask(b: int, t: int) -> np.ndarray:
    """Row 0 right-padded (a prompt short of its bucket), row 1 left-padded, row 2 with none."""
    pad = np.zeros((b, t), bool)
    pad[0, t - 7 :] = True
    pad[1, :5] = True
    return pad


def check_skips(fn, x: np.ndarray, pad: np.ndarray) -> None:
    """``fn(x)`` inside ``padding_rows(pad)`` equals ``fn`` on x with the padding rows zeroed, outside
    it (live rows bit for bit, padding rows as computed zero rows), and its GEMM got the live rows."""
    inside = jax.jit(lambda a, p: _within(fn, a, p))
    got = np.asarray(inside(x, pad))
    want = np.asarray(jax.jit(fn)(np.where(pad[..., None], 0.0, x).astype(x.dtype)))
    np.testing.assert_array_equal(got, want)
    assert f"tensor<{pad.size}xi8>" in inside.lower(x, pad).as_text(), "the GEMM did not get the live rows"


def _within(fn, a, p):
    with kernels.padding_rows(p):
        return fn(a)


@needs_kernels
def test_packed_gemms_skip_padding_rows():
    """int8 panels with f32 x, W8A8 (x rounded by the GEMM) with bias and gelu in its output pass,
    bf16 / f32 panels, and bf16 x on bf16 panels: the same numbers as computing every row."""
    rng = np.random.default_rng(0)
    b, t, k, n = 3, 24, 40, 48
    x = rng.standard_normal((b, t, k)).astype(np.float32)
    pad = pad_mask(b, t)
    wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
    s = (rng.random(n) / 50).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    wp = packing.pack(wq, (0,))
    check_skips(lambda a: kernels.matmul(a, wp, s, packed_k=1), x, pad)
    for act in (None, "gelu_tanh"):
        check_skips(lambda a, act=act: lowp.dense("s8", a, wp, s, 1, None, 1, bias, act)[0], x, pad)
    for dt in (jnp.bfloat16, np.float32):
        wf = packing.pack(rng.standard_normal((k, n)).astype(dt), (0,))
        check_skips(lambda a, wf=wf: kernels.matmul(a, wf, None, packed_k=1), x, pad)
    wb = packing.pack(rng.standard_normal((k, n)).astype(jnp.bfloat16), (0,))  # bf16 x too (quant="bf16a")
    check_skips(lambda a: lowp.dense("bf16", a, wb, None, 1, None, 1, bias, "gelu_tanh")[0], x, pad)


@needs_kernels
def test_int4_gemm_skips_padding_rows():
    """4-bit groups (symmetric and with minimums), plain and with the bias and gelu fused."""
    rng = np.random.default_rng(1)
    b, t, k, n = 3, 24, 64, 48
    x = rng.standard_normal((b, t, k)).astype(np.float32)
    pad = pad_mask(b, t)
    for group, asym in ((32, False), (64, True)):
        w, sm, _ = quantized(rng, k, n, group, asym)
        w, sm = jnp.asarray(w), jnp.asarray(sm)
        bias = jnp.asarray(rng.standard_normal(n).astype(np.float32))
        check_skips(lambda a, w=w, sm=sm: kernels.matmul_q4(a, w, sm), x, pad)
        gelu = lambda a, w=w, sm=sm, bias=bias: kernels.matmul_q4(a, w, sm, b=bias, act="gelu_tanh")
        check_skips(gelu, x, pad)


@needs_kernels
def test_no_live_rows_operand_for_decode_rows_or_other_shapes():
    """Decode (at most ``MAX_ROWS`` rows) and a matmul whose rows are not the call's ``[B,T]`` (e.g. an
    expert's gathered tokens) compute every row."""
    rng = np.random.default_rng(2)
    wp = packing.pack(rng.integers(-127, 128, (16, 16)).astype(np.int8), (0,))
    s = np.ones(16, np.float32)
    f = jax.jit(lambda a, p: _within(lambda a: kernels.matmul(a, wp, s, packed_k=1), a, p))
    x = rng.standard_normal((2, 4, 16)).astype(np.float32)
    assert "tensor<8xi8>" not in f.lower(x, np.zeros((2, 4), bool)).as_text()
    other = rng.standard_normal((40, 16)).astype(np.float32)
    text = f.lower(other, pad_mask(2, 24)).as_text()
    assert "tensor<48xi8>" not in text and "tensor<40xi8>" not in text


@needs_kernels
@pytest.mark.parametrize("quant", ["int4-g64-asym", "w8a8"])
def test_model_prefill_is_unchanged_by_skipping(ckpt_dir, monkeypatch, quant):
    """The peaked Llama's padded prompts (shorter than the bucket): the same logits and greedy tokens
    as a prefill that multiplies the padding rows too."""
    path = peaked_checkpoint(ckpt_dir)
    lg, tok, _, m = run_with_kernels(path, monkeypatch, True, quant=quant)
    texts = [exe.as_text() for key, exe in m._executables.items() if key[0] == "prefill"]
    assert texts and all("s8[64]" in t for t in texts)  # the live rows of 2 prompts x the 32-token bucket
    monkeypatch.setattr(aotlm.kernels, "padding_rows", lambda pad: contextlib.nullcontext())
    lg_all, tok_all, _, _ = run_with_kernels(path, monkeypatch, True, quant=quant)
    np.testing.assert_array_equal(lg, lg_all)
    np.testing.assert_array_equal(tok, tok_all)
