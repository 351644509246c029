"""The serving engine: one scheduler thread keeps a model's slots busy (continuous batching).

Requests arrive from any thread (``submit``) into a bounded queue. The scheduler thread loops in
rounds; each round it

1. frees the slots of cancelled requests (their rows stop at the next decode call),
2. admits waiting requests into free slots (a prompt's prefill plan: context-bucket chunks),
3. runs prefill chunks up to a token budget (``prefill_budget``; a long prompt is spread over
   rounds, so it delays the other slots' next tokens by about one chunk, not the whole
   prompt), and for each finished prompt inserts the request and streams its first token,
4. runs one decode call of ``decode_chunk`` steps over every live slot (the token bucket is
   the smallest covering the longest live slot) and streams each slot's new tokens,
5. retires finished requests, or sleeps when there is nothing to do.

All device work is the slot graphs (``aotlm.generate.slots``), compiled before ``start``:
after warm-up no mix of prompt lengths, settings or arrivals compiles anything.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aotlm.core import buckets as bk
from aotlm.core.graphs import FinishReason
from aotlm.generate.constraints import Matcher
from aotlm.generate.slots import SlotBatch, SlotModel, SlotRunner
from aotlm.serve.types import (
    EngineStopped,
    Finish,
    InvalidRequest,
    QueueFull,
    Request,
    SamplingParams,
    Token,
)

log = logging.getLogger("aotlm.serve")
DECODE_CHUNK = 1  # decode steps per scheduling round (README, Serving: measured choice)


@dataclass(eq=False)
class _Active:
    """A request holding a slot: prefilling (``plan`` left) or decoding (``live``)."""

    req: Request
    prompt: np.ndarray
    plan: collections.deque
    logits: object = None
    live: bool = False
    idx: int = 0  # the slot of the last token streamed
    first_at: float | None = None
    tokens: int = 0


class Engine:
    """Continuous batching over a model built with ``continuous_batching=True`` and compiled
    (wrapped in its ``SlotBatch``), or over any ``SlotRunner`` (``eos_token_id`` and
    ``pad_token_id`` are then the runner's business)."""

    def __init__(
        self,
        model: SlotModel | SlotRunner,
        *,
        eos_token_id: Sequence[int] = (),
        pad_token_id: int | None = None,
        max_queue: int = 64,
        max_tokens_cap: int | None = None,
        decode_chunk: int = DECODE_CHUNK,
        prefill_budget: int | None = None,
    ):
        if max_queue < 1 or decode_chunk < 1:
            raise ValueError("max_queue and decode_chunk must be >= 1")
        batch = model if isinstance(model, SlotRunner) else SlotBatch(model, eos_token_id, pad_token_id)
        self.batch: SlotRunner = batch
        self.eos_token_id = tuple(int(t) for t in eos_token_id)  # what ends a constrained answer
        self.n_positions = batch.n_positions
        self.vocab_size = batch.vocab_size
        self.max_queue = max_queue
        self.max_tokens_cap = max_tokens_cap
        self.decode_chunk = decode_chunk
        self.prefill_budget = prefill_budget or batch.max_chunk
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._slots: list[_Active | None] = [None] * batch.slots
        self._kill = np.zeros(batch.slots, np.bool_)  # freed rows to stop on the device
        self._accepting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ API
    def validate(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequest`` (naming the field) if the request cannot run."""
        v = self.vocab_size
        if any(not 0 <= int(t) < v for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {v})", "prompt")
        if self.max_tokens_cap is not None and params.max_tokens > self.max_tokens_cap:
            raise InvalidRequest(
                f"max_tokens={params.max_tokens} exceeds this server's cap of {self.max_tokens_cap}",
                "max_tokens",
            )
        bad = self.batch.check(len(prompt), params)
        if bad:
            raise InvalidRequest(bad[0][1], bad[0][0])

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        matcher: Matcher | None = None,
    ) -> Request:
        """Queue a request; iterate the returned ``Request`` for its tokens. ``matcher``
        (``aotlm.generate.constraints``) constrains its tokens to a grammar."""
        self.validate(prompt, params)
        req = Request(
            id=request_id or uuid.uuid4().hex,
            prompt=tuple(int(t) for t in prompt),
            params=params,
            submitted=time.perf_counter(),
            matcher=matcher,
        )
        with self._cv:
            if not self._accepting:
                raise EngineStopped("the server is shutting down (or not started); retry elsewhere")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests); retry later")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def start(self) -> Engine:
        with self._cv:
            self._accepting, self._stop = True, False
        self._thread = threading.Thread(target=self._run, name="aotlm-scheduler", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; let queued and running requests finish for ``timeout`` s, then cancel them."""
        with self._cv:
            self._accepting = False
            self._cv.notify()
        deadline = time.monotonic() + timeout
        while self._busy() and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(0.02)
        with self._cv:
            for req in list(self._waiting) + [a.req for a in self._slots if a is not None]:
                req.cancel()
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, timeout))

    @property
    def running(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        with self._cv:
            return {
                "queue_depth": len(self._waiting),
                "active_slots": sum(a is not None for a in self._slots),
                "slots": len(self._slots),
            }

    def _busy(self) -> bool:
        with self._cv:
            return bool(self._waiting) or any(a is not None for a in self._slots)

    # ------------------------------------------------------------------ scheduler
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    idle = lambda: not self._waiting and all(a is None for a in self._slots)
                    while not self._stop and idle():
                        self._cv.wait()
                    if self._stop and idle():  # shutdown() cancelled the rest: retired below
                        return
                self._round()
        except Exception as e:  # a device error: fail everything in flight, accept nothing more
            log.exception("aotlm serve: the scheduler stopped")
            self.error = e
            with self._cv:
                self._accepting = False
                pending = list(self._waiting) + [a.req for a in self._slots if a is not None]
                self._waiting.clear()
                self._slots = [None] * len(self._slots)
            for req in pending:
                req.push(Finish(FinishReason.ERROR.label, len(req.prompt), 0, None))

    def _round(self) -> None:
        self._retire_cancelled()
        self._admit()
        self._prefill()
        live = [(i, a) for i, a in enumerate(self._slots) if a is not None and a.live]
        if live:
            top = max(a.idx for _, a in live)
            masks = {i: a.req.matcher for i, a in live if a.req.matcher is not None}
            self.batch.constrain(masks)  # structured outputs: the next token's masks
            steps = 1 if masks else self.decode_chunk
            self.batch.decode(steps, top, self._kill if self._kill.any() else None)
            self._kill[:] = False
            self._stream(live)

    def _retire_cancelled(self) -> None:
        with self._cv:
            gone = [r for r in self._waiting if r.cancelled.is_set()]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            r.push(Finish(FinishReason.CANCELLED.label, len(r.prompt), 0, None))
        for i, a in enumerate(self._slots):
            if a is not None and a.req.cancelled.is_set():
                self._finish(i, FinishReason.CANCELLED.label)

    def _admit(self) -> None:
        with self._cv:
            for i in range(len(self._slots)):
                if not self._waiting:
                    break
                if self._slots[i] is None:
                    req = self._waiting.popleft()
                    prompt = np.asarray(req.prompt, np.int32)
                    plan = collections.deque(self.batch.prefill_plan(len(prompt)))
                    self._slots[i] = _Active(req, prompt, plan)
                    self._kill[i] = False  # the row is about to be re-inserted

    def _prefill(self) -> None:
        budget = self.prefill_budget
        pending = [(i, a) for i, a in enumerate(self._slots) if a is not None and a.plan]
        pending.sort(key=lambda ia: ia[1].req.submitted)
        for i, a in pending:
            while a.plan and budget > 0:
                step: bk.PrefillStep = a.plan.popleft()
                a.logits = self.batch.prefill_step(i, a.prompt, step)
                budget -= step.bucket
            if a.plan:
                return  # budget spent; the rest next round
            allow = None if a.req.matcher is None else a.req.matcher.mask()
            self.batch.insert(i, a.prompt, a.req.params, a.logits, allow)
            a.logits, a.live, a.idx = None, True, len(a.prompt) - 1
            self._stream([(i, a)])
            if budget <= 0:
                return

    def _stream(self, rows: list[tuple[int, _Active]]) -> None:
        """Push every row's new tokens (slots ``a.idx + 1 .. idx``) and finish the ended rows."""
        want = any(a.req.params.logprobs is not None for _, a in rows)
        host = self.batch.read(logprobs=want)
        now = time.perf_counter()
        for i, a in rows:
            new_idx = int(host["idx"][i])
            k = a.req.params.logprobs or 0
            for slot in range(a.idx + 1, new_idx + 1):
                tok = int(host["out"][i, slot])
                if a.req.matcher is not None:
                    a.req.matcher.advance((tok,))
                if a.req.params.logprobs is not None:
                    top = tuple(
                        (int(t), float(lp))
                        for t, lp in zip(
                            host["top_ids"][i, slot, :k], host["top_lp"][i, slot, :k], strict=True
                        )
                    )
                    a.req.push(Token(tok, float(host["logp"][i, slot]), top))
                else:
                    a.req.push(Token(tok))
                a.tokens += 1
            if a.first_at is None and new_idx > a.idx:
                a.first_at = now
            a.idx = new_idx
            if host["done"][i]:
                self._finish(i, FinishReason.of(host["reason"][i]).label)

    def _finish(self, i: int, reason: str) -> None:
        a = self._slots[i]
        assert a is not None
        ttft = None if a.first_at is None else a.first_at - a.req.submitted
        a.req.push(Finish(reason, len(a.prompt), a.tokens, ttft))
        with self._cv:
            self._slots[i] = None
            if a.live and reason == FinishReason.CANCELLED.label:
                self._kill[i] = True  # still running on the device: stop it at the next decode
            self._cv.notify()
