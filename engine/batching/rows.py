"""What the free rows of a serving batch still hold: the tokens whose K/V a row kept when its
request ended, so that a later prompt starting with them skips their prefill (prefix reuse).

Pure host bookkeeping (no JAX): the scheduler (``aotlm.batching.engine``) keeps its requests in the
lowest rows; a row freed by a finished request keeps that request's prompt and generated tokens
(those whose K/V was written: every one but the last) until it is reused. A new request takes
the free row holding the longest prefix of its prompt, else an empty free row, else the one
used least recently (LRU). Before a free row's tokens are overwritten, their K/V is copied out
into a ``PrefixStore`` (bounded in bytes, LRU), from which a later prompt can copy it back in.
``Active`` is the scheduler's record of a request holding a row.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from aotlm.batching.types import Request

TAG = 1 << 24  # above every vocabulary: a key is ``token + tag * TAG``


class PrefixKeys:
    """The keys prefix reuse compares: a row's K/V depends on its LoRA adapter, so each token is
    keyed with its request's adapter (a tag per name; 0: the base model) and prompts under
    different adapters share no prefix. ``renew(name)`` gives a reloaded adapter a fresh tag."""

    def __init__(self) -> None:
        self._tags: dict[str, int] = {}
        self._next = itertools.count(1)

    def key(self, tokens: np.ndarray, adapter: str | None) -> np.ndarray:
        if adapter is None:
            return np.asarray(tokens, np.int64)
        if adapter not in self._tags:
            self._tags[adapter] = next(self._next)
        return np.asarray(tokens, np.int64) + self._tags[adapter] * TAG

    def renew(self, adapter: str) -> None:
        self._tags.pop(adapter, None)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class HeldRows:
    """Per row: the tokens whose K/V it holds (``None``: nothing worth keeping) and its last use."""

    def __init__(self, slots: int):
        self.tokens: list[np.ndarray | None] = [None] * slots
        self.used = [0] * slots
        self._clock = itertools.count(1)

    def keep(self, row: int, tokens: np.ndarray) -> None:
        self.tokens[row] = np.asarray(tokens, np.int64) if len(tokens) else None
        self.used[row] = next(self._clock)

    def forget(self, row: int) -> None:
        self.tokens[row] = None

    def clear(self) -> None:
        self.tokens = [None] * len(self.tokens)

    def filled(self, row: int) -> int:
        """Cache slots of ``row`` that hold kept K/V."""
        held = self.tokens[row]
        return 0 if held is None else len(held)

    def swap(self, a: int, b: int) -> None:
        self.tokens[a], self.tokens[b] = self.tokens[b], self.tokens[a]
        self.used[a], self.used[b] = self.used[b], self.used[a]

    def best(self, prompt: np.ndarray, free: Sequence[int]) -> tuple[int | None, int]:
        """The free row holding the longest prefix of ``prompt`` and how many of its tokens can be
        reused (at most all but the prompt's last: its logits must be computed); ``(None, 0)``
        when no free row shares a token with it."""
        row, length = None, 0
        for r in free:
            held = self.tokens[r]
            if held is not None:
                n = min(common_prefix(held, prompt), len(prompt) - 1)
                if n > length:
                    row, length = r, n
        if row is not None:
            self.used[row] = next(self._clock)
        return row, length

    def victim(self, free: Sequence[int]) -> int:
        """The free row to overwrite: the first one holding nothing, else the least recently used."""
        empty = [r for r in free if self.tokens[r] is None]
        return empty[0] if empty else min(free, key=lambda r: self.used[r])

    def count(self) -> int:
        return sum(t is not None for t in self.tokens)


class PrefixStore:
    """Token sequences whose K/V was copied out of rows about to be overwritten, up to ``limit``
    bytes, least recently used dropped first. Each entry is ``(tokens, kv, nbytes)``: ``kv`` is
    the runner's opaque copy (``SlotRunner.save``). A sequence that starts another held one
    replaces it; one that is the start of a held one is not stored."""

    def __init__(self, limit: int, min_tokens: int = 16):
        self.limit, self.min_tokens = limit, min_tokens
        self.entries: collections.OrderedDict[int, tuple[np.ndarray, object, int]] = collections.OrderedDict()
        self.nbytes = 0
        self._ids = itertools.count()

    def wants(self, tokens: np.ndarray | None) -> bool:
        """Is ``tokens`` worth a copy (long enough, not already held as the start of an entry)?"""
        if self.limit <= 0 or tokens is None or len(tokens) < self.min_tokens:
            return False
        return not any(common_prefix(held, tokens) == len(tokens) for held, _, _ in self.entries.values())

    def put(self, tokens: np.ndarray, kv: object, nbytes: int) -> None:
        for key, (held, _, size) in list(self.entries.items()):
            if common_prefix(held, tokens) == len(held):  # the new one covers it
                del self.entries[key]
                self.nbytes -= size
        self.entries[next(self._ids)] = (np.asarray(tokens, np.int64), kv, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.limit and self.entries:
            _, (_, _, size) = self.entries.popitem(last=False)
            self.nbytes -= size

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def best(self, prompt: np.ndarray) -> tuple[object | None, int]:
        """The entry's copy holding the longest prefix of ``prompt`` and the tokens reusable (as
        ``HeldRows.best``); marks it used."""
        key, length = None, 0
        for k, (held, _, _) in self.entries.items():
            n = min(common_prefix(held, prompt), len(prompt) - 1)
            if n > length:
                key, length = k, n
        if key is None:
            return None, 0
        self.entries.move_to_end(key)
        return self.entries[key][1], length


@dataclass(eq=False)
class Active:
    """A request holding a row (the scheduler's record): prefilling (``plan`` left) or decoding (``live``)."""

    req: Request
    prompt: np.ndarray
    plan: collections.deque
    logits: object = None
    live: bool = False
    idx: int = 0  # the slot of the last token streamed
    first_at: float | None = None
    generated: list[int] = field(default_factory=list)
    filled: int = 0  # cache slots whose K/V is written (prefill); live rows: idx
    cached: int = 0  # prompt tokens whose K/V was reused
    scores: list = field(default_factory=list)  # prompt_logprobs: the chunks' ``PromptScores`` so far
    vector: object = None  # embed: the prompt's last hidden state, once its last chunk is encoded

    def written(self) -> np.ndarray:
        """The tokens whose K/V the row holds (a live row's last token is not fed yet)."""
        n = self.idx if self.live else self.filled
        return np.concatenate([self.prompt, np.asarray(self.generated, np.int32)])[:n]
