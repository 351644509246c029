"""sample() with sampling, seeds, stop conditions, streamers and scores, on a compiled model."""

import time

import numpy as np
import pytest
import transformers
from conformance import Recorder, hf_generate, hf_model

from aotlm import AutoModelForSampling, GenerationConfig

KW = dict(n_positions=[32, 64], context_length_estimate=[8, 16], compile_cache=False)


@pytest.fixture(scope="module")
def model(gpt2_path):
    return AutoModelForSampling.from_pretrained(gpt2_path, batch_size=3, **KW)


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(1).integers(0, 101, (3, 6))


def test_greedy_forms_agree_and_match_transformers(model, prompts, gpt2_path, llama_path):
    g = model.sample(prompts, max_new_tokens=30)
    assert (model.sample(prompts, max_new_tokens=30, do_sample=True, top_k=1, seed=3) == g).all()
    assert (model.sample(prompts, max_new_tokens=30, do_sample=True, temperature=0.0) == g).all()
    cfg = GenerationConfig(do_sample=False, temperature=0.3, top_p=0.5)  # warpers ignored when greedy
    assert (model.sample(prompts, max_new_tokens=30, generation_config=cfg) == g).all()
    np.testing.assert_array_equal(g, hf_generate(hf_model(gpt2_path), prompts, 30))
    llama = AutoModelForSampling.from_pretrained(llama_path, batch_size=1, **KW)
    ids = prompts[:1]
    out = llama.sample(ids, max_new_tokens=20, do_sample=True, top_k=1)
    np.testing.assert_array_equal(out, hf_generate(hf_model(llama_path), ids, 20))


def test_seeds_are_per_row_and_independent_of_companions(model, prompts):
    kw = dict(max_new_tokens=40, do_sample=True, top_p=0.9, temperature=1.3)
    a = model.sample(prompts, seed=[11, 12, 13], **kw)
    b = model.sample(prompts[[2, 0, 1]], seed=[13, 11, 12], **kw)  # other batch positions
    np.testing.assert_array_equal(a, b[[1, 2, 0]])
    alone = model.sample(prompts[1:2], seed=12, **kw)  # no companions
    np.testing.assert_array_equal(alone[0], a[1])
    other = model.sample(prompts, seed=[21, 22, 23], **kw)
    assert (other[:, 6:] != a[:, 6:]).any(axis=1).all(), "different seeds must differ"
    fresh = [model.sample(prompts[:1], **kw) for _ in range(2)]  # seed=None: fresh draws
    assert (fresh[0] != fresh[1]).any()
    # a batch mixing greedy and sampled rows gives each row what it gets alone
    mixed = model.sample(prompts, max_new_tokens=40, do_sample=[False, True, True], top_k=[0, 5, 0], seed=7)
    np.testing.assert_array_equal(mixed[0], model.sample(prompts[:1], max_new_tokens=40)[0])
    np.testing.assert_array_equal(
        mixed[1], model.sample(prompts[1:2], max_new_tokens=40, do_sample=True, top_k=5, seed=7)[0]
    )


