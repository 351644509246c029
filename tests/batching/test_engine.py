"""The serving scheduler (``aotlm.batching.engine.Engine``) against a fake ``SlotRunner``: no model,
no JAX, milliseconds per test. The fake's tokens are arithmetic (each token is the previous one
plus one, modulo the vocabulary), so every stream can be checked exactly; it records every call,
so admission order, the prefill budget, cancellation and shutdown can be asserted on."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from aotlm.batching import engine as engine_module
from aotlm.batching.engine import Engine
from aotlm.batching.prompt_scores import PromptScores
from aotlm.batching.slots import SlotRunner
from aotlm.batching.types import (
    Embedding,
    EngineStopped,
    Finish,
    InvalidRequest,
    PromptLogprobs,
    QueueFull,
    SamplingParams,
    Token,
)
from aotlm.core import buckets as bk
from aotlm.core.graphs import FinishReason

VOCAB = 50


class FakeSlots:
    """``SlotRunner`` with arithmetic tokens: the first token is the prompt's last + 1, each next
    one the previous + 1 (mod ``VOCAB``); ``eos`` ends a row, as does its ``max_tokens``."""

    def __init__(
        self, slots: int = 2, n_positions: int = 64, chunk: int = 4, eos: int | None = None, prompts: int = 1
    ):
        self.slots, self.n_positions, self.vocab_size, self.max_chunk = slots, n_positions, VOCAB, chunk
        self.max_prompts, self.prompt_buckets = prompts, (chunk,)
        self.eos = eos
        self.calls: list[tuple] = []  # ("prefill", row, start, prompt[0]), ("insert", row),
        # ("decode", rows decoded, rows cancelled)
        self.open = True  # False: each decode call waits for a ``release`` (``hold``)
        self.permits = threading.Semaphore(0)
        self.entered = 0  # decode calls begun
        self.steps: list[int] = []  # each decode call's steps
        self.cv = threading.Condition()
        self.idx = np.zeros(slots, np.int64)
        self.done = np.ones(slots, np.bool_)
        self.reason = np.zeros(slots, np.int32)
        self.last = np.zeros(slots, np.int64)
        self.out = np.full((slots, n_positions), -1, np.int32)

    def hold(self) -> None:
        """From now on every decode call waits for ``release`` (or ``let_go``)."""
        self.open = False

    def release(self) -> None:
        self.permits.release()

    def let_go(self) -> None:
        self.open = True
        self.permits.release()

    def wait_decodes(self, n: int) -> None:
        """Until ``n`` decode calls have begun (the n-th one may be waiting for ``release``)."""
        with self.cv:
            assert self.cv.wait_for(lambda: self.entered >= n, timeout=5), f"{self.entered} decodes, not {n}"

    def check(self, prompt_len: int, settings: SamplingParams) -> list[tuple[str, str]]:
        if prompt_len + settings.max_tokens > self.n_positions:
            return [("max_tokens", "too long")]
        return []

    def prefill_plan(self, prompt_len: int, start: int = 0) -> tuple[bk.PrefillStep, ...]:
        return bk.resume_plan(prompt_len, start, [self.max_chunk], [self.n_positions])

    def prefill_step(self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter=None) -> int:
        self.calls.append(("prefill", row, step.start, int(prompt[0])))
        return int(prompt[step.start + step.n_real - 1])  # "logits": the chunk's last token

    def prefill_scored(self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter=None):
        """``prefill_step`` plus scores: token ``t``'s log-probability is ``-t / 10``, its rank 1."""
        nxt = np.asarray(prompt[step.start + 1 : step.start + step.n_real + 1])
        top = nxt[:, None] + np.arange(2)
        scores = PromptScores(step.start + 1, nxt, -nxt / 10, np.ones(len(nxt), int), top, -top / 10)
        return self.prefill_step(row, prompt, step, adapter), scores

    def prefill_embedded(self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter=None):
        """``prefill_step``, returning the "hidden state" [prompt's last token, prompt length]."""
        self.prefill_step(row, prompt, step, adapter)
        return np.array([float(prompt[-1]), float(len(prompt))])

    def prefill_rows(self, rows, prompts, bucket: int, adapters=()) -> list[int]:
        assert 1 < len(rows) <= self.max_prompts and all(len(p) <= bucket for p in prompts)
        self.calls.append(("prefill_rows", tuple(rows), bucket))
        return [int(p[-1]) for p in prompts]

    def _emit(self, row: int, slot: int, tok: int) -> None:
        self.out[row, slot], self.idx[row] = tok, slot
        if self.eos is not None and tok == self.eos:
            self.done[row], self.reason[row] = True, FinishReason.EOS
        elif slot >= self.last[row]:
            self.done[row], self.reason[row] = True, FinishReason.LENGTH

    def constrain(self, matchers) -> None:
        assert not matchers, "grammar-constrained rows run on the real SlotBatch (test_structured*)"

    def insert(self, row: int, prompt: np.ndarray, settings: SamplingParams, logits: int, allow=None) -> None:
        self.calls.append(("insert", row))
        self.out[row] = -1
        self.out[row, : len(prompt)] = prompt
        self.done[row], self.reason[row] = False, FinishReason.RUNNING
        self.last[row] = len(prompt) + settings.max_tokens - 1
        self._emit(row, len(prompt), (logits + 1) % VOCAB)

    def decode(self, steps: int, max_live_slot: int, rows: int, cancel: np.ndarray | None = None) -> None:
        with self.cv:
            self.entered += 1
            self.cv.notify_all()
        if not self.open:
            assert self.permits.acquire(timeout=10), "a test held decoding and never released it"
        stopped = () if cancel is None else tuple(np.flatnonzero(cancel & ~self.done).tolist())
        self.done[list(stopped)] = True
        self.reason[list(stopped)] = FinishReason.STOPPED
        live = [r for r in range(self.slots) if not self.done[r]]
        assert all(r < rows for r in live), f"live rows {live} outside the {rows} decoded"
        self.calls.append(("decode", tuple(live), stopped))
        self.steps.append(steps)
        for r in live:
            for _ in range(steps):
                if not self.done[r]:
                    slot = int(self.idx[r]) + 1
                    self._emit(r, slot, (int(self.out[r, slot - 1]) + 1) % VOCAB)

    def swap(self, a: int, b: int, filled: int) -> None:
        self.calls.append(("swap", a, b))
        for x in (self.idx, self.done, self.reason, self.last, self.out):
            x[[a, b]] = x[[b, a]]
        up = max(a, b)
        if not self.done[up]:
            self.done[up], self.reason[up] = True, FinishReason.CANCELLED

    def save(self, row: int, filled: int) -> tuple[np.ndarray, int]:
        self.calls.append(("save", row, filled))
        return self.out[row, :filled].copy(), filled * 4

    def restore(self, row: int, kv: np.ndarray) -> None:
        self.calls.append(("restore", row, len(kv)))
        self.out[row, : len(kv)] = kv

    def read(self, logprobs: bool = False) -> dict[str, np.ndarray]:
        host = {"idx": self.idx.copy(), "done": self.done.copy(), "reason": self.reason.copy()}
        host["out"] = self.out.copy()
        if logprobs:
            k = 2
            host["logp"] = np.full(self.out.shape, -0.5, np.float32)
            host["top_ids"] = np.broadcast_to(self.out[..., None], (*self.out.shape, k)).copy()
            host["top_lp"] = np.full((*self.out.shape, k), -0.5, np.float32)
        return host


