"""Score graphs (``model.score``): per-token log-probs and argmax flags equal transformers'."""

import numpy as np
import pytest
import torch
from compile_counter import count_compiles
from conformance import hf_model

from aotlm import AutoModelForSampling
from aotlm.core import scoring


def hf_scores(path, ids, mask):
    """transformers' ``log_softmax(logits)`` gathered at the next token, and ``argmax == next``."""
    model = hf_model(path)
    ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
    pos = (mask_t.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids_t, attention_mask=mask_t, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids_t[:, 1:, None])[..., 0]
    greedy = logits[:, :-1].argmax(-1) == ids_t[:, 1:]
    return lp.numpy(), greedy.numpy()


def batch(rng, lengths, vocab, width):
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = rng.integers(0, vocab, n)
        mask[i, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize("name", ["gpt2_path", "llama_path"])
def test_scores_equal_transformers(name, request):
    """Left-padded batch, one chunk and a chunked text (longer than the largest context bucket)."""
    path = request.getfixturevalue(name)
    model = AutoModelForSampling.from_pretrained(
        path, batch_size=3, n_positions=[64, 128], context_length_estimate=[16, 32], scoring=True
    ).compile()
    rng = np.random.default_rng(0)
    for width, lengths in ((20, [20, 13, 1]), (20, [2, 13, 3]), (100, [100, 77, 40]), (129, [129, 1, 70])):
        ids, mask = batch(rng, lengths, 101, width)
        out = model.score(ids, attention_mask=mask)
        ref_lp, ref_greedy = hf_scores(path, ids, mask)
        for i, n in enumerate(lengths):
            cols = slice(width - n + 1, width)  # a row's first token has no prediction
            assert out.scored[i, cols].all() and not out.scored[i, : width - n + 1].any()
            np.testing.assert_allclose(out.logprobs[i, cols], ref_lp[i, width - n :], atol=1e-4, rtol=0)
            np.testing.assert_array_equal(out.is_greedy[i, cols], ref_greedy[i, width - n :])
        assert (out.logprobs[~out.scored] == 0).all()
        np.testing.assert_allclose(out.sum(), [ref_lp[i, width - n :].sum() for i, n in enumerate(lengths)],
                                   atol=1e-3)  # fmt: skip


def test_greedy_flags_follow_greedy_generation(gpt2_path):
    """A greedy continuation is all-argmax; changing one of its tokens breaks the flag there."""
    model = AutoModelForSampling.from_pretrained(gpt2_path, batch_size=1, n_positions=64, scoring=True)
    seq = model.sample(np.array([[5, 6, 7]]), max_new_tokens=10)[0]
    out = model.score(seq[None, :])
    assert out.is_greedy[0, 3:].all()
    bad = seq.copy()
    bad[5] = (bad[5] + 1) % 101
    assert not model.score(bad[None, :]).is_greedy[0, 5]


def test_graph_keys_and_zero_compiles_after_warmup(gpt2_path, tmp_path):
    kw = dict(batch_size=2, n_positions=[64, 128], context_length_estimate=[16, 32], compile_cache=tmp_path)
    model = AutoModelForSampling.from_pretrained(gpt2_path, scoring=True, **kw)
    keys = [k for k in model.graph_keys() if k[0] == "score"]
    assert keys == [("score", 16, 16), ("score", 32, 32), ("score", 32, 64), ("score", 32, 128)]
    plain = AutoModelForSampling.from_pretrained(gpt2_path, **kw)
    assert not [k for k in plain.graph_keys() if k[0] == "score"]
    model.compile()
    ids = np.arange(1, 91)[None, :] % 101
    with count_compiles() as c:
        model.score(ids), model.score(ids[:, :10]), model.score(np.repeat(ids[:, :40], 2, 0))
    assert c["backend"] == 0 and c["tracing"] == 0, c
    # a second model object with the same config loads every score graph from the compile cache
    again = AutoModelForSampling.from_pretrained(gpt2_path, scoring=True, **kw)
    with count_compiles() as c:
        again.compile()
        again.score(ids)
    assert c["backend"] == 0, c


def test_errors(gpt2_path):
    model = AutoModelForSampling.from_pretrained(gpt2_path, batch_size=1, n_positions=64)
    assert model.score(np.ones((1, 65), np.int64)).scored.sum() == 64  # the last token is only a target
    with pytest.raises(ValueError, match="n_positions=64.*rolling"):
        model.score(np.ones((1, 66), np.int64))
    with pytest.raises(ValueError, match="left padding"):
        model.score(np.ones((1, 4), np.int64), attention_mask=np.array([[1, 1, 1, 0]]))
    with pytest.raises(TypeError, match="scoring must be True or False"):
        AutoModelForSampling.from_pretrained(gpt2_path, scoring="yes")


def test_block_size():
    assert scoring.block_size(1, 1024, 50257) == 128
    assert scoring.block_size(8, 1024, 50257) == 16
    assert scoring.block_size(1, 100, 101) == 64  # never more than the length
    assert scoring.block_size(64, 16, 1 << 24) == 1
