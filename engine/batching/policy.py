"""The serving scheduler's decisions as pure functions of its state (vLLM's ``schedule()`` habit).

``aotlm.batching.engine.Engine`` runs rounds on a thread and owns the mechanism: the queue, the
runner's calls, prefix reuse, streaming. What it decides comes from here, computed on a frozen
snapshot (``RoundState``), with no clock, lock or device, so each rule is tested on plain values
(``tests/batching/test_policy.py``):

* ``admissions``: how many queued requests enter free rows this round (oldest first);
* ``plan_round``: once they are in, the round's prefill calls (``PrefillCall``: the oldest pending
  request first, chunks up to the token budget, whole short prompts of one bucket together) and
  the steps of its decode call (``decode_steps``, on the rows as the prefill leaves them);
* ``move_down``: which row moves into a row its request left, so busy rows stay ``0 .. n-1``;
* ``warmed``: which graphs start-up runs once (``SlotBatch.warm_up``), by ``prefill_flops``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aotlm.core.buckets import PrefillStep
from aotlm.models.arch import ArchConfig

# Start-up runs a serving graph once (an executable's first run costs more: on XLA:CPU it builds the
# YNNPACK dot runtimes, which the first requests would otherwise pay) unless it is estimated at more
# than its backend's bound here in FLOPs: then its own compute dwarfs what warming saves, and its first
# request pays instead (figures: engine/serve/README.md, "Compile ahead of time and warm-up"). A
# backend not listed (a GPU: 2e11 FLOPs take it a fraction of a millisecond) warms every graph.
WARM_FLOPS = {"cpu": 2e11}


@dataclass(frozen=True)
class Limits:
    """The engine's settings the rules read: the prefill token budget of a round, how many whole
    prompts one ``prefill_rows`` call takes and in which buckets, the decode steps of a call for a
    lone request (``decode_chunk``) and for one alone for a while (``solo_chunk``, None: never), and
    ``step_rows``: a step of ``n`` rows costs about ``1 + (n - 1) / step_rows`` one-row steps."""

    prefill_budget: int
    max_prompts: int
    prompt_buckets: tuple[int, ...]
    decode_chunk: int
    solo_chunk: int | None
    step_rows: int


@dataclass(frozen=True)
class RowView:
    """A busy row's request as the rules see it: ``key`` (the engine's handle), when it was
    submitted, the prefill chunks it has left, whether it decodes (``live``), whether a grammar
    constrains its tokens (its next mask needs the host after every token) and whether its prompt
    is scored (``prompt_logprobs``: its own graphs, never a shared ``prefill_rows`` call)."""

    key: int
    submitted: float
    plan: tuple[PrefillStep, ...]
    live: bool
    constrained: bool = False
    scored: bool = False


@dataclass(frozen=True)
class RoundState:
    """``rows``: one entry per slot (None: free); ``waiting``: requests queued; ``solo``: the one
    busy request has been alone long enough for ``solo_chunk`` calls."""

    rows: tuple[RowView | None, ...]
    waiting: int
    solo: bool = False


@dataclass(frozen=True)
class PrefillCall:
    """One prefill call: ``keys`` several whole one-chunk prompts of ``bucket`` at once
    (``prefill_rows``), or one request's next ``chunks`` plan steps (``prefill_step`` each)."""

    keys: tuple[int, ...]
    chunks: int
    bucket: int


@dataclass(frozen=True)
class RoundPlan:
    """A round after admission: its prefill calls in order, then one decode call of ``steps``
    steps over the busy rows (``steps == 0``: no row decodes)."""

    prefill: tuple[PrefillCall, ...]
    steps: int


def admissions(state: RoundState) -> int:
    """Queued requests that enter free rows now: as many as there are free rows."""
    return min(sum(r is None for r in state.rows), state.waiting)


def _whole(v: RowView) -> bool:
    """Is ``v``'s prompt one whole chunk from slot 0, not scored (it may share a ``prefill_rows`` call)?"""
    return not v.scored and len(v.plan) == 1 and v.plan[0].start == 0 and v.plan[0].width == v.plan[0].bucket