def expected(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % VOCAB for i in range(n)]


def collect(req, timeout: float = 5.0) -> tuple[list[int], Finish]:
    """The request's token ids and its ``Finish`` (fails instead of hanging)."""
    with ThreadPoolExecutor(1) as pool:
        items = pool.submit(list, req).result(timeout=timeout)
    return [t.id for t in items if isinstance(t, Token)], items[-1]


@pytest.fixture
def fake():
    return FakeSlots()


def test_the_fake_is_a_slot_runner(fake):
    assert isinstance(fake, SlotRunner)


def test_more_requests_than_slots_all_get_their_tokens(fake):
    """Admission: two slots, five requests; each waits for a free slot and gets exactly its tokens,
    and a second request joins the first one's decode calls (continuous batching)."""
    fake.hold()
    eng = Engine(fake, max_queue=8, decode_chunk=4, solo_chunk=None).start()
    try:
        prompts = [[3, 4, 5], [10], [7, 8, 9, 10, 11, 12], [40, 41], [49]]
        budgets = [9, 4, 5, 6, 7]  # the first outlasts its first decode call (4 steps, alone: decode_chunk=4)
        reqs = [eng.submit(prompts[0], SamplingParams(max_tokens=budgets[0]))]
        fake.wait_decodes(1)  # the first request is live; the others arrive now
        reqs += [eng.submit(p, SamplingParams(max_tokens=budgets[i])) for i, p in enumerate(prompts) if i]
        fake.let_go()
        for p, req, n in zip(prompts, reqs, budgets, strict=True):
            toks, fin = collect(req)
            assert toks == expected(p, n)
            assert (fin.reason, fin.prompt_tokens, fin.completion_tokens) == ("length", len(p), n)
        decoded = [c[1] for c in fake.calls if c[0] == "decode"]
        assert decoded[:2] == [(0,), (0, 1)]  # both slots busy at once
        inserted = [c[1] for c in fake.calls if c[0] == "insert"]
        assert len(inserted) == 5 and set(inserted) == {0, 1}
    finally:
        fake.let_go()
        eng.shutdown(timeout=1)


