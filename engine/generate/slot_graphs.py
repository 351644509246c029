"""Graphs of continuous batching: the KV cache's batch rows are slots that requests enter and leave.

Three graph kinds, compiled ahead of time like every other (``graph_keys``):

* ``("slot_prefill", C, W)``: encode one request's prompt chunk (context bucket ``C``, attending
  ``W`` cache slots, as ``core.graphs.prefill``) into the cache row ``row`` only; other rows are
  untouched, so it runs between decode steps of the other requests.
* ``("slot_insert",)``: put a request's per-row state (sampling settings, stop sequences,
  prompt tokens for the penalties) into row ``row`` and choose its first token from the prefill
  logits.
* ``("slot_decode", W)``: up to ``steps`` decode steps for every live row at once, each row at
  its own cache slot and position (``decoder.forward`` with a per-row ``write_idx``).

What is static: the ``ArchConfig``, the bucket sizes and the state widths (``core.graphs``'
``MAX_*``, ``sampling``'s). What is traced: the row, the steps, every per-row value. A row's
token at slot ``i`` has position ``i`` (a request starts at slot 0 of its row), so the hashed
sampling draws (``sampling.uniform``) are the ones ``sample()`` makes for the same prompt and
seed: a request's tokens do not depend on what the other slots hold.

Finished and free rows (``done``) still flow through the decode step (static shapes); their
K/V goes to the row's last cache slot with position -1, which no live query reads: a live row
writes at slot ``<= last - 1 <= S - 2`` and sees only slots below its write slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from aotlm.core import buckets as bk
from aotlm.core import graphs, sampling
from aotlm.core.contract import GraphHost
from aotlm.core.state import SlotState
from aotlm.models import decoder


def graph_keys(ctx_buckets, tg_buckets) -> list[tuple]:
    shapes = bk.prefill_graph_shapes(ctx_buckets, tg_buckets)
    return (
        [("slot_prefill", c, w) for c, w in shapes]
        + [("slot_insert",)]
        + [("slot_decode", w) for w in tg_buckets]
    )


def state_spec(slots: int, n_slots: int, vocab: int, sharding) -> SlotState:
    """Abstract serving state (shapes/dtypes/sharding) to lower the graphs with (``sharding``
    None: the shapes alone, e.g. for host buffers)."""
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    row = lambda dt: s((slots,), dt)
    return SlotState(
        **graphs.sampler_fields(slots, n_slots, vocab, s),
        idx=row(jnp.int32),
        first=row(jnp.int32),
        counts=s((slots, vocab), jnp.int32),
        ignore_eos=row(jnp.bool_),
        want=row(jnp.bool_),
        presence=row(jnp.float32),
        frequency=row(jnp.float32),
        bias_ids=s((slots, sampling.MAX_LOGIT_BIAS), jnp.int32),
        bias_val=s((slots, sampling.MAX_LOGIT_BIAS), jnp.float32),
        steps=s((), jnp.int32),
    )


def _penalty_bias(st):
    """OpenAI presence / frequency penalties over the tokens each row generated (as vLLM)."""
    counts = st.counts
    used = jnp.any((st.presence != 0) | (st.frequency != 0))

    def bias():
        c = counts.astype(jnp.float32)
        return -(st.frequency[:, None] * c + st.presence[:, None] * (c > 0))

    return lax.cond(used, bias, lambda: jnp.zeros(counts.shape, jnp.float32))


def emit_rows(st: SlotState, logits, slot, live) -> SlotState:
    """Choose every live row's token at its own ``slot [B]``, record it, decide who finishes.

    As ``core.graphs.emit`` (same reasons, stop sequences inside the generated tokens, eos
    unless ``ignore_eos``), with one slot per row; rows not ``live`` are left as they were.
    """
    b, n_slots = st.out.shape
    rows = jnp.arange(b)
    tok, lp, top_ids, top_lp = sampling.select(
        logits, st.params, st.seen, st.out, (slot - 1)[:, None], slot,
        jnp.any(st.want & live), _penalty_bias(st), st.allow, (st.bias_ids, st.bias_val),
    )  # fmt: skip
    tok = jnp.where(live, tok, st.pad)
    col = jnp.where(live, slot, n_slots)  # out of range: dropped
    put = lambda buf, x: buf.at[rows, col].set(x.astype(buf.dtype), mode="drop")
    out = put(st.out, tok)
    is_eos = jnp.any(tok[:, None] == st.eos[None, :], -1) & ~st.ignore_eos
    reason = graphs.end_reason(out, slot, st.first, st.stop, is_eos, st.last)
    reason = jnp.where(live, reason, st.reason)
    vocab_col = jnp.where(live, tok, st.seen.shape[1])
    return st.replace(
        tok=jnp.where(live, tok, st.tok),
        idx=jnp.where(live, slot, st.idx),
        out=out,
        logp=put(st.logp, lp),
        top_ids=put(st.top_ids, top_ids),
        top_lp=put(st.top_lp, top_lp),
        seen=st.seen.at[rows, vocab_col].set(True, mode="drop"),
        counts=st.counts.at[rows, vocab_col].add(1, mode="drop"),
        done=st.done | (reason != graphs.FinishReason.RUNNING),
        reason=reason,
    )


def slot_prefill(cfg, width: int, params, cache, tokens, positions, start, last, row):
    """Encode ``tokens [1,C]`` at slots ``start..start+C-1`` of cache row ``row`` (traced).

    The row is cut out of every layer's cache, run through the batch-1 forward and written
    back: one row copy per layer, a few MB, small beside the prompt's matmuls.
    """
    cut = lambda c: lax.dynamic_slice_in_dim(c, row, 1, 0)
    back = lambda c, r: lax.dynamic_update_slice_in_dim(c, r, row, 0)
    sub = {"k": [cut(c) for c in cache["k"]], "v": [cut(c) for c in cache["v"]], "pos": cut(cache["pos"])}
    old_width = 0 if width == tokens.shape[1] else width  # as core.graphs.prefill
    h, sub = decoder.forward(cfg, params, sub, tokens, positions, start, old_width)
    new = {
        "k": [back(c, r) for c, r in zip(cache["k"], sub["k"], strict=True)],
        "v": [back(c, r) for c, r in zip(cache["v"], sub["v"], strict=True)],
        "pos": back(cache["pos"], sub["pos"]),
    }
    h_last = lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
    return decoder.logits(cfg, params, h_last), new


def slot_insert(state: SlotState, logits, row_state: SlotState, row) -> SlotState:
    """Row ``row`` := ``row_state`` (a one-row state) after choosing its first token from ``logits [1,V]``."""
    one = row_state.replace(eos=state.eos, pad=state.pad)
    one = emit_rows(one, logits, row_state.idx, jnp.ones((1,), jnp.bool_))
    put = lambda full, r: lax.dynamic_update_slice_in_dim(full, r.astype(full.dtype), row, 0)
    rows = {k: jax.tree.map(put, getattr(state, k), getattr(one, k)) for k in SlotState.row_fields()}
    return state.replace(**rows)


def slot_decode(cfg, width: int, params, cache, state, cancel, replicated=None):
    """Up to ``state['steps']`` decode steps for every live row; ``cancel [B]`` ends rows first.

    The host picks ``width`` (static: the token bucket) so that every live row's slots stay
    below it for the whole call.
    """
    n_slots = state.out.shape[1]
    ended = cancel & ~state.done
    reason = jnp.where(ended, graphs.FinishReason.CANCELLED, state.reason)
    state = state.replace(done=state.done | cancel, reason=reason)

    def cond(carry):
        _, st, n = carry
        return (n < st.steps) & ~jnp.all(st.done)

    def body(carry):
        cache, st, n = carry
        live = ~st.done
        w_idx = jnp.where(live, st.idx, n_slots - 1)
        pos = jnp.where(live, st.idx, -1)
        h, cache = decoder.forward(cfg, params, cache, st.tok[:, None], pos[:, None], w_idx, width)
        logits = decoder.logits(cfg, params, h[:, 0])
        if replicated is not None:
            logits = lax.with_sharding_constraint(logits, replicated)
        return cache, emit_rows(st, logits, st.idx + 1, live), n + 1

    cache, state, _ = lax.while_loop(cond, body, (cache, state, jnp.int32(0)))
    return cache, state


def lower(model: GraphHost, key: tuple):
    """Lower one slot graph of ``model`` (a ``CausalLMForSampling`` with ``continuous_batching``)."""
    p, cache = model.abstract(model.params), model.cache_specs()
    rep, b, v = model.replicated, model.batch_size, model.cfg.vocab_size
    state = state_spec(b, model.n_positions, v, rep)
    cache_sh, state_sh = model.shardings(cache), model.shardings(state)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    if key[0] == "slot_prefill":
        _, c, w = key
        fn = functools.partial(slot_prefill, model.cfg, w)
        jit = jax.jit(fn, donate_argnums=(1,), out_shardings=(rep, cache_sh))
        tok = jax.ShapeDtypeStruct((1, c), jnp.int32, sharding=rep)
        return jit.lower(p, cache, tok, tok, scalar, scalar, scalar)
    if key[0] == "slot_insert":
        one = state_spec(1, model.n_positions, v, rep)
        row_state = one
        logits = jax.ShapeDtypeStruct((1, v), jnp.float32, sharding=rep)
        jit = jax.jit(slot_insert, donate_argnums=(0,), out_shardings=state_sh)
        return jit.lower(state, logits, row_state, scalar)
    _, w = key
    fn = functools.partial(slot_decode, model.cfg, w, replicated=rep)
    jit = jax.jit(fn, donate_argnums=(1, 2), out_shardings=(cache_sh, state_sh))
    return jit.lower(p, cache, state, jax.ShapeDtypeStruct((b,), jnp.bool_, sharding=rep))
