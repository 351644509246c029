"""A GGUF Q6_K matrix kept as stored: its 6-bit codes' high bits and its own scales in one leaf (the "K6
form" of a 4-bit scale leaf).

Q6_K cuts a row into blocks of 256 weights with an f16 scale ``d``, and each block into 16 groups of 16
with an int8 ``sc``: a weight is ``(d * sc) * (q - 32)``, ``q`` a 6-bit code (gguf-py's order, exact in
float32). The weight leaf holds the low 4 bits of each code as any 4-bit leaf (``quant4``, the kernels'
panels); the scale leaf ``<name>_scale`` is uint8 ``[K / 256, 82, *Nd]``, per block of 256 contracted
rows: rows 0-15 the groups' ``sc`` (int8 bits), rows 16 / 17 the low / high byte of ``d``, rows 18-81 the
codes' high 2 bits in the order the kernel reads them (``aotlm/kernels/int4.h``): per block ``j`` of 8
rows, rows ``18 + 2j`` and ``19 + 2j`` of a panel (16 output columns) are 32 bytes whose byte ``i`` holds
lane ``i`` of the block's 64 in its low nibble and lane ``i + 32`` in its high one; lane ``4c + t`` is
column ``c``'s rows ``8j + t`` (bits 0-1) and ``8j + 4 + t`` (bits 2-3). Those bytes mix the columns of
one panel, so the leaf's output dims split only into whole panels (as the weight's do); its block axis
is sharded like the weight's first contracted dim (a shard keeps whole blocks). 6.5625 bits a weight in
all, as the file. Stored panel-major like the other scale leaves (``packing.pack_scales``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from aotlm.kernels.layout import K6_ROWS, PANEL
from aotlm.models import kscales

ROWS = K6_ROWS  # sc x 16, d (2 bytes), high bits x 64
BLOCK = 256  # contracted rows per block
GROUP = 16  # rows per sub-block
PLANE = 18  # first row of the high bits


def pack(codes: np.ndarray, sc: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit ``codes`` (0..63, ``[K, *Nd]``), ``sc`` (int8, ``[K / 16, *Nd]``), ``d`` (f16, ``[K / 256,
    *Nd]``) -> ``(low 4 bits uint8 [K, *Nd], leaf uint8 [K / 256, 82, *Nd])``."""
    k, nd = codes.shape[0], codes.shape[1:]
    blocks, n = d.shape[0], math.prod(nd)
    if k != blocks * BLOCK or sc.shape != (blocks * 16, *nd) or d.shape[1:] != nd or nd[-1] % PANEL:
        raise ValueError(f"Q6_K codes {codes.shape}, scales {sc.shape} / {d.shape} do not fit")
    high = (np.asarray(codes, np.uint8) >> 4).reshape(blocks, 32, 2, 4, n // PANEL, PANEL)
    nib = high[:, :, 0] | (high[:, :, 1] << 2)  # [blocks, j, t, panel, c]: a lane's two rows
    lanes = nib.transpose(0, 1, 3, 4, 2).reshape(blocks, 32, n // PANEL, 2, 32)  # lane 4c + t, split
    plane = (lanes[..., 0, :] | (lanes[..., 1, :] << 4)).reshape(blocks, 32, n // PANEL, 2, PANEL)
    plane = plane.transpose(0, 1, 3, 2, 4).reshape(blocks, 64, *nd)
    dbytes = kscales.byte_planes(d)
    scs = np.asarray(sc, np.int8).view(np.uint8).reshape(blocks, 16, *nd)
    leaf = np.ascontiguousarray(np.concatenate([scs, dbytes, plane], axis=1))
    return np.ascontiguousarray(codes & np.uint8(15)), leaf


def parts(leaf) -> tuple:
    """The leaf (jnp) -> ``(scale float32 [K / 16, *Nd], high bits float32 [K, *Nd] (0..3) * 16)``."""
    blocks, nd = leaf.shape[0], leaf.shape[2:]
    n = math.prod(nd)
    d = kscales.from_planes(leaf[:, 16], leaf[:, 17])
    sc = jax.lax.bitcast_convert_type(leaf[:, :16], jnp.int8).astype(jnp.float32)
    s = (sc * d[:, None]).reshape(blocks * 16, *nd)
    plane = leaf[:, PLANE:].reshape(blocks, 32, 2, n // PANEL, PANEL).transpose(0, 1, 3, 2, 4)
    plane = plane.reshape(blocks, 32, n // PANEL, 32)
    lanes = jnp.concatenate([plane & 15, plane >> 4], axis=-1).reshape(blocks, 32, n // PANEL, PANEL, 4)
    two = jnp.stack([lanes & 3, lanes >> 2], axis=-1)  # [blocks, j, panel, c, t, half]
    high = two.transpose(0, 1, 5, 4, 2, 3).reshape(blocks * BLOCK, *nd)
    return s, high.astype(jnp.float32) * 16.0


def is_k6(sm) -> bool:
    """Static: is a logical 4-bit scale leaf in this form?"""
    return jnp.dtype(sm.dtype) == jnp.uint8 and sm.shape[1] == ROWS
