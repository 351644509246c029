"""4-bit weights in groups along the input dimension (``quant="int4"``): storage, quantization, math.

A matrix ``W [*Kd, *Nd]`` (contracted dims ``Kd``, flattened to ``K``) is cut into groups of
``group`` rows (32, 64 or 128) along ``K``; each group and output column has an f16 scale ``s``
and, when asymmetric, an f16 minimum ``m``; a weight is a 4-bit code ``q`` in 0..15:

* symmetric (Q4_0's form): ``w = s * (q - 8)``, ``s = a / -8`` with ``a`` the group's value of largest
  magnitude (so ``a`` itself is exact, codes -8..7 used);
* asymmetric (Q4_1's form): ``w = s * q + m``, ``m = min``, ``s = (max - min) / 15``.

Round to nearest, after the scale (and minimum) are rounded to f16, so the codes fit the stored
scale. f16, not f32: a group of 32 then costs 4.5 bits per weight (5 asymmetric) instead of 5 (6), and
GGUF's Q4_0 / Q4_1 blocks (f16 ``d`` / ``m``, 32 rows along the input) map onto it exactly: a GGUF
model's dequantized Q4 values round back to their own codes, checked group by group (``exact``; the
loader's ``ParamRewriter(gguf_blocks=True)``). The loader reads such a file's codes straight from its
blocks (``aotlm.models.codes4``: no dequantize and re-round). Q4_K's sub-blocks (32 rows, scale
``d * sc``, minimum ``-dmin * m``: f16 times 6 bits, exact in f32, not in f16) keep their codes and
their own scales too, exactly (``aotlm.models.kscales``: a uint8 scale leaf); only where a layout
split a block of 256 are the group's scale and minimum rounded to f16 instead: relative <= 2^-11 each.
A file's Q6_K matrices keep their 6-bit codes and scales (groups of 16: ``aotlm.models.k6scales``, the
codes' high bits in the scale leaf), Q5_K ones their 5-bit codes (Q4_K's scales, ``kscales.pack5``),
Q5_0 / Q5_1 ones theirs (f16 scales per 32, ``aotlm.models.q5scales``), else int8 (``models.quant``).

Leaves: the weight ``<name>`` as uint8 codes in the kernels' panel layout (``aotlm/kernels/int4.h``):
``[*Nd[:-1], Nd[-1] // 16, *Kd[:-1], Kd[-1] // 8, 16, 4]``, per block of 8 rows byte ``(c, t)`` holds
rows ``t`` (low nibble) and ``t + 4`` (high) of column ``c`` (``packing.pack_q4``) -- panels of 16
columns as ``models.packing``'s, so every logical dim is kept and a tensor-parallel shard is the
packed form of the logical shard. The scales
``<name>_scale`` are f16 ``[G, S, *Nd]`` (``S`` = 1, or 2: scale then minimum; a Q4_K matrix's: uint8
``[K / 256, 20, *Nd]``, ``kscales``), stored panel-major ``[*Nd[:-1], Nd[-1] // 16, G, S, 16]``
(``packing.pack_scales``); their group axis is
sharded like the weight's first contracted dim. The loader emits the codes one per byte and the scales
in the logical layout (so the mesh's padding / kv-head repeats apply to them unchanged);
``packing.prepare`` packs both always (with or without the kernels).

Which matrices: the ``PACK_CONTRACT`` ones (q/k/v/o, MLP, fused forms, an untied lm_head) and the tied
lm_head's copy ``embed_q [V, D]`` (groups along D), whose shape allows the layout (``packable``);
the embedding lookup stays in the compute dtype, MoE experts and any matrix whose shape does not fit
take int8 (``models.quant``). The math (``dense4``): x rounded to int8 per row and group (``round_x``)
times the dequantized ``s * q + m`` -- the CPU kernel ``aotlm_wmm_q4`` for any number of rows (integer
dot products), else XLA's dot of ``round_x(x)`` and ``dequantize(w)``: the same numbers.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from aotlm import kernels
from aotlm.kernels import layout
from aotlm.kernels.layout import PANEL
from aotlm.models import k6scales, kscales, lowp, packing, q5scales
from aotlm.models.codes4 import along_k, from_k

GROUPS = layout.Q4_GROUPS


def packable(shape: tuple, contract: tuple[int, ...], group: int, vocab: bool = False) -> bool:
    """Can a matrix of ``shape`` (contracted dims ``contract``) be stored as 4-bit groups of ``group``?
    ``vocab``: its output dim is a vocabulary, padded to whole panels later (``packing.pad_vocab``)."""
    kd, nd = packing.split_dims(shape, contract)
    if not kd or not nd:
        return False
    fits = kd[-1] % layout.Q4_ROWS == 0 and (vocab or nd[-1] % PANEL == 0)
    return fits and math.prod(kd) % group == 0 and math.prod(shape) > 0


def quantize_int4(
    w: np.ndarray, contract: tuple[int, ...], group: int, asymmetric: bool, exact: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``w`` -> ``(codes uint8 0..15 of w's shape, scales f16 [G, S, *Nd])`` (module docstring).

    ``exact`` (a GGUF file's Q4_0 / Q4_1 blocks, dequantized by the loader): a group whose round to
    nearest does not give back its values bit for bit retries with the scale one f16 step either way
    -- a block's own ``d`` when ``max - min`` lost a bit in f32 -- so such blocks keep their values
    (``exact_groups`` counts them)."""
    a = along_k(np.asarray(w, np.float32), contract, group)
    if asymmetric:
        lo, hi = a.min(axis=1, keepdims=True), a.max(axis=1, keepdims=True)
        mn = lo.astype(np.float16)
        s = ((hi - mn.astype(np.float32)) / 15.0).astype(np.float16)
    else:
        i = np.argmax(np.abs(a), axis=1)[:, None]
        s, mn = (np.take_along_axis(a, i, axis=1) / -8.0).astype(np.float16), None
    q = _codes(a, s, mn)
    if exact:
        for step in (np.inf, -np.inf):  # the groups not reproduced: the neighbouring f16 scales
            bad = ~np.all(_dequant(q, s, mn) == a, axis=1, keepdims=True)
            if not bad.any():
                break
            s2 = np.where(bad, np.nextafter(s, np.float16(step) * np.sign(s + np.float16(1e-7))), s)
            q2 = _codes(a, s2, mn)
            good = bad & np.all(_dequant(q2, s2, mn) == a, axis=1, keepdims=True)
            s, q = np.where(good, s2, s), np.where(good, q2, q)
    parts = (s, mn) if asymmetric else (s,)
    sm = np.concatenate(parts, axis=1)  # [G, S, *Nd]
    return from_k(q, w.shape, contract), sm