def test_stop_sequences_eos_and_per_row_lengths(model, prompts):
    p = prompts.shape[1]
    free = model.sample(prompts, max_new_tokens=50)
    # a two-token stop sequence whose last token lands at slot 32, crossing the 32 -> 64 bucket edge
    j = 32 - p
    stop = [int(free[0, p + j - 1]), int(free[0, p + j])]
    first = next(i for i in range(1, 51) if list(free[0, p + i - 1 : p + i + 1]) == stop)
    out = model.sample(prompts, max_new_tokens=50, stop_sequences=[stop], pad_token_id=0, return_dict=True)
    assert out.finish_reason[0] == "stop_sequence" and out.num_generated[0] == first + 1
    row = out.sequences[0]
    np.testing.assert_array_equal(row[: p + first + 1], free[0, : p + first + 1])  # the stop stays
    assert (row[p + first + 1 :] == 0).all()  # Cerebras: the rest of the row is padding
    # single-token stop sequences per row, eos lists, and per-row max_new_tokens
    tok1 = int(free[1, p + 3])
    out = model.sample(
        prompts,
        max_new_tokens=[50, 50, 7],
        stop_sequences=[[], [[tok1]], []],
        eos_token_id=[100, int(free[0, p + 5])],
        return_dict=True,
    )
    first_eos = next(i for i in range(50) if free[0, p + i] in (100, int(free[0, p + 5])))
    assert out.finish_reason == ["eos", "stop_sequence", "length"]
    first_stop = next(i for i in range(50) if free[1, p + i] == tok1)
    assert list(out.num_generated) == [first_eos + 1, first_stop + 1, 7]
    np.testing.assert_array_equal(out.sequences[2, : p + 7], free[2, : p + 7])
    assert out.logprobs.shape == (3, out.sequences.shape[1] - p) and (out.logprobs[:, 0] < 0).all()


def test_logprobs_are_those_of_the_processed_distribution(model, prompts):
    out = model.sample(prompts, max_new_tokens=3, return_dict=True, top_logprobs=4)
    ids, lps = out.top_logprobs
    assert ids.shape == (3, 3, 4)
    np.testing.assert_array_equal(ids[:, :, 0], out.sequences[:, 6:])  # greedy: the top token
    np.testing.assert_allclose(lps[:, :, 0], out.logprobs, atol=1e-6)
    logits = model.forward(prompts)
    want = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    np.testing.assert_allclose(out.logprobs[:, 0], want[np.arange(3), out.sequences[:, 6]], atol=1e-4)
    s = model.sample(prompts, max_new_tokens=3, return_dict=True, do_sample=True, top_k=3, seed=1)
    assert (s.logprobs > np.log(1 / 3) - 1e-6).any(axis=1).all()  # renormalized over 3 tokens


def test_streamers_and_stopping_criteria(model, prompts, capsys):
    one = AutoModelForSampling.from_pretrained(model.path, batch_size=1, **KW)
    ids = prompts[:1]
    rec = Recorder()
    out = one.sample(ids, max_new_tokens=13, streamer=rec)
    assert isinstance(rec.calls[-1], str) and sum(isinstance(c, str) for c in rec.calls) == 1
    np.testing.assert_array_equal(rec.calls[0], ids)  # the prompt first, as HF does
    streamed = np.concatenate([c.reshape(-1) for c in rec.calls[1:-1]])
    np.testing.assert_array_equal(streamed, out[0, 6:])
    assert len(rec.calls) == 1 + 13 + 1, "one put per token, as it is produced"
    # transformers' TextStreamer prints exactly the decoded generation
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(101)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk)
    one.sample(ids, max_new_tokens=13, streamer=transformers.TextStreamer(tok, skip_prompt=True))
    assert capsys.readouterr().out.strip() == tok.decode(out[0, 6:]).strip()
    # a StoppingCriteria ends generation between tokens
    crit = transformers.MaxTimeCriteria(max_time=0.0, initial_timestamp=time.time() - 1)
    stopped = one.sample(ids, max_new_tokens=50, stopping_criteria=[crit], return_dict=True)
    assert stopped.finish_reason == ["stopping_criteria"] and stopped.sequences.shape[1] < 6 + 50
    # fewer rows than compiled: the padding rows (never checked) do not keep the loop going
    crit = transformers.MaxTimeCriteria(max_time=0.0, initial_timestamp=time.time() - 1)
    few = model.sample(prompts[:2], max_new_tokens=20, stopping_criteria=[crit], return_dict=True)
    assert few.finish_reason == ["stopping_criteria"] * 2 and few.sequences.shape == (2, 6 + 1)


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop_sequences=[1, 2]), "stop_sequences"),
        (dict(stop_sequences=[[1, 500]]), "vocabulary"),
        (dict(top_k=[1, 2]), "one per row"),
        (dict(max_new_tokens=[3, 4]), "one per row"),
        (dict(streamer=object()), "put"),
        (dict(no_repeat_ngram_size=99), "no_repeat_ngram_size"),
        (dict(seed=-1), "seed"),
        (dict(top_kk=3), "unknown generation arguments"),
    ],
)
def test_bad_generation_arguments(model, prompts, kw, err):
    with pytest.raises((ValueError, TypeError), match=err):
        model.sample(prompts, **{"max_new_tokens": 4, **kw})


