"""``quant="bf16a"``: bf16 weights times prefill activations rounded to bf16 (``models/lowp.py``), on
``vdpbf16ps`` where the kernels' ISA level has AVX512-BF16, else the same products through the f32
path; every path within f32 summation error of the float64 product of the rounded operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import PROMPTS, peaked_checkpoint, rel_error

from aotlm import AutoModelForSampling, kernels
from aotlm.core import precision
from aotlm.models import lowp, packing
from aotlm.models.quant import QuantizationConfig, quant_config

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="aotlm kernels unavailable on this machine")
ROWS = (17, 33, 64, 65, 100, 300)  # row kernels (x rounded, passed as f32) up to 64; more: the GEMM


def _gelu(y):
    return 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3)))


def _bf16(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


def test_bf16a_products_match_numpy_on_every_path(monkeypatch):
    """The kernels (GEMM with bias + gelu fused, or the row kernels) and XLA's dot (kernels off) give
    ``bf16(x) @ w + b`` within 1e-5 of the float64 product; odd K / 2 and K past several blocks."""
    rng = np.random.default_rng(3)
    run = jax.jit(lambda x, w, b: lowp.bf16a(x, w, 1, None, 1, b, "gelu_tanh"), static_argnums=())
    for m in ROWS:
        for k, n in ((38, 16), (1030, 48)):
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
            b = rng.standard_normal(n).astype(np.float32)
            ref = _bf16(x) @ np.asarray(w, np.float64) + b
            y, fused = run(x, jnp.asarray(packing.pack(np.asarray(w), (0,))), b)
            assert bool(fused) == (m > 64), m  # the GEMM fuses bias and gelu; the row kernels do not
            y = np.asarray(y, np.float64) if m > 64 else _gelu(np.asarray(y, np.float64) + b)
            assert rel_error(y, _gelu(ref)) <= 1e-5, (m, k, n)
    monkeypatch.setenv("AOTLM_KERNELS", "0")  # XLA's dot of the bf16 operands, f32 products and sums
    x = rng.standard_normal((65, 1030)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((1030, 48)), jnp.bfloat16)
    y, fused = jax.jit(lambda x, w: lowp.bf16a(x, w, 1, None, None))(x, w)
    assert not fused and rel_error(y, _bf16(x) @ np.asarray(w, np.float64)) <= 1e-5


def test_bf16a_option_and_config():
    q = quant_config("bf16a")
    assert q == QuantizationConfig(quant_dtype="bf16", activations="bf16") and q.bf16a and not q.w8a8
    with pytest.raises(ValueError, match="activations"):
        QuantizationConfig(quant_dtype="s8", activations="bf16")
    described = precision.resolve("f32", "bf16a").describe()
    assert "bf16 prefill" in described and described != precision.resolve("f32", "bf16").describe()


def _model(path, monkeypatch, on: bool, quant: str | None):
    monkeypatch.setenv("AOTLM_KERNELS", "1" if on else "0")
    m = AutoModelForSampling.from_pretrained(
        path, batch_size=2, n_positions=64, context_length_estimate=64, compile_cache=False, quant=quant
    ).compile()
    return m.forward(PROMPTS), m.sample(PROMPTS, max_new_tokens=12), m


def test_bf16a_model_prefill_uses_the_gemm_and_keeps_greedy_tokens(ckpt_dir, monkeypatch):
    """A 2 x 64-row prefill calls the GEMM on bf16 x; logits within bf16 rounding of f32 and greedy
    tokens equal on the peaked checkpoint; the kernels off (XLA's bf16 dot) give the same tokens."""
    path = peaked_checkpoint(ckpt_dir)
    lg32, tok32, _ = _model(path, monkeypatch, True, None)
    lg, tok, m = _model(path, monkeypatch, True, "bf16a")
    prefill = [exe.as_text() for k, exe in m._executables.items() if k[0] == "prefill"]
    assert prefill and all("aotlm_gemm_pk" in t and "bf16[128," in t for t in prefill)
    assert rel_error(lg, lg32) <= 2e-2
    np.testing.assert_array_equal(tok, tok32)
    lg_off, tok_off, off = _model(path, monkeypatch, False, "bf16a")
    assert not any("aotlm_" in e.as_text() for e in off._executables.values())
    np.testing.assert_array_equal(tok_off, tok)
    assert rel_error(lg_off, lg) <= 1e-4
