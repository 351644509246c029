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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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

    def planes(v: np.ndarray) -> np.ndarray:  # f16 -> [blocks, 2, *Nd] (low byte, high byte)
        u = np.asarray(v, np.float16).view(np.uint16)
        return np.stack([u & 0xFF, u >> 8], axis=1).astype(np.uint8)

    grouped = lambda a: np.asarray(a, np.uint8).reshape(blocks, 8, *nd)  # noqa: E731
    return np.ascontiguousarray(
        np.concatenate([grouped(sc), grouped(mb), planes(d), planes(-np.asarray(dmin))], 1)
    )


def to_groups(leaf: np.ndarray) -> np.ndarray:
    """The leaf -> ``quant4``'s f16 form ``[K / 32, 2, *Nd]`` (scale, minimum each rounded to f16): for a
    tensor-parallel shard that would split a block of 256."""
    s, m = (np.asarray(a) for a in parts(jnp.asarray(leaf)))  # small: one pass through XLA's decoding
    return np.stack([s, m], axis=1).astype(np.float16)


def _f16(lo, hi):
    """Two byte planes -> f16 values (jnp)."""
    u = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def parts(leaf) -> tuple:
    """The leaf -> ``(scale, minimum)``, float32 ``[K / 32, *Nd]`` each (jnp): ``d * sc``, ``-dmin * mb``."""
    blocks, nd = leaf.shape[0], leaf.shape[2:]
    d, nmin = _f16(leaf[:, 16], leaf[:, 17]), _f16(leaf[:, 18], leaf[:, 19])
    s = leaf[:, 0:8].astype(jnp.float32) * d[:, None]
    m = leaf[:, 8:16].astype(jnp.float32) * nmin[:, None]
    return s.reshape(blocks * 8, *nd), m.reshape(blocks * 8, *nd)


def is_kform(sm) -> bool:
    """Static: is a logical 4-bit scale leaf in this form (not ``quant4``'s f16 one, nor Q6_K's
    ``k6scales``)?"""
    return jnp.dtype(sm.dtype) == jnp.uint8 and sm.shape[1] == ROWS
