"""Graphs of continuous batching: the KV cache's batch rows are slots that requests enter and leave.

Nine graph kinds, compiled ahead of time like every other (``graph_keys``):

* ``("slot_prefill", C, W)``: encode one request's prompt chunk (context bucket ``C``, attending
  ``W`` cache slots, as ``core.graphs.prefill``) into the cache row ``row`` only; other rows are
  untouched, so it runs between decode steps of the other requests. Besides the shapes
  ``sample()`` uses, every ``(C, W > C)``: a prompt resumed after a reused prefix
  (``buckets.resume_plan``).
* ``("slot_prefill_score", C, W)``: ``slot_prefill`` that also returns the log-probability,
  rank and most likely alternatives of every next prompt token (a request's prompt
  log-probabilities: vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``); only in a
  model built with ``prompt_logprobs=True``, for the shapes of a prompt encoded from slot 0.
* ``("slot_prefill_embed", C, W)``: ``slot_prefill`` that returns the final-normed hidden state of
  the chunk's ``last`` token instead of its logits (a prompt's embedding: last-token pooling, as vLLM
  pools a causal LM's); only in a model built with ``embeddings=True``, for the shapes of a prompt
  encoded from slot 0.
* ``("slot_prefill_rows", C, N)``: ``N`` (2, 4, 8) whole prompts that fit context bucket ``C``
  (``C <= ROWS_MAX_BUCKET``), each into its own row, in one call: a burst of short prompts shares
  the per-call costs (the weights read once, not ``N`` times).
* ``("slot_insert",)``: put a request's per-row state (sampling settings, stop sequences,
  prompt tokens for the penalties) into row ``row`` and choose its first token from the prefill
  logits.
* ``("slot_decode", W, R)``: up to ``steps`` decode steps for the first ``R`` rows, each row at
  its own cache slot and position (``decoder.forward`` with a per-row ``write_idx``). ``R`` runs
  over an occupancy ladder (``ladder``: powers of two up to the slots): the scheduler keeps
  its requests in the lowest rows and calls the smallest ``R`` holding them, so one request
  pays a one-row step, not a whole batch's.
* ``("slot_kv_out", W)`` / ``("slot_kv_in", W)``: copy a row's first ``W`` cache slots out (to
  arrays the host keeps in its prefix store) and back into a row.
* ``("slot_swap",)``: exchange two rows' states (their K/V moves by ``slot_kv_out`` /
  ``slot_kv_in``): how the scheduler keeps live rows low while freed rows keep their tokens' K/V.

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
from aotlm.core import graphs, sampling, scoring
from aotlm.core.contract import GraphHost
from aotlm.core.state import SlotState
from aotlm.models import decoder

MAX_PROMPTS = 8  # whole prompts one call encodes at most (short prompts share per-call costs)
ROWS_MAX_BUCKET = 128  # longer prompts are compute-bound: encoding them together saves nothing


def prompt_ladder(slots: int) -> tuple[int, ...]:
    """How many whole prompts a ``slot_prefill_rows`` graph encodes: 2, 4, 8 (up to the slots)."""
    return tuple(n for n in (2, 4, 8) if n <= min(slots, MAX_PROMPTS))


def rows_buckets(ctx_buckets) -> tuple[int, ...]:
    """The context buckets ``slot_prefill_rows`` graphs exist for: those up to ``ROWS_MAX_BUCKET``."""
    return tuple(c for c in ctx_buckets if c <= ROWS_MAX_BUCKET)


def ladder(slots: int) -> tuple[int, ...]:
    """The row counts decode graphs are compiled for: powers of two below ``slots``, and ``slots``."""
    out, r = [], 1
    while r < slots:
        out.append(r)
        r *= 2
    return (*out, slots)


def rows_for(live_rows: int, slots: int) -> int:
    """The smallest ladder row count holding rows ``0 .. live_rows - 1``."""
    return next(r for r in ladder(slots) if r >= max(live_rows, 1))


def graph_keys(
    ctx_buckets, tg_buckets, slots: int, prompt_logprobs: bool = False, embeddings: bool = False
) -> list[tuple]:
    """The slot graphs of a server; ``prompt_logprobs`` adds a ``slot_prefill_score`` graph and
    ``embeddings`` a ``slot_prefill_embed`` graph per fresh prefill shape (such a prompt is encoded
    from slot 0: no reused prefix)."""
    fresh = sorted(bk.prefill_graph_shapes(ctx_buckets, tg_buckets))
    shapes = set(fresh) | set(bk.resume_shapes(ctx_buckets, tg_buckets))
    return (
        [("slot_prefill", c, w) for c, w in sorted(shapes)]
        + [("slot_prefill_score", c, w) for c, w in (fresh if prompt_logprobs else ())]
        + [("slot_prefill_embed", c, w) for c, w in (fresh if embeddings else ())]
        + [("slot_prefill_rows", c, n) for c in rows_buckets(ctx_buckets) for n in prompt_ladder(slots)]
        + [("slot_insert",)]
        + [("slot_decode", w, r) for w in tg_buckets for r in ladder(slots)]
        + [("slot_swap",)]
        + [(kind, w) for w in tg_buckets for kind in ("slot_kv_out", "slot_kv_in")]
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
        steps=s((), jnp.int32),
    )


def emit_rows(st: SlotState, logits, slot, live) -> SlotState:
    """Choose every live row's token at its own ``slot [B]``, record it, decide who finishes.

    As ``core.graphs.emit`` (same reasons, stop sequences inside the generated tokens, eos
    unless ``ignore_eos``), with one slot per row; rows not ``live`` are left as they were.
    """
    b, n_slots = st.out.shape
    rows = jnp.arange(b)
    tok, lp, top_ids, top_lp = sampling.select(
        logits, st.params, st.seen, st.out, (slot - 1)[:, None], slot,
        jnp.any(st.want & live), (st.counts, st.presence, st.frequency), st.allow,
        (st.bias_ids, st.bias_val),
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


def _row_forward(cfg, width: int, params, cache, tokens, positions, start, row, lora):
    """``tokens [1,C]`` through the model at slots ``start..`` of cache row ``row``: (hidden
    states ``[1,C,D]``, the cache). Only the row's first ``width`` slots (all the call attends to
    and writes: ``start + C <= width``) are cut out of every layer's cache, run through the
    batch-1 forward and written back, not the whole row (a 256-token prompt in 512 slots: half
    the copies)."""
    old_width = 0 if width == tokens.shape[1] else width  # as core.graphs.prefill
    sub = slot_kv_out(width, cache, row)
    h, sub = decoder.forward(
        cfg, params, sub, tokens, positions, start, old_width, lora=jnp.reshape(lora, (1,))
    )
    return h, slot_kv_in(cache, sub, row)


def slot_prefill(cfg, width: int, params, cache, tokens, positions, start, last, row, lora):
    """Encode ``tokens [1,C]`` at slots ``start..start+C-1`` of cache row ``row`` (traced) with
    adapter slot ``lora`` (traced; -1: the base model); returns the logits at ``last`` and the
    cache."""
    h, new = _row_forward(cfg, width, params, cache, tokens, positions, start, row, lora)
    h_last = lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
    return decoder.logits(cfg, params, h_last), new


def slot_prefill_embed(cfg, width: int, params, cache, tokens, positions, start, last, row, lora):
    """``slot_prefill`` returning the hidden state ``[1, D]`` (float32, after the final norm) of the
    token at ``last`` instead of its logits: the last chunk of an embedding request's prompt."""
    h, new = _row_forward(cfg, width, params, cache, tokens, positions, start, row, lora)
    h_last = lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
    return h_last.astype(jnp.float32), new


