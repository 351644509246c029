"""One choice of an answer: its engine request read as text pieces (``ChoiceRun``), and what a
response sums over its choices (usage) or does to all of them (cancel).

``ChoiceRun.events`` turns the engine's items (``Token``, ``PromptLogprobs``, ``Finish``) into the
pieces the handlers send, with an echoed prompt (``aotlm.serve.echo``) first, stop strings found in
the text (``aotlm.serve.detok``) and the metrics of each token and finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from aotlm.batching.types import PromptLogprobs, Request, Token
from aotlm.core.graphs import FinishReason
from aotlm.serve.detok import ChoiceText, Piece, finish_reason
from aotlm.serve.echo import EchoRun
from aotlm.serve.metrics import Metrics
from aotlm.serve.protocol import APIError
from aotlm.serve.responses import usage


class ClientGone(Exception):
    """The client disconnected before a non-streamed answer was ready."""


@dataclass
class Streamed:
    """A streamed answer: the SSE chunks, and ``cancel`` for whoever sends them to call at the
    end whatever happens (a generator that never started has no ``finally`` to run)."""

    chunks: AsyncIterator[str]
    runs: list[ChoiceRun]

    def cancel(self) -> None:
        cancel_all(self.runs)


class ChoiceRun:
    """One choice: its engine request, its text, its metrics (``echo``: its prompt in the answer)."""

    def __init__(
        self,
        index: int,
        req: Request,
        text: ChoiceText,
        metrics: Metrics,
        prompt_tokens: int,
        prompt_no: int,
        echo: EchoRun | None = None,
        prompt_ids: Sequence[int] = (),
    ):
        self.index, self.req, self.text, self.metrics, self.echo = index, req, text, metrics, echo
        self.prompt_ids = list(prompt_ids)
        self.prompt_tokens, self.prompt_no = prompt_tokens, prompt_no
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.done: str | None = None  # the finish reason once known

    async def events(self) -> AsyncIterator[tuple[Piece, str | None]]:
        """``(piece, None)`` while generating, then one ``(piece, finish_reason)``; an echoed prompt
        is the first piece, the answer's offsets counting from its start."""
        last, e = None, self.echo
        shift = 0 if e is None else e.shift
        if e is not None and e.spec.echo and not e.waits:
            yield e.piece(), None
        async for item in self.req:
            if isinstance(item, PromptLogprobs):
                if e is not None:
                    e.scores = item
                    if e.waits:
                        yield e.piece(), None
            elif isinstance(item, Token):
                now = time.perf_counter()
                if last is None:
                    self.first = now
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                if e is not None and e.spec.silent:  # max_tokens 0: the token made is not shown
                    continue
                piece = _shifted(self.text.push(item), shift)
                if self.text.stopped:  # a stop string: answer now, free the slot
                    self.req.cancel()
                    yield piece, self._done("stop", self.text.n_tokens)
                    return
                if piece.text or piece.tokens:
                    yield piece, None
            else:
                if item.reason == "error":  # the scheduler failed (it logged why)
                    self._done("error", item.completion_tokens)
                    why = "the engine failed while generating; see the server log"
                    raise APIError(500, why, None, "server_error", "engine_error")
                self.cached_tokens = item.cached_tokens
                if e is not None and e.spec.silent:
                    yield Piece(""), self._done("length", 0)
                    return
                piece = _shifted(self.text.finish(), shift)
                n = self.text.n_tokens if self.text.stopped else item.completion_tokens
                yield piece, self._done(finish_reason(item, self.text.stopped), n)
                return

    def abandon(self) -> None:
        """Cancel the engine request (a no-op once finished); a choice nobody will read
        (client gone, server stopping) counts as finished with reason ``"cancelled"``."""
        self.req.cancel()
        if self.done is None:
            self._done(FinishReason.CANCELLED.label, self.text.n_tokens)

    def _done(self, reason: str, completion_tokens: int) -> str:
        self.done = reason
        self.completion_tokens = completion_tokens
        now = time.perf_counter()
        ttft = None if self.first is None else self.first - self.t0
        self.metrics.finished_request(
            reason, self.prompt_tokens, completion_tokens, ttft, now - self.t0, self.cached_tokens
        )
        return reason


def _shifted(piece: Piece, shift: int) -> Piece:
    """``piece`` with its tokens' offsets moved ``shift`` characters on (after an echoed prompt)."""
    return piece if not shift else Piece(piece.text, piece.tokens, [o + shift for o in piece.offsets])


def answer_ids(pieces: Sequence[Piece]) -> list[int]:
    """The answer's token ids in ``pieces`` (an echoed prompt's left out): vLLM's ``token_ids``."""
    return [t.id for p in pieces if not p.echoed for t in p.tokens]


def run_usage(runs: Sequence[ChoiceRun], prompt_tokens: int) -> dict:
    """The usage of a response: completion tokens of every choice; cached tokens once per prompt
    (the most any of its choices reused), as prompt tokens count once per prompt."""
    cached: dict[int, int] = {}
    for r in runs:
        cached[r.prompt_no] = max(cached.get(r.prompt_no, 0), r.cached_tokens)
    return usage(prompt_tokens, sum(r.completion_tokens for r in runs), sum(cached.values()))


def cancel_all(runs: Sequence[ChoiceRun]) -> None:
    for r in runs:
        r.abandon()


async def gathered_unless_gone(
    coros: Sequence, disconnected: Callable[[], Awaitable[None]], cancel: Callable
) -> list:
    """Every coroutine's result, unless the client goes away first (``ClientGone``); ``cancel`` (the
    engine requests') runs whatever happens."""
    gathered = asyncio.gather(*coros)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            raise ClientGone()
        return gathered.result()
    finally:
        watcher.cancel()
        gathered.cancel()
        gathered.add_done_callback(_retrieved)  # a cancelled gather's error is expected, not logged
        cancel()


def _retrieved(fut: asyncio.Future) -> None:
    """Mark a finished future's exception as seen (asyncio logs unseen ones at collection)."""
    if not fut.cancelled():
        fut.exception()
