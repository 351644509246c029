"""Prompt log-probabilities in the serving engine: each prompt token's log-probability, rank and top
alternatives equal transformers' log-softmax of the same checkpoint, for prompts of one chunk and of
several, while the same request's tokens stay ``sample()``'s; a scored prompt reuses no prefix."""

from __future__ import annotations

import numpy as np
import pytest
from compile_counter import count_compiles
from conformance import hf_model

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.batching import prompt_scores, slot_graphs
from aotlm.batching.engine import Engine
from aotlm.batching.slots import SlotBatch
from aotlm.batching.types import Finish, InvalidRequest, PromptLogprobs, PromptToken, SamplingParams, Token

SHAPES = dict(n_positions=64, context_length_estimate=[8, 16])


@pytest.fixture(scope="module")
def scored(gpt2_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("score_cache")
    kw = dict(batch_size=2, continuous_batching=True, compile_cache=cache, **SHAPES)
    model = AutoModelForSampling.from_pretrained(gpt2_path, prompt_logprobs=True, **kw).compile()
    ref = AutoModelForSampling.from_pretrained(gpt2_path, batch_size=1, compile_cache=cache, **SHAPES)
    return model, ref, hf_model(gpt2_path)


def hf_log_softmax(hf, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()


def run(engine: Engine, ids: list[int], sp: SamplingParams) -> tuple[list, list[Token], Finish]:
    items = list(engine.submit(ids, sp))
    return items, [t for t in items if isinstance(t, Token)], items[-1]


def test_the_answer_joins_chunks_and_names_a_gap():
    chunk = lambda first, ids: prompt_scores.PromptScores(
        first, np.array(ids), np.full(len(ids), -1.5), np.ones(len(ids), int),
        np.tile([[7, 8]], (len(ids), 1)), np.tile([[-0.1, -0.2]], (len(ids), 1)),
    )  # fmt: skip
    got = prompt_scores.answer(4, [chunk(1, [5, 6]), chunk(3, [9])], 1)
    assert got.tokens[0] is None
    assert got.tokens[1:] == tuple(PromptToken(t, -1.5, 1, ((7, -0.1),)) for t in (5, 6, 9))
    with pytest.raises(RuntimeError, match=r"prompt tokens \[3\] were not scored"):
        prompt_scores.answer(4, [chunk(1, [5, 6])], 1)


def test_prompt_logprobs_equal_transformers_and_tokens_stay(scored):
    """A prompt of one chunk and one of three (buckets 8 / 16): every token's log-probability
    within 1e-5 of transformers' log-softmax, its rank, and the top 5; generation as ``sample()``;
    the same prompt again is encoded again (no reuse), a plain request after it reuses it."""
    model, ref, hf = scored
    rng = np.random.default_rng(0)
    engine = Engine(model, eos_token_id=[], warm_up=True).start()
    try:
        for n in (6, 37):
            ids = rng.integers(0, 101, n).tolist()
            want = hf_log_softmax(hf, ids)
            sp = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=5)
            with count_compiles() as compiled:
                items, toks, fin = run(engine, ids, sp)
            assert compiled["backend"] == 0
            assert isinstance(items[0], PromptLogprobs) and items[0].tokens[0] is None
            for t in range(1, n):
                got, row = items[0].tokens[t], want[t - 1]
                assert got.id == ids[t]
                assert got.logprob == pytest.approx(row[ids[t]], abs=1e-5)
                assert got.rank == 1 + int(np.sum(row > row[ids[t]]))
                assert [i for i, _ in got.top] == np.argsort(-row, kind="stable")[:5].tolist()
                np.testing.assert_allclose([lp for _, lp in got.top], np.sort(row)[::-1][:5], atol=1e-5)
            sample = ref.sample(np.array([ids]), max_new_tokens=4)[0, n:].tolist()
            assert [t.id for t in toks] == sample and fin.reason == "length"
            again = run(engine, ids, sp)
            assert again[0][0] == items[0] and again[2].cached_tokens == 0
            plain = run(engine, ids, SamplingParams(max_tokens=4, temperature=0))
            assert not isinstance(plain[0][0], PromptLogprobs) and (plain[2].cached_tokens > 0) == (n > 16)
            assert [t.id for t in plain[1]] == sample
    finally:
        engine.shutdown(timeout=5)


def test_no_alternatives_with_prompt_logprobs_zero(scored):
    """``prompt_logprobs=0``: each prompt token's own log-probability, no alternatives."""
    model, _, hf = scored
    engine = Engine(model, eos_token_id=[]).start()
    try:
        p = [3, 1, 4, 1, 5]
        head = run(engine, p, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0][0]
        want = hf_log_softmax(hf, p)
        assert [t.logprob for t in head.tokens[1:]] == pytest.approx(
            [want[i - 1][p[i]] for i in range(1, len(p))], abs=1e-5
        )
        assert all(t.top == () for t in head.tokens[1:])
    finally:
        engine.shutdown(timeout=5)


def test_warm_up_runs_the_score_graphs(scored):
    """A scored prompt of any length is encoded from slot 0: its chunks' shapes are among the score
    graphs', and warm-up runs each."""
    model = scored[0]
    keys = slot_graphs.graph_keys(model.ctx_buckets, model.tg_buckets, model.batch_size, True)
    mine = {k[1:] for k in keys if k[0] == "slot_prefill_score"}
    batch = SlotBatch(model, [])
    assert {(s.bucket, s.width) for n in range(1, 64) for s in batch.prefill_plan(n)} == mine
    assert set(model.graph_keys()) == set(keys)
    assert batch.warm_up(None) == (len(keys), len(keys))


def test_a_model_without_score_graphs_names_the_flag(gpt2_path, scored):
    plain = AutoModelForSampling.from_pretrained(gpt2_path, batch_size=2, continuous_batching=True, **SHAPES)
    engine = Engine(plain, eos_token_id=[])
    with pytest.raises(InvalidRequest, match="--prompt-logprobs") as e:
        engine.validate([1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert e.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequest, match=r"prompt_logprobs must be in \[0, 5\], got 6"):
        Engine(scored[0], eos_token_id=[]).validate([1, 2], SamplingParams(max_tokens=1, prompt_logprobs=6))
    with pytest.raises(ValueError, match="continuous_batching=True too"):
        AutoModelForSampling.from_pretrained(gpt2_path, batch_size=1, prompt_logprobs=True, **SHAPES)


def test_compile_serve_prompt_logprobs_compiles_the_score_graphs(gpt2_path, tmp_path, capsys):
    """`aotlm compile --serve --prompt-logprobs` leaves nothing for `aotlm serve --prompt-logprobs`;
    the flag alone is a one-line error naming --serve (exit code 2)."""
    from aotlm.cli.app import main
    from aotlm.cli.common import serve_kwargs

    flags = ["--n-positions", "32", "--context-length-estimate", "8", "--batch-size", "2"]
    assert (
        main(
            ["compile", str(gpt2_path), "--serve", "--prompt-logprobs", "--cache-dir", str(tmp_path), *flags]
        )
        == 0
    )
    assert "slot_prefill_score" in capsys.readouterr().out
    kw = serve_kwargs(dict(n_positions=32, context_length_estimate=8, batch_size=2), str(gpt2_path), True)
    model = AutoModelForSampling.from_pretrained(gpt2_path, compile_cache=tmp_path, **kw).compile()
    assert [r["hit"] for r in model.compile_report] == [True] * len(model.graph_keys())
    assert main(["compile", str(gpt2_path), "--prompt-logprobs", "--cache-dir", str(tmp_path), *flags]) == 2
    assert "--prompt-logprobs adds serving graphs: give --serve too" in capsys.readouterr().err
