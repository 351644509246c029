"""``amp="bf16"`` / ``"f16"``: what they mean per backend (``aotlm.core.precision``) and that the
outputs stay right.

On CPU with the kernels amp is weight storage (the big matrices in bf16 / f16, activations and KV
cache f32); without them (another backend, ``AOTLM_KERNELS=0``) it is the compute dtype. Logits
are compared with transformers' fp32 model on the peaked tiny Llama of test_quant (its
fp32 top-1 margins are >= 20% of max|logit|, so greedy tokens must agree exactly) and on the
conftest GPT-2 (tied embedding: the logits read a bf16 / f16 copy of it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import PROMPTS, rel_error
from conformance import hf_last_logits, hf_model

from aotlm import AutoModelForSampling, kernels
from aotlm.core import precision
from aotlm.core.compile_cache import entry_key
from aotlm.models import packing
from aotlm.models.axes import CONTRACT_AXES
from aotlm.models.quant import QuantizationConfig

N_POS, NEW = 32, 16
REL = {"bf16": 1e-2, "f16": 1.5e-3}  # of max|fp32 logit| (as test_quant)
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
on_kernels = pytest.mark.skipif(not kernels.enabled(), reason="needs the CPU kernels")


def _load(path, **kw):
    return AutoModelForSampling.from_pretrained(
        path, batch_size=2, n_positions=N_POS, context_length_estimate=N_POS, compile_cache=False, **kw
    )


@pytest.fixture(scope="module")
def runs(peaked):
    """amp -> (model, last-prompt logits, greedy tokens) on the peaked Llama."""
    out = {}
    for amp in ("f32", "bf16", "f16"):
        m = _load(peaked, amp=amp)
        out[amp] = (m, m.forward(PROMPTS), m.sample(PROMPTS, max_new_tokens=NEW))
    return out


@pytest.mark.parametrize("amp", ["bf16", "f16"])
def test_logits_close_to_transformers_and_greedy_equals_f32(peaked, runs, amp):
    want = hf_last_logits(hf_model(peaked), PROMPTS)
    m, logits, tokens = runs[amp]
    assert m.amp == amp  # what the user asked, whatever the backend makes of it
    err = rel_error(logits, want)
    print(f"amp={amp} ({m.precision.describe()}): max|dz| / max|z_hf32| = {err:.2e}")
    assert 0 < err <= REL[amp]
    assert rel_error(runs["f32"][1], want) < 1e-5  # the f32 path is the reference's
    np.testing.assert_array_equal(tokens, runs["f32"][2])  # all NEW greedy tokens


@pytest.mark.parametrize("amp", ["bf16", "f16"])
def test_gpt2_tied_embedding_logits_close_to_transformers(gpt2_path, amp):
    want = hf_last_logits(hf_model(gpt2_path), PROMPTS)
    m = _load(gpt2_path, amp=amp)
    err = rel_error(m.forward(PROMPTS), want)
    print(f"gpt2 amp={amp}: max|dz| / max|z_hf32| = {err:.2e}")
    assert 0 < err <= REL[amp]
    if kernels.enabled():  # the tied lm_head reads a copy of the embedding in amp's dtype
        assert m.params["embed_q"].dtype == precision.AMP_DTYPES[amp]


@on_kernels
@pytest.mark.parametrize("amp", ["bf16", "f16"])
def test_kernels_store_amp_weights_with_f32_activations(peaked, runs, amp):
    m32, m = runs["f32"][0], runs[amp][0]
    dt = precision.AMP_DTYPES[amp]
    assert m.precision.weights_only and m.dtype == jnp.float32
    layer, ref = m.params["layers"][0], m32.params["layers"][0]
    for name in MATRICES:
        assert layer[name].dtype == dt, name
        assert layer[name].nbytes * 2 == ref[name].nbytes, name  # the matrices' memory halves
        assert packing.is_packed(name, layer[name].ndim), name  # in the kernels' panel layout
    assert m.params["lm_head"].dtype == dt and not {f"{n}_scale" for n in MATRICES} & set(layer)
    big = lambda mm: sum(w.nbytes for p in mm.params["layers"] for k, w in p.items() if k in CONTRACT_AXES)
    assert big(m) * 2 == big(m32)
    assert m.params["embed"].dtype == np.float32 and layer["ln1_scale"].dtype == np.float32
    assert all(c.dtype == np.float32 for c in m.cache["k"] + m.cache["v"])
    decode = [exe.as_text() for key, exe in m._executables.items() if key[0] == "decode"]
    assert decode and all("aotlm_wmm" in t for t in decode)
    # the same computation as quant=amp (weights only) at amp f32: the same logits, bit for bit
    np.testing.assert_array_equal(_load(peaked, quant=amp).forward(PROMPTS), runs[amp][1])


def test_without_kernels_amp_is_the_compute_dtype(peaked, monkeypatch):
    """Other backends (here: the kernels switched off) keep amp's meaning: every weight, the
    activations and the KV cache in bf16."""
    monkeypatch.setenv("AOTLM_KERNELS", "0")
    m = _load(peaked, amp="bf16")
    assert m.amp == "bf16" and not m.precision.weights_only and m.dtype == jnp.bfloat16
    assert {a.dtype for a in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    # a bf16 cache on CPU holds its bits as uint16 (aotlm.models.layers.cache_view)
    assert m.precision.kv == jnp.bfloat16 and all(c.dtype == jnp.uint16 for c in m.cache["k"] + m.cache["v"])
    assert rel_error(m.forward(PROMPTS), hf_last_logits(hf_model(peaked), PROMPTS)) <= REL["bf16"]


def test_resolve_per_backend():
    s8 = QuantizationConfig(quant_dtype="s8", dequant_dtype="bf16")
    p = precision.resolve("bf16", None, kernels_on=False)
    assert (p.compute, p.kv, p.quant, p.weights_only) == (jnp.bfloat16, jnp.bfloat16, None, False)
    p = precision.resolve("bf16", None, kernels_on=True)
    assert (p.compute, p.kv, p.quant.quant_dtype, p.weights_only) == (jnp.float32, jnp.float32, "bf16", True)
    assert precision.resolve("f16", None, kernels_on=True).quant.quant_dtype == "f16"
    assert precision.resolve("bf16", s8, kernels_on=True).quant == s8  # int8 weights, f32 activations
    assert precision.resolve("bf16", s8, kernels_on=False).compute == jnp.bfloat16  # dequant to bf16
    assert precision.resolve("f32", "bf16", kernels_on=True).quant.quant_dtype == "bf16"
    assert "bf16 weights, f32 activations, f32 KV" in precision.resolve("bf16", None, True).describe()


def test_dequant_dtype_must_match_amp(peaked):
    with pytest.raises(ValueError, match=r"dequant_dtype='bf16'\) does not match amp='f32'.*amp='bf16'"):
        _load(peaked, quant=QuantizationConfig(quant_dtype="s8", dequant_dtype="bf16"))
    with pytest.raises(ValueError, match=r"dequant_dtype='f16'\) does not match amp='bf16'"):
        precision.resolve("bf16", QuantizationConfig(dequant_dtype="f16"))
    with pytest.raises(ValueError, match="dequant_dtype='f8' is not supported"):
        QuantizationConfig(dequant_dtype="f8")
    with pytest.raises(ValueError, match="amp='f64' is not supported"):
        precision.resolve("f64", None)
    precision.check_dequant("f16", QuantizationConfig(dequant_dtype="f16"))  # equal: fine


@on_kernels
def test_int8_with_bf16_dequant_runs_the_int8_path(peaked, runs):
    """transformers-neuronx's int8 example (s8 weights, dequant bf16, amp bf16) stores and runs
    exactly what ``quant="int8"`` does: int8 matrices through the int8 kernels, f32 activations."""
    tnx = _load(peaked, amp="bf16", quant=QuantizationConfig(quant_dtype="s8", dequant_dtype="bf16"))
    int8 = _load(peaked, quant="int8")
    spec = lambda m: jax.tree.map(lambda a: (a.shape, a.dtype), m.params)
    assert spec(tnx) == spec(int8)
    assert tnx.params["layers"][0]["wq"].dtype == np.int8 and tnx.amp == "bf16"
    np.testing.assert_array_equal(tnx.forward(PROMPTS), int8.forward(PROMPTS))
    tokens = tnx.sample(PROMPTS, max_new_tokens=NEW)
    np.testing.assert_array_equal(tokens, int8.sample(PROMPTS, max_new_tokens=NEW))
    np.testing.assert_array_equal(tokens, runs["f32"][2])


def test_fingerprints_differ_between_amp_modes(peaked, runs, monkeypatch):
    models = [runs[a][0] for a in ("f32", "bf16", "f16")] + [_load(peaked, quant="bf16")]
    if kernels.enabled():  # then amp="bf16" without the kernels (bf16 compute) is another mode again
        monkeypatch.setenv("AOTLM_KERNELS", "0")
        models.append(_load(peaked, amp="bf16"))
    keys = {entry_key(m.fingerprint(), ("decode", N_POS), m.mesh)[0] for m in models}
    assert len(keys) == len(models)
    assert len({m.fingerprint()["precision"] for m in models}) == len(models)
