"""int8 weights with a scale per group of 32 rows along the input: a GGUF file's Q8_0 blocks as stored.

A Q8_0 block is 32 weights along a row with an f16 scale ``d``: ``w = d * q``, ``q`` int8. Stored as
per-output-channel int8 (``models.quant``'s default) such a matrix is rounded a second time, and a tiny
llama's greedy tokens then differ from transformers' load of the same file; here each group keeps its
own codes and scale, exactly (``quantize_groups`` finds them again from the dequantized values, group by
group, and checks that they give the values back bit for bit), at 8.5 bits a weight as in the file.

Leaves: the weight ``<name>`` as int8 codes, in the int8 panel layout the kernels read (``models.packing``,
``aotlm/kernels/group8.h``) or row-major where a shape does not pack; its scales ``<name>_scale`` f16
``[G, 1, *Nd]`` (``G = K / 32``; ``quant4``'s scale-leaf layout, so sharding and padding treat them
alike). The dtypes tell them apart from per-channel int8 (f32 scales ``[*Nd]``) and from 4-bit codes
(uint8).

The math: each row of x is rounded to int16 (scale ``max|x| / 32767``, a relative error <= 1.5e-5 of
the row's largest value, as the per-channel int8 kernel rounds it) and multiplied with the codes in
integers, the scales applied per group: the CPU kernel (``aotlm_wmm_q4`` with int8 codes) for any
number of rows, else XLA's dot of ``round_x`` and ``dequantize``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from aotlm import kernels
from aotlm.models import packing

GROUP = 32  # rows per scale: GGUF Q8_0's block


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


def _codes(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    s32 = s.astype(np.float32)
    inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 != 0)
    return np.clip(np.rint(a * inv), -127, 127).astype(np.int8)


def quantize_groups(w: np.ndarray, contract: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``w`` -> ``(codes int8 of w's shape, scales f16 [G, 1, *Nd])``: per group of 32 contracted rows
    ``s = max|w| / 127`` rounded to f16, ``q = round(w / s)``. A group of a Q8_0 file's values
    (``d * q``, llama.cpp's largest code 127) gets its own ``d`` and codes back; a group that does not
    reproduce its values bit for bit retries with the scale one f16 step either way."""
    nk = len(contract)
    a = _groups(np.asarray(w, np.float32), contract)
    s = (np.max(np.abs(a), axis=1, keepdims=True) / 127.0).astype(np.float16)
    q = _codes(a, s)
    for step in (np.inf, -np.inf):
        bad = ~np.all(q * s.astype(np.float32) == a, axis=1, keepdims=True)
        if not bad.any():
            break
        s2 = np.where(bad, np.nextafter(s, np.float16(step)), s)
        q2 = _codes(a, s2)
        good = bad & np.all(q2 * s2.astype(np.float32) == a, axis=1, keepdims=True)
        s, q = np.where(good, s2, s), np.where(good, q2, q)
    kd_nd = (*(w.shape[c] for c in contract), *(n for i, n in enumerate(w.shape) if i not in contract))
    codes = np.ascontiguousarray(np.moveaxis(q.reshape(kd_nd), tuple(range(nk)), contract))
    return codes, s  # s: [G, 1, *Nd]


def is_int8_groups(w, scale) -> bool:
    """Static: is ``w`` (with ``scale``) an int8 leaf of this module (not per-channel int8)?"""
    return scale is not None and jnp.dtype(w.dtype) == jnp.int8 and jnp.dtype(scale.dtype) == jnp.float16


def dequantize(w, sm, name: str):
    """An int8 leaf (packed or row-major) and its scales -> the f32 matrix ``[*Kd, *Nd]`` (jnp)."""
    logical = packing.unpack(w, name) if packing.is_packed(name, w.ndim) else w
    nk = len(packing.PACK_CONTRACT[name])
    kd, nd = logical.shape[:nk], logical.shape[nk:]
    g = sm.shape[0]
    q = logical.astype(jnp.float32).reshape(g, -1, *nd)
    y = q * sm[:, :1].astype(jnp.float32)
    if sm.shape[1] == 2:
        y = y + sm[:, 1:].astype(jnp.float32)
    return y.reshape(*kd, *nd)


def round_x(x, axes: int):
    """``x`` rounded to int16 per row (its last ``axes`` dims; scale ``max|x| / 32767``) and back to f32:
    what the kernel multiplies."""
    lead = x.shape[: x.ndim - axes]
    xf = x.astype(jnp.float32).reshape(*lead, -1)
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
