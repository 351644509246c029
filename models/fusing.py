"""Fused projections' host-side layouts (``quant.ParamRewriter``'s ``fuse_qkv``, ``core.sharding``'s
replicated kv heads): q / k / v heads grouped per kv head."""

from __future__ import annotations

import numpy as np


def fuse_qkv_heads(q: np.ndarray, k: np.ndarray, v: np.ndarray, head_axis: int) -> np.ndarray:
    """``q [.., H, Dh]``, ``k/v [.., K, Dh]`` (heads at ``head_axis``) -> ``[.., K, H/K + 2, Dh]``.

    Query head ``h`` reads kv head ``h // (H/K)`` (transformers' ``repeat_kv``), so group ``k``
    holds query heads ``k*G .. k*G+G-1`` and then kv head ``k``'s key and value.
    """
    n_kv = k.shape[head_axis]
    g = q.shape[head_axis] // n_kv
    qg = q.reshape(*q.shape[:head_axis], n_kv, g, *q.shape[head_axis + 1 :])
    kv = [np.expand_dims(a, head_axis + 1) for a in (k, v)]
    return np.ascontiguousarray(np.concatenate([qg, *kv], axis=head_axis + 1))


def regroup_qkv(fused: np.ndarray, kv_axis: int, r: int) -> np.ndarray:
    """Repeat every kv head of a fused ``[.., K, G+2, Dh]`` ``r`` times -> ``[.., K*r, G/r+2, Dh]``.

    The fused form of ``replicated-heads`` (``aotlm.core.sharding``): new group ``k*r + j`` holds
    query heads ``(k*r + j)*G/r ..`` and a copy of kv head ``k``.
    """
    if r == 1:
        return fused
    g = fused.shape[kv_axis + 1] - 2
    if g % r:
        raise ValueError(f"cannot regroup {g} query heads per kv head into {r} replicas")
    take = lambda sl: fused[(slice(None),) * (kv_axis + 1) + (sl,)]
    q = take(slice(0, g))
    q = q.reshape(*q.shape[:kv_axis], q.shape[kv_axis] * r, g // r, *q.shape[kv_axis + 2 :])
    k, v = (np.repeat(take(slice(i, i + 1)), r, axis=kv_axis) for i in (g, g + 1))
    return np.ascontiguousarray(np.concatenate([q, k, v], axis=kv_axis + 1))
