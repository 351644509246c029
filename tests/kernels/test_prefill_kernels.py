"""Prefill kernels besides the GEMMs' products (``engine/kernels/attn.h``, ``gemm.h``'s output pass).

The attention over a prompt's own tokens (``kernels.causal_attention``) against a NumPy softmax on
odd shapes (grouped-query heads, head sizes not multiples of 8 or 16, padding keys, a sliding
window, a fully hidden query row), read from separate q / k / v or in place from the fused
projection, with k and v returned in the cache's layouts; the GEMM's bias and activation (gelu
tanh, relu) against NumPy; and whole models: prefill graphs call the kernels, and greedy tokens
and logits match the pure-JAX path (``AOTLM_KERNELS=0``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import peaked_checkpoint, run_with_kernels

from aotlm import kernels
from aotlm.models import packing

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="aotlm kernels unavailable on this machine")


def _softmax_attention(q, k, v, mask, scale):
    """float64 reference: o[b,i,h] = softmax_j(scale q.k_j over visible j) @ v (zeros if none)."""
    b, t, h, _ = q.shape
    g = h // k.shape[2]
    o = np.zeros(q.shape, np.float64)
    for bi in range(b):
        for hi in range(h):
            s = (q[bi, :, hi].astype(np.float64) @ k[bi, :, hi // g].T.astype(np.float64)) * scale
            s = np.where(mask[bi], s, -np.inf)
            m = np.max(s, -1, keepdims=True)
            e = np.where(mask[bi], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
            z = e.sum(-1, keepdims=True)
            o[bi, :, hi] = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0) @ v[bi, :, hi // g]
    return o


@pytest.mark.parametrize(
    "b,t,h,kh,dh",
    [(2, 17, 4, 2, 64), (1, 128, 12, 12, 64), (3, 50, 6, 2, 80), (2, 100, 8, 1, 33), (1, 200, 2, 2, 128)],
)
def test_causal_attention_matches_numpy(b, t, h, kh, dh):
    rng = np.random.default_rng(t)
    q = rng.standard_normal((b, t, h, dh)).astype(np.float32)
    k, v = (rng.standard_normal((b, t, kh, dh)).astype(np.float32) for _ in range(2))
    mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
    mask[0, :, :3] = False  # row 0: three padding keys (so its first three queries see nothing)
    if t > 60:
        mask &= ~np.tril(np.ones((t, t), bool), -40)[None]  # a 40-slot sliding window
    f = jax.jit(lambda q, k, v, m: kernels.causal_attention(q, k, v, m, 0.125))
    o, kt, vt = (np.asarray(a) for a in f(q, k, v, mask))
    ref = _softmax_attention(q, k, v, mask, 0.125)
    assert np.abs(o - ref).max() <= 2e-6 * np.abs(ref).max()
    assert not o[0, :3].any()  # hidden query rows: zeros
    np.testing.assert_array_equal(kt, np.swapaxes(k, 1, 2))
    np.testing.assert_array_equal(vt, np.transpose(v, (0, 2, 3, 1)))
    g = h // kh  # the same numbers read in place from a fused projection [B,T,K,G+2,Dh]
    qkv = np.concatenate([q.reshape(b, t, kh, g, dh), k[:, :, :, None], v[:, :, :, None]], axis=3)
    fused = jax.jit(lambda a, m: kernels.causal_attention(a, None, None, m, 0.125))(qkv, mask)
    for got, want in zip(fused, (o, kt, vt), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def round_x16(x: np.ndarray) -> np.ndarray:
    """x as the int8 row kernel multiplies it: rounded to int16 per row (scale max|x| / 32767)."""
    s = np.abs(x).max(-1, keepdims=True) / np.float32(32767)
    return (np.rint(x / s) * s).astype(np.float32)


def _gelu_tanh(y):
    return 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3)))


@pytest.mark.parametrize("act", [None, "gelu_tanh", "relu"])
def test_gemm_bias_and_activation_match_numpy(act):
    """The GEMM's output pass: ``act(x @ W * scale + b)`` for packed int8, bf16 and f32 W and row-major f32 W,
    at 65 and 300 rows (past the row kernels; int8 on a VNNI CPU: the row kernel's, x as int16); f32 with K
    odd and N not a multiple of 16."""
    rng = np.random.default_rng(3)
    fn = {None: lambda y: y, "gelu_tanh": _gelu_tanh, "relu": lambda y: np.maximum(y, 0)}[act]
    for m, k, n in ((65, 38, 48), (300, 770, 64)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32)
        wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
        s = (rng.random(n) / 50).astype(np.float32)
        wb = rng.standard_normal((k, n)).astype(jnp.bfloat16)
        w32 = rng.standard_normal((k, n)).astype(np.float32)
        wqp = packing.pack(wq, (0,))
        xr = x if m > kernels.row_limit(wqp, 1) else round_x16(x)  # VNNI CPUs: int8 rows on the row kernel
        cases = [
            (wqp, s, 1, (xr.astype(np.float64) @ wq) * s),
            (packing.pack(wb, (0,)), None, 1, x.astype(np.float64) @ wb.astype(np.float64)),
            (packing.pack(w32, (0,)), None, 1, x.astype(np.float64) @ w32),
        ]
        xf = x[:, : k - 1]  # f32 W: odd K, N - 11 columns (a partial last panel: 5 of 16)
        wf = rng.standard_normal((k - 1, n - 11)).astype(np.float32)
        cases.append((wf, None, None, xf.astype(np.float64) @ wf))
        for w, sc, pk, ref in cases:
            xi, bi = (xf, b[: n - 11]) if pk is None else (x, b)
            assert kernels.gemm_fuses(xi, w, 1, None, pk, act)
            y = jax.jit(lambda x, w, b, sc=sc, pk=pk: kernels.matmul(x, w, sc, packed_k=pk, b=b, act=act))(
                xi, w, bi
            )
            want = fn(ref + bi)
            assert np.abs(np.asarray(y, np.float64) - want).max() <= 1e-5 * np.abs(want).max(), (m, k, act)
    assert not kernels.gemm_fuses(x, wf, 1, None, None, "silu")  # not fused: XLA applies it


@pytest.mark.parametrize("act", [None, "gelu_tanh", "relu"])
def test_row_kernels_apply_bias_and_activation(act):
    """Decode rows (1..16) on packed int8 / bf16 / f16 / f32 W: the row kernel's output pass gives
    ``act(x @ W * scale + b)`` within 1e-5 of NumPy (int8: of the int16-rounded x's bound), and an
    f32 x stays f32 / a bf16 x comes back bf16."""
    rng = np.random.default_rng(4)
    fn = {None: lambda y: y, "gelu_tanh": _gelu_tanh, "relu": lambda y: np.maximum(y, 0)}[act]
    for m, k, n in ((1, 38, 48), (5, 770, 64), (16, 130, 32)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32)
        s = (rng.random(n) / 50).astype(np.float32)
        wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
        for w, sc, tol in (
            (wq, s, 1e-4),
            (rng.standard_normal((k, n)).astype(jnp.bfloat16), None, 1e-5),
            (rng.standard_normal((k, n)).astype(np.float16), None, 1e-5),
            (rng.standard_normal((k, n)).astype(np.float32), None, 1e-5),
        ):
            wp = packing.pack(w, (0,))
            assert kernels.gemm_fuses(x, wp, 1, None, 1, act)
            f = jax.jit(lambda x, w, b, sc=sc: kernels.matmul(x, w, sc, packed_k=1, b=b, act=act))
            want = fn(x.astype(np.float64) @ w.astype(np.float64) * (1 if sc is None else sc) + b)
            y = np.asarray(f(x, wp, b), np.float64)
            assert np.abs(y - want).max() <= tol * np.abs(want).max(), (m, k, w.dtype, act)
            assert "aotlm_wmm_pk" in f.lower(x, wp, b).compile().as_text()
            yb = f(jnp.asarray(x, jnp.bfloat16), wp, b)
            assert yb.dtype == jnp.bfloat16


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("kw", [{}, {"quant": "int8"}], ids=["f32", "int8"])
def test_prefill_graphs_call_the_attention_kernel(request, ckpt_dir, monkeypatch, model, kw):
    """GPT-2 (fused q / k / v read in place; int8: the GEMM's bias + gelu) and the peaked Llama of
    test_quant (rotary: separate q / k / v, grouped heads): prefill attends in
    ``aotlm_attn``, decode does not; logits match the pure-JAX path, and the Llama's greedy tokens
    (top-1 margins >= 20% of max|logit|) are equal."""
    path = request.getfixturevalue("gpt2_path") if model == "gpt2" else peaked_checkpoint(ckpt_dir)
    lg_on, tok_on, _, m = run_with_kernels(path, monkeypatch, True, fuse_qkv=True, **kw)
    texts = {str(key): exe.as_text() for key, exe in m._executables.items()}
    assert any("prefill" in key and "aotlm_attn" in t for key, t in texts.items())
    assert not any("decode" in key and "aotlm_attn" in t for key, t in texts.items())
    lg_off, tok_off, _, _ = run_with_kernels(path, monkeypatch, False, fuse_qkv=True, **kw)
    assert np.abs(lg_on - lg_off).max() <= 1e-2 * np.abs(lg_off).max()
    if model == "llama":
        np.testing.assert_array_equal(tok_on, tok_off)