def test_decode_steps_per_call_follow_the_rows_and_the_queue():
    """A lone request decodes ``decode_chunk`` (4 here) steps a call, two busy rows 3 (``_steps``), and
    one while a prompt waits (it would wait for the whole call); tokens are the same either way."""
    fake = FakeSlots(slots=2)
    fake.hold()
    eng = Engine(fake, decode_chunk=4, solo_chunk=None).start()
    try:
        prompts, budgets = [[1], [2], [3]], [20, 20, 4]
        reqs = [eng.submit(prompts[0], SamplingParams(max_tokens=20))]
        fake.wait_decodes(1)  # alone: 4 steps
        reqs += [
            eng.submit(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts[1:], budgets[1:], strict=True)
        ]
        fake.let_go()
        for p, req, n in zip(prompts, reqs, budgets, strict=True):
            assert collect(req)[0] == expected(p, n)
        assert fake.steps[:2] == [4, 1], fake.steps  # then two rows busy and a third prompt waiting
        # then two rows busy with nothing waiting: 3 steps a call (4 again once one is left)
        assert set(fake.steps) == {1, 3, 4}, fake.steps
    finally:
        fake.let_go()
        eng.shutdown(timeout=1)


@pytest.mark.parametrize("solo_after", [0.0, 60.0])
def test_a_request_alone_for_a_while_decodes_longer_calls(monkeypatch, solo_after):
    """Alone since ``SOLO_AFTER`` s (a lone client), a request decodes ``solo_chunk`` steps a call; a
    newcomer waits for that call, then calls follow the busy rows, and stay short for the one left
    until ``SOLO_AFTER`` s pass without company. Tokens are the same either way."""
    monkeypatch.setattr(engine_module, "SOLO_AFTER", solo_after)
    fake = FakeSlots(slots=2)
    fake.hold()
    eng = Engine(fake, decode_chunk=4, solo_chunk=12).start()
    try:
        reqs = [eng.submit([1], SamplingParams(max_tokens=40))]
        fake.wait_decodes(1)  # never crowded yet: a solo call
        reqs.append(eng.submit([2], SamplingParams(max_tokens=12)))
        fake.let_go()
        assert [collect(r)[0] for r in reqs] == [expected([1], 40), expected([2], 12)]
        assert fake.steps[:2] == [12, 3], fake.steps  # solo, then two rows busy (4 * 4 // 5)
        assert fake.steps[-1] == (12 if solo_after == 0 else 4), fake.steps  # the first one alone again
    finally:
        fake.let_go()
        eng.shutdown(timeout=1)


