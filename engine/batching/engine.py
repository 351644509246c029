"""The serving engine: one scheduler thread keeps a model's slots busy (continuous batching).

Requests arrive from any thread (``submit``) into a bounded queue. The scheduler thread loops in
rounds; each round it

1. frees the slots of cancelled requests,
2. admits waiting requests into free slots (a prompt's prefill plan: context-bucket chunks,
   starting after the longest prefix of it a free row still holds (``rows.HeldRows``) or the
   prefix store holds a copy of (``rows.PrefixStore``: what overwritten rows held),
3. runs prefill chunks up to a token budget (``prefill_budget``; a long prompt is spread over
   rounds, so it delays the other slots' next tokens by about one chunk, not the whole
   prompt), and for each finished prompt inserts the request and streams its first token,
4. runs one decode call over the busy rows (the token bucket is the smallest covering the longest
   live slot, the row count the smallest ladder value covering the busy rows) and streams each
   slot's new tokens: ``solo_chunk`` steps for a request alone for a while, fewer for more busy
   rows (``policy.decode_steps``), one while a prompt waits to be prefilled,
5. retires finished requests, or sleeps when there is nothing to do.

Rows stay compact: requests hold rows ``0 .. n-1``. When a request ends below the highest busy
row, the two rows are swapped (``SlotRunner.swap``: the K/V of their written slots and their
states), so the decode graph for ``n`` rows covers every request and the freed row, now above
them, keeps its tokens' K/V for reuse. All device work is the slot graphs
(``aotlm.batching.slots``), compiled before ``start``: after warm-up no mix of prompt lengths,
settings or arrivals compiles anything.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np

from aotlm.batching import policy, prompt_scores
from aotlm.batching.rows import Active, HeldRows, PrefixKeys, PrefixStore
from aotlm.batching.slots import SlotBatch, SlotModel, SlotRunner
from aotlm.batching.types import (
    EngineStopped,
    Finish,
    InvalidRequest,
    QueueFull,
    Request,
    SamplingParams,
    Token,
)
from aotlm.core.graphs import FinishReason
from aotlm.generate.constraints import Matcher

log = logging.getLogger("aotlm.serve")
# decode steps per call for a lone request (``policy.decode_steps``): a call's fixed ~1.3-1.9 ms (argument
# handling, the graph's state slices and copies) is ~40-60% of a GPT-2-small int4 one-row step
DECODE_CHUNK = 8
# A step of n rows costs about (1 + (n - 1) / STEP_ROWS) one-row steps on the CPU kernels (the weights
# are read once per step whatever the rows; measured: GPT-2-small int4 4 rows 1.7x, 16 rows ~6x;
# SmolLM2-135M w8a8 1.3x, 3.8x): ``policy.decode_steps`` keeps every call about as long as a lone request's.
STEP_ROWS = 4
# A request alone for SOLO_AFTER s (nobody else queued or running meanwhile: a lone client) decodes
# SOLO_CHUNK steps a call (SmolLM2-135M int4-g64 on a Xeon: 3.60 vs ~4.2 ms a token at 8, 3.47 in
# ``sample()``); a newcomer then waits for one such call (~0.1 s) once, and calls shrink again.
SOLO_AFTER, SOLO_CHUNK = 1.0, 32
PREFIX_STORE_BYTES = 512 << 20  # K/V copied out of overwritten rows, kept for reuse (LRU)


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
        solo_chunk: int | None = SOLO_CHUNK,
        prefill_budget: int | None = None,
        prefix_cache: bool = True,
        prefix_store_bytes: int = PREFIX_STORE_BYTES,
        warm_up: bool = False,
    ):
        if max_queue < 1 or decode_chunk < 1 or (solo_chunk is not None and solo_chunk < 1):
            raise ValueError("max_queue, decode_chunk and solo_chunk must be >= 1")
        batch = model if isinstance(model, SlotRunner) else SlotBatch(model, eos_token_id, pad_token_id)
        # (graphs run, graphs in all) by warm_up, None without it
        self.warmed = batch.warm_up() if warm_up and isinstance(batch, SlotBatch) else None
        self.batch: SlotRunner = batch
        self.eos_token_id = tuple(int(t) for t in eos_token_id)  # what ends a constrained answer
        self.n_positions = batch.n_positions
        self.vocab_size = batch.vocab_size
        self.max_queue = max_queue
        self.max_tokens_cap = max_tokens_cap
        self.decode_chunk, self.solo_chunk = decode_chunk, solo_chunk
        self.prefill_budget = prefill_budget or batch.max_chunk
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._slots: list[Active | None] = [None] * batch.slots
        self.prefix_cache = prefix_cache
        self._held = HeldRows(batch.slots)
        self._store = PrefixStore(prefix_store_bytes)
        self._keys = PrefixKeys()  # prefix reuse keyed by each request's LoRA adapter
        self._reuse = {"requests": 0, "hits": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._crowd_at = -float("inf")  # when two requests were last in the engine together
        self._accepting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def limits(self) -> policy.Limits:
        """The settings the policy reads, as they are now (they may be changed between rounds)."""
        b, chunk = self.batch, self.decode_chunk
        return policy.Limits(
            self.prefill_budget, b.max_prompts, tuple(b.prompt_buckets), chunk, self.solo_chunk, STEP_ROWS
        )

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
        req = Request(
            id=request_id or uuid.uuid4().hex,
            prompt=tuple(int(t) for t in prompt),
            params=params,
            submitted=time.perf_counter(),
            matcher=matcher,
        )
        with self._cv:  # validated under the lock: an adapter is not unloaded meanwhile (change_adapter)
            self.validate(prompt, params)
            if not self._accepting:
                raise EngineStopped("the server is shutting down (or not started); retry elsewhere")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests); retry later")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def change_adapter(self, name: str, change):
        """Run ``change()`` (loading or unloading LoRA adapter ``name`` on the model) while no queued
        or running request uses ``name`` (else ``InvalidRequest``); prefixes kept under its old
        weights are not reused after. Returns what ``change`` returns."""
        with self._cv:
            users = [r.params for r in self._waiting] + [a.req.params for a in self._slots if a is not None]
            if any(p.adapter == name for p in users):
                raise InvalidRequest(
                    f"adapter {name!r} is in use by a request; retry when it ends", "lora_name"
                )
            out = change()
            self._keys.renew(name)
        return out

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
                "held_rows": self._held.count(),
                "prefix_store_bytes": self._store.nbytes,
                "prefix_store_entries": len(self._store.entries),
                **{f"prefix_{k}": v for k, v in self._reuse.items()},
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
                self._held.clear()
                self._store.clear()
            for req in pending:
                req.push(Finish(FinishReason.ERROR.label, len(req.prompt), 0, None))

    def _round(self) -> None:
        self._retire_cancelled()
        self._admit()
        plan = policy.plan_round(self._state(), self.limits)
        steps = plan.steps
        if self._prefill(plan.prefill):  # a request ended at its first token: the rows changed
            steps = policy.decode_steps(self._state(), self.limits)
        live = [(i, a) for i, a in enumerate(self._slots) if a is not None and a.live]
        if live and steps:
            top = max(a.idx for _, a in live)
            masks = {i: a.req.matcher for i, a in live if a.req.matcher is not None}
            self.batch.constrain(masks)  # structured outputs: the next token's masks
            self.batch.decode(steps, top, self._busy_rows())
            self._stream(live)

    def _state(self, note: bool = True) -> policy.RoundState:
        """The snapshot the policy decides on; with ``note``, notes company (``solo_chunk`` calls
        need a request alone for ``SOLO_AFTER`` s; a lone client's next request, queued until
        admitted, is no company)."""
        with self._cv:
            waiting = len(self._waiting)
            now = time.monotonic()
            if note and (waiting or sum(a is not None for a in self._slots) > 1):
                self._crowd_at = now
            view = lambda a: policy.RowView(
                id(a), a.req.submitted, tuple(a.plan), a.live, a.req.matcher is not None,
                a.req.params.prompt_logprobs is not None or a.req.params.embed,
            )  # fmt: skip
            rows = tuple(None if a is None else view(a) for a in self._slots)
            return policy.RoundState(rows, waiting, now - self._crowd_at > SOLO_AFTER)

    def _busy_rows(self) -> int:
        """Rows ``0 .. n-1`` hold every request (compact)."""
        return max((i + 1 for i, a in enumerate(self._slots) if a is not None), default=0)

    def _retire_cancelled(self) -> None:
        with self._cv:
            gone = [r for r in self._waiting if r.cancelled.is_set()]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            r.push(Finish(FinishReason.CANCELLED.label, len(r.prompt), 0, None))
        for i in reversed(range(len(self._slots))):  # from the top: a swap moves a higher row down
            a = self._slots[i]
            if a is not None and a.req.cancelled.is_set():
                self._finish(i, FinishReason.CANCELLED.label, running=a.live)

    def _admit(self) -> None:
        n_in = policy.admissions(self._state(note=False))
        with self._cv:
            take = [self._waiting.popleft() for _ in range(min(n_in, len(self._waiting)))]
        for req in take:
            n = self._busy_rows()
            prompt = np.asarray(req.prompt, np.int32)
            free_rows = range(n, len(self._slots))
            key = self._keys.key(prompt, req.params.adapter)
            row, length = self._held.best(key, free_rows) if self.prefix_cache else (None, 0)
            kv, stored = self._store.best(key) if self.prefix_cache else (None, 0)
            kv = kv if stored > length else None  # a held row beats a copy of the same length
            scored = req.params.prompt_logprobs is not None or req.params.embed  # every token encoded here
            if scored or not self._saves(len(prompt), max(length, stored)):
                row, kv, length = None, None, 0
            reuse = row is not None and kv is None  # the row holds a prefix of the prompt
            self._bring_down(n, row if reuse else self._held.victim(free_rows), reuse)
            self._held.forget(n)
            if kv is not None:
                self.batch.restore(n, kv)
                length = stored
            plan = collections.deque(self.batch.prefill_plan(len(prompt), length))
            cached = plan[0].start
            self._reuse["requests"] += 1
            self._reuse["hits"] += cached > 0
            self._reuse["prompt_tokens"] += len(prompt)
            self._reuse["cached_tokens"] += cached
            with self._cv:
                self._slots[n] = Active(req, prompt, plan, filled=cached, cached=cached)

    def _saves(self, prompt_len: int, held: int) -> bool:
        """Does resuming after ``held`` tokens encode fewer (bucket) tokens than a fresh prefill?"""
        cost = lambda start: sum(s.bucket for s in self.batch.prefill_plan(prompt_len, start))
        return held > 0 and cost(held) < cost(0)

    def _bring_down(self, n: int, row: int, reuse: bool) -> None:
        """Make row ``n`` (the lowest free one) ready for a new request from free row ``row``: with
        ``reuse`` ``row``'s K/V (a prefix of the prompt) is copied into ``n``, else ``row``'s tokens
        are about to be overwritten and go to the prefix store; ``n``'s kept tokens move up into
        ``row``. Both rows are free, so only K/V is copied (no states: ``insert`` writes ``n``'s),
        and nothing of a row holding nothing (a lone client's next request: one copy, not a swap)."""
        if not reuse:
            self._keep_copy(row)
        if row == n:
            return
        mine = self._held.filled(n)
        kv_n = self.batch.save(n, mine)[0] if mine else None
        if reuse:
            self.batch.restore(n, self.batch.save(row, self._held.filled(row))[0])
        if kv_n is not None:
            self.batch.restore(row, kv_n)
        self._held.swap(n, row)

    def _keep_copy(self, row: int) -> None:
        """Copy the K/V of the tokens free row ``row`` holds into the prefix store, if worth it."""
        held = self._held.tokens[row]
        if self.prefix_cache and self._store.wants(held):
            kv, nbytes = self.batch.save(row, len(held))
            self._store.put(held, kv, nbytes)

    def _prefill(self, calls: Sequence[policy.PrefillCall]) -> bool:
        """Run the round's prefill calls (``policy.prefill_calls``); insert and stream each finished
        prompt. Returns whether a request ended at its first token (the rows moved)."""
        ended = False
        for call in calls:
            where = {id(a): (i, a) for i, a in enumerate(self._slots) if a is not None}
            group = [where[k] for k in call.keys]  # rows now: an ended request moved rows down
            if len(group) > 1:
                rows, prompts = [i for i, _ in group], [a.prompt for _, a in group]
                adapters = [a.req.params.adapter for _, a in group]
                logits = self.batch.prefill_rows(rows, prompts, call.bucket, adapters)
                for (_, a), lg in zip(group, logits, strict=True):
                    a.plan.clear()
                    a.logits, a.filled = lg, len(a.prompt)
            else:
                i, a = group[0]
                for _ in range(call.chunks):
                    prompt_scores.encode(self.batch, i, a, a.plan.popleft())
                if a.plan:
                    return ended  # budget spent; the rest next round
                if prompt_scores.after_prompt(a):  # an embedding: the request ends with its prompt
                    self._finish(i, FinishReason.LENGTH.label, running=False)
                    ended = True
                    continue
            for i, a in group:
                allow = None if a.req.matcher is None else a.req.matcher.mask()
                self.batch.insert(i, a.prompt, a.req.params, a.logits, allow)
                a.logits, a.live, a.idx = None, True, len(a.prompt) - 1
            busy = self._busy_rows()
            self._stream(group)
            ended = ended or self._busy_rows() < busy
        return ended

    def _stream(self, rows: list[tuple[int, Active]]) -> None:
        """Push every row's new tokens (slots ``a.idx + 1 .. idx``) and finish the ended rows."""
        want = any(a.req.params.logprobs is not None for _, a in rows)
        host = self.batch.read(logprobs=want)
        now = time.perf_counter()
        ended = []
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
                a.generated.append(tok)
            if a.first_at is None and new_idx > a.idx:
                a.first_at = now
            a.idx = new_idx
            if host["done"][i]:
                ended.append((i, FinishReason.of(host["reason"][i]).label))
        for i, reason in sorted(ended, reverse=True):  # from the top: a swap moves a higher row down
            self._finish(i, reason, running=False)

    def _finish(self, i: int, reason: str, running: bool) -> None:
        """End row ``i``'s request (``running``: its row is still live on the device); keep its
        tokens' K/V in the freed row and keep the busy rows compact."""
        a = self._slots[i]
        assert a is not None
        ttft = None if a.first_at is None else a.first_at - a.req.submitted
        a.req.push(Finish(reason, len(a.prompt), len(a.generated), ttft, a.cached))
        kept = a.written()
        with self._cv:
            self._slots[i] = None
            top = policy.move_down([a is not None for a in self._slots], i)
            if top is not None:  # the highest request moves down into the gap; the freed row up (stopped)
                b = self._slots[top]
                assert b is not None
                self.batch.swap(i, top, max(len(kept), len(b.written())))
                self._slots[i], self._slots[top] = b, None
                i = top
            elif running:
                self.batch.swap(i, i, 1)  # stops the row (the row moving "up" is marked done)
            self._held.keep(i, self._keys.key(kept, a.req.params.adapter))
            self._cv.notify()
