"""The generate() adapter equals transformers ``generate`` where HF is deterministic."""

import numpy as np
import pytest
import torch
from compile_counter import count_compiles
from conformance import hf_model, left_padded_batch
from textkit import PIPE_SHAPES, shared_text_checkpoint

from aotlm import AutoModelForSampling, HuggingFaceGenerationModelAdapter


@pytest.fixture(scope="module")
def adapter(gpt2_path):
    model = AutoModelForSampling.from_pretrained(
        gpt2_path, batch_size=4, n_positions=32, context_length_estimate=32, num_beams=2, compile_cache=False
    )
    return HuggingFaceGenerationModelAdapter(hf_model(gpt2_path).config, model.compile())


def test_adapter_equals_generate(adapter, gpt2_path):
    ref = hf_model(gpt2_path)
    ids, mask = left_padded_batch(np.random.default_rng(11), [6, 3], 101)
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    eos = int(hf_model(gpt2_path).generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)[0, -1])
    cases = [
        dict(max_new_tokens=10, do_sample=False),
        dict(max_new_tokens=10, do_sample=False, eos_token_id=eos),
        dict(max_length=14, do_sample=False),
        dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, min_new_tokens=7),  # eos held back
        dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, min_length=12),
        dict(max_new_tokens=10, num_beams=2, eos_token_id=eos, length_penalty=0.5),
        dict(max_new_tokens=10, num_beams=2, num_return_sequences=2, early_stopping=True),
    ]
    with count_compiles() as c:
        for kw in cases:
            got = adapter.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **kw)
            with torch.no_grad():
                want = ref.generate(ids, attention_mask=mask, pad_token_id=0, **kw)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
            torch.testing.assert_close(got, want, msg=str(kw))
        out = adapter.generate(
            input_ids=ids,
            attention_mask=mask,
            pad_token_id=0,
            max_new_tokens=6,
            num_beams=2,
            return_dict_in_generate=True,
            output_scores=True,
        )
    assert c["backend"] == 0, "the adapter compiled after compile()"
    with torch.no_grad():
        want = ref.generate(
            ids,
            attention_mask=mask,
            pad_token_id=0,
            max_new_tokens=6,
            num_beams=2,
            return_dict_in_generate=True,
            output_scores=True,
        )
    assert type(out).__name__ == type(want).__name__
    torch.testing.assert_close(out.sequences, want.sequences)
    torch.testing.assert_close(out.sequences_scores, want.sequences_scores, atol=1e-4, rtol=0)
    greedy = adapter.generate(ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True)
    assert type(greedy).__name__ == "GenerateDecoderOnlyOutput"


def test_step_scores_and_transition_scores_are_transformers(adapter, gpt2_path):
    ref = hf_model(gpt2_path)
    ids, mask = left_padded_batch(np.random.default_rng(12), [6, 4], 101)
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    kw = dict(
        attention_mask=mask, pad_token_id=0, max_new_tokens=6, do_sample=False, repetition_penalty=1.3,
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )  # fmt: skip
    got = adapter.generate(ids, **kw)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
    assert type(got).__name__ == type(want).__name__ and got.logits is not None
    torch.testing.assert_close(got.sequences, want.sequences)
    for name in ("scores", "logits"):
        assert len(getattr(got, name)) == len(getattr(want, name)) == 6
        for g, w in zip(getattr(got, name), getattr(want, name), strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    # what users compute from them: each chosen token's log-probability
    ours = ref.compute_transition_scores(got.sequences, got.scores, normalize_logits=True)
    theirs = ref.compute_transition_scores(want.sequences, want.scores, normalize_logits=True)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    only = adapter.generate(ids, **dict(kw, output_logits=False))
    assert only.logits is None and len(only.scores) == 6


def test_adapter_sampling_is_seeded(adapter):
    ids = torch.tensor([[3, 14, 15, 92]])

    def run():
        torch.manual_seed(0)
        return adapter.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=3)

    a, b = run(), run()
    assert a.shape == (3, 12)
    torch.testing.assert_close(a, b)  # torch.manual_seed reproduces the adapter's draws
    assert len({tuple(r.tolist()) for r in a}) > 1


