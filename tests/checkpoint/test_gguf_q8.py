"""A GGUF file's Q8_0 blocks (by default; Q5_0 / Q5_1 ones under ``quant="int8"``, whose default keeps their
5-bit codes: test_gguf_q5.py) kept as int8 groups (``aotlm.models.quant8``): every matrix holds the file's
own codes and scales (its values bit for bit), and the logits stay within 1e-4 of the largest logit of
transformers' float32 load of the same file, greedy tokens equal; the XLA path (kernels off) gives the
same tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf_builders import VOCAB, logical_matrix, tiny_llama_files

from aotlm import AutoModelForSampling, kernels
from aotlm.models import quant8
from aotlm.models.checkpoint.gguf_weights import GGUFWeights

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
KW = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``files(type)``: the tiny untied Llama as a GGUF of that type (a fresh conversion cache, no weight
    cache)."""
    root = tmp_path_factory.mktemp("q8_gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOTLM_GGUF_CACHE", str(root / "cache"))
    mp.setenv("AOTLM_WEIGHT_CACHE", "0")  # read the file, not an earlier load's leaves
    yield tiny_llama_files(root)
    mp.undo()


@pytest.mark.parametrize(("qtype", "quant"), [("Q8_0", None), ("Q5_0", "int8"), ("Q5_1", "int8")])
def test_matrices_keep_their_blocks(files, monkeypatch, qtype, quant):
    """Q8_0's default storage (and int8's of Q5_*): every matrix (the lm_head too) is int8 codes with an f16
    scale (Q5_1: and minimum) per 32 rows, equal to the file's values bit for bit; the lm_head and MLP
    matrices are never read whole as float32 (Q8_0: its codes straight from the blocks; Q5_*: a chunk of
    rows at a time)."""
    q8_file = files(qtype)
    ref = AutoModelForSampling.from_pretrained(q8_file, quant="none", **KW)
    read, floats, direct, q8_blocks = [], GGUFWeights.get, [], GGUFWeights.q8_blocks

    def spy(self, name):
        got = q8_blocks(self, name)
        direct.extend([name] if got is not None else [])
        return got

    monkeypatch.setattr(GGUFWeights, "get", lambda self, n: read.append(n) or floats(self, n))
    monkeypatch.setattr(GGUFWeights, "q8_blocks", spy)
    m = AutoModelForSampling.from_pretrained(q8_file, quant=quant, **KW)
    assert read and not [n for n in read if n.endswith(("lm_head.weight", "mlp.down_proj.weight"))]
    assert ("lm_head.weight" in direct) == (qtype == "Q8_0"), direct
    leaves = [(leaf, 0) for leaf in MATRICES] + [("lm_head", None)]
    for leaf, layer in leaves:
        src = m.params["layers"][0] if layer is not None else m.params
        w, sm = src[leaf], src[f"{leaf}_scale"]
        want = logical_matrix(ref, leaf, layer)
        assert w.dtype == np.int8 and sm.dtype == np.float16 and sm.shape[-2] == 1 + (qtype == "Q5_1"), leaf
        got = np.asarray(quant8.dequantize(jnp.asarray(w), jnp.asarray(sm), leaf))
        np.testing.assert_array_equal(got[..., : want.shape[-1]], want, err_msg=leaf)  # vocab padding


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


NO_KERNELS = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")


@pytest.mark.parametrize(
    ("qtype", "on"),
    [pytest.param(t, True, marks=NO_KERNELS) for t in ("Q8_0", "Q5_0", "Q5_1")] + [("Q8_0", False)],
)
def test_logits_match_transformers(files, monkeypatch, qtype, on):  # Q5_*: under quant="int8"
    """Logits of 4 prompts within 1e-4 of the largest (x rounded to int16 per row is the only error left;
    per-channel int8 had re-rounded every weight: 2.3% for Q8_0), 8 greedy tokens equal to transformers';
    with the kernels and on XLA's path."""
    q8_file = files(qtype)
    monkeypatch.setenv("AOTLM_KERNELS", "1" if on else "0")
    ref = _hf(q8_file)
    m = AutoModelForSampling.from_pretrained(q8_file, quant="int8" if qtype != "Q8_0" else None, **KW)
    assert m.params["layers"][0]["wq_scale"].dtype == np.float16
    prompts = np.random.default_rng(4).integers(0, VOCAB, (4, 1, 12))
    with torch.no_grad():
        want = np.concatenate([ref(torch.tensor(p)).logits[:, -1].numpy() for p in prompts])
        hf = ref.generate(
            torch.tensor(prompts[0]), attention_mask=torch.ones((1, 12), dtype=torch.long), max_new_tokens=8,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        ).numpy()  # fmt: skip
    got = np.concatenate([m.forward(p) for p in prompts])
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), np.abs(got - want).max()
    np.testing.assert_array_equal(m.sample(prompts[0], max_new_tokens=8), hf)
