"""Symmetric rounding to a narrow type with one scale per slice, shared by the int8 and fp8 storages.

``per_channel`` (host, while loading: a weight's output channels, ``models/quant.py``,
``models/quant_fp8.py``) and ``per_row`` (in the graph: activation rows, ``models/lowp.py``,
``quant_fp8``) both take ``s = max|v| / top`` over the slice and store ``v / s`` clipped to ``+-top``:
rounded to nearest by ``np.rint`` / ``jnp.round`` for an integer type, by the cast itself (round to
nearest even) for a float one (e4m3).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def per_channel(w, contract: tuple[int, ...], top: float, dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(q of w's shape in dtype, s float32 of w's shape without the contract axes)``, ``q * s ~ w``,
    ``s = max|w| / top`` over the ``contract`` axes; an all-zero channel (e.g. tp padding) gets scale 0."""
    w = np.asarray(w, np.float32)
    integer = np.issubdtype(np.dtype(dtype), np.integer)
    # max|w| without a full-size |w|; then rounded a few rows at a time in cache (2.5-3x faster on a 1B
    # model's matrices than whole-array temporaries, the same numbers)
    hi, lo = np.max(w, axis=contract, keepdims=True), np.min(w, axis=contract, keepdims=True)
    scale = np.abs(np.maximum(hi, -lo)) / np.float32(top)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    if w.ndim == 0:
        t = w / safe
        return np.clip(np.rint(t) if integer else t, -top, top).astype(dtype), scale.astype(np.float32)
    q = np.empty(w.shape, dtype)
    step = max(1, (1 << 16) // max(1, w[0].size))
    for i in range(0, w.shape[0], step):
        t = np.divide(w[i : i + step], safe if safe.shape[0] == 1 else safe[i : i + step])
        t = np.rint(t, out=t) if integer else t
        q[i : i + step] = np.clip(t, -top, top, out=t).astype(dtype)
    return q, np.squeeze(scale, axis=contract).astype(np.float32)


def per_row(x, axes: int, top: float, dtype):
    """Each row of ``x [..., *K]`` (its last ``axes`` dims) in ``dtype`` with scale ``max|x| / top`` (1 for
    an all-zero row), computed in the graph: ``(q [..., *K], s [...] f32)``, ``q * s ~ x``."""
    xf = x.astype(jnp.float32)
    red = tuple(range(x.ndim - axes, x.ndim))
    amax = jnp.max(jnp.abs(xf), axis=red)
    s = jnp.where(amax > 0, amax / top, 1.0)
    t = xf / s.reshape(*s.shape, *(1,) * axes)
    t = jnp.round(t) if jnp.issubdtype(dtype, jnp.integer) else t
    return jnp.clip(t, -top, top).astype(dtype), s
