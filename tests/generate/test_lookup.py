"""Prompt lookup decoding: transformers' candidates, plain decoding's output, the rounds on device."""

import numpy as np
import pytest
import torch
from compile_counter import count_compiles
from conformance import hf_model
from pair_law import chi2, draw_pairs, pair_law

from aotlm import AutoModelForSampling
from aotlm.generate import lookup

KW = dict(batch_size=3, n_positions=[32, 64], context_length_estimate=32)


@pytest.fixture(scope="module")
def model(llama_path, tmp_path_factory):
    return AutoModelForSampling.from_pretrained(
        llama_path, compile_cache=tmp_path_factory.mktemp("lookup_cache"), **KW
    )


def _transformers_candidates(seq, k: int, ngram: int) -> list[int]:
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = PromptLookupCandidateGenerator(
        num_output_tokens=k, max_matching_ngram_size=ngram, max_length=10_000
    )
    out, _ = gen.get_candidates(torch.tensor([seq]))
    return out[0, len(seq) :].tolist()


def test_proposals_are_transformers_candidates():
    rng = np.random.default_rng(3)
    width, tried, found = 40, 0, 0
    for _ in range(60):
        k, ngram = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        rows = [rng.integers(0, 4, int(rng.integers(1, 30))).tolist() for _ in range(3)]
        hist = np.full((3, width), 7, np.int32)  # past each row's end: never read as its tokens
        length = np.zeros(3, np.int32)
        for r, seq in enumerate(rows):
            pad = int(rng.integers(0, width - len(seq) - 5))  # left padding: -1, never matched
            hist[r, :pad] = -1
            hist[r, pad : pad + len(seq)] = seq
            length[r] = pad + len(seq)
        drafts, ok = lookup.propose(hist, length, k, ngram)
        for r, seq in enumerate(rows):
            want = _transformers_candidates(seq, k, ngram)
            tried += 1
            found += bool(want)
            assert bool(ok[r]) == bool(want), (seq, k, ngram)
            assert np.asarray(drafts[r, : len(want)]).tolist() == want, (seq, k, ngram, drafts[r])
            assert (np.asarray(drafts[r, len(want) :]) == 0).all()  # the rest: token 0, checked like any
    assert 0 < found < tried  # both matches and misses were compared


def _repeating(rng, lengths, vocab):
    """Left-padded prompts that repeat a phrase, so their continuations can be looked up."""
    n = max(lengths)
    ids, mask = np.zeros((len(lengths), n), np.int64), np.zeros((len(lengths), n), np.int64)
    for i, length in enumerate(lengths):
        phrase = rng.integers(1, vocab, 5)
        ids[i, n - length :] = np.resize(phrase, length)
        mask[i, n - length :] = 1
    return ids, mask


