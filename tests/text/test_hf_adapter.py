"""The generate() adapter equals transformers ``generate`` where HF is deterministic."""

import numpy as np
import pytest
import torch
from compile_counter import count_compiles
from conformance import hf_model, left_padded_batch

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
    with pytest.raises(ValueError, match="epsilon_cutoff=0.1 is not supported.*supported: max_length"):
        adapter.generate(ids, max_new_tokens=2, epsilon_cutoff=0.1)
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
        dict(stop_strings=["\n"]),  # generation would not stop there
        dict(max_time=0.5),  # nor after that time
        dict(output_attentions=True, return_dict_in_generate=True),  # the output would lack them
        dict(output_hidden_states=True, return_dict_in_generate=True),
        dict(output_logits=True, return_dict_in_generate=True),
    ],
)
def test_arguments_that_change_the_output_are_refused_not_ignored(adapter, kw):
    ids = torch.ones((1, 4), dtype=torch.int64)
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name}=.* is not supported by aotlm's generate adapter"):
        adapter.generate(ids, max_new_tokens=2, **kw)
    with pytest.raises(ValueError, match="output_scores is supported with beam search only"):
        adapter.generate(ids, max_new_tokens=2, return_dict_in_generate=True, output_scores=True)
    beams = dict(num_beams=2, return_dict_in_generate=True, output_scores=True)
    out = adapter.generate(ids, max_new_tokens=2, **beams)
    assert out.sequences_scores.shape == (1,)
    for unused in ("output_scores", "output_attentions"):  # without return_dict_in_generate: unused
        assert adapter.generate(ids, max_new_tokens=2, **{unused: True}).shape == (1, 6)