def test_eos_ends_a_request_and_frees_its_slot():
    fake = FakeSlots(slots=1, eos=7)
    eng = Engine(fake).start()
    try:
        toks, fin = collect(eng.submit([4], SamplingParams(max_tokens=10)))
        assert toks == [5, 6, 7] and fin.reason == "eos"
        toks, fin = collect(eng.submit([20], SamplingParams(max_tokens=2)))  # the slot was freed
        assert toks == [21, 22] and fin.reason == "length"
    finally:
        eng.shutdown(timeout=1)


def test_a_long_prompt_is_spread_over_rounds_by_the_prefill_budget():
    """Budget one chunk per round: a 3-chunk prompt takes 3 rounds, and the live request decodes
    between its chunks instead of waiting for the whole prompt."""
    fake = FakeSlots(slots=2, chunk=4)
    fake.hold()
    eng = Engine(fake, prefill_budget=4, solo_chunk=None).start()
    try:
        first = eng.submit([1], SamplingParams(max_tokens=30))
        fake.wait_decodes(1)
        long = eng.submit(list(range(10, 22)), SamplingParams(max_tokens=2))
        fake.let_go()
        assert collect(long)[0] == expected(list(range(10, 22)), 2)
        assert collect(first)[0] == expected([1], 30)
        kinds = ["long" if c[0] == "prefill" and c[3] == 10 else c[0] for c in fake.calls]
        chunks = [i for i, k in enumerate(kinds) if k == "long"]
        assert len(chunks) == 3
        assert all("decode" in kinds[a:b] for a, b in zip(chunks, chunks[1:], strict=False))
    finally:
        fake.let_go()
        eng.shutdown(timeout=1)


def test_prefill_goes_oldest_first_and_a_full_queue_refuses():
    """Fairness: with one slot, requests are served in the order they arrived; past ``max_queue``
    waiting requests ``submit`` raises ``QueueFull``."""
    fake = FakeSlots(slots=1)
    fake.hold()
    eng = Engine(fake, max_queue=3).start()
    try:
        running = eng.submit([30], SamplingParams(max_tokens=4))
        fake.wait_decodes(1)
        waiting = [eng.submit([i], SamplingParams(max_tokens=2)) for i in (1, 2, 3)]
        with pytest.raises(QueueFull):
            eng.submit([4], SamplingParams(max_tokens=2))
        fake.let_go()
        assert collect(running)[0] == expected([30], 4)
        for i, req in zip((1, 2, 3), waiting, strict=True):
            assert collect(req)[0] == expected([i], 2)
        assert [c[3] for c in fake.calls if c[0] == "prefill"] == [30, 1, 2, 3]
    finally:
        fake.let_go()
        eng.shutdown(timeout=1)