def _codes(a: np.ndarray, s: np.ndarray, mn: np.ndarray | None) -> np.ndarray:
    """Round to nearest codes of groups ``a [G, g, ..]`` for f16 scales ``s`` (and minimums ``mn``)."""
    base, off = (0.0, 8.0) if mn is None else (mn.astype(np.float32), 0.0)
    s32 = s.astype(np.float32)
    inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 != 0)
    q = np.clip(np.rint((a - base) * inv) + off, 0, 15)
    return np.where(s32 != 0, q, off).astype(np.uint8)


def _dequant(q: np.ndarray, s: np.ndarray, mn: np.ndarray | None) -> np.ndarray:
    """``s * q + m`` in f32 (``m = -8 s`` symmetric): the values the codes stand for."""
    s32 = s.astype(np.float32)
    m = -8.0 * s32 if mn is None else mn.astype(np.float32)
    return q.astype(np.float32) * s32 + m


def exact_groups(w: np.ndarray, codes: np.ndarray, sm: np.ndarray, contract: tuple[int, ...]) -> float:
    """The share of groups whose codes and scales give ``w`` back bit for bit (diagnostics, tests)."""
    g = sm.shape[0]
    group = np.asarray(w).size // (g * math.prod(sm.shape[2:]))
    a, q = along_k(np.asarray(w, np.float32), contract, group), along_k(codes, contract, group)
    deq = _dequant(q, sm[:, :1], sm[:, 1:] if sm.shape[1] == 2 else None)
    return float(np.all(deq == a, axis=1).mean())


def logical_dims(name: str, shape: tuple) -> tuple[tuple, tuple]:
    """``(Kd, Nd)`` of a packed 4-bit leaf ``name`` (or of a local shard of one)."""
    return layout.q4_logical_dims(shape, len(packing.PACK_CONTRACT[name]))


def codes(w, name: str):
    """Packed 4-bit leaf -> its codes ``[*Kd, *Nd]`` as f32 (jnp)."""
    kd, nd = logical_dims(name, w.shape)
    nk, nn = len(kd), len(nd)
    a = jnp.stack([w & 15, w >> 4], axis=-1)  # [..N-blocks, ..K-blocks, 16, 4 (t), 2 (half)]
    order = (*range(nn, nn + nk), nn + nk + 2, nn + nk + 1, *range(nn), nn + nk)
    return jnp.transpose(a, order).reshape(*kd, *nd).astype(jnp.float32)


