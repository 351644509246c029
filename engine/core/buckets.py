"""Bucket arithmetic: which fixed shapes get compiled, and which one a request uses.

Everything here is a pure function of Python ints, so it is trivially testable and
identical in every process (the compile-cache key depends on it).

Vocabulary (transformers-neuronx):
  * token-generation (decode) buckets ``W``: a decode graph of width ``W`` attends to the
    first ``W`` KV-cache slots only, so early tokens read less of the cache.
  * context-encoding (prefill) buckets ``C``: a prompt of ``P <= C`` tokens is encoded by
    the ``C`` graph (right-padded inside the bucket); a longer prompt is encoded in chunks
    of the largest bucket.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIN_TOKEN_BUCKET = 128


def _length(v, what: str) -> int:
    """A bucket length as given: an int (numpy's too); a float, string or bool is a TypeError."""
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what} takes an int or a list of ints, got {v!r} ({type(v).__name__})") from None


def _lengths(values, what: str) -> list[int] | int:
    """An int or a list of ints, as ints."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        return _length(values, what)
    return [_length(v, what) for v in values]


def _as_sorted_unique(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = sorted(set(values))
    if not out:
        raise ValueError(f"{what}: the bucket list is empty; give at least one length")
    if out[0] <= 0:
        raise ValueError(f"{what}: bucket lengths must be positive, got {out}")
    return tuple(out)


def token_buckets(n_positions: int | Sequence[int]) -> tuple[int, ...]:
    """Token-generation buckets from ``n_positions``.

    An int gives powers of two from 128 up to it, the last being ``n_positions`` itself
    (a single bucket when ``n_positions <= 128``); a list is used as given (sorted).
    """
    n = _lengths(n_positions, "n_positions")
    if isinstance(n, list):
        return _as_sorted_unique(n, "n_positions")
    if n <= 0:
        raise ValueError(f"n_positions must be positive, got {n}")
    out, w = [], MIN_TOKEN_BUCKET
    while w < n:
        out.append(w)
        w *= 2
    out.append(n)
    return tuple(out)


def context_buckets(
    context_length_estimate: int | Sequence[int] | None, tg_buckets: Sequence[int]
) -> tuple[int, ...]:
    """Context-encoding buckets; default: half of each token-generation bucket."""
    if context_length_estimate is None:
        out = _as_sorted_unique([max(1, w // 2) for w in tg_buckets], "context_length_estimate")
    else:
        c = _lengths(context_length_estimate, "context_length_estimate")
        out = _as_sorted_unique(c if isinstance(c, list) else [c], "context_length_estimate")
    if out[0] <= 0:
        raise ValueError(f"context_length_estimate must be positive, got {out}")
    if out[-1] > max(tg_buckets):
        raise ValueError(
            f"context bucket {out[-1]} is larger than n_positions={max(tg_buckets)}; "
            "lower context_length_estimate or raise n_positions"
        )
    return out


def smallest_fitting(buckets: Sequence[int], length: int) -> int | None:
    """The smallest bucket >= length, or None when none fits."""
    for b in buckets:
        if b >= length:
            return b
    return None


@dataclass(frozen=True)
class PrefillStep:
    """One context-encoding call: ``bucket`` tokens written at cache slot ``start``.

    ``width`` is the number of cache slots the call attends to (static): ``bucket`` for a
    prompt that fits one bucket, else the smallest token bucket covering ``start+bucket``.
    ``n_real`` tokens of the chunk are real; the rest is right padding.
    """

    start: int
    bucket: int
    width: int
    n_real: int


def prefill_plan(
    prompt_len: int, ctx_buckets: Sequence[int], tg_buckets: Sequence[int]
) -> tuple[PrefillStep, ...]:
    """How a prompt of ``prompt_len`` tokens is encoded.

    A prompt that fits the largest context bucket is one call of the smallest fitting
    bucket. A longer one is encoded in chunks of the largest bucket ``C``; the last chunk
    is shifted left so that it ends exactly at the prompt end (it recomputes a few cached
    tokens, which writes back identical keys/values), so no chunk is padded and only the
    ``(C, W)`` graphs are needed for chunking.
    """
    if prompt_len <= 0:
        raise ValueError("the prompt is empty: give at least one token")
    c_max = max(ctx_buckets)
    fit = smallest_fitting(ctx_buckets, prompt_len)
    if fit is not None:
        return (PrefillStep(0, fit, fit, prompt_len),)
    steps, start = [], 0
    while start < prompt_len:
        start = min(start, prompt_len - c_max)
        width = smallest_fitting(tg_buckets, start + c_max)
        if width is None:  # pragma: no cover - guarded by the n_positions check
            raise ValueError(f"prompt of {prompt_len} tokens does not fit n_positions={max(tg_buckets)}")
        steps.append(PrefillStep(start, c_max, width if start else c_max, c_max))
        start += c_max
    return tuple(steps)


def resume_plan(
    prompt_len: int, start: int, ctx_buckets: Sequence[int], tg_buckets: Sequence[int]
) -> tuple[PrefillStep, ...]:
    """How a prompt is encoded when the K/V of its first ``start`` tokens is already in its row.

    The rest goes in chunks from ``start``: the smallest context bucket holding what is left
    (right-padded; padding gets position -1, which no query sees), else the largest. A chunk
    that would run past the cache's end is shifted left, recomputing a few held tokens. When no
    chunk can start after slot 0, or ``start`` is 0, this is ``prefill_plan``: nothing is
    reused. The first step's ``start`` is the tokens reused.
    """
    c_max, n_slots = max(ctx_buckets), max(tg_buckets)
    steps, s = [], max(start, 0)
    while 0 < s < prompt_len:
        c = smallest_fitting(ctx_buckets, prompt_len - s) or c_max
        s = min(s, n_slots - c)
        width = smallest_fitting(tg_buckets, s + c)
        if s <= 0 or width is None or width <= c:
            break
        real = min(c, prompt_len - s)
        steps.append(PrefillStep(s, c, width, real))
        s += real
    if not steps:
        return prefill_plan(prompt_len, ctx_buckets, tg_buckets)
    return tuple(steps)


def resume_shapes(ctx_buckets: Sequence[int], tg_buckets: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Every ``(bucket, width)`` prefill graph ``resume_plan`` may call: each context bucket
    attending each wider token bucket."""
    return tuple((c, w) for c in ctx_buckets for w in tg_buckets if w > c)


def prefill_graph_shapes(
    ctx_buckets: Sequence[int], tg_buckets: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """Every ``(bucket, width)`` prefill graph a model may call."""
    shapes = {(c, c) for c in ctx_buckets}
    c_max = max(ctx_buckets)
    shapes |= {(c_max, w) for w in tg_buckets if w > c_max}
    return tuple(sorted(shapes))


def graph_keys(ctx_buckets: Sequence[int], tg_buckets: Sequence[int]) -> list[tuple]:
    """Every graph a model compiles: prefill ``(C, W)`` shapes, first-token selection, decode ``W``."""
    keys: list[tuple] = [("prefill", c, w) for c, w in prefill_graph_shapes(ctx_buckets, tg_buckets)]
    return keys + [("select",)] + [("decode", w) for w in tg_buckets]


def decode_bucket(tg_buckets: Sequence[int], slot: int) -> int:
    """The decode graph used to feed the token at cache slot ``slot``."""
    w = smallest_fitting(tg_buckets, slot + 1)
    if w is None:
        raise ValueError(f"cache slot {slot} is beyond n_positions={max(tg_buckets)}")
    return w