def test_adapter_batch_rule(adapter):
    ids = torch.ones((3, 4), dtype=torch.int64)
    with pytest.raises(ValueError, match="compiled batch"):
        adapter.generate(ids, max_new_tokens=2, num_beams=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="compiled batch"):
        adapter.generate(ids[:2], max_new_tokens=2, do_sample=True, num_return_sequences=3)
    with pytest.raises(ValueError, match="encoder_repetition_penalty=1.5 is not supported.*supported: max_"):
        adapter.generate(ids, max_new_tokens=2, encoder_repetition_penalty=1.5)
    with pytest.raises(TypeError, match="unsupported arguments \\['bogus'\\]; supported: "):
        adapter.generate(ids, max_new_tokens=2, bogus=1)
    for bad in (2.5, True):  # 2.5 was truncated to 2
        with pytest.raises(TypeError, match="max_new_tokens must be an int"):
            adapter.generate(ids, max_new_tokens=bad)
    with pytest.raises(ValueError, match="max_length=4 leaves no room after the 4-token prompt"):
        adapter.generate(ids, max_length=4, max_new_tokens=None)


@pytest.mark.parametrize(
    "kw",
    [
        dict(output_attentions=True, return_dict_in_generate=True),  # the output would lack them
        dict(output_hidden_states=True, return_dict_in_generate=True),
    ],
)
def test_arguments_that_change_the_output_are_refused_not_ignored(adapter, kw):
    ids = torch.ones((1, 4), dtype=torch.int64)
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name}=.* is not supported by aotlm's generate adapter"):
        adapter.generate(ids, max_new_tokens=2, **kw)
    with pytest.raises(ValueError, match="output_logits runs with greedy search or sampling, not beams"):
        adapter.generate(ids, max_new_tokens=2, num_beams=2, return_dict_in_generate=True, output_logits=True)
    beams = dict(num_beams=2, return_dict_in_generate=True, output_scores=True)
    out = adapter.generate(ids, max_new_tokens=2, **beams)
    assert out.sequences_scores.shape == (1,)
    for unused in ("output_scores", "output_attentions"):  # without return_dict_in_generate: unused
        assert adapter.generate(ids, max_new_tokens=2, **{unused: True}).shape == (1, 6)


def test_max_time_ends_generation(adapter):
    ids = torch.tensor([[3, 14, 15, 92]])
    assert adapter.generate(ids, max_new_tokens=20, max_time=0.0).shape == (1, 5)  # one token, then time
    assert adapter.generate(ids, max_new_tokens=20, max_time=60.0).shape == (1, 24)
    with pytest.raises(ValueError, match="streamer / stopping_criteria / stop_strings / max_time run with"):
        adapter.generate(ids, max_new_tokens=4, num_beams=2, max_time=60.0)


def test_assistant_model_is_speculative_decoding(adapter, gpt2_path):
    """transformers' assisted generation with an aotlm assistant: the target's own greedy tokens."""
    draft = AutoModelForSampling.from_pretrained(
        gpt2_path, batch_size=4, n_positions=32, context_length_estimate=32, compile_cache=False
    )
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        want = hf_model(gpt2_path).generate(
            ids, max_new_tokens=8, do_sample=False, pad_token_id=0, assistant_model=hf_model(gpt2_path)
        )
    for assistant in (draft, HuggingFaceGenerationModelAdapter(draft.hf_config, draft)):
        got = adapter.generate(ids, max_new_tokens=8, pad_token_id=0, assistant_model=assistant,
                               num_assistant_tokens=3)  # fmt: skip
        torch.testing.assert_close(got, want)
        assert adapter.model.last_speculative_stats["rounds"] >= 1
    with pytest.raises(TypeError, match="assistant_model must be an aotlm model"):
        adapter.generate(ids, max_new_tokens=2, assistant_model=hf_model(gpt2_path))
    with pytest.raises(ValueError, match="assistant_model runs with greedy search or sampling, not beams"):
        adapter.generate(ids, max_new_tokens=2, num_beams=2, assistant_model=draft)


