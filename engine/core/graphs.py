"""The compiled graph kinds: context encoding (prefill), first-token selection, token generation.

All are pure functions of (params, cache, inputs). What is static (a ``jax.jit`` static
argument, baked into the executable) and what is traced:

* static: the ``ArchConfig``, the bucket sizes ``(C, W)`` / ``W``, and the widths of the
  generation state (``MAX_EOS``, ``MAX_STOPS`` x ``MAX_STOP_LEN``, ``sampling.NGRAM_MAX``,
  ``sampling.TOP_LOGPROBS_MAX``). Changing any of these is a different graph.
* traced: every weight, the KV cache, token ids, positions, slots, and the whole generation
  state: per-row sampling parameters and seeds, per-row last slots (``max_new_tokens``),
  eos ids, stop sequences, pad id, the chunk end. New values never recompile.

The KV cache and the generation state are donated to every call and updated in place.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax import lax

from aotlm.core import sampler_params, sampling
from aotlm.core.state import DecodeState
from aotlm.models import decoder

MAX_EOS = 32  # eos ids: a traced [MAX_EOS] array padded with -1
MAX_STOPS = 8  # stop sequences per row
MAX_STOP_LEN = 16  # tokens per stop sequence (right-aligned, padded with -2)


class FinishReason(enum.IntEnum):
    """Why a row stopped: ``state.reason`` (int32, traced) holds these values.

    The graphs write ``EOS``, ``STOP_SEQUENCE`` and ``LENGTH`` (and the slot graphs ``CANCELLED``
    for a cancelled slot); the host writes ``STOPPED`` for a ``StoppingCriteria`` hit and
    ``CANCELLED`` / ``ERROR`` for a serving request cut short before it ended or failed by a
    device error.
    ``label`` is the name outputs use (``GenerateOutput.finish_reason``, ``Finish.reason``),
    ``openai`` the HTTP API's ``finish_reason``: both come from ``NAMES``, the one table.
    """

    RUNNING = 0
    EOS = 1
    STOP_SEQUENCE = 2
    LENGTH = 3
    STOPPED = 4
    CANCELLED = 5
    ERROR = 6

    @property
    def label(self) -> str:
        return NAMES[self][0]

    @property
    def openai(self) -> str:
        return NAMES[self][1]

    @classmethod
    def of(cls, value: int | str) -> FinishReason:
        """The member for a ``state.reason`` value or a ``label``; an unknown value is ``LENGTH``."""
        if isinstance(value, str):
            return next((r for r in cls if NAMES[r][0] == value), cls.LENGTH)
        return cls(int(value)) if int(value) in cls._value2member_map_ else cls.LENGTH


NAMES = {  # reason -> (label, OpenAI finish_reason)
    FinishReason.RUNNING: ("running", "length"),
    FinishReason.EOS: ("eos", "stop"),
    FinishReason.STOP_SEQUENCE: ("stop_sequence", "stop"),
    FinishReason.LENGTH: ("length", "length"),
    FinishReason.STOPPED: ("stopping_criteria", "stop"),
    FinishReason.CANCELLED: ("cancelled", "cancelled"),
    FinishReason.ERROR: ("error", "error"),
}


def prefill(cfg, width: int, params, cache, tokens, positions, start, last, lora=None):
    """Encode ``tokens [B,C]`` at cache slots ``start..start+C-1`` (``lora [B]``: each row's
    adapter slot, ``decoder.forward``'s).

    Returns the float32 logits ``[B,V]`` of chunk position ``last`` (the last real prompt
    token) and the updated cache.
    """
    # a (C, C) graph always starts at slot 0 (see buckets.prefill_plan): no earlier slots to read
    old_width = 0 if width == tokens.shape[1] else width
    h, cache = decoder.forward(cfg, params, cache, tokens, positions, start, old_width, lora=lora)
    h_last = lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
    return decoder.logits(cfg, params, h_last), cache


def mask_eos(logits, eos, slot, min_end):
    """``min_new_tokens`` / ``min_length``: the eos ids get ``-inf`` in rows whose token at
    ``slot`` would end them before slot ``min_end [B]`` (transformers' MinLength /
    MinNewTokensLength processors, applied before every other processor as there). ``eos`` is
    padded with -1, which indexes past the vocabulary and is dropped."""
    b, v = logits.shape
    cols = jnp.where(eos >= 0, eos, v)
    fill = jnp.where(jnp.reshape(slot, (-1,)) < min_end, -jnp.inf, jnp.inf)
    return logits.at[:, cols].min(jnp.broadcast_to(fill[:, None], (b, eos.shape[0])), mode="drop")


def emit(st: DecodeState, logits, slot, path: str | None = None) -> DecodeState:
    """Choose the token of ``slot`` for every live row, record it and decide who finishes.

    Eos ids are masked in rows shorter than their ``min_end`` (``mask_eos``). Finished rows
    get ``pad``. A row finishes on an eos id (``eos``), on a stop sequence that
    ends at this token and lies inside the generated tokens (``stop_sequence``; it stays in
    the output, Cerebras semantics), or at its last slot (``length``).
    """
    logits = mask_eos(logits, st.eos, slot, st.min_end)
    tok, lp, top_ids, top_lp = sampling.select(
        logits, st.params, st.seen, st.out, slot - 1, st.pos, st.want_logprobs, allow=st.allow,
        sparse=(st.bias_ids, st.bias_val), path=path,
    )  # fmt: skip
    live = ~st.done
    tok = jnp.where(live, tok, st.pad)
    b = tok.shape[0]
    col = lambda buf, x: lax.dynamic_update_slice(buf, x[:, None].astype(buf.dtype), (0, slot))
    out = col(st.out, tok)
    top = lambda buf, x: lax.dynamic_update_slice(buf, x[:, None].astype(buf.dtype), (0, slot, 0))
    is_eos = jnp.any(tok[:, None] == st.eos[None, :], -1)
    reason = end_reason(out, slot, st.first, st.stop, is_eos, st.last)
    reason = jnp.where(live, reason, st.reason)
    seen = st.seen.at[jnp.arange(b), tok].set(True)
    return st.replace(
        tok=tok,
        out=out,
        logp=col(st.logp, jnp.where(live, lp, 0.0)),
        top_ids=top(st.top_ids, top_ids),
        top_lp=top(st.top_lp, top_lp),
        seen=seen,
        done=reason != FinishReason.RUNNING,
        reason=reason,
        end=jnp.where(live & (reason != FinishReason.RUNNING), slot, st.end),
    )


def end_reason(out, slot, first, stop, is_eos, last):
    """Why each row ends with the token just written at ``slot`` of ``out [B,S]``, or ``RUNNING``.

    ``slot`` and ``first`` (the first generated slot) are scalars or one per row. A stop
    sequence counts when the last ``MAX_STOP_LEN`` tokens end with it inside the generated
    tokens; eos wins over a stop sequence, which wins over the length limit ``last``.
    """
    b, s = out.shape
    back = jnp.reshape(slot, (-1, 1)) - (MAX_STOP_LEN - 1) + jnp.arange(MAX_STOP_LEN)[None, :]
    back = jnp.broadcast_to(back, (b, MAX_STOP_LEN))
    window = jnp.take_along_axis(out, jnp.clip(back, 0, s - 1), axis=1)  # [B, L]
    window = jnp.where(back >= jnp.reshape(first, (-1, 1)), window, -3)  # generated tokens only
    hit = jnp.all((stop == -2) | (stop == window[:, None, :]), -1) & jnp.any(stop != -2, -1)
    length = jnp.where(slot >= last, FinishReason.LENGTH, FinishReason.RUNNING)
    stopped = jnp.where(jnp.any(hit, -1), FinishReason.STOP_SEQUENCE, length)
    return jnp.where(is_eos, FinishReason.EOS, stopped)


def select_first(logits, state: DecodeState) -> DecodeState:
    """The first generated token (slot ``state.idx``) from the prefill logits."""
    return emit(scored(state, logits, state.idx), logits, state.idx)


def scored(st: DecodeState, logits, slot) -> DecodeState:
    """A state lowered with ``[B, V]`` scores (``state_spec(..., scores=True)``) gets the scores the
    token of ``slot`` is chosen from, before ``emit`` records it; any other state is returned as is."""
    if st.scores.shape[-1] == 1:
        return st
    if st.scores.shape != logits.shape:
        raise ValueError(f"scores {st.scores.shape} lowered for logits {logits.shape}")
    masked = mask_eos(logits, st.eos, slot, st.min_end)
    sparse = (st.bias_ids, st.bias_val)
    scores = sampling.processed_scores(masked, st.params, st.seen, st.out, slot - 1, st.allow, sparse)
    return st.replace(scores=scores.astype(jnp.float32), raw=logits.astype(jnp.float32))


def decode(cfg, width: int, params, cache, state, replicated=None, group: int = 0):
    """Generate tokens on device until slot ``width``, ``state.limit`` or every row is done.

    ``state.tok`` is the token at slot ``idx`` (already emitted), ``pos`` its position.
    One call covers one token-generation bucket (or one streaming chunk: the host sets
    ``limit``), so the host only switches buckets or hands out chunks. ``replicated`` (a
    sharding) gathers the vocabulary-sharded logits once per step under tensor parallelism,
    so the sampler's vocabulary-wide ops need no other collectives.

    ``group`` (static) shapes the loop for backends whose loops and branches cost a round trip to
    the host (XLA:GPU copies a ``while_loop``'s condition and a ``cond``'s predicate to the host and
    waits for the device each time): 0 checks every step and lets the sampler choose its path per
    step (CPU); 1 chooses the sampler's path once per call (``sampling.plain`` does not change
    within a call), so a greedy step holds no branch; ``group > 1`` also runs steps ``group`` at a
    time in a loop of fixed trip count (no round trip inside), checking "all rows done" between
    groups, then the last ``< group`` steps one at a time. Tokens are the same for every ``group``:
    a finished row emits ``pad`` while others run, as in any batch.
    """
    limit = jnp.minimum(state.limit, width)

    def cond(carry):
        _, st = carry
        return (st.idx < limit) & ~jnp.all(st.done)

    def step(carry, path=None):
        cache, st = carry
        idx = st.idx
        h, cache = decoder.forward(
            cfg, params, cache, st.tok[:, None], st.pos[:, None], idx, width, lora=st.adapter
        )
        logits = decoder.logits(cfg, params, h[:, 0])
        if replicated is not None:
            logits = lax.with_sharding_constraint(logits, replicated)
        st = scored(st.replace(pos=st.pos + 1, idx=idx + 1), logits, idx + 1)
        return cache, emit(st, logits, idx + 1, path)

    if group == 0:
        return lax.while_loop(cond, step, (cache, state))

    def run(path):
        carry = (cache, state)
        if group > 1:
            more = lambda c: (c[1].idx + group <= limit) & ~jnp.all(c[1].done)
            steps = lambda c: lax.fori_loop(0, group, lambda _, x: step(x, path), c)
            carry = lax.while_loop(more, steps, carry)
            # a group may run past the step where the last row finished: end where a step-by-step loop does
            c, st = carry
            last = jnp.minimum(st.idx, jnp.max(st.end))
            carry = c, st.replace(idx=jnp.where(jnp.all(st.done), last, st.idx))
        return lax.while_loop(cond, lambda c: step(c, path), carry)

    fast = sampling.plain(state.params, state.want_logprobs, allow=state.allow, sparse=(state.bias_ids,))
    return lax.cond(fast, lambda: run("plain"), lambda: run("full"))


def sampler_fields(batch: int, n_slots: int, vocab: int, spec) -> dict:
    """The ``SamplerState`` fields but ``idx`` / ``first``, each ``spec(shape, dtype)``."""
    row = lambda dt: spec((batch,), dt)
    k = sampling.TOP_LOGPROBS_MAX
    f32, i32 = jnp.float32, jnp.int32
    return dict(
        tok=row(i32),
        done=row(jnp.bool_),
        reason=row(i32),
        last=row(i32),
        out=spec((batch, n_slots), i32),
        logp=spec((batch, n_slots), f32),
        top_ids=spec((batch, n_slots, k), i32),
        top_lp=spec((batch, n_slots, k), f32),
        seen=spec((batch, vocab), jnp.bool_),
        allow=spec((batch, sampling.mask_words(vocab)), jnp.uint32),
        bias_ids=spec((batch, sampling.MAX_LOGIT_BIAS), i32),
        bias_val=spec((batch, sampling.MAX_LOGIT_BIAS), f32),
        stop=spec((batch, MAX_STOPS, MAX_STOP_LEN), i32),
        eos=spec((MAX_EOS,), i32),
        pad=spec((), i32),
        params=sampler_params.row_spec(row),
        adapter=row(i32),
    )


def state_spec(batch: int, n_slots: int, vocab: int, sharding, scores: bool = False) -> DecodeState:
    """Abstract generation state (shapes/dtypes/sharding) used to lower the graphs; ``scores``:
    with the ``[B, V]`` scores of each token (``DecodeState.scores``)."""
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    row = lambda dt: s((batch,), dt)
    i32 = jnp.int32
    return DecodeState(
        **sampler_fields(batch, n_slots, vocab, s),
        idx=s((), i32),
        first=s((), i32),
        pos=row(i32),
        end=row(i32),
        min_end=row(i32),
        limit=s((), i32),
        want_logprobs=s((), jnp.bool_),
        scores=s((batch, vocab if scores else 1), jnp.float32),
        raw=s((batch, vocab if scores else 1), jnp.float32),
    )
