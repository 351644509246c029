"""Core engine conformance against transformers PyTorch fp32 (GPT-2 and Llama)."""

import numpy as np
import pytest
import transformers
from conformance import (
    check_conformance,
    hf_generate,
    hf_last_logits,
    hf_model,
    left_padded_batch,
    make_checkpoint,
)

from aotlm import AutoModelForSampling, GPT2ForSampling, LlamaForSampling


def test_gpt2_conformance(gpt2_path):
    check_conformance(gpt2_path, vocab=101)


def test_llama_gqa_conformance(llama_path):
    check_conformance(llama_path, vocab=101)


def test_llama3_rope_scaling_conformance(ckpt_dir):
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=101,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    path = make_checkpoint(ckpt_dir / "llama3", cfg)
    check_conformance(path, vocab=101)


@pytest.mark.parametrize("fixture", ["gpt2_path", "llama_path"])
def test_prompts_across_context_buckets_and_chunking(fixture, request):
    """Prompts at, across and beyond the context-bucket edges; generation across token buckets."""
    path = request.getfixturevalue(fixture)
    ref = hf_model(path)
    model = AutoModelForSampling.from_pretrained(
        path, batch_size=2, n_positions=[32, 64, 128], context_length_estimate=[8, 16], compile_cache=False
    )
    rng = np.random.default_rng(3)
    for length in (8, 9, 16, 17, 40, 63):  # 17, 40, 63 > largest context bucket: chunked
        ids = rng.integers(0, 101, (2, length))
        np.testing.assert_allclose(model.forward(ids), hf_last_logits(ref, ids), atol=1e-4, rtol=0)
    ids = rng.integers(0, 101, (2, 20))  # chunked prompt, then decode through buckets 32 -> 64 -> 128
    out = model.sample(ids, max_new_tokens=100)
    np.testing.assert_array_equal(out, hf_generate(ref, ids, 100))
    ids, mask = left_padded_batch(rng, [3, 19], 101)  # left-padded and chunked
    out = model.sample(ids, max_new_tokens=40, attention_mask=mask)
    np.testing.assert_array_equal(out, hf_generate(ref, ids, 40, mask=mask))


def test_start_ids_equal_attention_mask_and_small_batch(llama_path):
    model = LlamaForSampling.from_pretrained(llama_path, batch_size=4, n_positions=64, compile_cache=False)
    rng = np.random.default_rng(5)
    ids, mask = left_padded_batch(rng, [4, 10, 7], 101)
    a = model.sample(ids, max_new_tokens=8, attention_mask=mask)
    b = model.sample(ids, max_new_tokens=8, start_ids=[6, 0, 3])
    assert a.shape == (3, 18)  # batch of 3 padded to 4 inside, trimmed on return
    np.testing.assert_array_equal(a, b)
    # torch tensors and nested lists are accepted
    import torch

    c = model.sample(torch.tensor(ids), max_new_tokens=8, attention_mask=torch.tensor(mask))
    np.testing.assert_array_equal(a, c)
    d = model.sample(ids[1].tolist(), max_new_tokens=8)
    np.testing.assert_array_equal(a[1:2], d)


def test_eos_stops_rows_and_pads_like_transformers(gpt2_path):
    ref = hf_model(gpt2_path)
    model = GPT2ForSampling.from_pretrained(gpt2_path, batch_size=3, n_positions=64, compile_cache=False)
    rng = np.random.default_rng(7)
    ids, mask = left_padded_batch(rng, [6, 11, 8], 101)
    free = model.sample(ids, max_new_tokens=20, attention_mask=mask)
    eos = int(free[0, ids.shape[1] + 4])  # a token row 0 emits: it stops there
    out = model.sample(ids, max_new_tokens=20, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    exp = hf_generate(ref, ids, 20, mask=mask, eos=eos, pad=0)
    np.testing.assert_array_equal(out, exp)
    row0 = out[0, ids.shape[1] :]
    first = int(np.argmax(row0 == eos))
    assert (row0[first + 1 :] == 0).all()


def test_sequence_length_and_default_length(gpt2_path):
    model = GPT2ForSampling.from_pretrained(gpt2_path, n_positions=64, compile_cache=False)
    ids = np.arange(1, 11)[None]
    assert model.sample(ids, sequence_length=30).shape == (1, 30)
    assert model.sample(ids).shape == (1, 64)


def test_auto_model_rejects_wrong_family(gpt2_path):
    with pytest.raises(ValueError, match="gpt2"):
        LlamaForSampling.from_pretrained(gpt2_path, compile_cache=False)