def prefill_calls(state: RoundState, limits: Limits) -> tuple[PrefillCall, ...]:
    """The round's prefill, oldest pending request first, until the budget is spent: with the
    oldest one's prompt whole, the next whole prompts of its bucket join it (as many as one call and
    the budget take); else its chunks one by one, a prompt left unfinished ending the round's
    prefill (the rest next round)."""
    pending = sorted((v for v in state.rows if v is not None and v.plan), key=lambda v: v.submitted)
    budget, calls = limits.prefill_budget, []
    while pending and budget > 0:
        first = pending[0]
        bucket = first.plan[0].bucket
        group = [first]
        if _whole(first) and limits.max_prompts > 1 and bucket in limits.prompt_buckets:
            same = [v for v in pending if _whole(v) and v.plan[0].bucket == bucket]
            group = same[: max(1, min(limits.max_prompts, budget // bucket))]
        if len(group) > 1:
            calls.append(PrefillCall(tuple(v.key for v in group), 1, bucket))
            budget -= bucket * len(group)
        else:
            n = 0
            while n < len(first.plan) and budget > 0:
                budget -= first.plan[n].bucket
                n += 1
            calls.append(PrefillCall((first.key,), n, bucket))
            if n < len(first.plan):
                break
        done = {v.key for v in group}
        pending = [v for v in pending if v.key not in done]
    return tuple(calls)


def decode_steps(state: RoundState, limits: Limits) -> int:
    """Steps of the round's decode call: ``solo_chunk`` for a request alone a while, else
    ``decode_chunk * step_rows // (step_rows + n - 1)`` for ``n`` busy rows (8, 6, 5, 4 for 1-4 rows
    at 8 and 4: the call's fixed cost shared by several tokens, and a call about as long whatever
    the rows, since a row ending inside it waits for the call's end to be freed); one while a
    request waits in the queue or for its prefill, or a live row is constrained; 0 when no row
    decodes. A finished row stays in the call without touching the others' numbers, so batch
    invariance holds at any steps."""
    busy = [v for v in state.rows if v is not None]
    if not any(v.live for v in busy):
        return 0
    if state.waiting or not all(v.live for v in busy) or any(v.constrained for v in busy if v.live):
        return 1
    if limits.solo_chunk and len(busy) == 1 and state.solo:
        return limits.solo_chunk
    return max(1, limits.decode_chunk * limits.step_rows // (limits.step_rows + len(busy) - 1))


def after_prefill(state: RoundState, calls: Sequence[PrefillCall]) -> RoundState:
    """The rows as ``calls`` leave them: the chunks they run gone, finished prompts live."""
    ran = {k: c.chunks for c in calls for k in c.keys}
    rows = []
    for v in state.rows:
        if v is not None and v.key in ran:
            plan = v.plan[ran[v.key] :]
            v = RowView(v.key, v.submitted, plan, v.live or not plan, v.constrained, v.scored)
        rows.append(v)
    return RoundState(tuple(rows), state.waiting, state.solo)


def plan_round(state: RoundState, limits: Limits) -> RoundPlan:
    """The round's prefill calls and the steps of its decode call (for the rows as the prefill
    leaves them, should no request end at its first token)."""
    calls = prefill_calls(state, limits)
    return RoundPlan(calls, decode_steps(after_prefill(state, calls), limits))


def move_down(busy: Sequence[bool], freed: int) -> int | None:
    """The row whose request moves into row ``freed`` (just left): the highest busy row when it is
    above ``freed`` (None: ``freed`` is the top, nothing moves), so busy rows stay ``0 .. n-1``."""
    top = max((i for i, b in enumerate(busy) if b), default=-1)
    return top if top > freed else None


def prefill_flops(cfg: ArchConfig, key: tuple) -> float:
    """Multiply-adds x 2 of a serving graph's prompt tokens (the layers' matrices per token, the
    attention of each token over the graph's width); 0 for graphs that encode no prompt."""
    if key[0] in ("slot_prefill", "slot_prefill_score", "slot_prefill_embed"):
        tokens, width = key[1], key[2]
    elif key[0] == "slot_prefill_rows":
        tokens, width = key[1] * key[2], key[1]
    else:
        return 0.0
    d, heads = cfg.hidden_size, cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = (3 if cfg.gated_mlp else 2) * d * cfg.intermediate_size * max(1, cfg.experts_per_token)
    attention = 4 * cfg.n_heads * cfg.head_dim * width
    return 2.0 * tokens * cfg.n_layers * (d * heads + mlp) + tokens * cfg.n_layers * attention


def warm_bound(platform: str) -> float | None:
    """``WARM_FLOPS`` for jax's ``platform`` name (None: warm every graph)."""
    return WARM_FLOPS.get(platform)


def warmed(cfg: ArchConfig, keys: Sequence[tuple], max_flops: float | None) -> list[tuple]:
    """The graphs of ``keys`` start-up runs once: those of at most ``max_flops`` (None: every one),
    and always the cheapest ``slot_prefill`` (its logits feed the insert and decode graphs)."""
    out = [k for k in keys if max_flops is None or prefill_flops(cfg, k) <= max_flops]
    prefills = [k for k in keys if k[0] == "slot_prefill"]
    if prefills and not any(k[0] == "slot_prefill" for k in out):
        out.insert(0, min(prefills, key=lambda k: prefill_flops(cfg, k)))
    return out
