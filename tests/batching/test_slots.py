"""The slot engine without HTTP: continuous batching gives each request exactly what ``sample()``
gives it alone, admits and retires requests independently, and compiles nothing after warm-up."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from compile_counter import count_compiles

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.batching import policy, slot_graphs
from aotlm.batching.engine import Engine
from aotlm.batching.slots import SlotBatch
from aotlm.batching.types import EngineStopped, Finish, InvalidRequest, QueueFull, SamplingParams, Token
from aotlm.cli.app import main
from aotlm.cli.common import serve_kwargs

SHAPES = dict(n_positions=64, context_length_estimate=[8, 16])


@pytest.fixture(scope="module")
def served(gpt2_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve_cache")
    model = AutoModelForSampling.from_pretrained(
        gpt2_path, batch_size=3, continuous_batching=True, compile_cache=cache, **SHAPES
    )
    model.compile()
    ref = AutoModelForSampling.from_pretrained(gpt2_path, batch_size=1, compile_cache=cache, **SHAPES)
    return model, ref


@pytest.fixture
def engine(served):
    eng = Engine(served[0], eos_token_id=[], warm_up=True).start()  # what ``aotlm serve`` does
    yield eng
    eng.shutdown(timeout=5)


def collect(req) -> tuple[list[Token], Finish]:
    items = list(req)
    return [t for t in items if isinstance(t, Token)], items[-1]


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 101, n).tolist()


def test_each_request_gets_what_sample_gives_it(served, engine):
    """Greedy and seeded rows, prompts of every bucket and a chunked one (> 16 tokens), more
    requests than slots: each equals ``sample()`` of its prompt alone; nothing compiles."""
    _, ref = served
    cases = [
        (prompt(5, 1), SamplingParams(max_tokens=12, temperature=0)),
        (prompt(14, 2), SamplingParams(max_tokens=9, temperature=0.9, seed=7)),
        (prompt(30, 3), SamplingParams(max_tokens=20, temperature=0)),
        (prompt(2, 4), SamplingParams(max_tokens=3, temperature=0.7, top_k=5, seed=3)),
        (prompt(9, 5), SamplingParams(max_tokens=25, temperature=1.2, top_p=0.8, seed=11)),
        (prompt(16, 6), SamplingParams(max_tokens=1, temperature=0)),
        (prompt(7, 7), SamplingParams(max_tokens=15, temperature=0, repetition_penalty=1.3)),
    ]
    with count_compiles() as compiled:
        reqs = [engine.submit(p, sp) for p, sp in cases]
        got = [collect(r) for r in reqs]
    assert compiled["backend"] == 0, f"{compiled['backend']} compilations after warm-up"
    for (p, sp), (toks, fin) in zip(cases, got, strict=True):
        kw = dict(repetition_penalty=sp.repetition_penalty)
        if sp.temperature > 0:
            kw.update(
                do_sample=True, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=sp.seed
            )
        want = ref.sample(np.array([p]), max_new_tokens=sp.max_tokens, **kw)[0, len(p) :].tolist()
        assert [t.id for t in toks] == want
        assert fin == Finish("length", len(p), sp.max_tokens, fin.time_to_first_token)
        assert fin.time_to_first_token is not None and fin.time_to_first_token > 0


def test_warm_up_runs_every_serving_graph(served, monkeypatch):
    """``aotlm serve`` runs each graph once before opening its port (the engine fixture's
    requests then get ``sample()``'s tokens: warming leaves nothing a request reads)."""
    model, seen = served[0], []
    real = model.executable
    monkeypatch.setattr(model, "executable", lambda key: seen.append(key) or real(key))
    keys = slot_graphs.graph_keys(model.ctx_buckets, model.tg_buckets, model.batch_size)
    assert SlotBatch(model, []).warm_up() == SlotBatch(model, []).warm_up(None) == (len(keys), len(keys))
    assert set(seen) == set(keys)
    # with a bound the bigger prefills wait for their first request; the cheapest one still runs
    bound = sorted(policy.prefill_flops(model.cfg, k) for k in keys if k[0] == "slot_prefill")[1]
    seen.clear()
    n, total = SlotBatch(model, []).warm_up(max_flops=bound)
    assert set(seen) == set(policy.warmed(model.cfg, keys, bound)) and n < total == len(keys)
    assert {k for k in keys if "prefill" not in k[0]} <= set(seen)
    monkeypatch.setitem(policy.WARM_FLOPS, jax.default_backend(), bound)  # the default: this backend's
    assert SlotBatch(model, []).warm_up() == (n, total)


def test_short_request_finishes_while_a_long_one_runs(engine, monkeypatch):
    slow_decode(monkeypatch)  # 54 steps of ~1 ms could all run before this thread submits the short
    long = engine.submit(prompt(4, 8), SamplingParams(max_tokens=55, temperature=0))
    first = next(iter(long))  # the long request is generating
    assert isinstance(first, Token)
    short = engine.submit(prompt(6, 9), SamplingParams(max_tokens=3, temperature=0))
    toks, fin = collect(short)
    assert fin.reason == "length" and len(toks) == 3
    assert engine.stats()["active_slots"] >= 1, "the long request should still hold its slot"
    rest, fin_long = collect(long)
    assert fin_long.completion_tokens == 55 and len(rest) == 54


def test_cancel_frees_the_slot(served, monkeypatch):
    slow_decode(monkeypatch, 0.005)
    eng = Engine(served[0], eos_token_id=[]).start()
    try:
        hogs = [eng.submit(prompt(3, i), SamplingParams(max_tokens=60, temperature=0)) for i in range(5)]
        for h in hogs[:3]:
            next(iter(h))  # running
        for h in hogs:  # three running, two still waiting
            h.cancel()
        for h in hogs:
            toks, fin = collect(h)
            assert fin.reason == "cancelled" and len(toks) < 60
        done = [eng.submit(prompt(4, 20 + i), SamplingParams(max_tokens=4, temperature=0)) for i in range(6)]
        assert all(collect(r)[1].reason == "length" for r in done)
        stats = eng.stats()
        assert (stats["queue_depth"], stats["active_slots"], stats["slots"]) == (0, 0, 3)
    finally:
        eng.shutdown(timeout=5)


def test_stop_tokens_eos_logprobs_and_penalties(served, engine):
    _, ref = served
    p = prompt(6, 30)
    greedy = ref.sample(np.array([p]), max_new_tokens=10, return_dict=True)
    out = greedy.sequences[0, len(p) :].tolist()
    # a token stop sequence (kept in the output) and an eos id end the row early
    toks, fin = collect(
        engine.submit(p, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=((out[3],),)))
    )
    assert fin.reason == "stop_sequence" and [t.id for t in toks] == out[: out.index(out[3]) + 1]
    eng2 = Engine(served[0], eos_token_id=[out[2]]).start()
    try:
        toks, fin = collect(eng2.submit(p, SamplingParams(max_tokens=10, temperature=0)))
        assert fin.reason == "eos" and [t.id for t in toks] == out[: out.index(out[2]) + 1]
        toks, fin = collect(eng2.submit(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
        assert fin.reason == "length" and [t.id for t in toks] == out
    finally:
        eng2.shutdown(timeout=5)
    # log-probs: the chosen token's, and the k best, as sample() reports them
    toks, _ = collect(engine.submit(p, SamplingParams(max_tokens=10, temperature=0, logprobs=3)))
    np.testing.assert_allclose([t.logprob for t in toks], greedy.logprobs[0], rtol=1e-4, atol=1e-5)
    assert all(len(t.top) == 3 and t.top[0][0] == t.id for t in toks)
    # frequency / presence penalties on generated tokens, checked against logits on the host
    sp = SamplingParams(max_tokens=8, temperature=0, frequency_penalty=1.5, presence_penalty=0.5)
    toks, _ = collect(engine.submit(p, sp))
    seq, counts = list(p), np.zeros(101)
    for t in toks:
        logits = ref.forward(np.array([seq]))[0] - 1.5 * counts - 0.5 * (counts > 0)
        assert t.id == int(np.argmax(logits))
        seq.append(t.id)
        counts[t.id] += 1


def slow_decode(monkeypatch, seconds: float = 0.02) -> None:
    """The tiny model decodes a token in ~1 ms: slow it so requests stay in flight while we look."""
    real = SlotBatch.decode

    def decode(self, *a, **kw):
        time.sleep(seconds)
        return real(self, *a, **kw)

    monkeypatch.setattr(SlotBatch, "decode", decode)


def test_bad_requests_and_backpressure(served, monkeypatch):
    model, _ = served
    slow_decode(monkeypatch)
    eng = Engine(model, eos_token_id=[], max_queue=2, max_tokens_cap=40)
    with pytest.raises(EngineStopped):  # not started
        eng.submit([1, 2], SamplingParams())
    eng.start()
    try:
        for p, sp, field in [
            ([], SamplingParams(), "prompt"),
            ([1] * 60, SamplingParams(max_tokens=10), "max_tokens"),
            ([1] * 64, SamplingParams(max_tokens=1), "prompt"),
            ([500], SamplingParams(), "prompt"),
            ([1], SamplingParams(max_tokens=41), "max_tokens"),
            ([1], SamplingParams(temperature=-1), "temperature"),
            ([1], SamplingParams(top_p=0), "top_p"),
            ([1], SamplingParams(presence_penalty=3), "presence_penalty"),
            ([1], SamplingParams(logprobs=6), "logprobs"),
            ([1], SamplingParams(seed=2**32), "seed"),
            ([1], SamplingParams(stop_token_ids=((1000,),)), "stop"),
        ]:
            with pytest.raises(InvalidRequest) as e:
                eng.submit(p, sp)
            assert e.value.param == field, (p, sp)
        # 3 slots busy + 2 waiting = full
        reqs = []
        for _ in range(3):  # one at a time: the queue holds 2
            reqs.append(eng.submit([1, 2], SamplingParams(max_tokens=40, temperature=0)))
            next(iter(reqs[-1]))
        reqs += [eng.submit([1, 2], SamplingParams(max_tokens=2, temperature=0)) for _ in range(2)]
        with pytest.raises(QueueFull):
            eng.submit([1, 2], SamplingParams(max_tokens=2))
    finally:
        t0 = time.perf_counter()
        eng.shutdown(timeout=0.2)  # in-flight requests are cancelled after the timeout
        assert time.perf_counter() - t0 < 10
    assert {collect(r)[1].reason for r in reqs} <= {"cancelled", "length"}
    with pytest.raises(EngineStopped):
        eng.submit([1, 2], SamplingParams())


def test_model_needs_continuous_batching(served):
    _, ref = served
    with pytest.raises(ValueError, match="continuous_batching=True"):
        Engine(ref)
    keys = served[0].graph_keys()
    assert ("slot_decode", 64, 1) in keys and ("slot_decode", 64, served[0].batch_size) in keys


def test_compile_serve_precompiles_every_serving_graph(gpt2_path, tmp_path, capsys):
    """`aotlm compile --serve` with serve's flags leaves nothing for the server to compile."""
    flags = ["--n-positions", "32", "--context-length-estimate", "8", "--batch-size", "2"]
    assert main(["compile", str(gpt2_path), "--serve", "--cache-dir", str(tmp_path), *flags]) == 0
    assert "slot_decode" in capsys.readouterr().out
    kw = serve_kwargs(dict(n_positions=32, context_length_estimate=8, batch_size=2), str(gpt2_path))
    model = AutoModelForSampling.from_pretrained(gpt2_path, compile_cache=tmp_path, **kw).compile()
    assert [r["hit"] for r in model.compile_report] == [True] * len(model.graph_keys())
    kinds = {"slot_prefill", "slot_prefill_rows", "slot_insert", "slot_decode", "slot_swap", "slot_kv_out"}
    kinds.add("slot_kv_in")
    assert {k[0] for k in model.graph_keys()} == kinds


def record_rows(monkeypatch, gate: threading.Event | None = None) -> list[int]:
    """The ``rows`` every decode call is given (the scheduler's busy rows); with ``gate``, each call
    waits until it is set."""
    seen: list[int] = []
    real = SlotBatch.decode

    def decode(self, steps, top, rows, cancel=None):
        seen.append(rows)
        if gate is not None:
            assert gate.wait(timeout=60), "the test never opened the gate"
        return real(self, steps, top, rows, cancel)

    monkeypatch.setattr(SlotBatch, "decode", decode)
    return seen


def test_tokens_and_logprobs_do_not_depend_on_the_batch(served, monkeypatch):
    """Batch invariance: a request's greedy tokens, seeded samples and log-probs are bitwise
    those it gets alone (the one-row graph), whatever else shares the batch, whichever ladder
    graph runs it and after being moved down rows as the requests below it end."""
    gate = threading.Event()
    gate.set()
    rows = record_rows(monkeypatch, gate)
    # no solo chunks: a request planned alone decodes at most 8 steps a call
    eng = Engine(served[0], eos_token_id=[], prefix_cache=False, solo_chunk=None).start()
    try:
        targets = [
            (prompt(10, 40), SamplingParams(max_tokens=30, temperature=0, logprobs=2)),
            (prompt(6, 41), SamplingParams(max_tokens=30, temperature=0.8, seed=5, logprobs=2)),
        ]
        alone = [collect(eng.submit(p, sp)) for p, sp in targets]
        assert set(rows) == {1}
        with count_compiles() as compiled:
            for (p, sp), (want, _) in zip(targets, alone, strict=True):
                # decode calls wait until all three are queued, and the first of the company outlives
                # its first call (<= 1 + 8 tokens, should it run alone): three rows meet, however slow
                # this thread is between the submissions
                gate.clear()
                company = [
                    eng.submit(prompt(4 + i, 50 + i), SamplingParams(max_tokens=12 + 5 * i, temperature=0))
                    for i in range(2)
                ]
                req = eng.submit(p, sp)
                gate.set()
                got, _ = collect(req)  # row 2, moved to 1, then 0 as the others end
                assert [(t.id, t.logprob, t.top) for t in got] == [(t.id, t.logprob, t.top) for t in want]
                assert all(collect(r)[1].reason == "length" for r in company)
        assert compiled["backend"] == 0, f"{compiled['backend']} compilations after warm-up"
        assert {1, 2, 3} <= set(rows)
    finally:
        eng.shutdown(timeout=5)


def test_prefix_reuse_gives_the_same_tokens(served):
    """A chat's next turn (its last prompt + the answer + more) reuses the held K/V of the first
    turn (``cached_tokens``) and gets exactly the tokens of a full prefill; off, nothing is reused."""
    model, ref = served
    first = prompt(12, 60)
    runs = {}
    for on in (True, False):
        eng = Engine(model, eos_token_id=[], prefix_cache=on).start()
        try:
            t1, f1 = collect(eng.submit(first, SamplingParams(max_tokens=10, temperature=0)))
            follow = first + [t.id for t in t1] + prompt(7, 61)
            greedy = collect(eng.submit(follow, SamplingParams(max_tokens=10, temperature=0)))
            seeded = collect(eng.submit(follow, SamplingParams(max_tokens=10, temperature=0.9, seed=3)))
            runs[on] = (f1, greedy, seeded, follow, eng.stats())
        finally:
            eng.shutdown(timeout=5)
    f1, (toks, fin), (stoks, sfin), follow, stats = runs[True]
    assert f1.cached_tokens == 0 and fin.cached_tokens >= 12 and sfin.cached_tokens == len(follow) - 1
    assert stats["prefix_hits"] == 2
    assert stats["prefix_cached_tokens"] == fin.cached_tokens + sfin.cached_tokens
    want = ref.sample(np.array([follow]), max_new_tokens=10)[0, len(follow) :].tolist()
    assert [t.id for t in toks] == want
    _, (toks_off, fin_off), (stoks_off, _), _, stats_off = runs[False]
    assert fin_off.cached_tokens == 0 and stats_off["prefix_hits"] == 0
    assert [t.id for t in toks_off] == want and [t.id for t in stoks] == [t.id for t in stoks_off]


def test_prompts_waiting_together_are_prefilled_in_one_call(served, monkeypatch):
    """Two short prompts that wait while a long request decodes are encoded by one
    ``slot_prefill_rows`` call, each into its row, and each gets what ``sample()`` gives it alone."""
    model, ref = served
    slow_decode(monkeypatch, 0.01)
    calls = []
    real = SlotBatch.prefill_rows
    monkeypatch.setattr(SlotBatch, "prefill_rows", lambda self, *a: calls.append(a[0]) or real(self, *a))
    eng = Engine(model, eos_token_id=[], prefix_cache=False).start()
    try:
        long = eng.submit(prompt(3, 70), SamplingParams(max_tokens=40, temperature=0))
        next(iter(long))
        cases = [prompt(5, 71), prompt(7, 72)]
        reqs = [eng.submit(p, SamplingParams(max_tokens=6, temperature=0)) for p in cases]
        for p, r in zip(cases, reqs, strict=True):
            want = ref.sample(np.array([p]), max_new_tokens=6)[0, len(p) :].tolist()
            assert [t.id for t in collect(r)[0]] == want
        assert calls == [[1, 2]]
        collect(long)
    finally:
        eng.shutdown(timeout=5)


def test_a_prefix_copied_out_and_back_gives_the_same_tokens(served):
    """The first prompt's row is overwritten by later requests (its K/V copied into the prefix
    store first); a prompt continuing it copies the K/V back into a row and resumes after it,
    with exactly the tokens of a full prefill; no compiles."""
    model, ref = served
    eng = Engine(model, eos_token_id=[]).start()
    try:
        first = prompt(20, 80)
        toks = collect(eng.submit(first, SamplingParams(max_tokens=6, temperature=0)))[0]
        with count_compiles() as compiled:
            for i in range(4):  # sequential: each takes an empty row first, then the LRU one
                collect(eng.submit(prompt(9, 81 + i), SamplingParams(max_tokens=2, temperature=0)))
            assert eng.stats()["prefix_store_entries"] >= 1
            follow = first + [t.id for t in toks] + prompt(5, 90)
            got, fin = collect(eng.submit(follow, SamplingParams(max_tokens=8, temperature=0)))
        assert compiled["backend"] == 0, f"{compiled['backend']} compilations after warm-up"
        assert fin.cached_tokens >= 16
        want = ref.sample(np.array([follow]), max_new_tokens=8)[0, len(follow) :].tolist()
        assert [t.id for t in got] == want
    finally:
        eng.shutdown(timeout=5)