def test_torch_habits_say_where_they_are():
    model = object.__new__(AutoModelForSampling)  # no weights needed: the names are not there
    with pytest.raises(AttributeError, match=r"no generate\(\): sample\(input_ids, .*HuggingFaceGeneration"):
        model.generate([[1, 2]])
    with pytest.raises(AttributeError, match=r"no eval\(\): it only runs inference"):
        model.eval()
    assert not hasattr(model, "to") and not hasattr(model, "cuda")
    with pytest.raises(AttributeError, match="'AutoModelForSampling' object has no attribute 'bogus'"):
        _ = model.bogus


def _same_scores(got, want, n_gen):
    """Per step, transformers' ``[B, V]`` arrays against aotlm's for the rows still generating."""
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        live = n_gen > t
        w = np.asarray(w)[live]
        assert (np.isneginf(g[live]) == np.isneginf(w)).all(), t  # the same tokens removed
        np.testing.assert_allclose(np.where(np.isinf(w), 0, g[live]), np.where(np.isinf(w), 0, w), atol=1e-4)


def test_output_scores_and_logits_are_transformers(model, prompts, gpt2_path):
    import torch

    ref = hf_model(gpt2_path)
    free = model.sample(prompts, max_new_tokens=10)
    eos = int(free[0, prompts.shape[1] + 5])  # row 0 would end after 6 tokens
    kw = dict(
        max_new_tokens=10, repetition_penalty=1.4, min_new_tokens=4, no_repeat_ngram_size=2, eos_token_id=eos
    )
    got = model.sample(prompts, return_dict=True, output_scores=True, output_logits=True, **kw)
    mask = torch.ones(prompts.shape, dtype=torch.long)
    with torch.no_grad():
        want = ref.generate(
            torch.tensor(prompts), do_sample=False, return_dict_in_generate=True, output_scores=True,
            output_logits=True, pad_token_id=0, attention_mask=mask, **kw,
        )  # fmt: skip
    np.testing.assert_array_equal(got.sequences, want.sequences.numpy())
    _same_scores(got.scores, want.scores, got.num_generated)
    _same_scores(got.logits, want.logits, got.num_generated)
    assert np.isneginf(got.scores[0]).any()  # min_new_tokens holds eos back: a processor in the scores
    np.testing.assert_array_equal(got.sequences, model.sample(prompts, **kw))  # the same tokens as without
    # sampled rows: after the warpers, each step's scores are transformers' warped scores of the prefix
    temp, k = 1.3, 7
    out = model.sample(
        prompts, max_new_tokens=8, do_sample=True, temperature=temp, top_k=k, seed=5, return_dict=True,
        output_scores=True,
    )  # fmt: skip
    assert out.logits is None and len(out.scores) == 8
    warp = transformers.LogitsProcessorList(
        [transformers.TemperatureLogitsWarper(temp), transformers.TopKLogitsWarper(k)]
    )
    seqs = torch.tensor(out.sequences)
    with torch.no_grad():
        logits = ref(seqs).logits
    p = prompts.shape[1]
    want = [warp(seqs[:, : p + t], logits[:, p + t - 1].clone()).numpy() for t in range(8)]
    _same_scores(out.scores, want, out.num_generated)
    with pytest.raises(ValueError, match="pass return_dict=True"):
        model.sample(prompts, max_new_tokens=2, output_scores=True)
