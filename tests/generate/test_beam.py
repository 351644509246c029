"""Beam search and context broadcasting against transformers ``generate`` (tiny GPT-2 and Llama)."""

import numpy as np
import pytest
import torch
from compile_counter import count_compiles
from conformance import hf_model, left_padded_batch

from aotlm import AutoModelForSampling

NEW = 12


def _load(path, **kw):
    args = dict(batch_size=8, n_positions=32, context_length_estimate=32, compile_cache=False, num_beams=4)
    args.update(kw)
    return AutoModelForSampling.from_pretrained(path, **args)


@pytest.fixture(scope="module")
def gpt2_beam(gpt2_path):
    """Compiled once for the module: beams of 2 prompts x 4, and a 2-row prompt prefill."""
    return _load(gpt2_path, prompt_batch_size=2).compile()


def _hf_beam(ref, ids, mask, **kw):
    with torch.no_grad():
        r = ref.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
            **kw,
        )
    return r.sequences.numpy(), r.sequences_scores.numpy()


@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])  # default: llama
def test_beam_search_equals_transformers(family, gpt2_path, llama_path, request):
    path = {"gpt2": gpt2_path, "llama": llama_path}[family]
    ref = hf_model(path)
    ids, mask = left_padded_batch(np.random.default_rng(3), [6, 4], 101)
    # gpt2: compiled ahead (compile() counted below); llama: graphs compiled on first use
    model = request.getfixturevalue("gpt2_beam") if family == "gpt2" else _load(path)
    # an eos the beams do produce: the 3rd generated token of HF's best beam without eos
    seqs, _ = _hf_beam(ref, ids, mask, num_beams=4, eos_token_id=None)
    eos = int(seqs[0, ids.shape[1] + 2])
    cases = [
        (nb, lp, es, nrs) for nb in (4, 2) for lp in (1.0, 0.5) for es in (True, False) for nrs in (1, 2)
    ] + [(4, 1.0, "never", 2), (4, 0.5, "never", 1)]
    eos_inside = False
    for i, (nb, lp, es, nrs) in enumerate(cases):
        kw = dict(num_beams=nb, length_penalty=lp, early_stopping=es, num_return_sequences=nrs)
        kw["eos_token_id"] = None if i % 4 == 3 else eos
        want, want_scores = _hf_beam(ref, ids, mask, **kw)
        with count_compiles() as c:
            got = model.sample(
                ids, max_new_tokens=NEW, attention_mask=mask, pad_token_id=0, return_dict=True, **kw
            )
        if nb == 4 and family == "gpt2":
            assert c["backend"] == 0, "beam search compiled after compile()"
        assert got.sequences.shape == want.shape, (kw, got.sequences.shape, want.shape)
        np.testing.assert_array_equal(got.sequences, want, err_msg=str(kw))
        np.testing.assert_allclose(got.sequences_scores, want_scores, atol=1e-4, rtol=0, err_msg=str(kw))
        gen = got.sequences[:, ids.shape[1] : -1]
        eos_inside |= kw["eos_token_id"] is not None and bool((gen == eos).any())
    assert eos_inside, "no case finished a beam on eos before the end"
    # plain sequences (no dict) are the same array
    seq = model.sample(
        ids, max_new_tokens=NEW, attention_mask=mask, num_beams=4, eos_token_id=eos, pad_token_id=0
    )
    np.testing.assert_array_equal(seq, _hf_beam(ref, ids, mask, num_beams=4, eos_token_id=eos)[0])


def test_num_return_sequences_one_prefill_and_same_rows(gpt2_beam):
    model = gpt2_beam
    assert ("gather",) in model.graph_keys() and ("bprefill", 2, 32, 32) in model.graph_keys()
    ids, mask = left_padded_batch(np.random.default_rng(4), [5, 3], 101)
    calls = []
    plain = model.executable

    def spy(key):
        calls.append(key)
        return plain(key)

    model.executable = spy
    with count_compiles() as c:
        out = model.sample(ids, max_new_tokens=10, attention_mask=mask, num_return_sequences=4)
    assert c["backend"] == 0
    prefills = [k for k in calls if "prefill" in k[0]]
    assert prefills == [("bprefill", 2, 32, 32)], calls  # one 2-row prefill for 2 prompts x 4 rows
    # each returned row equals the same request without broadcasting (every row prefilled)
    calls.clear()
    want = model.sample(np.repeat(ids, 4, 0), max_new_tokens=10, attention_mask=np.repeat(mask, 4, 0))
    assert [k for k in calls if "prefill" in k[0]] == [("prefill", 32, 32)]
    assert out.shape == (8, ids.shape[1] + 10)
    np.testing.assert_array_equal(out, want)
    # sampled: copy j of prompt i gets seed + j; equal to the unbroadcast request with those seeds
    with count_compiles() as c:
        out = model.sample(
            ids, max_new_tokens=10, attention_mask=mask, num_return_sequences=4, do_sample=True, seed=7
        )
    assert c["backend"] == 0
    seeds = [7, 8, 9, 10] * 2
    want = model.sample(
        np.repeat(ids, 4, 0),
        max_new_tokens=10,
        attention_mask=np.repeat(mask, 4, 0),
        do_sample=True,
        seed=seeds,
    )
    np.testing.assert_array_equal(out, want)
    assert len({tuple(r) for r in out[:4]}) > 1, "the copies of a prompt should differ"


def test_beam_errors(gpt2_path):
    model = _load(gpt2_path, batch_size=4, num_beams=2)  # errors come before any compilation
    ids = np.ones((3, 4), np.int64)
    with pytest.raises(ValueError, match="compiled batch"):
        model.sample(ids, max_new_tokens=4, num_beams=2)
    with pytest.raises(ValueError, match="compiled batch"):
        model.sample(ids[:1], max_new_tokens=4, num_beams=8)
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.sample(ids[:1], max_new_tokens=4, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="compiled batch"):
        model.sample(ids, max_new_tokens=4, num_return_sequences=2)
    with pytest.raises(ValueError, match="early_stopping"):
        model.sample(ids[:1], max_new_tokens=4, num_beams=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="multiple of num_beams"):
        _load(gpt2_path, batch_size=3, num_beams=2)