def test_lookup_greedy_equals_plain_decoding(model):
    ids, mask = _repeating(np.random.default_rng(1), [12, 7, 9], 101)
    new = 30  # slots 12..42: crosses the 32-slot bucket edge
    want = model.sample(ids, max_new_tokens=new, attention_mask=mask)
    accepted = 0
    for k, ngram in ((1, 1), (3, 2), (5, 3)):
        got = model.sample(
            ids,
            max_new_tokens=new,
            attention_mask=mask,
            prompt_lookup_num_tokens=k,
            max_matching_ngram_size=ngram,
        )
        np.testing.assert_array_equal(got, want, err_msg=f"k={k} ngram={ngram}")
        stats = model.last_speculative_stats
        assert stats["graph_calls"] <= 2 < stats["rounds"], stats  # the rounds run on device
        accepted += stats["accepted"]
    assert accepted > 0  # proposals were taken, not only checked
    # rows with nothing to look up step one token at a time: no proposals counted for those steps
    distinct = np.arange(10, 22)[None]
    got = model.sample(distinct, max_new_tokens=new, prompt_lookup_num_tokens=3)
    np.testing.assert_array_equal(got, model.sample(distinct, max_new_tokens=new))
    stats = model.last_speculative_stats
    assert stats["proposed"] < 3 * stats["rounds"], stats
    got1 = model.sample(ids[:1, -12:], max_new_tokens=new, prompt_lookup_num_tokens=4)
    np.testing.assert_array_equal(got1, model.sample(ids[:1, -12:], max_new_tokens=new))
    # with eos: rows stop at different times, finished rows padded as sample() pads them
    eos = int(want[0, ids.shape[1] + 4])
    kw = dict(max_new_tokens=new, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    np.testing.assert_array_equal(
        model.sample(ids, prompt_lookup_num_tokens=3, **kw), model.sample(ids, **kw)
    )
    with count_compiles() as c:  # its graphs are compiled: a second request compiles nothing
        model.sample(ids, max_new_tokens=new, attention_mask=mask, prompt_lookup_num_tokens=3)
    assert c["backend"] == 0 and c["tracing"] == 0


def test_lookup_equals_transformers_prompt_lookup(model, llama_path):
    ref = hf_model(llama_path)
    ids, _ = _repeating(np.random.default_rng(4), [14], 101)
    with torch.no_grad():
        want = ref.generate(
            torch.tensor(ids), max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=4, pad_token_id=0
        )
    got = model.sample(ids, max_new_tokens=24, prompt_lookup_num_tokens=4)
    np.testing.assert_array_equal(got, want.numpy())


def test_lookup_sampling_follows_target(model, llama_path):
    """Chi-square: (1st, 2nd) generated tokens under top_k=3 sampling vs the target's exact law."""
    ref = hf_model(llama_path)
    temp, k3 = 1.5, 3
    pairs = lambda prompt: pair_law(ref, prompt, temp, k3)

    def proposed(prompt, a):
        h = np.append(prompt[0], a).astype(np.int32)[None]
        return int(lookup.propose(h, np.array([h.shape[1]]), 1, 1)[0][0, 0])

    # a prompt whose lookup proposes a likely 2nd token after a likely 1st: proposals the target keeps
    # sometimes and rejects sometimes (each try puts the last try's likely pairs before the same tail)
    prompt = np.array([[5, 17, 42, 8]])
    for _ in range(8):
        cells = pairs(prompt)
        if any((a, proposed(prompt, a)) in cells for a, _ in cells):
            break
        prompt = np.array([[*(x for pair in cells for x in pair), 5, 17, 42, 8]])
    else:
        pytest.fail("no prompt found whose lookup proposes a likely token")

    def generate(ids, seeds):
        kw = dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=1)
        out = model.sample(
            ids, max_new_tokens=2, do_sample=True, temperature=temp, top_k=k3, seed=seeds, **kw
        )
        return out, model.last_speculative_stats

    counts, acc, prop = draw_pairs(generate, prompt, cells)
    assert 0 < acc < prop, (acc, prop)  # both the acceptance and the rejection paths ran
    stat = chi2(counts, cells)
    assert stat < 26.1, (stat, counts)  # chi-square, 8 degrees of freedom, p = 0.001


def test_lookup_errors(model):
    ids = np.ones((1, 3), np.int64)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be an int >= 1"):
            model.sample(ids, max_new_tokens=2, prompt_lookup_num_tokens=bad)
    with pytest.raises(ValueError, match="max_matching_ngram_size must be an int >= 1"):
        model.sample(ids, max_new_tokens=2, prompt_lookup_num_tokens=2, max_matching_ngram_size=0)
    with pytest.raises(ValueError, match="give prompt_lookup_num_tokens too"):
        model.sample(ids, max_new_tokens=2, max_matching_ngram_size=2)
    with pytest.raises(ValueError, match="not both"):
        model.sample(ids, max_new_tokens=2, prompt_lookup_num_tokens=2, draft_model=model)
    with pytest.raises(ValueError, match="num_beams"):
        model.sample(ids, max_new_tokens=2, prompt_lookup_num_tokens=2, num_beams=3)
    with pytest.raises(ValueError, match=r"\['repetition_penalty'\] not supported with prompt_lookup"):
        model.sample(ids, max_new_tokens=2, prompt_lookup_num_tokens=2, repetition_penalty=1.3)
    with pytest.raises(
        ValueError, match=r"\+ prompt_lookup_num_tokens \(2\) - 1 = 65 exceeds n_positions=64"
    ):
        model.sample(np.ones((1, 20), np.int64), max_new_tokens=44, prompt_lookup_num_tokens=2)


