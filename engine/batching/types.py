"""What a serving request sends and receives: plain dataclasses, no JAX, no HTTP.

``SamplingParams`` (defined in ``aotlm.generate.params``, re-exported here) uses OpenAI's names
(``max_tokens``, ``temperature`` ...) plus the HF extras the in-graph sampler has; every value
becomes a traced per-slot array, so no value ever compiles.
A ``Request`` yields ``Token`` items and ends with one ``Finish`` (a request asking for
``prompt_logprobs`` gets one ``PromptLogprobs`` first; an ``embed`` request one ``Embedding``, then its
``Finish``); it can be iterated from a
thread (blocking) or from asyncio (``async for``), and cancelled from anywhere.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from aotlm.generate.constraints import Matcher
from aotlm.generate.params import SamplingParams

__all__ = [
    "EngineStopped",
    "Embedding",
    "Finish",
    "InvalidRequest",
    "PromptLogprobs",
    "QueueFull",
    "Request",
    "SamplingParams",
    "Token",
]


class QueueFull(Exception):
    """The engine's waiting queue is at ``max_queue``: retry later (HTTP 429)."""


class EngineStopped(Exception):
    """The engine is shutting down and accepts no new requests (HTTP 503)."""


class InvalidRequest(ValueError):
    """A request the engine cannot run (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Token:
    id: int
    logprob: float | None = None  # of the distribution the token was drawn from
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first


@dataclass(frozen=True)
class PromptToken:
    """A prompt token under the model's own distribution at its position: its log-probability,
    its rank (1: the most likely) and the ``k`` most likely tokens ``(id, logprob)``."""

    id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """``SamplingParams.prompt_logprobs``' answer, pushed once before the first ``Token``: one
    entry per prompt token, None for the first (nothing precedes it)."""

    tokens: tuple[PromptToken | None, ...]


@dataclass(frozen=True)
class Embedding:
    """``SamplingParams.embed``' answer, pushed before its ``Finish``: the final-normed hidden state of
    the prompt's last token (float32 ``[D]``, not normalized)."""

    vector: tuple[float, ...]


@dataclass(frozen=True)
class Finish:
    reason: str  # a ``FinishReason`` label: "eos", "stop_sequence", "length", "cancelled", "error"
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float | None  # seconds from submit to the first token; None if none
    cached_tokens: int = 0  # prompt tokens whose K/V was reused, not computed (prefix reuse)


@dataclass(eq=False)
class Request:
    """A submitted request: iterate it for ``Token`` items, then one ``Finish``.

    The engine thread calls ``push`` (the scheduler's side; nothing else should); a consumer
    reads with ``for item in req`` (blocking) or ``async for item in req`` (inside one event
    loop). ``cancel()`` frees its slot at the next scheduling round; the stream then ends with
    ``Finish(reason="cancelled")``.
    """

    id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    submitted: float
    matcher: Matcher | None = None  # structured outputs: the request's grammar state
    cancelled: threading.Event = field(default_factory=threading.Event)
    _items: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def push(self, item: Token | PromptLogprobs | Embedding | Finish) -> None:
        self._items.put(item)
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed in between: nobody is listening
                pass

    def __iter__(self) -> Iterator[Token | PromptLogprobs | Embedding | Finish]:
        while True:
            item = self._items.get()
            yield item
            if isinstance(item, Finish):
                return

    async def __aiter__(self) -> AsyncIterator[Token | PromptLogprobs | Embedding | Finish]:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                await self._wake.wait()
                self._wake.clear()
                continue
            yield item
            if isinstance(item, Finish):
                return
