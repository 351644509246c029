"""The serving scheduler (``aotlm.serve.engine.Engine``) against a fake ``SlotRunner``: no model,
no JAX, milliseconds per test. The fake's tokens are arithmetic (each token is the previous one
plus one, modulo the vocabulary), so every stream can be checked exactly; it records every call,
so admission order, the prefill budget, cancellation and shutdown can be asserted on."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from aotlm.core import buckets as bk
from aotlm.core.graphs import FinishReason
from aotlm.generate.slots import SlotRunner
from aotlm.serve.engine import Engine
from aotlm.serve.types import EngineStopped, Finish, InvalidRequest, QueueFull, SamplingParams, Token

VOCAB = 50


class FakeSlots:
    """``SlotRunner`` with arithmetic tokens: the first token is the prompt's last + 1, each next
    one the previous + 1 (mod ``VOCAB``); ``eos`` ends a row, as does its ``max_tokens``."""

    def __init__(self, slots: int = 2, n_positions: int = 64, chunk: int = 4, eos: int | None = None):
        self.slots, self.n_positions, self.vocab_size, self.max_chunk = slots, n_positions, VOCAB, chunk
        self.eos = eos
        self.calls: list[tuple] = []  # ("prefill", row, start, prompt[0]), ("insert", row),
        # ("decode", rows decoded, rows cancelled)
        self.open = True  # False: each decode call waits for a ``release`` (``hold``)
        self.permits = threading.Semaphore(0)
        self.entered = 0  # decode calls begun
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

    def prefill_plan(self, prompt_len: int) -> tuple[bk.PrefillStep, ...]:
        return bk.prefill_plan(prompt_len, [self.max_chunk], [self.n_positions])

    def prefill_step(self, row: int, prompt: np.ndarray, step: bk.PrefillStep) -> int:
        self.calls.append(("prefill", row, step.start, int(prompt[0])))
        return int(prompt[step.start + step.n_real - 1])  # "logits": the chunk's last token

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

    def decode(self, steps: int, max_live_slot: int, cancel: np.ndarray | None = None) -> None:
        with self.cv:
            self.entered += 1
            self.cv.notify_all()
        if not self.open:
            assert self.permits.acquire(timeout=10), "a test held decoding and never released it"
        stopped = () if cancel is None else tuple(np.flatnonzero(cancel & ~self.done).tolist())
        self.done[list(stopped)] = True
        self.reason[list(stopped)] = FinishReason.STOPPED
        live = [r for r in range(self.slots) if not self.done[r]]
        self.calls.append(("decode", tuple(live), stopped))
        for r in live:
            for _ in range(steps):
                if not self.done[r]:
                    slot = int(self.idx[r]) + 1
                    self._emit(r, slot, (int(self.out[r, slot - 1]) + 1) % VOCAB)

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
    eng = Engine(fake, max_queue=8).start()
    try:
        prompts = [[3, 4, 5], [10], [7, 8, 9, 10, 11, 12], [40, 41], [49]]
        reqs = [eng.submit(prompts[0], SamplingParams(max_tokens=3))]
        fake.wait_decodes(1)  # the first request is live; the others arrive now
        reqs += [eng.submit(p, SamplingParams(max_tokens=3 + i)) for i, p in enumerate(prompts) if i]
        fake.let_go()
        for i, (p, req) in enumerate(zip(prompts, reqs, strict=True)):
            toks, fin = collect(req)
            assert toks == expected(p, 3 + i)
            assert (fin.reason, fin.prompt_tokens, fin.completion_tokens) == ("length", len(p), 3 + i)
        decoded = [c[1] for c in fake.calls if c[0] == "decode"]
        assert decoded[:2] == [(0,), (0, 1)]  # both slots busy at once
        inserted = [c[1] for c in fake.calls if c[0] == "insert"]
        assert len(inserted) == 5 and set(inserted) == {0, 1}
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
    eng = Engine(fake, prefill_budget=4).start()
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
    """A cancelled running request finishes ``cancelled`` and its row is stopped on the device at
    the next decode while the other row goes on; a cancelled waiting one never reaches prefill."""
    fake = FakeSlots(slots=2)
    fake.hold()
    eng = Engine(fake, max_queue=4).start()
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
        assert fin.reason == "cancelled" and toks == expected([5], 3)  # the held decode call ran
        assert collect(waiting) == ([], Finish("cancelled", 2, 0, None))
        toks, fin = collect(other)
        assert toks == expected([20], 6) and (fin.reason, fin.completion_tokens) == ("length", 6)
        assert [c[3] for c in fake.calls if c[0] == "prefill"] == [5, 20]  # the waiting one never ran
        assert [c[2] for c in fake.calls if c[0] == "decode"][:3] == [(), (), (0,)]
        assert fake.reason[0] == FinishReason.STOPPED
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
