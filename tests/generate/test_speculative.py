"""Speculative decoding: exact greedy output, per-row acceptance at batch > 1, rollback, errors."""

import json
import shutil

import numpy as np
import pytest
import torch
from compile_counter import count_compiles
from conformance import hf_model, left_padded_batch, make_checkpoint
from pair_law import chi2, draw_pairs, pair_law

from aotlm import AutoModelForSampling
from aotlm.generate.speculative import SpeculativeGenerator

KW = dict(batch_size=3, n_positions=[16, 32], context_length_estimate=16)


@pytest.fixture(scope="module")
def near_draft(llama_path, ckpt_dir):
    """The target with noise on its weights: accepts some proposals, not all (varies per row)."""
    path = ckpt_dir / "llama_near"
    if not (path / "config.json").is_file():
        model = hf_model(llama_path)
        torch.manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3 * p.std())
        model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def models(llama_path, near_draft, tmp_path_factory):
    cache = tmp_path_factory.mktemp("spec_cache")  # same architecture: the draft reuses prefill graphs
    target = AutoModelForSampling.from_pretrained(llama_path, compile_cache=cache, **KW)
    same = AutoModelForSampling.from_pretrained(llama_path, compile_cache=cache, **KW)
    near = AutoModelForSampling.from_pretrained(near_draft, compile_cache=cache, **KW)
    return target, same, near


def test_speculative_greedy_equals_target_greedy(models):
    target, same, near = models
    ids, mask = left_padded_batch(np.random.default_rng(7), [7, 3, 5], 101)
    new = 20  # slots 7..27: crosses the 16-slot bucket edge
    want = target.sample(ids, max_new_tokens=new, attention_mask=mask)
    want1 = target.sample(ids[:1], max_new_tokens=new)
    uneven = 0
    for k in (1, 3, 5):
        for draft, exact in ((same, True), (near, False)):
            gen = SpeculativeGenerator(draft, target, k)
            got = gen.generate(ids, max_new_tokens=new, attention_mask=mask)
            np.testing.assert_array_equal(got, want, err_msg=f"k={k}")
            # the rounds run on device: one graph call per bucket pair (16 and 32 slots), not per round
            assert gen.stats["graph_calls"] <= 2 < gen.stats["rounds"], gen.stats
            if exact:
                assert gen.stats["acceptance"] == 1.0
            else:
                assert 0.0 < gen.stats["acceptance"] < 1.0, gen.stats
                uneven += gen.stats["uneven_rounds"]
            got1 = target.sample(ids[:1], max_new_tokens=new, draft_model=draft, speculation_length=k)
            np.testing.assert_array_equal(got1, want1, err_msg=f"batch 1, k={k}")
    assert uneven > 0, "rows never accepted different numbers of tokens: the slot-hole path is untested"
    # with eos: rows stop at different times, finished rows are padded as sample() does
    eos = int(want[0, ids.shape[1] + 4])
    want = target.sample(ids, max_new_tokens=new, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    got = SpeculativeGenerator(near, target, 3).generate(
        ids, max_new_tokens=new, attention_mask=mask, eos_token_id=eos, pad_token_id=0
    )
    np.testing.assert_array_equal(got, want)
    # graphs compiled: a second request compiles nothing
    gen = SpeculativeGenerator(near, target, 3)
    assert {key[0] for key in gen.graph_keys()} == {"spec"} and len(gen.graph_keys()) == 2
    with count_compiles() as c:
        gen.generate(ids, max_new_tokens=new, attention_mask=mask)
    assert c["backend"] == 0 and c["tracing"] == 0


def test_speculative_return_dict_and_stops_are_plain_decodings(models):
    target, _, near = models
    ids, mask = left_padded_batch(np.random.default_rng(7), [7, 3, 5], 101)
    free = target.sample(ids, max_new_tokens=20, attention_mask=mask)
    p = ids.shape[1]
    kw = dict(max_new_tokens=20, attention_mask=mask, eos_token_id=int(free[0, p + 9]), pad_token_id=0)
    kw.update(return_dict=True, stop_sequences=[free[1, p + 5 : p + 7].tolist()])
    want = target.sample(ids, **kw)
    assert {"eos", "stop_sequence"} <= set(want.finish_reason), want.finish_reason
    got = target.sample(ids, draft_model=near, speculation_length=3, **kw)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert got.finish_reason == want.finish_reason
    np.testing.assert_array_equal(got.num_generated, want.num_generated)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-4)
    assert 0 < target.last_speculative_stats["acceptance"] < 1  # the near draft: kept and rejected rounds


def test_speculative_errors(models, gpt2_path, llama_path, tmp_path):
    target, same, _ = models
    with pytest.raises(ValueError, match="speculation_length"):
        SpeculativeGenerator(same, target, 0)
    with pytest.raises(ValueError, match="speculation_length"):
        target.sample(np.ones((1, 3), np.int64), max_new_tokens=2, draft_model=same, speculation_length=0)
    other = make_checkpoint(tmp_path / "v103", _gpt2_config(103))
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeGenerator(AutoModelForSampling.from_pretrained(other, **KW), target, 2)
    a, b = tmp_path / "a", tmp_path / "b"
    for d, word in ((a, "hello"), (b, "world")):
        shutil.copytree(llama_path, d)
        (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {word: 0}}}))
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeGenerator(
            AutoModelForSampling.from_pretrained(a, **KW), AutoModelForSampling.from_pretrained(b, **KW), 2
        )
    with pytest.raises(ValueError, match="batch_size"):
        SpeculativeGenerator(AutoModelForSampling.from_pretrained(llama_path, batch_size=1), target, 2)
    with pytest.raises(ValueError, match="n_positions"):
        SpeculativeGenerator(same, target, 5).generate(np.ones((1, 10), np.int64), max_new_tokens=20)


def _gpt2_config(vocab):
    import transformers

    return transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=vocab, n_positions=64)


def test_speculative_sampling_follows_target(models, llama_path, near_draft):
    """Chi-square: (1st, 2nd) generated tokens under top_k=3 sampling vs the target's exact law."""
    target, _, near = models
    ref = hf_model(llama_path)
    prompt = np.array([[5, 17, 42, 8]])
    temp, k3 = 1.5, 3
    cells = pair_law(ref, prompt, temp, k3)
    gen = SpeculativeGenerator(near, target, 2)

    def generate(ids, seeds):
        out = gen.generate(ids, max_new_tokens=2, do_sample=True, temperature=temp, top_k=k3, seed=seeds)
        return out, gen.stats

    counts, acc, prop = draw_pairs(generate, prompt, cells)
    assert 0 < acc < prop, (acc, prop)  # both the acceptance and the residual paths ran
    stat = chi2(counts, cells)
    assert stat < 26.1, (stat, counts)  # chi-square, 8 degrees of freedom, p = 0.001
    # same seed -> same tokens (the sampled path is deterministic given the seed at batch 1)
    one = lambda: gen.generate(prompt, max_new_tokens=6, do_sample=True, temperature=temp, seed=3)
    np.testing.assert_array_equal(one(), one())
