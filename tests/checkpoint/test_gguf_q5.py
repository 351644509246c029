"""A GGUF file's Q5_0 / Q5_1 blocks kept as stored by default (``aotlm.models.q5scales``: the 5-bit codes'
low 4 bits in the 4-bit panels, the f16 scales (and minimums) and high bits in a uint8 scale leaf, 5.5 / 6
bits a weight as in the file): every matrix equals the file's values bit for bit (an lm_head whose
vocabulary is not whole panels of 16 too, padded with zero scales), and the logits stay within
int16 activations' error of transformers' float32 load of the same file, greedy tokens equal, with the
kernels and on XLA's path."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conformance import hf_generate, hf_last_logits
from gguf_builders import VOCAB, logical_matrix, tiny_llama_files

from aotlm import AutoModelForSampling, kernels
from aotlm.kernels.layout import Q5_ROWS
from aotlm.models import quant4

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
KW = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False)
TOL16 = 3e-4  # of max |logit|: x held as int16 per group of 32 (test_gguf_f32a.py: int4-f32a within 1e-4)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``files(type)``: the tiny untied Llama as a GGUF of that type (fresh conversion cache, no weight
    cache)."""
    root = tmp_path_factory.mktemp("q5_gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOTLM_GGUF_CACHE", str(root / "cache"))
    mp.setenv("AOTLM_WEIGHT_CACHE", "0")
    yield tiny_llama_files(root)
    mp.undo()


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_matrices_keep_their_5_bit_codes(files, qtype):
    path = files(qtype)
    ref = AutoModelForSampling.from_pretrained(path, quant="none", **KW)
    m = AutoModelForSampling.from_pretrained(path, **KW)
    assert m.spec.quant.label == ("int4-g32-a16" if qtype == "Q5_0" else "int4-g32-asym-a16")
    for leaf in MATRICES:
        w, sm = m.params["layers"][0][leaf], m.params["layers"][0][f"{leaf}_scale"]
        assert w.dtype == sm.dtype == np.uint8 and sm.shape[-2] == Q5_ROWS[qtype], (leaf, sm.shape)
        got = np.asarray(quant4.dequantize(jnp.asarray(w), jnp.asarray(sm), leaf))
        np.testing.assert_array_equal(got, logical_matrix(ref, leaf), err_msg=leaf)
    w, sm = m.params["lm_head"], m.params["lm_head_scale"]  # vocab 1026: padded to 1040 (65 panels)
    assert w.dtype == sm.dtype == np.uint8 and sm.shape[-2] == Q5_ROWS[qtype] and sm.shape[0] == 65
    want = logical_matrix(ref, "lm_head", None)
    got = np.asarray(quant4.dequantize(jnp.asarray(w), jnp.asarray(sm), "lm_head"))
    np.testing.assert_array_equal(got[..., : want.shape[-1]], want)
    assert not got[..., want.shape[-1] :].any()  # the padded vocabulary: zero scales
    kept = sum(
        x.nbytes
        for leaf in MATRICES
        for x in (m.params["layers"][0][leaf], m.params["layers"][0][f"{leaf}_scale"])
    )
    weights = sum(logical_matrix(ref, leaf).size for leaf in MATRICES)
    assert kept * 8 / weights == (5.5 if qtype == "Q5_0" else 6.0)  # bits a weight, as the file's blocks


NO_KERNELS = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")


@pytest.mark.parametrize(
    ("qtype", "on"), [pytest.param(t, True, marks=NO_KERNELS) for t in ("Q5_0", "Q5_1")] + [("Q5_1", False)]
)
def test_logits_and_tokens_match_transformers(files, monkeypatch, qtype, on):
    path = files(qtype)
    monkeypatch.setenv("AOTLM_KERNELS", "1" if on else "0")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    m = AutoModelForSampling.from_pretrained(path, **KW)
    assert m.params["layers"][0]["w_up_scale"].dtype == np.uint8
    prompts = np.random.default_rng(4).integers(0, VOCAB, (4, 1, 12))
    want = np.concatenate([hf_last_logits(ref, p) for p in prompts])
    got = np.concatenate([m.forward(p) for p in prompts])
    assert np.abs(got - want).max() <= TOL16 * np.abs(want).max(), np.abs(got - want).max()
    np.testing.assert_array_equal(m.sample(prompts[0], max_new_tokens=8), hf_generate(ref, prompts[0], 8))