def slot_prefill_score(cfg, width: int, params, cache, tokens, positions, start, last, row, lora, targets):
    """``slot_prefill`` that also scores ``targets [1,C]`` (the prompt token after each position,
    -1: none) with the model's own distribution (``scoring.ranked_scores``): returns the logits at
    ``last``, ``(logp, rank, top_ids, top_lp)`` (``[1,C]``, ``[1,C]``, ``[1,C,K]`` x 2, ``K =
    sampling.TOP_LOGPROBS_MAX``) and the cache: a request's prompt log-probabilities, computed
    by the prefill that encodes it."""
    h, new = _row_forward(cfg, width, params, cache, tokens, positions, start, row, lora)
    h_last = lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
    ranked = functools.partial(scoring.ranked_scores, k=sampling.TOP_LOGPROBS_MAX)
    scores = scoring.blocked(cfg, params, h, targets, ranked)
    return decoder.logits(cfg, params, h_last), scores, new


def slot_prefill_rows(cfg, params, cache, tokens, positions, last, rows, lora):
    """Encode ``N`` whole prompts at once: ``tokens [N,C]`` (each from slot 0, right-padded;
    ``positions`` -1 on padding), each into its cache row ``rows [N]`` with its adapter slot
    ``lora [N]`` (traced). Returns each
    prompt's logits at its ``last [N]`` token as ``N`` arrays ``[1,V]`` (one per ``slot_insert``)
    and the cache. Only the rows' first ``C`` slots are read and written; the host fills unused
    entries with copies of a real one (the same values written twice), never another row.
    """
    n, c = tokens.shape
    blocks = [slot_kv_out(c, cache, rows[r]) for r in range(n)]  # each row's first C slots
    sub = jax.tree.map(lambda *xs: jnp.concatenate(xs), *blocks)
    h, sub = decoder.forward(cfg, params, sub, tokens, positions, jnp.int32(0), 0, lora=lora)
    new = cache
    for r in range(n):
        new = slot_kv_in(new, jax.tree.map(lambda x, r=r: x[r : r + 1], sub), rows[r])
    logits = decoder.logits(cfg, params, h[jnp.arange(n), last])
    return tuple(logits[r : r + 1] for r in range(n)), new