def test_cancel_a_running_and_a_waiting_request():
    """A cancelled running request finishes ``cancelled``; the request above it moves down into
    its row (a swap, which stops the freed row on the device) and goes on unchanged; a cancelled
    waiting one never reaches prefill."""
    fake = FakeSlots(slots=2)
    fake.hold()
    eng = Engine(fake, max_queue=4, decode_chunk=4, solo_chunk=None).start()
    try:
        doomed = eng.submit([5], SamplingParams(max_tokens=40))
        fake.wait_decodes(1)
        other = eng.submit([20], SamplingParams(max_tokens=6))
        waiting = eng.submit([9, 9], SamplingParams(max_tokens=2))
        fake.release()
        fake.wait_decodes(2)  # ``other`` holds the second slot, ``waiting`` waits for one
        doomed.cancel()
        waiting.cancel()
        fake.let_go()
        toks, fin = collect(doomed)
        # its first token, a 4-step call alone, then the held 1-step call (``waiting`` waits)
        assert fin.reason == "cancelled" and toks == expected([5], 6)
        assert collect(waiting) == ([], Finish("cancelled", 2, 0, None))
        toks, fin = collect(other)
        assert toks == expected([20], 6) and (fin.reason, fin.completion_tokens) == ("length", 6)
        assert [c[3] for c in fake.calls if c[0] == "prefill"] == [5, 20]  # the waiting one never ran
        assert ("swap", 0, 1) in fake.calls  # ``other`` moved down, the cancelled row up
        decoded = [c[1] for c in fake.calls if c[0] == "decode"]
        assert decoded[:2] == [(0,), (0, 1)] and all(rows == (0,) for rows in decoded[2:])
        assert fake.done.all() and fake.reason[1] == FinishReason.CANCELLED
    finally:
        fake.let_go()
        eng.shutdown(timeout=1)


def test_shutdown_cancels_what_is_left_and_refuses_new_requests():
    fake = FakeSlots(slots=1)
    fake.hold()
    eng = Engine(fake).start()
    running = eng.submit([5], SamplingParams(max_tokens=40))
    fake.wait_decodes(1)
    queued = eng.submit([6], SamplingParams(max_tokens=4))
    threading.Timer(0.1, fake.let_go).start()
    eng.shutdown(timeout=0.05)
    assert not eng.running
    assert collect(running)[1].reason == "cancelled"
    assert collect(queued) == ([], Finish("cancelled", 1, 0, None))
    with pytest.raises(EngineStopped):
        eng.submit([1], SamplingParams(max_tokens=2))


def test_invalid_requests_name_their_field(fake):
    eng = Engine(fake, max_tokens_cap=10)
    with pytest.raises(InvalidRequest) as e:
        eng.submit([VOCAB], SamplingParams(max_tokens=2))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest) as e:
        eng.submit([1], SamplingParams(max_tokens=11))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as e:
        eng.submit([1] * 60, SamplingParams(max_tokens=10))
    assert e.value.param == "max_tokens"


def test_logprobs_are_streamed_from_read(fake):
    eng = Engine(fake).start()
    try:
        items = list(eng.submit([2], SamplingParams(max_tokens=2, logprobs=1)))
        tokens = [t for t in items if isinstance(t, Token)]
        assert [(t.id, t.logprob, t.top) for t in tokens] == [
            (3, -0.5, ((3, -0.5),)),
            (4, -0.5, ((4, -0.5),)),
        ]
    finally:
        eng.shutdown(timeout=1)


def test_a_scored_prompt_is_encoded_whole_and_its_scores_come_first():
    """``prompt_logprobs``: the held prefix is not reused (every chunk from slot 0 is scored), the
    chunks' scores join into one ``PromptLogprobs`` before the first token; short scored prompts
    waiting together are not encoded in one ``prefill_rows`` call."""
    fake = FakeSlots(slots=2, prompts=2)
    eng = Engine(fake).start()
    try:
        a = list(range(1, 11))  # 3 chunks of 4
        collect(eng.submit(a, SamplingParams(max_tokens=2)))
        fake.calls.clear()
        items = list(eng.submit(a + [30], SamplingParams(max_tokens=2, prompt_logprobs=1)))
        head, fin = items[0], items[-1]
        assert isinstance(head, PromptLogprobs) and head.tokens[0] is None and fin.cached_tokens == 0
        assert [(t.id, t.logprob, t.rank, t.top) for t in head.tokens[1:]] == [
            (t, -t / 10, 1, ((t, -t / 10),)) for t in a[1:] + [30]
        ]
        assert [c[2] for c in fake.calls if c[0] == "prefill"] == [0, 4, 7]  # the last one overlaps
        assert [t.id for t in items[1:-1]] == expected(a + [30], 2)
    finally:
        eng.shutdown(timeout=1)
    fake = FakeSlots(slots=8, prompts=4)
    fake.hold()
    eng = Engine(fake, prefill_budget=32, solo_chunk=None).start()
    try:
        busy = eng.submit([7], SamplingParams(max_tokens=30))
        fake.wait_decodes(1)
        kinds = [None, 0, None, 1, 0]  # prompt_logprobs of five short prompts queued together
        asks = [SamplingParams(max_tokens=3, prompt_logprobs=k) for k in kinds]
        reqs = [eng.submit([i, i + 1], sp) for i, sp in enumerate(asks)]
        fake.let_go()
        heads = [list(r)[0] for r in reqs]
        assert [h.tokens[1].top if k is not None else h for h, k in zip(heads, kinds, strict=True)] == [
            Token(2),
            (),
            Token(4),
            ((4, -0.4),),
            (),
        ]
        collect(busy)
        prefills = [c[:3] for c in fake.calls if c[0].startswith("prefill")]
        assert prefills == [("prefill", 0, 0), ("prefill_rows", (1, 3), 4), ("prefill", 2, 0),
                            ("prefill", 4, 0), ("prefill", 5, 0)]  # fmt: skip
    finally:
        eng.shutdown(timeout=1)


