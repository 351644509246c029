"""``sequence_bias`` in ``sample()`` and the HF adapter against transformers' ``generate`` (one-token
biases in the graph, longer sequences matched on the host after every token, their start in the prompt,
left padding), and ``aotlm.generate.sequence_bias`` on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from token_rules import EOS, NEW, Prompts, model_pair

from aotlm import HuggingFaceGenerationModelAdapter
from aotlm.generate import sequence_bias as sb

P = Prompts(9)
IDS, MASK = P.ids, P.mask
theirs, ours = P.theirs, P.ours


@pytest.fixture(scope="module")
def pair(llama_path):
    return model_pair(llama_path)


def test_sequence_bias_equals_transformers(pair):
    model, ref = pair
    base = ours(model)
    first, second = base[:, 6].tolist(), base[:, 7].tolist()
    rare = int(np.argmin(np.bincount(base[:, 6:].ravel(), minlength=101)[3:])) + 3  # never chosen
    cases = [
        dict(sequence_bias=[[[rare], 8.0]]),  # a strong push: chosen at once
        dict(sequence_bias=[[[first[0]], -30.0], [[first[1]], -30.0]]),  # pushed out
        dict(sequence_bias=[[[a, rare], 12.0] for a in first]),  # after each row's first token
        dict(sequence_bias=[[[*IDS[0, -2:].tolist(), rare], 9.0]]),  # its start in the prompt
        dict(sequence_bias={(first[0], second[0]): -25.0, (rare,): 1.5}),  # transformers' older dict
        dict(sequence_bias=[[[first[2], rare], 6.0], [[rare], 3.0]], suppress_tokens=[second[1]]),
    ]
    for kw in cases:
        got = ours(model, **kw)
        np.testing.assert_array_equal(got, theirs(ref, **kw), err_msg=str(kw))
        assert not np.array_equal(got, base), kw
    adapter = HuggingFaceGenerationModelAdapter(ref.config, model)
    kw = dict(sequence_bias=[[[first[1], rare], 10.0]])
    got = adapter.generate(torch.tensor(IDS), attention_mask=torch.tensor(MASK), max_new_tokens=NEW,
                           eos_token_id=EOS, pad_token_id=0, **kw)  # fmt: skip
    np.testing.assert_array_equal(got.numpy(), theirs(ref, **kw))


def test_bad_biases_are_refused_before_any_device_work(pair):
    model, _ = pair
    for kw, err, match in [
        (dict(sequence_bias=[[[101], 1.0]]), ValueError, r"holds 101, outside the vocabulary \[0, 101\)"),
        (dict(sequence_bias=[[5, 1.0]]), TypeError, r"must be \[\[token ids\], bias\] pairs"),
        (dict(sequence_bias=[]), TypeError, "must be"),
        (dict(sequence_bias=[[[5], "x"]]), TypeError, r"the bias of \[5\] must be a finite number"),
        (dict(sequence_bias=[[[5], float("nan")]]), TypeError, "finite number"),
        (dict(sequence_bias=[[[t], 1.0] for t in range(101)] * 1), None, None),  # 101 tokens: fits
        (dict(sequence_bias=[[[5], 1.0]], repetition_penalty=1.3), ValueError, "with a repetition_penalty"),
    ]:
        if err is None:
            ours(model, **kw)
            continue
        with pytest.raises(err, match=match):
            ours(model, **kw)
    with pytest.raises(ValueError, match=r"\['sequence_bias'\] not supported with num_beams > 1"):
        model.sample(IDS[:1], max_new_tokens=4, num_beams=2, sequence_bias=[[[5], 1.0]])


def test_biases_and_matching():
    hist = [[1, 2, 3], [4, 5]]
    pairs = sb.pairs([[[9], 1.0], [[2, 3, 40], 2.0], [[3, 40], 0.5], [[5, 9], 4.0], [[9], -1.0]], 70)
    assert pairs == (((9,), -1.0), ((2, 3, 40), 2.0), ((3, 40), 0.5), ((5, 9), 4.0))  # the last bias of [9]
    bias = sb.SequenceBias(pairs, hist, width=4)
    ids, vals = bias.arrays(3)
    got = [
        dict(zip(i[i >= 0].tolist(), v[i >= 0].tolist(), strict=True)) for i, v in zip(ids, vals, strict=True)
    ]
    assert got == [{9: -1.0, 40: 2.5}, {9: 3.0}, {9: 3.0}]  # sums; a padding row copies row 1
    bias.advance(np.array([40, 6]), done=np.array([False, True]))
    assert hist == [[1, 2, 3, 40], [4, 5]] and bias.dynamic
    with pytest.raises(ValueError, match="more than 2 distinct tokens"):
        sb.SequenceBias(pairs, hist, width=2)
