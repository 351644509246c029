"""Attention products on the kernels: a prompt's causal attention (``attn.h``), one decode step's
attention over the KV cache (``dattn.h``) and the batched dots of speculative checks (``bdot.h``).
One device only: under tensor parallelism XLA's einsum keeps its own partitioning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from aotlm.kernels import build as kernels
from aotlm.kernels.context import one_device


def attention_ok(t: int) -> bool:
    """Static check: can decode attention with ``t`` query tokens use ``bdot`` in this trace?

    Only on one device (under tensor parallelism XLA's einsum keeps its own partitioning) and
    for few query tokens (decode steps, speculative checks); prefill stays on XLA's dot.
    """
    return 1 <= t <= kernels.MAX_ROWS and kernels.enabled() and one_device()


def decode_attention_ok(q) -> bool:
    """Static check: can ``q [B,1,H,Dh]`` (one query token per row) attend with ``decode_attention``
    (kernels on, one device)?"""
    return q.ndim == 4 and q.shape[1] == 1 and kernels.enabled() and one_device()


def causal_attention_ok(x) -> bool:
    """Static check: can a prefill call whose activations are ``x [B,T,...]`` attend over its own
    tokens with ``causal_attention``? More than ``MAX_ROWS`` query tokens (decode keeps ``bdot``),
    f32, one device (under tensor parallelism XLA's einsum keeps its own partitioning)."""
    f32 = jnp.dtype(x.dtype) == jnp.float32
    return x.shape[1] > kernels.MAX_ROWS and f32 and kernels.enabled() and one_device()


def causal_attention(q, k, v, mask, scale: float):
    """Softmax attention of ``q [B,T,H,Dh]`` over the call's own ``k, v [B,T,K,Dh]`` (``H`` a
    multiple of ``K``) with ``mask [B,T,T]`` (bool, causal: ``j <= i`` only is computed), scores
    ``scale * q.k`` in f32; a query row with no visible key gives zeros (``attn.h``). ``k`` and
    ``v`` None: ``q`` is the fused projection ``[B,T,K,G+2,Dh]`` (per kv head its ``G`` query heads,
    then k and v), read in place. Returns ``(o [B,T,H,Dh], k [B,K,T,Dh], v [B,K,Dh,T])``: k and v
    also in the KV cache's layouts."""
    kernels.ensure_registered()
    if k is None:
        b, t, kh, g2, dh = q.shape
        h, empty = kh * (g2 - 2), jnp.zeros((0,), jnp.float32)
        k = v = empty
    else:
        b, t, h, dh = q.shape
        kh = k.shape[2]
    out = (
        jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, t, dh), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, dh, t), jnp.float32),
    )
    return jax.ffi.ffi_call("aotlm_attn", out)(q, k, v, mask.astype(jnp.bool_), scale=np.float32(scale))


def bdot(a, b, n: int, n_limit=None, l_limit=None):
    """``c[i, m, j] = sum_l a[i, m, l] * b[i, j, l]`` for ``j < n``, ``l < a.shape[2]`` (f32).

    ``b [IB >= I, NB >= n, LB >= L]`` may be a whole KV cache: only its leading blocks are read
    (a decode call over the first rows of a serving batch passes the whole cache). ``b`` is
    f32, bf16, f16, or uint16 holding bf16 bits (how CPU models store a bf16 cache); converted in
    registers, accumulated in f32.
    ``n_limit`` / ``l_limit`` (traced ints, scalars or one per row ``i`` ``[I]``): only
    ``j < n_limit`` (other outputs are 0) and ``l < l_limit`` are computed -- the cache slots
    written so far (per row: each serving row reads its own slots, not the longest row's).
    """
    kernels.ensure_registered()
    big = jnp.iinfo(jnp.int32).max
    lims = [jnp.asarray(big if v is None else v, jnp.int32) for v in (n_limit, l_limit)]
    if any(v.ndim for v in lims):  # one (n, l) pair per row
        lims = [jnp.broadcast_to(v, (a.shape[0],)) for v in lims]
    lim = jnp.stack(lims, axis=-1)
    out = jax.ShapeDtypeStruct((a.shape[0], a.shape[1], n), jnp.float32)
    return jax.ffi.ffi_call("aotlm_bdot", out)(a, b, lim)


def decode_attention(q, keys, values, k_new, v_new, mask, limit, scale: float):
    """One decode step's attention in one call (``dattn.h``): ``q [I, G, Dh]`` (``I = B * Kh``: row
    ``i // Kh``, kv head ``i % Kh``) over cache slots ``j < limit[i]`` of ``keys [IB >= I, S, Dh]`` /
    ``values [IB, Dh, S]`` that ``mask [B, W + 1]`` shows (its last column: the row's own token,
    ``k_new`` / ``v_new [I, Dh]``), softmax of ``scale * q . k`` over them. Returns ``[I, G, Dh]``
    f32; a row that sees nothing gets zeros. The cache is read in place (f32, bf16, its bits as
    uint16, f16)."""
    kernels.ensure_registered()
    f32 = lambda x: x.astype(jnp.float32)
    lim = jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (q.shape[0],))
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("aotlm_dattn", out)(
        f32(q), keys, values, f32(k_new), f32(v_new), mask.astype(jnp.bool_), lim, scale=np.float32(scale)
    )
