"""``suppress_tokens``, ``begin_suppress_tokens`` and ``bad_words_ids`` in ``sample()`` (and the HF
adapter) against transformers' ``generate``, and ``aotlm.generate.bans`` on its own."""

from __future__ import annotations

import numpy as np
import pytest
from token_rules import EOS, NEW, Prompts, model_pair

from aotlm import HuggingFaceGenerationModelAdapter
from aotlm.generate import bans

P = Prompts(4)
IDS, MASK = P.ids, P.mask
theirs, ours = P.theirs, P.ours


@pytest.fixture(scope="module")
def pair(llama_path):
    return model_pair(llama_path)


def test_bans_equal_transformers(pair):
    model, ref = pair
    base = ours(model)
    np.testing.assert_array_equal(base, theirs(ref))
    first, second = base[:, 6].tolist(), base[:, 7].tolist()
    cases = [
        dict(suppress_tokens=first),
        dict(begin_suppress_tokens=first),  # the first new token only
        dict(bad_words_ids=[[first[0]], [EOS]]),  # a bad word that is an eos alone is dropped
        dict(bad_words_ids=[[a, b] for a, b in zip(first, second, strict=True)]),  # matched on the host
        dict(bad_words_ids=[[*IDS[0, -2:].tolist(), first[0]]]),  # its start in the prompt
        dict(
            suppress_tokens=[base[0, 8]],
            begin_suppress_tokens=first[1:],
            bad_words_ids=[[first[0], second[0]]],
        ),
    ]
    for kw in cases:
        got = ours(model, **kw)
        np.testing.assert_array_equal(got, theirs(ref, **kw), err_msg=str(kw))
        assert not np.array_equal(got, base) or kw.get("bad_words_ids") == [[first[0]], [EOS]], kw
    adapter = HuggingFaceGenerationModelAdapter(ref.config, model)
    import torch

    kw = dict(suppress_tokens=first, bad_words_ids=[[first[1], second[1]]])
    got = adapter.generate(
        torch.tensor(IDS),
        attention_mask=torch.tensor(MASK),
        max_new_tokens=NEW,
        eos_token_id=EOS,
        pad_token_id=0,
        **kw,
    )
    np.testing.assert_array_equal(got.numpy(), theirs(ref, **kw))


def test_a_suppressed_token_is_never_drawn(pair):
    model, _ = pair
    free = model.sample(IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=True, top_k=3, seed=[1, 2, 3])
    banned = sorted({int(t) for t in free[:, 6:].ravel()})[:2]
    res = model.sample(
        IDS,
        attention_mask=MASK,
        max_new_tokens=NEW,
        do_sample=True,
        top_k=3,
        seed=[1, 2, 3],
        suppress_tokens=banned,
        return_dict=True,
        top_logprobs=3,
    )
    assert not np.isin(res.sequences[:, 6:], banned).any()
    assert not np.isin(res.top_logprobs[0], banned).any()  # nor offered as an alternative
    assert np.isfinite(res.logprobs).all()


def test_bad_bans_are_refused_before_any_device_work(pair):
    model, _ = pair
    for kw, err, match in [
        (
            dict(suppress_tokens=[101]),
            ValueError,
            r"suppress_tokens holds 101, outside the vocabulary \[0, 101\)",
        ),
        (dict(suppress_tokens=3), TypeError, "suppress_tokens must be a list of token ids"),
        (dict(begin_suppress_tokens=[[1, 2]]), TypeError, r"must hold token ids \(ints\), got \[1, 2\]"),
        (dict(suppress_tokens=[True]), TypeError, "must hold token ids"),
        (dict(bad_words_ids=[]), TypeError, "bad_words_ids must be a non-empty list of token-id lists"),
        (dict(bad_words_ids=[5, 6]), TypeError, "bad_words_ids must be a non-empty list of token-id lists"),
        (dict(bad_words_ids=[[5], []]), TypeError, "non-empty list of token-id lists"),
        (dict(bad_words_ids=[[-1]]), ValueError, "bad_words_ids holds -1, outside the vocabulary"),
    ]:
        with pytest.raises(err, match=match):
            ours(model, **kw)
    with pytest.raises(ValueError, match=r"\['bad_words_ids'\] not supported with num_beams > 1"):
        model.sample(IDS[:1], max_new_tokens=4, num_beams=2, bad_words_ids=[[5]])


def test_masks_and_matching():
    hist = [[1, 2, 3], [4, 5]]
    ban = bans.Bans((7,), (8,), ((9,), (2, 3, 40), (5, 41)), 70, hist, [50, -1])
    allowed = lambda mask, t: bool(mask[t // 32] >> np.uint32(t % 32) & np.uint32(1))
    allow = np.full((2, 3), bans.ALL_ONES, np.uint32)
    ban.apply(allow, first=True)
    assert ban.dynamic and not any(allowed(allow[r], t) for r in (0, 1) for t in (7, 8, 9))
    assert (
        not allowed(allow[0], 40)
        and allowed(allow[0], 41)
        and allowed(allow[1], 40)
        and not allowed(allow[1], 41)
    )
    ban.advance(np.array([40, 6]), done=np.array([False, True]))  # a done row gets nothing
    assert hist == [[1, 2, 3, 40], [4, 5]]
    allow[:] = bans.ALL_ONES
    ban.apply(allow, first=False, live=np.array([True, False]))
    assert allowed(allow[0], 8) and not allowed(allow[0], 7) and allowed(allow[0], 40)
    assert allowed(allow[1], 41) and not allowed(allow[1], 7)  # not live: the fixed bans only
    everything = bans.Bans(tuple(range(64)), (), (), 64, [[1]], [3])  # nothing left: the eos may end it
    allow = np.full((1, 2), bans.ALL_ONES, np.uint32)
    everything.apply(allow, first=True)
    assert allow.tolist() == [[1 << 3, 0]]
    assert bans.bad_words([[3], [3, 4]], 10, [3]) == ((3, 4),)
    assert bans.token_list(np.array([1, 2]), "suppress_tokens", 10) == (1, 2)
