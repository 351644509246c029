"""fp8 weights and activations (``quant="fp8"``, ``aotlm.models.quant_fp8``).

The rounding and the products against a float64 reference of the same e4m3 values; models stored that
way (every big matrix e4m3, K-minor, with a scale per output channel; a tied lm_head's own e4m3 copy;
the memory plan against the stored bytes and tensor parallelism: ``test_memory.py``, ``test_quant.py``);
their logits against f32 (bound ~3x the worst measured) and greedy tokens on the peaked checkpoint
(``test_quant.py``: fp32 top-1 margins >= 20% of the largest logit); the graphs lowered for a GPU hold
dots of two e4m3 operands with the weight's K contiguous (what cuBLASLt's fp8 GEMM takes without a
copy) and no e4m3 weight converted to a wider type. On a GPU: cuBLASLt's fp8 GEMMs in the compiled graph.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from builders import PROMPTS, rel_error

from aotlm import AutoModelForSampling
from aotlm.core.compile_cache import entry_key
from aotlm.core.precision import resolve
from aotlm.models import packing, quant_fp8
from aotlm.models.axes import CONTRACT_AXES, LOGICAL_AXES
from aotlm.models.quant import QuantizationConfig, quant_config

E4M3 = ml_dtypes.float8_e4m3fn
N_POS, NEW = 32, 16
# max|dz| / max|z32| measured: the peaked Llama 2.3e-2 (f32 and bf16 compute alike), GPT-2 (tied) 3.3e-2
REL = 1e-1


def _load(path, **kw):
    return AutoModelForSampling.from_pretrained(
        path, batch_size=2, n_positions=N_POS, context_length_estimate=N_POS, compile_cache=False, **kw
    )


def _ref(x, w, scale, axes=1, nt=False):
    """float64 reference: x's rows rounded to e4m3 with max|x| / 448, summed against w's e4m3 values."""
    x = np.asarray(x, np.float64)
    red = tuple(range(x.ndim - axes, x.ndim))
    amax = np.abs(x).max(axis=red)
    sx = np.where(amax > 0, (amax / 448.0).astype(np.float32), 1.0).astype(np.float64)
    xq = (x / sx.reshape(*sx.shape, *(1,) * axes)).astype(np.float32).astype(E4M3).astype(np.float64)
    wf = np.asarray(w).astype(np.float64)
    y = np.tensordot(xq, wf, axes=((red), ((wf.ndim - 1,) if nt else tuple(range(axes)))))
    return y * sx.reshape(*sx.shape, *(1,) * (y.ndim - sx.ndim)) * np.asarray(scale, np.float64)


def test_quantize_is_per_output_channel_and_saturates_nowhere():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32) * rng.uniform(0.01, 30, 40).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero channel (tp padding)
    q, s = quant_fp8.quantize(w, (0,))
    assert q.dtype == E4M3 and q.shape == w.shape and s.shape == (40,) and s.dtype == np.float32
    qf = q.astype(np.float32)
    assert not np.isnan(qf).any()
    assert s[3] == 0 and not qf[:, 3].any()
    live = np.arange(40) != 3
    np.testing.assert_array_equal(np.abs(qf[:, live]).max(0), 448.0)  # each channel's largest |w| -> 448
    # e4m3 keeps 3 mantissa bits: a normal value within 2^-4 of itself, a subnormal within 2^-10 of the scale
    err = np.abs(qf * s - w)
    assert (err <= np.maximum(np.abs(w) / 16, s * 2.0**-10) * (1 + 1e-6)).all()
    q1, s1 = quant_fp8.quantize(w.T.copy(), (1,))  # [N, K] rows: the embedding copy's form
    np.testing.assert_array_equal(q1.astype(np.float32), qf.T)
    np.testing.assert_array_equal(s1, s)


def test_quantize_in_row_chunks_equals_the_whole_array_formula():
    w = np.random.default_rng(1).standard_normal((4, 9000)).astype(np.float32)  # > one 64k chunk of rows
    w = np.concatenate([w] * 3)
    q, s = quant_fp8.quantize(w, (1,))
    whole = np.clip(w / (np.abs(w).max(1, keepdims=True) / np.float32(448)), -448, 448).astype(E4M3)
    np.testing.assert_array_equal(q.astype(np.float32), whole.astype(np.float32))


@pytest.mark.parametrize(("rows", "axes", "nt"), [((3,), 1, False), ((2, 5), 1, True), ((1, 2), 2, False)])
def test_dense_equals_the_float64_product_of_the_same_e4m3_values(rows, axes, nt):
    rng = np.random.default_rng(2)
    k = (4, 16) if axes == 2 else (64,)
    x = rng.standard_normal((*rows, *k)).astype(np.float32) * 5
    x.reshape(-1, *k)[0] = 0.0  # a row of zeros: scale 1, zeros out
    w = rng.standard_normal((24, 64) if nt else (*k, 24)).astype(np.float32)
    q, s = quant_fp8.quantize(w, (1,) if nt else tuple(range(axes)))
    y = jax.jit(lambda x: quant_fp8.dense(x, jnp.asarray(q), jnp.asarray(s), axes, nt))(x)
    want = _ref(x, q, s, axes, nt)
    assert y.dtype == jnp.float32 and y.shape == want.shape
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert not np.asarray(y).reshape(-1, *want.shape[len(rows) :])[0].any() and np.asarray(y).any()


def test_fp8_names_and_precision():
    q = quant_config("fp8")
    assert q == QuantizationConfig("f8") and q.fp8 and q.label == "fp8" and not q.w8a8
    assert resolve("bf16", "fp8", kernels_on=False).describe() == (
        "amp=bf16: fp8 weights, bf16, fp8 matmul activations, bf16 KV"
    )
    with pytest.raises(ValueError, match="'fp8'"):
        quant_config("fp4")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the line a CPU logs (a GPU has fp8 GEMMs)")
def test_a_cpu_says_it_has_no_fp8_path(gpt2_path, caplog):
    with caplog.at_level("WARNING", logger="aotlm.core.precision"):
        _load(gpt2_path, quant="int8")
        assert not caplog.records
        _load(gpt2_path, quant="fp8")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["quant='fp8' is for GPUs with fp8 tensor cores; on a CPU use int8 or int4 (faster)"]


@pytest.fixture(scope="module")
def runs(peaked):
    return {name: _load(peaked, **kw) for name, kw in {"f32": {}, "fp8": {"quant": "fp8"}}.items()}


def _big(params):
    return [(n, w, p) for p in [params, *params["layers"]] for n, w in p.items() if n in CONTRACT_AXES]


def test_fp8_graphs_have_their_own_compile_cache_key(runs):
    ms = [runs["f32"], runs["fp8"]]
    assert len({entry_key(m.fingerprint(), ("decode", N_POS), m.mesh)[0] for m in ms}) == 2


def test_every_big_matrix_is_e4m3_k_minor_with_a_scale_per_output_channel(runs):
    m, m32 = runs["fp8"], runs["f32"]
    big = _big(m.params)
    assert len(big) == 1 + 7 * m.cfg.n_layers  # untied lm_head + q/k/v/o/gate/up/down per layer
    for name, w, p in big:
        assert w.dtype == jnp.float8_e4m3fn and quant_fp8.is_tn(name, w.ndim), name  # [*N, *K, 1]
        nk = len(CONTRACT_AXES[name])
        want = w.shape[: w.ndim - 1 - nk]
        assert p[name + "_scale"].dtype == jnp.float32 and p[name + "_scale"].shape == want, name
    # the values: layer 0's w_down [F, D] is stored [D, F, 1], each output row its input column's codes
    w32 = m32.params["layers"][0]["w_down"]
    w32 = packing.unpack(w32, "w_down") if packing.is_packed("w_down", w32.ndim) else w32  # the CPU panels
    q, s = quant_fp8.quantize(np.asarray(w32, np.float32), (0,))
    got = np.asarray(m.params["layers"][0]["w_down"])
    np.testing.assert_array_equal(got.astype(np.float32), quant_fp8.tn(q, (0,)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(m.params["layers"][0]["w_down_scale"]), s)
    assert m.params["embed"].dtype == jnp.float32 and "embed_q" not in m.params  # untied: no copy


def test_k_minor_axes_shard_as_the_logical_ones():
    assert quant_fp8.tn_axes("wo", LOGICAL_AXES["wo"]) == (
        *LOGICAL_AXES["wo"][2:],
        *LOGICAL_AXES["wo"][:2],
        None,
    )
    assert packing.logical_axes(("layers", 0, "wq"), 4) == (
        *LOGICAL_AXES["wq"][1:],
        LOGICAL_AXES["wq"][0],
        None,
    )
    w = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # wo-like [H, Dh, D], contract (0, 1)
    np.testing.assert_array_equal(quant_fp8.tn(w, (0, 1))[..., 0], w.transpose(2, 0, 1))


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_tied_head_reads_its_own_e4m3_copy(gpt2_path, monkeypatch, kernels):
    """With the CPU kernels and without (as on a GPU). (The memory plan of fp8 against the stored leaves:
    ``tests/core/test_memory.py``, tp 1 and 2.)"""
    monkeypatch.setenv("AOTLM_KERNELS", kernels)
    m = _load(gpt2_path, quant="fp8")
    assert m.params["embed_q"].dtype == jnp.float8_e4m3fn and m.params["embed"].dtype == jnp.float32
    v, (rows, d) = m.cfg.vocab_size, m.params["embed_q"].shape
    assert v <= rows < v + 16 and d == m.params["embed"].shape[1]
    assert m.params["embed_q_scale"].shape == (rows,)
    monkeypatch.delenv("AOTLM_KERNELS")


@pytest.mark.parametrize("amp", ["f32", "bf16"])
def test_logits_bounded_and_greedy_tokens_agree(peaked, runs, monkeypatch, amp):
    """bf16 without the CPU kernels: bf16 compute, as on a GPU (with them amp="bf16" computes in f32)."""
    ref = runs["f32"]
    if amp == "bf16":
        monkeypatch.setenv("AOTLM_KERNELS", "0")
    m = runs["fp8"] if amp == "f32" else _load(peaked, quant="fp8", amp=amp)
    assert jnp.dtype(m.precision.compute) == jnp.dtype({"f32": jnp.float32, "bf16": jnp.bfloat16}[amp])
    err = rel_error(m.forward(PROMPTS), ref.forward(PROMPTS))
    print(f"peaked llama fp8 amp={amp}: max|dz| / max|z32| = {err:.2e}")
    assert 0 < err <= REL
    np.testing.assert_array_equal(
        m.sample(PROMPTS, max_new_tokens=NEW), ref.sample(PROMPTS, max_new_tokens=NEW)
    )
    monkeypatch.delenv("AOTLM_KERNELS", raising=False)


def test_gpt2_tied_logits_bounded(gpt2_path):
    err = rel_error(_load(gpt2_path, quant="fp8").forward(PROMPTS), _load(gpt2_path).forward(PROMPTS))
    print(f"gpt2 fp8: max|dz| / max|z32| = {err:.2e}")
    assert 0 < err <= REL


F8_DOT = re.compile(
    r"stablehlo\.dot_general[^\n]*contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\][^\n]*"
    r"\(tensor<[^>]*xf8E4M3FN>, tensor<([\dx]*)xf8E4M3FN>\)"
)
F8_CONVERT = re.compile(r"stablehlo\.convert[^\n]*\(tensor<[^>]*xf8E4M3FN>\)")


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_gpu_graphs_multiply_two_e4m3_operands(peaked, monkeypatch, kind):
    """Without the CPU kernels (as on a GPU) every product of the graph is one dot of two e4m3
    operands, which XLA:GPU lowers to cuBLASLt's fp8 GEMM on Hopper; no e4m3 leaf is widened."""
    monkeypatch.setenv("AOTLM_KERNELS", "0")
    m = _load(peaked, quant="fp8", amp="bf16")
    key = next(k for k in m.graph_keys() if k[0] == kind)
    text = m.lower(key).as_text()
    dots = F8_DOT.findall(text)
    assert len(dots) == len(_big(m.params)), (len(dots), len(_big(m.params)))
    for _, rhs, shape in dots:  # K contiguous in the weight (cuBLASLt's fp8 layout: no transpose)
        n, dims = shape.count("x") + 1, [int(d) for d in rhs.split(",")]
        assert dims == list(range(n - len(dims), n)), (rhs, shape)
    assert not F8_CONVERT.findall(text)
    monkeypatch.delenv("AOTLM_KERNELS")


def _hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and float(getattr(dev, "compute_capability", "0")) >= 8.9


@pytest.mark.skipif(not _hopper(), reason="needs a GPU with fp8 tensor cores (Ada / Hopper: compute 8.9+)")
def test_on_a_gpu_the_products_are_cublaslt_fp8_gemms(peaked, runs):
    m = _load(peaked, quant="fp8", amp="bf16")
    key = next(k for k in m.graph_keys() if k[0] == "decode")
    compiled = m.lower(key).compile().as_text()
    assert compiled.count("__cublas$lt$matmul$f8") >= len(_big(m.params)) // m.cfg.n_layers, "fp8 GEMMs"
    moved = re.findall(r"= f8e4m3fn\[[\d,]+\][^ ]* (?:transpose|copy)\(", compiled)
    assert not moved, f"an e4m3 operand transposed / copied before its GEMM: {moved[:3]}"  # K-minor storage
    err = rel_error(m.forward(PROMPTS), runs["f32"].forward(PROMPTS))
    assert 0 < err <= REL
