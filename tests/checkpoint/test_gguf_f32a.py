"""A GGUF file's blocks kept as stored with activations held as f32 holds them (``quant="int4-f32a"``:
each group of x in three int8 parts, each rounding what the ones before left, ``aotlm/kernels/int4.h``):
logits within 1e-4 (relative to the largest) of transformers' float32 load of the same file, which
dequantizes it, for every block type the int4 storage keeps (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K;
Q8_0 is int8 groups, whose activations are int16), and the same greedy tokens. Plain ``"int4"`` rounds x
to int8 once, as llama.cpp does: ~100x further; ``"int4-a16"`` holds it as int16 (two int8 digits): within
~1e-4, the same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_builders import VOCAB, tiny_config, write_gguf

from aotlm import AutoModelForSampling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SHAPES = dict(batch_size=1, n_positions=[32], context_length_estimate=[16])
TOL = 1e-4  # of max |logit|: the conformance tolerance of float32 storage
TOL16 = 3e-4  # x as int16 per group of 32: 4e-5 - 1.2e-4 on these files
# file type -> the tensors of another type (llama.cpp's K_M mixes; the outputs of the tiny vocab, 1026, are
# kept as stored too, padded to whole panels of 16)
MIXES = {
    "Q4_0": {},
    "Q4_1": {},
    "Q5_0": {},
    "Q5_1": {},
    "Q4_K": {"ffn_down": "Q6_K", "attn_v": "Q6_K"},
    "Q5_K": {"ffn_down": "Q6_K", "attn_v": "Q6_K"},
    "Q6_K": {},
}
TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", pytest.param("Q6_K", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """``gguf_file(type)``: the tiny Llama (random, scale 3) as a GGUF of that type and its ``MIXES``."""
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("f32a_gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOTLM_GGUF_CACHE", str(root / "cache"))
    mp.setenv("AOTLM_WEIGHT_CACHE", "0")
    ckpt = make_checkpoint(root / "hf", tiny_config("llama"), scale=3.0)
    T = gguf.GGMLQuantizationType

    def get(qtype: str):
        mix = {k: getattr(T, v) for k, v in MIXES[qtype].items()} or None
        return write_gguf(ckpt, "llama", getattr(T, qtype), root / f"llama-{qtype}.gguf", mix=mix)

    yield get
    mp.undo()


def reference(path, ids: np.ndarray, new: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' float32 load of the GGUF file: last-position logits and greedy tokens."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = ref(torch.tensor(ids)).logits[:, -1].float().numpy()
        out = ref.generate(
            torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long), max_new_tokens=new,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return logits, out.numpy()


@pytest.mark.parametrize("qtype", TYPES)
def test_kept_blocks_with_f32_activations_match_transformers(gguf_file, qtype, tmp_path):
    path = gguf_file(qtype)
    ids = np.random.default_rng(3).integers(0, VOCAB, (1, 12))
    want, tokens = reference(path, ids, 8)
    kw = dict(compile_cache=tmp_path, **SHAPES)
    m = AutoModelForSampling.from_pretrained(str(path), quant="int4-f32a", **kw)
    leaves = m.params["layers"][0]
    assert m.spec.quant.activations == "f32" and leaves["w_gate"].dtype == leaves["w_down"].dtype == np.uint8
    err = np.abs(m.forward(ids) - want).max() / np.abs(want).max()
    assert err <= TOL, f"{qtype}: logits differ by {err:.2e} of the largest"
    np.testing.assert_array_equal(m.sample(ids, max_new_tokens=8), tokens)
    if qtype == "Q4_K":  # x rounded to int8 once (plain int4): far outside float32's tolerance
        plain = AutoModelForSampling.from_pretrained(str(path), quant="int4", **kw)
        assert np.abs(plain.forward(ids) - want).max() / np.abs(want).max() > 20 * TOL
        a16 = AutoModelForSampling.from_pretrained(str(path), quant="int4-a16", **kw)
        assert a16.spec.quant.activations == "s16" and a16.spec.quant.label == "int4-g32-asym-a16"
        assert np.abs(a16.forward(ids) - want).max() / np.abs(want).max() <= TOL16
        np.testing.assert_array_equal(a16.sample(ids, max_new_tokens=8), tokens)