def test_prompt_lookup_is_transformers_prompt_lookup(adapter, gpt2_path):
    """``prompt_lookup_num_tokens``: transformers' prompt lookup decoding, the same greedy tokens."""
    ids = torch.tensor([[3, 14, 15, 92, 65, 3, 14, 15, 92, 65, 3, 14]])
    for lookup in (
        dict(prompt_lookup_num_tokens=3),
        dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=1),
    ):
        with torch.no_grad():
            want = hf_model(gpt2_path).generate(
                ids, max_new_tokens=12, do_sample=False, pad_token_id=0, **lookup
            )
        adapter.model.last_speculative_stats = None
        torch.testing.assert_close(adapter.generate(ids, max_new_tokens=12, pad_token_id=0, **lookup), want)
        assert adapter.model.last_speculative_stats["proposed"] >= 1  # the lookup's rounds ran
    with pytest.raises(
        ValueError, match="prompt_lookup_num_tokens runs with greedy search or sampling, not beams"
    ):
        adapter.generate(ids, max_new_tokens=2, num_beams=2, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="not both"):
        adapter.generate(ids, max_new_tokens=2, prompt_lookup_num_tokens=3, assistant_model=adapter)


def test_top_h_and_epsilon_sampling_apply(adapter):
    """transformers' Top-H and epsilon warpers: narrow enough that only the likeliest token of each
    step survives, the sampled tokens are the greedy ones (plain sampling's are not)."""
    ids = torch.tensor([[3, 14, 15, 92]])
    greedy = adapter.generate(ids, max_new_tokens=8)
    kw = dict(max_new_tokens=8, do_sample=True, top_k=0, seed=5)
    assert not torch.equal(adapter.generate(ids, **kw), greedy)
    torch.testing.assert_close(adapter.generate(ids, top_h=1e-6, **kw), greedy)
    torch.testing.assert_close(adapter.generate(ids, epsilon_cutoff=0.9, **kw), greedy)


@pytest.fixture(scope="module")
def text_adapter(tmp_path_factory):
    import transformers

    path, cache = shared_text_checkpoint(tmp_path_factory)
    model = AutoModelForSampling.from_pretrained(path, compile_cache=cache, **PIPE_SHAPES)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return HuggingFaceGenerationModelAdapter(ref.config, model.compile()), ref, tok


def test_stop_strings_end_rows_as_transformers(text_adapter):
    ours, ref, tok = text_adapter
    tok.padding_side = "left"
    enc = tok(["def fibonacci(n):", "import os\nclass"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        free = ref.generate(**enc, **kw)
    plen = enc["input_ids"].shape[1]
    texts = [tok.decode(r[plen:]) for r in free]
    # stops that first appear mid-generation in each row, spanning tokens where the text allows
    stops = [texts[0][5:8], texts[1][9:11]]
    assert all(stops) and all(s not in tok.decode(r[:plen]) for s, r in zip(stops, free, strict=True))
    for strings in ([stops[0]], stops):
        with torch.no_grad():
            want = ref.generate(**enc, **kw, stop_strings=strings, tokenizer=tok)
        got = ours.generate(**enc, **kw, stop_strings=strings, tokenizer=tok)
        for r in range(len(strings)):  # the rows a stop applies to were cut short in transformers
            assert not torch.equal(want[r], free[r, : want.shape[1]]) or want.shape[1] < free.shape[1]
        torch.testing.assert_close(got, want, msg=str(strings))
    with pytest.raises(ValueError, match="stop_strings=\\['x'\\] need the model's tokenizer"):
        ours.generate(**enc, **kw, stop_strings=["x"])
    with pytest.raises(ValueError, match="stop_strings / max_time run with greedy search or sampling"):
        ours.generate(**enc, max_new_tokens=4, num_beams=2, stop_strings=["x"], tokenizer=tok)
