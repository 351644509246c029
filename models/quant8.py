"""int8 weights with a scale per group of 32 rows along the input: a GGUF file's Q8_0 (Q5_0, Q5_1) blocks
as stored.

A Q8_0 block is 32 weights along a row with an f16 scale ``d``: ``w = d * q``, ``q`` int8 (Q5_0: 5-bit
``q - 16``; Q5_1: ``d * q + m`` with an f16 minimum). Stored as per-output-channel int8
(``models.quant``'s default) such a matrix is rounded a second time, and a tiny llama's greedy tokens
then differ from transformers' load of the same file; here each group keeps its own codes, scale (and
minimum), exactly (``quantize_groups`` finds them again from the dequantized values, group by group, and
checks that they give the values back bit for bit), at 8.5 bits a weight (9 with a minimum).

Leaves: the weight ``<name>`` as int8 codes, in the int8 panel layout the kernels read
(``models.packing``, ``aotlm/kernels/group8.h``) or row-major where a shape does not pack; its scales
``<name>_scale`` f16 ``[G, S, *Nd]`` (``G = K / 32``, S = 2 with minimums; ``quant4``'s scale-leaf
layout, so sharding and padding treat them alike), panel-major beside a packed weight
(``packing.pack_scales``). The dtypes tell them apart from per-channel int8
(f32 scales ``[*Nd]``) and from 4-bit codes (uint8).

The math: each row of x is rounded to int16 per group of 32 (scale ``max|x| / 32767``, an error <=
1.5e-5 of the group's largest value) and multiplied with the codes in integers, the scales applied per
group: the CPU kernel (``aotlm_wmm_q4`` with int8 codes) for any number of rows, else XLA's dot of
``round_x`` and ``dequantize``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from aotlm import kernels
from aotlm.models import packing

GROUP = 32  # rows per scale: GGUF Q8_0's block
# GGUF block types of 32 rows kept this way: (largest |code| of a symmetric block, or the largest code of
# one with a minimum; whether it has one). Q8_0: d q, q in -127..127; Q5_0: d (q - 16), the block's
# extreme weight at code 0 (llama.cpp), so |q - 16| reaches 16; Q5_1: d q + m, q in 0..31.
TYPES = {"Q8_0": (127, False), "Q5_0": (16, False), "Q5_1": (31, True)}


def scale_rows(qtype: str | None) -> int:
    """Rows per group of a ``TYPES`` block's scale leaf (1, or 2 with a minimum); 0 for any other type."""
    kind = TYPES.get(qtype) if qtype else None
    return 1 + kind[1] if kind else 0


def packable(shape: tuple, contract: tuple[int, ...], vocab: bool = False) -> bool:
    """Can a matrix of ``shape`` (contracted dims ``contract``) be stored as int8 groups of 32 in panels?
    ``vocab``: its output dim is a vocabulary, padded to whole panels later (``packing.pad_vocab``)."""
    kd, nd = packing.split_dims(shape, contract)
    if not kd or not nd or math.prod(shape) == 0:
        return False
    return kd[-1] % 2 == 0 and (vocab or nd[-1] % 16 == 0) and math.prod(kd) % GROUP == 0


def _groups(w: np.ndarray, contract: tuple[int, ...]) -> np.ndarray:
    """``w`` as ``[G, 32, *Nd]`` along its contracted dims (moved first, flattened)."""
    nk = len(contract)
    a = np.moveaxis(np.asarray(w), contract, tuple(range(nk)))
    return a.reshape(math.prod(a.shape[:nk]) // GROUP, GROUP, *a.shape[nk:])


def _codes(a: np.ndarray, s: np.ndarray, mn: np.ndarray | None) -> np.ndarray:
    s32 = s.astype(np.float32)
    inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 != 0)
    base = 0.0 if mn is None else mn.astype(np.float32)
    return np.clip(np.rint((a - base) * inv), -128, 127).astype(np.int8)


def _values(q: np.ndarray, s: np.ndarray, mn: np.ndarray | None) -> np.ndarray:
    """``s * q (+ m)`` in f32, as gguf-py dequantizes a block and the kernel multiplies."""
    v = q * s.astype(np.float32)
    return v if mn is None else v + mn.astype(np.float32)


