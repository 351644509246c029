"""Blocked (flash-style) attention for long prefill calls: never a whole [queries x window] block.

``layers.attend`` scores every query of a call against every attended slot at once, a
``[B, K, G, T, W]`` float32 block beside a ``[B, T, W]`` mask (``layers.attention_mask``): for a
16384-token chunk in a 32768-slot window that is tens of GB. Here the queries go in blocks of
``Q_BLOCK`` rows (``lax.map``) and, for each query block, the keys in blocks (``lax.fori_loop``)
with a running max, sum and output per query row in float32 (online softmax). Each block's
visibility (written slots, empty slots, causality, padding, sliding window) and its ALiBi bias
are computed from iotas and positions on the fly, so the peak is one ``[B, H, Q_BLOCK,
K_BLOCK]`` score block whatever ``T`` and ``W``.

Key blocks that no query of the block can see are not visited: cache slots at or past the
largest write slot (a traced loop bound), blocks wholly behind a sliding window, and the
call's own keys past the diagonal (causal), so a causal prefill does half the score work of
the whole-block path. The two key segments of ``layers.attend`` stay separate (the old cache,
read before this call writes it, then the call's own keys), so the cache is still only
written, never read back, in the same step.

``decoder.forward`` takes this path when ``use_blocked(T, W)`` (static shapes): small graphs
and decode (``T == 1``) keep ``layers.attend`` exactly as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from aotlm.models.layers import NEG_INF, cache_view

# Blocked when a call's score block (queries x attended keys, per head and batch row) has at
# least this many elements: 2^18 float32 scores are 1 MiB per head and row. Measured on the
# 2-core EPYC (attention alone, XLA default flags): at 256 x 256 the two paths ran about even,
# from 512 x 512 on the blocked one was 3-10x faster (it skips the causal upper half and never
# materializes masks or softmax copies), so only smaller graphs keep ``layers.attend``. Calls
# of fewer than MIN_QUERIES tokens (decode, speculative checks) always keep it (``use_blocked``).
MIN_SCORES = 2**18
MIN_QUERIES = 32
# Rows of a query block and slots of a key block: [B, H, 256, 512] float32 scores are 512 KiB per
# head and row. Among 128..1024 these sizes were fastest or within noise of it for head dims 16
# and 64 (bigger query blocks lost up to 2x, smaller ones paid the loop's per-block cost).
Q_BLOCK = 256
K_BLOCK = 512


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["kv_pos", "positions", "write_idx"],
    meta_fields=["width", "window"],
)
@dataclass(frozen=True)
class Keys:
    """What the blocked path needs to recompute any block's visibility (``layers.attention_mask``).

    ``kv_pos [B,S]``: the cache's token positions before this call (-1 = empty);
    ``positions [B,T]``: this call's positions (-1 = padding); ``write_idx``: the call's first
    slot, a scalar or one per row (traced); ``width`` (static): cache slots attended besides
    the call's own tokens (0 = none); ``window`` (static): the layer's sliding window or None.
    A pytree whose statics stay static through ``jax.jit`` / loops.
    """

    kv_pos: jax.Array
    positions: jax.Array
    write_idx: jax.Array
    width: int
    window: int | None


def use_blocked(t: int, width: int) -> bool:
    """Static: does a call of ``t`` query tokens over ``width`` old slots take the blocked path?

    The score block of ``layers.attend`` has ``t * (width + t)`` elements per head and row (old
    slots, then the call's own tokens). Calls of fewer than ``MIN_QUERIES`` tokens (decode,
    speculative verification) never do: their few score rows are small at any window, and they
    keep ``layers.attend``'s in-place cache kernel.
    """
    return t >= MIN_QUERIES and t * (width + t) >= MIN_SCORES


def _online_step(carry, s, values):
    """Fold one key block into the running ``(max, sum, out)`` of every query row (float32).

    ``s [B,K,R,kb]`` masked scores (rows ``R = G * bq``), ``values [B,K,Dh,kb]``. A row with no
    visible key so far holds garbage weighted by ``exp(NEG_INF - max) = 0`` once it sees one.
    """
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bkrs,bkds->bkrd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv


def _block_scores(qb, keys, visible, key_pos, g: int, scale: float, softcap, slopes):
    """Masked float32 scores ``[B,K,G*bq,kb]`` of query block ``qb [B,K,G*bq,Dh]`` on ``keys [B,K,kb,Dh]``.

    ``visible [1|B,1|bq,kb]``; ``key_pos [B,kb]`` the keys' positions (ALiBi: ``slope * max(pos,
    0)``, ``slopes`` a static tuple or None); ``g`` (static) query heads per kv head. Same order as
    ``layers.attend``: scale, softcap, bias, mask.
    """
    b, k, r, _ = qb.shape
    kb, bq = keys.shape[2], r // g
    s = jnp.einsum("bkrd,bksd->bkrs", qb, keys, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = s.reshape(b, k, g, bq, kb)
    if slopes is not None:
        sl = jnp.asarray(slopes, jnp.float32).reshape(1, k, g, 1, 1)
        s = s + sl * jnp.maximum(key_pos, 0).astype(jnp.float32)[:, None, None, None, :]
    return jnp.where(visible[:, None, None], s, NEG_INF).reshape(b, k, r, kb)


def _old_blocks(carry, qb, i: jax.Array, bq: int, keys: Keys, ck, cv, score):
    """Fold the cache slots ``0..width-1`` visible to query block ``i`` into ``carry``.

    Slots at or past the largest write slot are seen by no row (``layers.attention_mask``), so
    the loop stops there; with a sliding window it starts at the first block any query of the
    block can reach. A block runs past ``width`` only when ``K_BLOCK`` does not divide it: it is
    read from ``S - kb`` instead and its slots below ``j * kb`` (already folded) are hidden.
    """
    w, s_len = keys.width, ck.shape[2]
    kb = min(K_BLOCK, w)
    w_idx = jnp.reshape(keys.write_idx, (-1,))  # [1|B]
    q_slot = w_idx[:, None] + i * bq + jnp.arange(bq, dtype=jnp.int32)[None, :]  # [1|B, bq]
    hi = (jnp.minimum(jnp.max(w_idx), w) + kb - 1) // kb
    lo = jnp.int32(0)
    if keys.window is not None:
        lo = jnp.maximum(jnp.min(w_idx) + i * bq - keys.window + 1, 0) // kb

    def body(j, carry):
        st = jnp.minimum(j * kb, s_len - kb)
        slot = st + jnp.arange(kb, dtype=jnp.int32)  # [kb]
        kp = lax.dynamic_slice_in_dim(keys.kv_pos, st, kb, 1)  # [B, kb]
        vis = (slot >= j * kb) & (slot < w)
        vis = vis[None, None, :] & (slot[None, None, :] < w_idx[:, None, None]) & (kp[:, None, :] >= 0)
        if keys.window is not None:
            vis &= slot[None, None, :] > q_slot[:, :, None] - keys.window
        s = score(qb, cache_view(lax.dynamic_slice_in_dim(ck, st, kb, 2)), vis, kp)
        vb = cache_view(lax.dynamic_slice_in_dim(cv, st, kb, 3))
        return _online_step(carry, s, vb.astype(jnp.promote_types(qb.dtype, vb.dtype)))  # bf16 cache: f32

    return lax.fori_loop(lo, hi, body, carry)


def _new_blocks(carry, qb, i: jax.Array, bq: int, kn, vn, pos, window: int | None, score):
    """Fold the call's own keys visible to query block ``i`` (blocks ``<= i``: causal) into ``carry``.

    ``kn [B,K,Tp,Dh]``, ``vn [B,K,Dh,Tp]``, ``pos [B,Tp]`` (padding -1 hidden); key blocks have
    ``bq`` slots, so block ``i`` is the diagonal one.
    """
    q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)
    lo = jnp.int32(0) if window is None else jnp.maximum(i * bq - window + 1, 0) // bq

    def body(j, carry):
        st = j * bq
        k_idx = st + jnp.arange(bq, dtype=jnp.int32)
        kp = lax.dynamic_slice_in_dim(pos, st, bq, 1)  # [B, bq]
        vis = k_idx[None, :] <= q_idx[:, None]
        if window is not None:
            vis &= k_idx[None, :] > q_idx[:, None] - window
        vis = vis[None] & (kp[:, None, :] >= 0)
        s = score(qb, lax.dynamic_slice_in_dim(kn, st, bq, 2), vis, kp)
        return _online_step(carry, s, lax.dynamic_slice_in_dim(vn, st, bq, 3))

    return lax.fori_loop(lo, i + 1, body, carry)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_kv: tuple[jax.Array, jax.Array],
    keys: Keys,
    scale: float,
    softcap: float | None = None,
    slopes: tuple[float, ...] | None = None,
) -> jax.Array:
    """Attention of ``q [B,T,H,Dh]`` over the old cache and the call's own ``k, v [B,T,K,Dh]``.

    The result equals ``layers.attend`` on the two segments of ``layers.attention_mask`` (GQA
    groups, sliding window, ALiBi ``slopes`` (static tuple, per query head) or None, ``softcap``),
    up to float32 rounding. ``cache_kv = (cache_k [B,K,S,Dh], cache_v [B,K,Dh,S])`` is read, not
    written; only its first ``keys.width`` slots are attended. Static: shapes, ``width``,
    ``window``, ``scale``, ``softcap``, ``slopes``; traced: everything else. ``T`` is padded to
    whole query blocks with hidden (position -1) tokens.
    """
    b, t, h, dh = q.shape
    kh = k.shape[2]
    g = h // kh
    bq = min(Q_BLOCK, t)
    nq = -(-t // bq)
    pad = nq * bq - t
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    pos = jnp.pad(keys.positions, ((0, 0), (0, pad)), constant_values=-1) if pad else keys.positions
    # query blocks [nq, B, K, G*bq, Dh]: rows grouped per kv head, so each block is one batched dot
    qb = jnp.transpose(q.reshape(b, nq, bq, kh, g, dh), (1, 0, 3, 4, 2, 5)).reshape(nq, b, kh, g * bq, dh)
    kn, vn = jnp.swapaxes(k, 1, 2), jnp.transpose(v, (0, 2, 3, 1))  # the cache layouts
    score = lambda qb_, keys_, vis, kp: _block_scores(qb_, keys_, vis, kp, g, scale, softcap, slopes)

    def one_block(args):
        i, qi = args
        carry = (
            jnp.full((b, kh, g * bq), NEG_INF, jnp.float32),
            jnp.zeros((b, kh, g * bq), jnp.float32),
            jnp.zeros((b, kh, g * bq, dh), jnp.float32),
        )
        if keys.width:
            carry = _old_blocks(carry, qi, i, bq, keys, *cache_kv, score)
        _, l, acc = _new_blocks(carry, qi, i, bq, kn, vn, pos, keys.window, score)
        return acc / jnp.maximum(l, 1e-30)[..., None]

    out = lax.map(one_block, (jnp.arange(nq, dtype=jnp.int32), qb))  # [nq, B, K, G*bq, Dh]
    out = jnp.transpose(out.reshape(nq, b, kh, g, bq, dh), (1, 0, 4, 2, 3, 5)).reshape(b, nq * bq, h, dh)
    return out[:, :t].astype(q.dtype)
