"""A GGUF Q4_K matrix's own scales, kept for its 4-bit codes (the "K form" of a 4-bit scale leaf).

Q4_K cuts a row into blocks of 256 weights with an f16 scale ``d`` and minimum ``dmin``, and each
block into 8 groups of 32 with 6-bit integers ``sc`` and ``mb``: a weight is ``(d * sc) * q - (dmin *
mb)`` (gguf-py's order, exact in float32). ``aotlm.models.quant4``'s f16 scale and minimum per group
round ``d * sc`` (17 significant bits) to f16 and cost 1 bit a weight; this form keeps the file's
numbers, exactly, in 0.625 bits a weight.

Leaf ``<name>_scale``: uint8 ``[K / 256, 20, *Nd]`` (the f16 form is ``[K / 32, S, *Nd]``; the dtype
tells them apart). Per block of 256 contracted rows and output column: rows 0-7 ``sc`` of its 8
groups, rows 8-15 ``mb``, rows 16 / 17 the low / high byte of ``d``, rows 18 / 19 those of ``-dmin``
(f16). Its block axis is sharded like the weight's first contracted dim (a shard keeps whole blocks).
Stored panel-major beside the packed codes (``packing.pack_scales``: ``[*Nd[:-1], Nd[-1] // 16, K / 256,
20, 16]``), which the kernel ``aotlm_wmm_q4`` reads (``aotlm/kernels/int4.h``); XLA's path through
:func:`parts` of the logical leaf.

Q5_K has Q4_K's scales and 5-bit codes: its leaf (:func:`pack5`) is ``[K / 256, 52, *Nd]``, the 20 rows
above, then the codes' high bits (the weight leaf holds their low 4 bits): per block ``j`` of 8 rows, row
``20 + j`` of a panel (16 output columns) is 16 bytes whose byte ``i`` holds lane ``i + 16 m`` of the
block's 64 in bits ``2m`` (row ``8j + t``) and ``2m + 1`` (row ``8j + 4 + t``), lane ``4c + t`` being
column ``c``: one 16-byte load, broadcast and shifted per 128-bit lane, puts them over the kernel's lanes.
Those bytes mix the columns of a panel, so the output dims split only into whole panels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from aotlm.kernels.layout import K5_ROWS, PANEL

ROWS = 20  # sc x 8, mb x 8, d (2 bytes), -dmin (2 bytes)
BLOCK = 256  # contracted rows per block
GROUP = 32  # rows per sub-block


def pack(sc: np.ndarray, mb: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """``sc`` / ``mb`` (integers 0..63, ``[K / 32, *Nd]``) and ``d`` / ``dmin`` (f16 values, ``[K / 256,
    *Nd]``) -> the leaf ``[K / 256, 20, *Nd]`` uint8."""
    blocks, nd = d.shape[0], d.shape[1:]
    if sc.shape != (blocks * 8, *nd) or mb.shape != sc.shape or dmin.shape != d.shape:
        raise ValueError(
            f"Q4_K scales of shapes {sc.shape} / {mb.shape} / {d.shape} / {dmin.shape} do not fit"
        )
    grouped = lambda a: np.asarray(a, np.uint8).reshape(blocks, 8, *nd)  # noqa: E731
    return np.ascontiguousarray(
        np.concatenate([grouped(sc), grouped(mb), byte_planes(d), byte_planes(-np.asarray(dmin))], 1)
    )


def byte_planes(v: np.ndarray) -> np.ndarray:
    """f16 values ``[G, *Nd]`` -> their low and high bytes as two rows, uint8 ``[G, 2, *Nd]`` (the scale
    leaves' f16 fields, one byte per column)."""
    u = np.asarray(v, np.float16).view(np.uint16)
    return np.stack([u & 0xFF, u >> 8], axis=1).astype(np.uint8)


def from_planes(lo, hi):
    """Two byte planes (jnp, ``byte_planes``' rows) -> the f16 values as float32."""
    u = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def pack5(codes: np.ndarray, leaf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_K: 5-bit ``codes`` (0..31, ``[K, *Nd]``) and their scales' leaf (``pack``) -> ``(low 4 bits
    uint8 [K, *Nd], leaf uint8 [K / 256, 52, *Nd]``)."""
    k, nd, blocks = codes.shape[0], codes.shape[1:], leaf.shape[0]
    if k != blocks * BLOCK or leaf.shape != (blocks, ROWS, *nd) or nd[-1] % PANEL:
        raise ValueError(f"Q5_K codes {codes.shape} and scales {leaf.shape} do not fit")
    out = np.concatenate([leaf, high_plane(codes, BLOCK)], axis=1)
    return np.ascontiguousarray(codes & np.uint8(15)), np.ascontiguousarray(out)


def high_plane(codes: np.ndarray, rows: int) -> np.ndarray:
    """5-bit ``codes`` ``[K, *Nd]`` -> their high bits as the kernel reads them, ``[K / rows, rows / 8,
    *Nd]`` uint8 (module docstring: per block ``j`` of 8 rows, 16 bytes a panel)."""
    k, nd = codes.shape[0], codes.shape[1:]
    n, per = math.prod(nd), rows // 8
    high = (np.asarray(codes, np.uint8) >> 4).reshape(k // rows, per, 2, 4, n // PANEL, PANEL)
    two = high[:, :, 0] | (high[:, :, 1] << 1)  # [blocks, j, t, panel, c]: a lane's two rows
    lanes = two.transpose(0, 1, 3, 4, 2).reshape(k // rows, per, n // PANEL, 4, 16)  # lane 16 m + i
    plane = lanes[..., 0, :] | (lanes[..., 1, :] << 2) | (lanes[..., 2, :] << 4) | (lanes[..., 3, :] << 6)
    return plane.reshape(k // rows, per, *nd)


def high5(leaf):
    """A Q5_K leaf (jnp) -> its codes' high bits times 16, float32 ``[K, *Nd]``."""
    return high_bits(leaf[:, ROWS:])


def high_bits(plane):
    """``high_plane``'s bytes ``[K / rows, rows / 8, *Nd]`` (jnp) -> the high bits times 16, float32 ``[K,
    *Nd]``."""
    blocks, per, nd = plane.shape[0], plane.shape[1], plane.shape[2:]
    n = math.prod(nd)
    plane = plane.reshape(blocks, per, n // PANEL, 1, 16)
    lanes = (plane >> (2 * jnp.arange(4, dtype=jnp.uint8)).reshape(1, 1, 1, 4, 1)) & 3
    lanes = lanes.reshape(blocks, per, n // PANEL, PANEL, 4)  # [blocks, j, panel, c, t]
    two = jnp.stack([lanes & 1, lanes >> 1], axis=-1)  # [.., t, half]
    high = two.transpose(0, 1, 5, 4, 2, 3).reshape(blocks * per * 8, *nd)
    return high.astype(jnp.float32) * 16.0


def to_groups(leaf: np.ndarray) -> np.ndarray:
    """The leaf -> ``quant4``'s f16 form ``[K / 32, 2, *Nd]`` (scale, minimum each rounded to f16): for a
    tensor-parallel shard that would split a block of 256."""
    s, m = (np.asarray(a) for a in parts(jnp.asarray(leaf)))  # small: one pass through XLA's decoding
    return np.stack([s, m], axis=1).astype(np.float16)


def parts(leaf) -> tuple:
    """The leaf -> ``(scale, minimum)``, float32 ``[K / 32, *Nd]`` each (jnp): ``d * sc``, ``-dmin * mb``."""
    blocks, nd = leaf.shape[0], leaf.shape[2:]
    d, nmin = from_planes(leaf[:, 16], leaf[:, 17]), from_planes(leaf[:, 18], leaf[:, 19])
    s = leaf[:, 0:8].astype(jnp.float32) * d[:, None]
    m = leaf[:, 8:16].astype(jnp.float32) * nmin[:, None]
    return s.reshape(blocks * 8, *nd), m.reshape(blocks * 8, *nd)


def is_kform(sm) -> bool:
    """Static: is a logical 4-bit scale leaf in this form (not ``quant4``'s f16 one, nor Q5_K's or Q6_K's
    ``k6scales``)?"""
    return jnp.dtype(sm.dtype) == jnp.uint8 and sm.shape[1] == ROWS


def is_k5(sm) -> bool:
    """Static: is a logical scale leaf a Q5_K one (``pack5``)?"""
    return jnp.dtype(sm.dtype) == jnp.uint8 and sm.shape[1] == K5_ROWS