def slot_insert(state: SlotState, logits, row_state: SlotState, row) -> SlotState:
    """Row ``row`` := ``row_state`` (a one-row state) after choosing its first token from ``logits [1,V]``."""
    one = row_state.replace(eos=state.eos, pad=state.pad)
    one = emit_rows(one, logits, row_state.idx, jnp.ones((1,), jnp.bool_))
    put = lambda full, r: lax.dynamic_update_slice_in_dim(full, r.astype(full.dtype), row, 0)
    rows = {k: jax.tree.map(put, getattr(state, k), getattr(one, k)) for k in SlotState.row_fields()}
    return state.replace(**rows)


def take_rows(state: SlotState, rows: int) -> SlotState:
    """The first ``rows`` (static) rows of ``state`` (the shared fields as they are)."""
    return state.replace(
        **{k: jax.tree.map(lambda x: x[:rows], getattr(state, k)) for k in SlotState.row_fields()}
    )


def put_rows(state: SlotState, part: SlotState) -> SlotState:
    """``state`` with its first rows replaced by ``part``'s (``take_rows``' inverse, in place)."""
    put = lambda full, x: lax.dynamic_update_slice_in_dim(full, x, 0, 0)
    return part.replace(
        **{k: jax.tree.map(put, getattr(state, k), getattr(part, k)) for k in SlotState.row_fields()}
    )


def slot_decode(cfg, width: int, rows: int, params, cache, state, cancel, replicated=None):
    """Up to ``state.steps`` decode steps for the live rows among the first ``rows``; ``cancel
    [slots]`` ends rows first. Rows at or past ``rows`` are neither read nor written.

    The host picks ``width`` (static: the token bucket) so that every live row's slots stay
    below it for the whole call, and ``rows`` (static, a ``ladder`` value) so that every live
    row is below it.
    """
    full, state, cancel = state, take_rows(state, rows), cancel[:rows]
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
        h, cache = decoder.forward(
            cfg, params, cache, st.tok[:, None], pos[:, None], w_idx, width, lora=st.adapter
        )
        logits = decoder.logits(cfg, params, h[:, 0])
        if replicated is not None:
            logits = lax.with_sharding_constraint(logits, replicated)
        return cache, emit_rows(st, logits, st.idx + 1, live), n + 1

    cache, state, _ = lax.while_loop(cond, body, (cache, state, jnp.int32(0)))
    return cache, put_rows(full, state)


def _row_block(buf, row, width: int, axis: int):
    """Row ``row``'s first ``width`` slots (along ``axis``) of one cache buffer."""
    size = [1] + [min(width, d) if a == axis else d for a, d in enumerate(buf.shape[1:], 1)]
    return lax.dynamic_slice(buf, [row] + [0] * (buf.ndim - 1), size)


def slot_kv_out(width: int, cache, row):
    """A copy of row ``row``'s first ``width`` (static) slots: ``{"k", "v", "pos"}`` one-row blocks."""
    return {
        "k": [_row_block(c, row, width, 2) for c in cache["k"]],
        "v": [_row_block(c, row, width, 3) for c in cache["v"]],
        "pos": _row_block(cache["pos"], row, width, 1),
    }


def slot_kv_in(cache, kv, row):
    """Write ``kv`` (``slot_kv_out``'s blocks) into row ``row``'s first slots."""
    put = lambda buf, x: lax.dynamic_update_slice(buf, x, [row] + [0] * (buf.ndim - 1))
    return {
        "k": [put(c, x) for c, x in zip(cache["k"], kv["k"], strict=True)],
        "v": [put(c, x) for c, x in zip(cache["v"], kv["v"], strict=True)],
        "pos": put(cache["pos"], kv["pos"]),
    }


