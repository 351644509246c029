"""transformers' token bans for ``sample()``: ``suppress_tokens``, ``begin_suppress_tokens`` and
``bad_words_ids``, as rows of the decode state's allowed-token bitmask (``DecodeState.allow``).

Each sets the scores of the tokens it bans to ``-inf`` before the warpers, as transformers'
``SuppressTokensLogitsProcessor``, ``SuppressTokensAtBeginLogitsProcessor`` (the first new token
only) and ``NoBadWordsLogitsProcessor`` (a one-token bad word always; a longer one's last token
when the row's tokens end with the rest of it; a bad word that is just an eos id is dropped, as
transformers drops it). One setting for every row of the call, as in transformers.

Suppressed tokens and one-token bad words are one fixed mask: the decode loop stays on the
device. ``begin_suppress_tokens`` costs one more mask upload after the first token; bad words of
several tokens are matched on the host after every token (one token per decode call, as
structured outputs run). A row left with no token at all may choose its eos ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ALL_ONES = np.uint32(0xFFFFFFFF)
# the per-call token settings of sample() (sequence_bias: aotlm.generate.sequence_bias)
FIELDS = ("suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "sequence_bias")


def _token(t, name: str, vocab: int) -> int:
    if isinstance(t, bool) or not isinstance(t, int | np.integer):
        raise TypeError(f"{name} must hold token ids (ints), got {t!r}")
    if not 0 <= int(t) < vocab:
        raise ValueError(f"{name} holds {int(t)}, outside the vocabulary [0, {vocab})")
    return int(t)


def token_list(value, name: str, vocab: int) -> tuple[int, ...]:
    """``suppress_tokens`` / ``begin_suppress_tokens``: a list of token ids (None: none)."""
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a list of token ids, e.g. [13, 198], got {value!r}")
    return tuple(_token(t, name, vocab) for t in value)


def bad_words(value, vocab: int, eos_ids: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """``bad_words_ids``: a non-empty list of non-empty token-id lists (None: none), less the ones
    that are an eos id alone."""
    if value is None:
        return ()
    err = "bad_words_ids must be a non-empty list of token-id lists, e.g. [[13], [198, 198]]"
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise TypeError(f"{err}, got {value!r}")
    seqs = []
    for seq in value:
        if isinstance(seq, str | bytes) or not isinstance(seq, Sequence | np.ndarray) or not len(seq):
            raise TypeError(f"{err}, got {value!r}")
        seqs.append(tuple(_token(t, "bad_words_ids", vocab) for t in seq))
    eos = {int(e) for e in eos_ids if e >= 0}
    return tuple(s for s in seqs if not (len(s) == 1 and s[0] in eos))


def _clear(mask: np.ndarray, tokens) -> None:
    """Clear the bits of ``tokens`` in ``mask [..., words]``."""
    for t in tokens:
        mask[..., t // 32] &= ~np.uint32(1 << (t % 32))


def _set(mask: np.ndarray, tokens) -> None:
    for t in tokens:
        mask[..., t // 32] |= np.uint32(1 << (t % 32))


def ends_with(history: Sequence[int], prefix: tuple[int, ...]) -> bool:
    """Whether ``history`` ends with ``prefix`` (a sequence's tokens but its last)."""
    return len(history) >= len(prefix) and tuple(history[len(history) - len(prefix) :]) == prefix


def _completing(history: Sequence[int], words) -> list[int]:
    """The last tokens of the ``words`` (several tokens each) whose other tokens end ``history``."""
    return [s[-1] for s in words if ends_with(history, s[:-1])]


def extend(histories: list[list[int]], tokens: np.ndarray, done: np.ndarray) -> None:
    """Each row that was live (not ``done``) gets its newest token."""
    for r, hist in enumerate(histories):
        if not done[r]:
            hist.append(int(tokens[r]))


class Bans:
    """One call's bans over its ``rows`` rows of ``vocab`` tokens; ``histories``: each row's real
    prompt tokens, extended by ``advance`` with what it generates."""

    def __init__(self, suppress, begin, words, vocab: int, histories: list[list[int]], eos_ids):
        n_words = -(-vocab // 32)
        self.static = np.full(n_words, ALL_ONES, np.uint32)
        _clear(self.static, suppress)
        _clear(self.static, [s[0] for s in words if len(s) == 1])
        self.begin = None
        if begin:
            self.begin = self.static.copy()
            _clear(self.begin, begin)
        self.longer = tuple(s for s in words if len(s) > 1)
        self.histories = histories
        self.eos = [int(e) for e in eos_ids if 0 <= e < vocab]

    @property
    def dynamic(self) -> bool:
        """Whether the masks change with each token (bad words of several tokens)."""
        return bool(self.longer)

    def apply(self, allow: np.ndarray, first: bool, live: np.ndarray | None = None) -> None:
        """AND the bans into ``allow [rows, words]`` for the next token (``first``: the first new
        one); ``live``: the rows still generating (others are left as they are)."""
        allow &= self.begin if first and self.begin is not None else self.static
        for r, hist in enumerate(self.histories):
            if live is not None and not live[r]:
                continue
            _clear(allow[r], _completing(hist, self.longer))
            if not allow[r].any():  # nothing left to choose: the row may end
                _set(allow[r], self.eos)

    def advance(self, tokens: np.ndarray, done: np.ndarray) -> None:
        """Each row that was live gets its newest token."""
        if self.longer:
            extend(self.histories, tokens, done)


def build(cfg, ids: np.ndarray, mask: np.ndarray, vocab: int, eos_ids) -> Bans | None:
    """The bans ``cfg`` (a ``GenerationConfig``) asks for over the padded prompt batch, or None."""
    suppress = token_list(getattr(cfg, "suppress_tokens", None), "suppress_tokens", vocab)
    begin = token_list(getattr(cfg, "begin_suppress_tokens", None), "begin_suppress_tokens", vocab)
    words = bad_words(getattr(cfg, "bad_words_ids", None), vocab, eos_ids)
    if not (suppress or begin or words):
        return None
    histories = [row[keep > 0].tolist() for row, keep in zip(ids, mask, strict=True)]
    return Bans(suppress, begin, words, vocab, histories, eos_ids)


class RequestBans:
    """One serving request's bans (vLLM's ``allowed_token_ids`` and ``bad_words``, as token ids) in the
    shape of a structured-output matcher (``fill`` / ``mask`` / ``advance``: what the slot engine
    drives), over the request's grammar matcher when it has one. Bad words are matched against the
    request's generated tokens only, as vLLM matches them; ``held`` (its eos and stop token ids) are
    banned until it has ``min_tokens`` tokens (vLLM's ``min_tokens``)."""

    def __init__(self, vocab: int, allowed=(), words=(), eos_ids=(), inner=None, min_tokens=0, held=()):
        self.min_tokens, self.held = int(min_tokens), [int(t) for t in held if 0 <= int(t) < vocab]
        self.base = np.full(-(-vocab // 32), ALL_ONES, np.uint32)
        if allowed:
            self.base[:] = 0
            _set(self.base, allowed)
        _clear(self.base, [s[0] for s in words if len(s) == 1])
        self.longer = tuple(tuple(s) for s in words if len(s) > 1)
        self.history: list[int] = []
        self.eos = [int(e) for e in eos_ids if 0 <= int(e) < vocab]
        self.inner = inner

    def fill(self, out: np.ndarray) -> np.ndarray:
        """The next token's allowed bitmask, written into ``out`` (``[words(V)]`` uint32)."""
        if self.inner is not None:
            self.inner.fill(out)
        else:
            out[:] = ALL_ONES
        out &= self.base
        _clear(out, _completing(self.history, self.longer))
        if len(self.history) < self.min_tokens:  # vLLM's min_tokens: no eos / stop token before it
            _clear(out, self.held)
        if not out.any():  # nothing left to choose: the request may end
            _set(out, self.eos)
        return out

    def mask(self) -> np.ndarray:
        return self.fill(np.zeros(len(self.base), np.uint32))

    def advance(self, tokens) -> bool:
        ok = self.inner.advance(tokens) if self.inner is not None else True
        self.history.extend(int(t) for t in tokens)
        return ok