def _same_output(got, want):
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert got.finish_reason == want.finish_reason
    np.testing.assert_array_equal(got.num_generated, want.num_generated)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-4)
    assert got.top_logprobs is None and 0 < got.time_to_first_token


def test_lookup_return_dict_is_plain_decodings(model, llama_path):
    ids, mask = _repeating(np.random.default_rng(1), [12, 7, 9], 101)
    free = model.sample(ids, max_new_tokens=30, attention_mask=mask)
    eos = int(free[1, ids.shape[1] + 6])  # row 1 ends early; the others may run to their length
    kw = dict(max_new_tokens=[30, 30, 17], attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    want = model.sample(ids, return_dict=True, **kw)
    assert {"eos", "length"} <= set(want.finish_reason), want.finish_reason
    for k in (1, 3):
        _same_output(model.sample(ids, return_dict=True, prompt_lookup_num_tokens=k, **kw), want)
    # sampled rows: each token's log-prob is the target's processed distribution's (plain decoding's)
    temp, k3 = 1.3, 5
    got = model.sample(
        ids[:1], max_new_tokens=20, do_sample=True, temperature=temp, top_k=k3, seed=3,
        return_dict=True, prompt_lookup_num_tokens=3,
    )  # fmt: skip
    seq, n = got.sequences[0], int(got.num_generated[0])
    assert n == 20 and got.finish_reason == ["length"]
    with torch.no_grad():
        logits = hf_model(llama_path)(torch.tensor(seq[None])).logits[0].double() / temp
    scores = logits[12 - 1 : 12 - 1 + n]  # the scores each generated token was drawn from
    cut = torch.topk(scores, k3, -1).values[:, -1:]
    lp = torch.log_softmax(scores.masked_fill(scores < cut, -torch.inf), -1)
    want_lp = lp.gather(1, torch.tensor(seq[12:, None])).numpy()[:, 0]
    np.testing.assert_allclose(got.logprobs[0], want_lp, atol=2e-4)


def test_lookup_stops_and_streams_as_plain_decoding(model):
    ids, mask = _repeating(np.random.default_rng(2), [12, 7, 9], 101)
    p = ids.shape[1]
    free = model.sample(ids, max_new_tokens=30, attention_mask=mask)
    stops = [free[0, p + 8 : p + 10].tolist(), [int(free[2, p + 13])]]
    kw = dict(max_new_tokens=30, attention_mask=mask, return_dict=True, stop_sequences=stops)
    want = model.sample(ids, **kw)
    assert "stop_sequence" in want.finish_reason, want.finish_reason
    _same_output(model.sample(ids, prompt_lookup_num_tokens=3, **kw), want)
    # stopping criteria end a row at the token they see, as in plain decoding (one token a call there)
    tok = int(free[1, p + 11])
    ends = lambda seqs, scores: np.asarray(seqs)[:, -1] == tok  # noqa: E731
    kw = dict(max_new_tokens=30, attention_mask=mask, return_dict=True, stopping_criteria=[ends])
    want = model.sample(ids, **kw)
    assert "stopping_criteria" in want.finish_reason, want.finish_reason
    _same_output(model.sample(ids, prompt_lookup_num_tokens=3, **kw), want)
    # a streamer (one prompt) gets the prompt, then the tokens as the rounds commit them
    streams = []
    for extra in ({}, {"prompt_lookup_num_tokens": 3}):
        s = _Collect()
        out = model.sample(ids[:1, -12:], max_new_tokens=24, streamer=s, **extra)
        assert s.ended and s.puts[0].tolist() == ids[:1, -12:].tolist()
        streams.append(np.concatenate([np.ravel(x) for x in s.puts[1:]]).tolist())
        assert streams[-1] == out[0, 12:].tolist()
        assert not extra or max(x.size for x in s.puts[1:]) > 1  # a round's tokens come together
    assert streams[0] == streams[1]
    with pytest.raises(
        ValueError, match="a streamer follows one prompt with prompt_lookup_num_tokens, got 3"
    ):
        model.sample(
            ids, attention_mask=mask, max_new_tokens=4, streamer=_Collect(), prompt_lookup_num_tokens=3
        )


class _Collect:
    """A transformers BaseStreamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(np.asarray(value))

    def end(self):
        self.ended = True