def quantize_groups(
    w: np.ndarray, contract: tuple[int, ...], levels: int = 127, minimum: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``w`` -> ``(codes int8 of w's shape, scales f16 [G, S, *Nd])``: per group of 32 contracted rows
    ``s = max|w| / levels`` rounded to f16, ``q = round(w / s)`` (``minimum``: ``m = min(w)`` in f16,
    ``s = (max(w) - m) / levels``, ``q = round((w - m) / s)``; S = 2). A group of a GGUF file's values
    (``TYPES``: Q8_0 with 127, Q5_0 16, Q5_1 31 and a minimum) gets its own scale, minimum and codes
    back; a group that does not reproduce its values bit for bit retries with the scale one f16 step
    either way."""
    nk = len(contract)
    a = _groups(np.asarray(w, np.float32), contract)
    if minimum:
        mn = np.min(a, axis=1, keepdims=True).astype(np.float16)
        s = ((np.max(a, axis=1, keepdims=True) - mn.astype(np.float32)) / levels).astype(np.float16)
    else:
        mn, s = None, (np.max(np.abs(a), axis=1, keepdims=True) / levels).astype(np.float16)
    q = _codes(a, s, mn)
    for step in (np.inf, -np.inf):
        bad = ~np.all(_values(q, s, mn) == a, axis=1, keepdims=True)
        if not bad.any():
            break
        s2 = np.where(bad, np.nextafter(s, np.float16(step)), s)
        q2 = _codes(a, s2, mn)
        good = bad & np.all(_values(q2, s2, mn) == a, axis=1, keepdims=True)
        s, q = np.where(good, s2, s), np.where(good, q2, q)
    kd_nd = (*(w.shape[c] for c in contract), *(n for i, n in enumerate(w.shape) if i not in contract))
    codes = np.ascontiguousarray(np.moveaxis(q.reshape(kd_nd), tuple(range(nk)), contract))
    return codes, (s if mn is None else np.concatenate([s, mn], axis=1))  # [G, S, *Nd]


def is_int8_groups(w, scale) -> bool:
    """Static: is ``w`` (with ``scale``) an int8 leaf of this module (not per-channel int8)?"""
    return scale is not None and jnp.dtype(w.dtype) == jnp.int8 and jnp.dtype(scale.dtype) == jnp.float16


def dequantize(w, sm, name: str):
    """An int8 leaf (packed or row-major) and its scales -> the f32 matrix ``[*Kd, *Nd]`` (jnp)."""
    logical = packing.unpack(w, name) if packing.is_packed(name, w.ndim) else w
    nk = len(packing.PACK_CONTRACT[name])
    kd, nd = logical.shape[:nk], logical.shape[nk:]
    sm = packing.unpack_scales(sm, len(nd))
    g = sm.shape[0]
    q = logical.astype(jnp.float32).reshape(g, -1, *nd)
    y = q * sm[:, :1].astype(jnp.float32)
    if sm.shape[1] == 2:
        y = y + sm[:, 1:].astype(jnp.float32)
    return y.reshape(*kd, *nd)


def round_x(x, axes: int):
    """``x`` rounded to int16 per row (its last ``axes`` dims) and group of 32 (scale ``max|x| / 32767``)
    and back to f32: what the kernel multiplies."""
    lead = x.shape[: x.ndim - axes]
    xf = x.astype(jnp.float32).reshape(*lead, -1, GROUP)
    s = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 32767.0
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    return (jnp.round(xf * inv) * s).reshape(x.shape)


def dense8(x, w, sm, axes: int, name: str, b=None, act: str | None = None):
    """``x [..., *Kd] @ W`` (f32 accumulation, ``x``'s dtype) for an int8 group leaf ``name``: the kernel
    on a packed leaf, else XLA's dot of ``round_x`` and ``dequantize``. ``b`` / ``act`` (a
    ``kernels.GEMM_ACTS`` name): only where ``kernels.q4_fuses`` says so, in the kernel's output pass."""
    pk = packing.packed_k(name, w.ndim)
    if pk and kernels.q4_supported(x, name):
        nt = name == "embed_q"
        return kernels.matmul_q4(x, w, sm, axes, name, packed_k=pk, nt=nt, b=b, act=act)
    wl = dequantize(w, sm, name)
    return jnp.tensordot(round_x(x, axes), wl, axes=axes, preferred_element_type=jnp.float32).astype(x.dtype)