def test_an_embedding_request_ends_with_its_prompt_and_leaves_its_tokens_for_reuse():
    """``embed``: every chunk from slot 0 (a held prefix is not reused), the last one embedded; an
    ``Embedding``, then the ``Finish`` (nothing generated, no insert); the row keeps the prompt's K/V,
    which a later prompt continuing it reuses."""
    fake = FakeSlots(slots=2)
    eng = Engine(fake).start()
    try:
        a = list(range(1, 11))
        collect(eng.submit(a, SamplingParams(max_tokens=2)))
        fake.calls.clear()
        items = list(eng.submit(a + [30], SamplingParams(max_tokens=1, embed=True)))
        assert items[0] == Embedding((30.0, 11.0)) and len(items) == 2
        assert items[1] == Finish("length", 11, 0, None, 0)
        assert [c[2] for c in fake.calls if c[0] == "prefill"] == [0, 4, 7]
        assert not any(c[0] == "insert" for c in fake.calls)
        follow = a + [30, 31, 32]
        toks, fin = collect(eng.submit(follow, SamplingParams(max_tokens=2)))
        assert toks == expected(follow, 2) and fin.cached_tokens == 11
    finally:
        eng.shutdown(timeout=1)


def test_a_prompt_resumes_after_the_prefix_a_free_row_holds():
    """A finished request's row keeps its tokens; a later prompt starting with them is admitted into
    that row (copied down to the lowest free row) and prefilled from the first token not held,
    reported as ``cached_tokens``; a prompt sharing nothing takes an empty row, keeping the other."""
    fake = FakeSlots(slots=2)
    eng = Engine(fake).start()
    try:
        a = list(range(1, 9))
        toks, fin = collect(eng.submit(a, SamplingParams(max_tokens=3)))
        assert fin.cached_tokens == 0
        b = list(range(20, 28))
        assert collect(eng.submit(b, SamplingParams(max_tokens=2)))[1].cached_tokens == 0
        # b took the empty row: a's tokens copied up into it, kept (free rows: no state swap)
        assert ("save", 0, 10) in fake.calls and ("restore", 1, 10) in fake.calls
        assert not any(c[0] == "swap" for c in fake.calls)
        follow = a + toks + [40, 41]  # a chat's next turn: 13 tokens, the first 10 held
        toks2, fin2 = collect(eng.submit(follow, SamplingParams(max_tokens=2)))
        assert toks2 == expected(follow, 2) and fin2.cached_tokens == 10  # a's prompt + 2 of its tokens
        # a's row and b's exchanged (K/V only), then the prompt resumes at its 11th token
        assert fake.calls[-7:-2] == [("save", 0, 9), ("save", 1, 10), ("restore", 0, 10), ("restore", 1, 9),
                                     ("prefill", 0, 10, 1)]  # fmt: skip
        stats = eng.stats()
        assert (stats["prefix_requests"], stats["prefix_hits"], stats["held_rows"]) == (3, 1, 2)
    finally:
        eng.shutdown(timeout=1)