def slot_swap(state: SlotState, a, b) -> SlotState:
    """Exchange the states of rows ``a`` and ``b`` (traced); the row that moves up (to the larger
    index) is marked done, so a freed row that was still live stops (``CANCELLED``). The rows'
    K/V move by ``slot_kv_out`` / ``slot_kv_in`` (a swap of two cache rows inside one graph made
    XLA copy the whole cache: ~200 ms for GPT-2-small's 16 rows of 512 slots)."""

    def row_swap(x):
        xa, xb = lax.dynamic_index_in_dim(x, a, 0), lax.dynamic_index_in_dim(x, b, 0)
        return lax.dynamic_update_index_in_dim(lax.dynamic_update_index_in_dim(x, xb, a, 0), xa, b, 0)

    state = state.replace(**{k: jax.tree.map(row_swap, getattr(state, k)) for k in SlotState.row_fields()})
    up = jnp.maximum(a, b)
    ended = ~state.done[up]
    reason = jnp.where(ended, graphs.FinishReason.CANCELLED, state.reason[up])
    return state.replace(done=state.done.at[up].set(True), reason=state.reason.at[up].set(reason))


def lower(model: GraphHost, key: tuple):
    """Lower one slot graph of ``model`` (a ``CausalLMForSampling`` with ``continuous_batching``)."""
    p, cache = model.abstract(model.params), model.cache_specs()
    rep, b, v = model.replicated, model.batch_size, model.cfg.vocab_size
    state = state_spec(b, model.n_positions, v, rep)
    cache_sh, state_sh = model.shardings(cache), model.shardings(state)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    if key[0] in ("slot_prefill", "slot_prefill_embed"):
        _, c, w = key
        fn = functools.partial(slot_prefill if key[0] == "slot_prefill" else slot_prefill_embed, model.cfg, w)
        jit = jax.jit(fn, donate_argnums=(1,), out_shardings=(rep, cache_sh))
        tok = jax.ShapeDtypeStruct((1, c), jnp.int32, sharding=rep)
        return jit.lower(p, cache, tok, tok, scalar, scalar, scalar, scalar)
    if key[0] == "slot_prefill_score":
        _, c, w = key
        fn = functools.partial(slot_prefill_score, model.cfg, w)
        jit = jax.jit(fn, donate_argnums=(1,), out_shardings=(rep, (rep,) * 4, cache_sh))
        tok = jax.ShapeDtypeStruct((1, c), jnp.int32, sharding=rep)
        return jit.lower(p, cache, tok, tok, scalar, scalar, scalar, scalar, tok)
    if key[0] == "slot_prefill_rows":
        _, c, n = key
        fn = functools.partial(slot_prefill_rows, model.cfg)
        jit = jax.jit(fn, donate_argnums=(1,), out_shardings=((rep,) * n, cache_sh))
        tok = jax.ShapeDtypeStruct((n, c), jnp.int32, sharding=rep)
        vec = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)
        return jit.lower(p, cache, tok, tok, vec, vec, vec)
    if key[0] == "slot_insert":
        one = state_spec(1, model.n_positions, v, rep)
        row_state = one
        logits = jax.ShapeDtypeStruct((1, v), jnp.float32, sharding=rep)
        jit = jax.jit(slot_insert, donate_argnums=(0,), out_shardings=state_sh)
        return jit.lower(state, logits, row_state, scalar)
    if key[0] in ("slot_kv_out", "slot_kv_in"):  # the blocks are sharded as the cache is
        out = functools.partial(slot_kv_out, key[1])
        blocks = jax.tree.map(lambda b, c: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=c.sharding),
                              jax.eval_shape(out, cache, scalar), cache)  # fmt: skip
        if key[0] == "slot_kv_out":
            return jax.jit(out, out_shardings=model.shardings(blocks)).lower(cache, scalar)
        jit = jax.jit(slot_kv_in, donate_argnums=(0,), out_shardings=cache_sh)
        return jit.lower(cache, blocks, scalar)
    if key[0] == "slot_swap":
        return jax.jit(slot_swap, donate_argnums=(0,), out_shardings=state_sh).lower(state, scalar, scalar)
    _, w, rows = key
    fn = functools.partial(slot_decode, model.cfg, w, rows, replicated=rep)
    jit = jax.jit(fn, donate_argnums=(1, 2), out_shardings=(cache_sh, state_sh))
    return jit.lower(p, cache, state, jax.ShapeDtypeStruct((b,), jnp.bool_, sharding=rep))