# How x is held per group, by the graph's activations kind (lowp): one int8 part (llama.cpp's rounding);
# "s16" (quant="int4-a16"): 2, one int16 value in two int8 digits, within max|x| / (2 * 32639); "f32"
# (quant="int4-f32a"): three int8 parts, the second and third rounding what the parts before left, so x is
# held within max|x| / (127 * 254^2)
X_PARTS = {None: 1, "s16": 2, "f32": 3}
X16 = 32639  # the largest |x| / scale two int8 digits hold (int4.h, q4x.h)


def round_x(x, group: int, axes: int, top: int = 127):
    """``x`` rounded to integers per row and group of ``group`` contracted entries (scale ``max|x| /
    top``: int8 at 127, the two digits' int16 at ``X16``) and back to f32: what the kernel multiplies
    (``aotlm/kernels/int4.h``)."""
    lead, kd = x.shape[: x.ndim - axes], x.shape[x.ndim - axes :]
    xf = x.astype(jnp.float32).reshape(*lead, -1, group)
    s = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / float(top)
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    return (jnp.clip(jnp.round(xf * inv), -top, top) * s).reshape(*lead, *kd)


def dequantize(w, sm, name: str):
    """Packed 4-bit leaf and its scales -> the f32 matrix ``[*Kd, *Nd]`` (jnp): ``s * q + m`` (XLA's
    path, the same numbers the kernel multiplies)."""
    q = codes(w, name)
    kd, nd = logical_dims(name, w.shape)
    k, n = math.prod(kd), math.prod(nd)
    sm = packing.unpack_scales(sm, len(nd))
    g = k // kernels.q4_group(k, sm, len(nd))  # a clear error if the groups do not tile K
    if k6scales.is_k6(sm):  # a Q6_K matrix's own scales and its codes' high bits
        s, high = k6scales.parts(sm)
        q, s = q + high.reshape(q.shape), s.reshape(g, 1, n)
        m = -32.0 * s
    elif q5scales.is_q5(sm):  # a Q5_0 / Q5_1 matrix's own scales and its codes' high bits
        s, m, high = q5scales.parts(sm)
        q, s, m = q + high.reshape(q.shape), s.reshape(g, 1, n), m.reshape(g, 1, n)
    elif kscales.is_kform(sm) or kscales.is_k5(sm):  # a Q4_K / Q5_K matrix's own scales
        s, m = (a.reshape(g, 1, n) for a in kscales.parts(sm))
        q = q + kscales.high5(sm).reshape(q.shape) if kscales.is_k5(sm) else q
    else:
        s = sm[:, 0].astype(jnp.float32).reshape(g, 1, n)
        m = sm[:, 1].astype(jnp.float32).reshape(g, 1, n) if sm.shape[1] == 2 else -8.0 * s
    return (q.reshape(g, k // g, n) * s + m).reshape(*kd, *nd)


def is_int4(w, scale) -> bool:
    """Static: is ``w`` (with ``scale``) a 4-bit leaf of this module?"""
    return scale is not None and jnp.dtype(w.dtype) == jnp.uint8


def dense4(x, w, sm, axes: int, name: str, b=None, act: str | None = None):
    """``x [..., *Kd] @ W`` (f32 accumulation, ``x``'s dtype) for a 4-bit leaf ``name``: the kernel, or
    XLA's dot of ``dequantize`` (kernels off / another backend). ``b`` / ``act`` (a ``kernels.GEMM_ACTS``
    name): only where ``kernels.q4_fuses`` says so, added / applied in the kernel's output pass."""
    pk = packing.packed_k(name, w.ndim)
    if pk is None:
        raise ValueError(f"4-bit leaf {name} of shape {w.shape} is not in the panel layout")
    nt, parts = name == "embed_q", X_PARTS.get(lowp.kind(), 1)
    if kernels.q4_supported(x, name):
        return kernels.matmul_q4(x, w, sm, axes, name, packed_k=pk, nt=nt, b=b, act=act, parts=parts)
    wl = dequantize(w, sm, name)
    g = kernels.q4_group(math.prod(wl.shape[:axes]), sm, wl.ndim - axes)
    xr = round_x(x, g, axes, X16 if parts == 2 else 127)
    left, part = x.astype(jnp.float32), xr
    for _ in range(parts - 1 if parts == 3 else 0):  # each part rounds what the ones before left (kernel's)
        left = left - part
        part = round_x(left, g, axes)
        xr = xr + part
    y = jnp.tensordot(xr, wl, axes=axes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