def test_short_prompts_arriving_together_are_prefilled_in_one_call():
    """Whole one-chunk prompts waiting together go through one ``prefill_rows`` call, as many as
    the round's prefill budget holds; the oldest first, each then streams its own tokens."""
    fake = FakeSlots(slots=4, prompts=4)
    fake.hold()
    eng = Engine(fake, prefill_budget=8, solo_chunk=None).start()
    try:
        busy = eng.submit([7], SamplingParams(max_tokens=30))
        fake.wait_decodes(1)
        reqs = [eng.submit([i, i + 1], SamplingParams(max_tokens=3)) for i in range(10, 13)]
        fake.let_go()
        for i, r in zip(range(10, 13), reqs, strict=True):
            assert collect(r)[0] == expected([i, i + 1], 3)
        assert collect(busy)[0] == expected([7], 30)
        prefills = [c[:3] for c in fake.calls if c[0].startswith("prefill")]
        assert prefills == [("prefill", 0, 0), ("prefill_rows", (1, 2), 4), ("prefill", 3, 0)]
    finally:
        eng.shutdown(timeout=1)


def test_a_prefix_overwritten_in_its_row_comes_back_from_the_store():
    """With one slot, a second prompt overwrites the row holding the first; the first's tokens are
    copied out first (``save``), and a prompt continuing the first copies them back (``restore``)
    and resumes after them. A store of 0 bytes keeps nothing."""
    for limit, reused in ((1 << 20, True), (0, False)):
        fake = FakeSlots(slots=1)
        eng = Engine(fake, prefix_store_bytes=limit).start()
        try:
            a = list(range(1, 21))
            toks = collect(eng.submit(a, SamplingParams(max_tokens=3)))[0]
            collect(eng.submit(list(range(30, 50)), SamplingParams(max_tokens=2)))
            follow = a + toks + [7, 8]
            toks2, fin = collect(eng.submit(follow, SamplingParams(max_tokens=2)))
            assert toks2 == expected(follow, 2)
            assert (fin.cached_tokens > 0) == reused and (("save", 0, 22) in fake.calls) == reused
            assert (("restore", 0, 22) in fake.calls) == reused
            assert eng.stats()["prefix_store_entries"] == (2 if reused else 0)
        finally:
            eng.shutdown(timeout=1)


def test_a_request_ending_at_prefill_moves_the_next_prompt_down_before_its_prefill():
    """Two prompts admitted in one round: the first ends at its first token (``max_tokens=1``), so
    the row above moves down into its row; the second prompt is then prefilled in its new row,
    not the one it was admitted to (the soak once caught the scheduler using the stale row)."""
    fake = FakeSlots(slots=3)
    fake.hold()
    eng = Engine(fake, prefill_budget=8, solo_chunk=None).start()  # both prompts in one round
    try:
        busy = eng.submit([1], SamplingParams(max_tokens=30))
        fake.wait_decodes(1)
        short = eng.submit([5, 6], SamplingParams(max_tokens=1))
        other = eng.submit([9, 10, 11], SamplingParams(max_tokens=3))
        fake.let_go()
        assert collect(short)[0] == expected([5, 6], 1)
        assert collect(other)[0] == expected([9, 10, 11], 3)
        assert collect(busy)[0] == expected([1], 30)
        prefills = [c[1:] for c in fake.calls if c[0] == "prefill"]
        assert prefills == [(0, 0, 1), (1, 0, 5), (1, 0, 9)]
        deadline = time.monotonic() + 5  # the Finish goes out just before the slot is freed
        while eng.stats()["active_slots"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.error is None and eng.stats()["active_slots"] == 0
    finally:
        fake.let_go()
        eng.shutdown(timeout=1)
