"""Speculative decoding on device: draft rounds and target checks in one ``lax.while_loop``.

One graph ``("spec", k, Wt, Wd, draft)`` lives in the *target's* executables (``draft`` = a
hash of the draft model's configuration, so the compile-cache key covers both models). It
takes both models' params and caches and runs whole rounds until every row is done, a cache
bucket is full, or the host's ``limit`` slot is reached (a chunk, so the loop is resumable).
Per round, with nothing crossing to the host:

1. the draft runs ``k + 1`` steps feeding the last committed token and then its own
   proposals ``d1..dk`` (the last step only writes ``dk``'s keys/values, so the draft cache
   holds whatever the target accepts);
2. the target runs one forward of the ``k + 1`` tokens ``[last, d1..dk]`` at slots
   ``idx..idx+k`` and decides per row how many proposals it accepts (``a``): greedy rows keep
   leading ``d_j == argmax``; sampled rows use the standard rejection rule (Leviathan et al.,
   Chen et al.): accept ``d_j`` with probability ``min(1, p/q)``, at the first rejection draw
   from ``norm(max(0, p - q))``, after ``k`` acceptances draw a bonus token from ``p``;
3. row ``r`` commits ``t0..t_{a_r}`` (stopping at an eos id or its budget), and both caches
   roll back: slot ``idx + j`` of row ``r`` keeps its entry iff ``j < keep_r``.

**Slots at batch > 1.** Rows share one write slot (the graphs write ``T`` tokens at one slot),
but rows accept different numbers of tokens. Each row keeps its own positions (RoPE / learned
positions follow ``pos``, not the slot); the shared slot advances by the largest count kept,
and a row that kept fewer leaves the rest of its slots as padding (``pos = -1``: invisible to
every query). These holes cost slots, so a row keeps all it accepted only while the cache can
still hold the worst case of the rest of every request; otherwise every row keeps the round's
smallest count (no holes; rows that accepted more re-propose). At batch 1 there are never
holes. With a sliding window the window is counted in slots (as transformers does), so holes
widen it slightly: at batch > 1 on sliding-window models, use a draft only when exactness is
not required.

Static: ``k``, both widths, both architectures, the slot capacity. Traced: everything per row
(sampling parameters, seeds, budgets, positions) and the slot, round and chunk limit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from aotlm.core import sampler_params, sampling
from aotlm.core.contract import GraphHost
from aotlm.models import decoder

MAX_EOS = 8
SP_KEYS = sampler_params.DRAW_NAMES  # the settings a row samples with (transformers' names)
DRAFT, ACCEPT, RESIDUAL = 0, 1, 2  # random streams: uniform(seed, position, round * 4 + stream)


def rollback(cache, idx, keep, k: int):
    """Slots ``idx + j`` of row ``r`` become padding (``pos = -1``) for ``j >= keep[r]``."""
    b = keep.shape[0]
    chunk = lax.dynamic_slice(cache["pos"], (0, idx), (b, k + 1))
    chunk = jnp.where(jnp.arange(k + 1)[None, :] >= keep[:, None], -1, chunk)
    return dict(cache, pos=lax.dynamic_update_slice(cache["pos"], chunk, (0, idx)))


def _logprobs(logits, sp):
    """Processed log-probs ``[..., V]`` (HF warpers, per row) for logits ``[B, ..., V]``."""
    shape = logits.shape
    reps = 1 if len(shape) == 2 else shape[1]
    flat = jax.tree.map(lambda a: jnp.repeat(a, reps), sp)
    return sampling.sort_free_logprobs(logits.reshape(-1, shape[-1]), flat).reshape(shape).astype(jnp.float32)


def _u(sp, position, rnd, stream):
    return sampling.uniform(sp.seed, position, rnd * 4 + stream)


def _replicate(x, replicated):
    """Vocabulary-sharded logits gathered once under tp, so the token choice needs no collectives."""
    return x if replicated is None else lax.with_sharding_constraint(x, replicated)


def propose(cfg, k: int, width: int, params, cache, st, replicated=None):
    """The draft's ``k`` proposals ``[B, k]`` and their log-probs ``[B, k, V]`` (zeros when no row
    samples: greedy rounds skip the warpers)."""
    sp, b, v = st["sp"], st["last"].shape[0], cfg.vocab_size
    samp = sampling.sampled_rows(sp)

    def body(j, carry):
        cache, tok, out, logq = carry
        h, cache = decoder.forward(
            cfg, params, cache, tok[:, None], (st["pos"] + j)[:, None], st["idx"] + j, width
        )
        lg = _replicate(decoder.logits(cfg, params, h[:, 0]), replicated)
        greedy = jnp.argmax(lg, -1).astype(jnp.int32)

        def sampled():
            lq = _logprobs(lg, sp)
            drawn = sampling.draw(jnp.exp(lq), _u(sp, st["pos"] + j + 1, st["rnd"], DRAFT))
            return lq, jnp.where(samp, drawn, greedy).astype(jnp.int32)

        lq, nxt = lax.cond(jnp.any(samp), sampled, lambda: (jnp.zeros_like(lg), greedy))
        jj = jnp.minimum(j, k - 1)
        keep_old = j >= k  # step k only writes dk's keys/values
        out = jnp.where(keep_old, out, lax.dynamic_update_slice(out, nxt[:, None], (0, jj)))
        logq = jnp.where(keep_old, logq, lax.dynamic_update_slice(logq, lq[:, None], (0, jj, 0)))
        return cache, nxt, out, logq

    init = (cache, st["last"], jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k, v), jnp.float32))
    cache, _, drafts, logq = lax.fori_loop(0, k + 1, body, init)
    return cache, drafts, logq


def verify(cfg, k: int, width: int, params, cache, st, drafts, logq, replicated=None):
    """The target's tokens ``t [B, k+1]``, acceptance ``a [B]`` and the log-probs of ``t`` under the
    target's processed distribution ``[B, k+1]`` (zeros unless ``st["want"]``) for ``[last, drafts]``
    (greedy rows: leading ``d_j == argmax``; sampled rows: the rejection rule above). ``logq``
    None: the proposals are not drawn (prompt lookup), ``q`` is a point mass on each, so ``d_j``
    is kept with probability ``p(d_j)`` and a rejection draws from ``p`` without ``d_j``."""
    sp = st["sp"]
    tokens = jnp.concatenate([st["last"][:, None], drafts], 1)
    positions = st["pos"][:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    h, cache = decoder.forward(cfg, params, cache, tokens, positions, st["idx"], width)
    lg = _replicate(decoder.logits(cfg, params, h), replicated)
    t_g = jnp.argmax(lg, -1).astype(jnp.int32)
    a_g = jnp.sum(jnp.cumprod((drafts == t_g[:, :k]).astype(jnp.int32), 1), 1)
    samp = sampling.sampled_rows(sp)

    def sampled(_):
        logp = _logprobs(lg, sp)  # [B, k+1, V]
        pd = jnp.take_along_axis(logp[:, :k], drafts[..., None], 2)[..., 0]
        qd = jnp.zeros_like(pd) if logq is None else jnp.take_along_axis(logq, drafts[..., None], 2)[..., 0]
        u = jax.vmap(lambda j: _u(sp, positions[:, j] + 1, st["rnd"], ACCEPT), out_axes=1)(jnp.arange(k))
        ok = u < jnp.exp(jnp.minimum(pd - qd, 0.0))
        a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), 1), 1)
        p_a = jnp.exp(jnp.take_along_axis(logp, a[:, None, None], 1)[:, 0])
        resid = jnp.maximum(p_a - _q_at(drafts, logq, a, p_a), 0.0)
        resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_a)
        pos_a = jnp.take_along_axis(positions, a[:, None], 1)[:, 0] + 1
        corr = sampling.draw(resid, _u(sp, pos_a, st["rnd"], RESIDUAL))
        j = jnp.arange(k + 1)[None, :]
        d_pad = jnp.concatenate([drafts, jnp.zeros((drafts.shape[0], 1), drafts.dtype)], 1)
        t_s = jnp.where(j < a[:, None], d_pad, corr[:, None]).astype(jnp.int32)
        t = jnp.where(samp[:, None], t_s, t_g)
        lp = jnp.where(st["want"], jnp.take_along_axis(logp, t[..., None], 2)[..., 0], 0.0)
        return t, jnp.where(samp, a, a_g), lp

    def greedy(_):
        zeros = lambda: jnp.zeros(t_g.shape, jnp.float32)
        lp = lax.cond(st["want"], lambda: _greedy_logprobs(lg, t_g), zeros)
        return t_g, a_g, lp

    t, a, lp = lax.cond(jnp.any(samp), sampled, greedy, None)
    return cache, t, a.astype(jnp.int32), lp


def _greedy_logprobs(logits, tokens):
    """``log_softmax(logits)`` at ``tokens``: what a greedy row's token scores (plain decoding's)."""
    lg = logits.astype(jnp.float32)
    return jnp.take_along_axis(lg, tokens[..., None], -1)[..., 0] - jax.nn.logsumexp(lg, -1)


def _q_at(drafts, logq, a, like):
    """The proposal distribution at each row's first rejected draft ``a`` (after all ``k``: zero,
    the bonus token is drawn from ``p``)."""
    if logq is None:  # point masses on the drafts; index -1 (the bonus) is all zeros
        d_pad = jnp.concatenate([drafts, jnp.full((drafts.shape[0], 1), -1, drafts.dtype)], 1)
        return jax.nn.one_hot(
            jnp.take_along_axis(d_pad, a[:, None], 1)[:, 0], like.shape[-1], dtype=like.dtype
        )
    q_pad = jnp.concatenate([jnp.exp(logq), jnp.zeros_like(like)[:, None]], 1)
    return jnp.take_along_axis(q_pad, a[:, None, None], 1)[:, 0]


def commit(st, t, a, lp, k: int, capacity: int):
    """Per row: how many slots to keep, which tokens (and their log-probs ``lp``) to append (up to
    eos / budget), new state."""
    live = ~st["done"]
    c = jnp.where(live, a + 1, 0)
    big = jnp.int32(2**30)
    c_max = jnp.max(c)
    c_min = jnp.min(jnp.where(live, c, big))
    rest = jnp.max(jnp.where(live, st["budget"] - st["n_out"] - c, 0))
    # every row keeps all it accepted while the cache holds the worst case of the rest
    even = st["idx"] + c_max + rest + k > capacity
    keep = jnp.where(even, jnp.where(live, c_min, 0), c)
    # append t[r, :keep_r] after n_out[r], stopping after an eos id or at the budget
    j = jnp.arange(k + 1)[None, :]
    stop = jnp.any(t[:, :, None] == st["eos"][None, None, :], -1) | (
        st["n_out"][:, None] + j + 1 >= st["budget"][:, None]
    )
    stop &= j < keep[:, None]
    first_stop = jnp.min(jnp.where(stop, j, big), 1)
    cut = jnp.minimum(keep, first_stop + 1)
    col = jnp.where(j < cut[:, None], st["n_out"][:, None] + j, st["out"].shape[1])  # past the end: dropped
    rows = jnp.broadcast_to(jnp.arange(t.shape[0])[:, None], col.shape)
    out = st["out"].at[rows, col].set(t, mode="drop")
    lps = st["lp"].at[rows, col].set(lp, mode="drop")
    last = jnp.take_along_axis(t, jnp.maximum(keep - 1, 0)[:, None], 1)[:, 0]
    n_live = jnp.sum(live.astype(jnp.int32))
    return keep, dict(
        st,
        out=out,
        lp=lps,
        n_out=st["n_out"] + cut,
        done=st["done"] | (first_stop < big),
        last=jnp.where(keep > 0, last, st["last"]),
        pos=st["pos"] + keep,
        idx=st["idx"] + jnp.max(keep),
        rnd=st["rnd"] + 1,
        proposed=st["proposed"] + n_live * k,
        accepted=st["accepted"] + jnp.sum(jnp.where(live, a, 0)),
        uneven=st["uneven"] + ((c_max != c_min) & ~even).astype(jnp.int32),
    )


def loop(
    tcfg, dcfg, k: int, wt: int, wd: int, capacity: int, tparams, tcache, dparams, dcache, st, replicated=None
):
    """Rounds until every row is done, the next round would pass slot ``min(wt, wd, limit)``."""
    end = jnp.minimum(st["limit"], min(wt, wd))

    def cond(carry):
        *_, s = carry
        return (s["idx"] + k + 1 <= end) & ~jnp.all(s["done"])

    def body(carry):
        tcache, dcache, s = carry
        dcache, drafts, logq = propose(dcfg, k, wd, dparams, dcache, s, replicated)
        tcache, t, a, lp = verify(tcfg, k, wt, tparams, tcache, s, drafts, logq, replicated)
        keep, s2 = commit(s, t, a, lp, k, capacity)
        return rollback(tcache, s["idx"], keep, k), rollback(dcache, s["idx"], keep, k), s2

    return lax.while_loop(cond, body, (tcache, dcache, st))


def state_spec(batch: int, n_out: int, sharding) -> dict:
    """Abstract loop state (replicated): per-row tokens, positions, budgets, sampling values."""
    s = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    row = lambda dt=jnp.int32: s((batch,), dt)
    sp = sampler_params.row_spec(row)  # the decode state's RowParams (penalties stay neutral)
    rows = {name: row() for name in ("last", "pos", "n_out", "budget")}
    scalars = {name: s(()) for name in ("idx", "rnd", "limit", "proposed", "accepted", "uneven")}
    return dict(
        rows,
        **scalars,
        done=row(jnp.bool_),
        out=s((batch, n_out)),
        lp=s((batch, n_out), jnp.float32),  # each token's log-prob (written when want)
        want=s((), jnp.bool_),
        eos=s((MAX_EOS,)),
        sp=sp,
    )


def lower(target: GraphHost, draft: GraphHost, key: tuple):
    """Lower ``("spec", k, Wt, Wd, tag)`` for ``target`` with ``draft``."""
    _, k, wt, wd, _ = key
    rep = target.replicated
    capacity = min(target.n_positions, draft.n_positions)
    tc, dc = target.cache_specs(), draft.cache_specs()
    st = state_spec(target.batch_size, capacity, rep)
    fn = jax.jit(
        functools.partial(loop, target.cfg, draft.cfg, k, wt, wd, capacity, replicated=rep),
        donate_argnums=(1, 3),
        out_shardings=(target.shardings(tc), draft.shardings(dc), target.shardings(st)),
    )
    return fn.lower(target.abstract(target.params), tc, draft.abstract(draft.params), dc, st)
