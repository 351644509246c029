"""A GGUF file's tied embedding under ``quant="int4"``: the logits' copy (``embed_q``) keeps the file's
blocks (Q6_K as llama.cpp's Q4_K_M / Q4_0 files store a tied embedding, Q4_K, Q4_0) instead of an int8
copy rounded again per vocab row (``ParamRewriter.keeps_head``, ``codes4.Groups4.lm_head``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from aotlm import AutoModelForSampling
from aotlm.models import quant4

gguf = pytest.importorskip("gguf")

# (file type, embedding type, embed_q scale leaf rows: K6 / Q4_K's own / f16 per 32 without minimums)
CASES = [("Q4_K", "Q6_K", 82), ("Q4_K", "Q4_K", 20), ("Q4_0", "Q4_0", 1)]


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory):
    """``tied_file(type, embedding type)``: a tiny tied Llama GGUF (vocab 1026: not whole panels)."""
    from conformance import make_checkpoint
    from gguf_builders import tiny_config, write_gguf

    root = tmp_path_factory.mktemp("gguf_head")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOTLM_GGUF_CACHE", str(root / "cache"))
    mp.setenv("AOTLM_WEIGHT_CACHE", "0")
    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = True
    ckpt = make_checkpoint(root / "hf", cfg, scale=3.0)
    T = gguf.GGMLQuantizationType

    def get(qtype: str, embedding: str):
        mix = {"token_embd": getattr(T, embedding), "ffn_down": T.Q6_K} if qtype == "Q4_K" else None
        return write_gguf(ckpt, "llama", getattr(T, qtype), root / f"{qtype}-{embedding}.gguf", mix=mix)

    yield get
    mp.undo()


@pytest.mark.parametrize(("qtype", "embedding", "rows"), CASES)
def test_tied_lm_head_keeps_the_files_blocks(tied_file, qtype, embedding, rows):
    path = tied_file(qtype, embedding)
    kw = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False)
    ref = AutoModelForSampling.from_pretrained(path, quant="none", **kw)
    m = AutoModelForSampling.from_pretrained(path, quant="int4", **kw)
    w, sm = m.params["embed_q"], m.params["embed_q_scale"]
    assert w.dtype == np.uint8 and sm.shape[-2:] == (rows, 16), sm.shape  # panel-major [.., G, rows, 16]
    vocab, d = ref.params["embed"].shape
    deq = np.asarray(quant4.dequantize(jnp.asarray(w), jnp.asarray(sm), "embed_q"))  # [D, V padded]
    assert deq.shape == (d, vocab + (-vocab % 16))
    np.testing.assert_array_equal(deq[:, :vocab].T, np.asarray(ref.params["embed"]))  # the file's values
    assert not deq[:, vocab:].any()  # the padding columns' scales are zero
    ids = np.arange(1, 9)[None]
    lg, lg_ref = m.forward(ids), ref.forward(ids)  # x rounded to int8 per group: close, not equal
    assert lg.shape == lg_ref.shape and np.abs(lg - lg_ref).max() <= 0.05 * np.abs(lg_ref).max()
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    np.testing.assert_array_equal(m.sample(ids, **greedy), ref.sample(ids, **greedy))
