"""A GGUF file's Q8_0 blocks kept as stored (``aotlm.models.quant8``): every matrix holds the file's own
codes and scales (its values bit for bit), and the default storage's logits stay within 1e-4 of the
largest logit of transformers' float32 load of the same file, greedy tokens equal; the XLA path (kernels
off) gives the same tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf_builders import VOCAB, tiny_config, write_gguf

from aotlm import AutoModelForSampling, kernels
from aotlm.models import packing, quant8
from aotlm.models.checkpoint.gguf_weights import GGUFWeights

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
KW = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    """The tiny untied Llama as a Q8_0 GGUF (a fresh conversion cache, no weight cache)."""
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("q8_gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOTLM_GGUF_CACHE", str(root / "cache"))
    mp.setenv("AOTLM_WEIGHT_CACHE", "0")  # read the file, not an earlier load's leaves
    ckpt = make_checkpoint(root / "hf-llama", tiny_config("llama"), scale=3.0)
    yield write_gguf(ckpt, "llama", T.Q8_0, root / "llama-Q8_0.gguf")
    mp.undo()


def logical(m, leaf: str, layer: int | None = 0) -> np.ndarray:
    """A float32 model's matrix in its logical layout (packed f32 panels unpacked)."""
    w = m.params["layers"][layer][leaf] if layer is not None else m.params[leaf]
    return np.asarray(packing.unpack(w, leaf) if packing.is_packed(leaf, w.ndim) else w)


def test_q8_0_matrices_keep_their_blocks(q8_file, monkeypatch):
    """Default storage: every matrix (the lm_head too) is int8 codes with an f16 scale per 32 rows, equal
    to the file's values bit for bit; the lm_head is rounded a chunk of rows at a time (no float32 copy)."""
    ref = AutoModelForSampling.from_pretrained(q8_file, quant="none", **KW)
    chunked, chunks = [], GGUFWeights.row_chunks
    spy = lambda self, n, *a: chunked.append(n) or chunks(self, n, *a)  # noqa: E731
    monkeypatch.setattr(GGUFWeights, "row_chunks", spy)
    m = AutoModelForSampling.from_pretrained(q8_file, **KW)
    assert "output.weight" in chunked or "lm_head.weight" in chunked
    leaves = [(leaf, 0) for leaf in MATRICES] + [("lm_head", None)]
    for leaf, layer in leaves:
        src = m.params["layers"][0] if layer is not None else m.params
        w, sm = src[leaf], src[f"{leaf}_scale"]
        want = logical(ref, leaf, layer)
        assert w.dtype == np.int8 and sm.dtype == np.float16 and sm.shape[1] == 1, leaf
        got = np.asarray(quant8.dequantize(jnp.asarray(w), jnp.asarray(sm), leaf))
        np.testing.assert_array_equal(got[..., : want.shape[-1]], want, err_msg=leaf)  # vocab padding


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


NO_KERNELS = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")


@pytest.mark.parametrize("on", [pytest.param(True, marks=NO_KERNELS), False])
def test_q8_0_logits_match_transformers(q8_file, monkeypatch, on):
    """Logits of 4 prompts within 1e-4 of the largest (x rounded to int16 per row is the only error left;
    per-channel int8 had re-rounded every weight), 8 greedy tokens equal to transformers'; with the
    kernels and on XLA's path."""
    monkeypatch.setenv("AOTLM_KERNELS", "1" if on else "0")
    ref = _hf(q8_file)
    m = AutoModelForSampling.from_pretrained(q8_file, **KW)
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
