"""A GGUF Q5_0 / Q5_1 matrix kept as stored: its 5-bit codes' high bits and its own f16 scales (and
minimums) in one leaf (the "Q5 form" of a 4-bit scale leaf).

Q5_0 cuts a row into blocks of 32 weights with an f16 ``d``: a weight is ``d * (q - 16)``; Q5_1 adds an
f16 ``m``: ``d * q + m`` (``q`` a 5-bit code; gguf-py's order, exact in float32). The weight leaf holds
the low 4 bits of each code as any 4-bit leaf (``quant4``, the kernels' panels); the scale leaf
``<name>_scale`` is uint8 ``[K / 32, R, *Nd]``, per group of 32 contracted rows: rows 0 / 1 the low /
high byte of ``d``, Q5_1's rows 2 / 3 those of ``m``, then 4 rows of the codes' high bits, one per
block of 8 rows in Q5_K's order (``kscales.high_plane``). R = 6 (Q5_0) or 8 (Q5_1): 5.5 / 6 bits a
weight, as the file. Those bytes mix the columns of one panel, so the output dims split only into whole
panels; the group axis is sharded like the weight's first contracted dim. Stored panel-major like the
other scale leaves (``packing.pack_scales``), read by ``aotlm/kernels/int4.h``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from aotlm.kernels.layout import PANEL, Q5_ROWS
from aotlm.models import kscales

GROUP = 32  # contracted rows per group
HIGH = 4  # rows of high bits per group (one per block of 8 rows)


def pack(codes: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """5-bit ``codes`` (0..31, ``[K, *Nd]``), ``d`` (f16 values, ``[K / 32, *Nd]``) and ``m`` (Q5_1's, or
    None for Q5_0) -> ``(low 4 bits uint8 [K, *Nd], leaf uint8 [K / 32, 6 or 8, *Nd])``."""
    k, nd = codes.shape[0], codes.shape[1:]
    if k % GROUP or d.shape != (k // GROUP, *nd) or (m is not None and m.shape != d.shape) or nd[-1] % PANEL:
        raise ValueError(f"Q5 codes {codes.shape} and scales {d.shape} do not fit")
    planes = [kscales.byte_planes(d)] + ([] if m is None else [kscales.byte_planes(m)])
    rows = [*planes, kscales.high_plane(codes, GROUP)]
    leaf = np.ascontiguousarray(np.concatenate(rows, axis=1))
    return np.ascontiguousarray(np.asarray(codes, np.uint8) & np.uint8(15)), leaf


def parts(leaf) -> tuple:
    """The leaf (jnp) -> ``(scale, minimum float32 [K / 32, *Nd], high bits float32 [K, *Nd] (0 / 1) *
    16)``; Q5_0's minimum is ``-16 * scale``."""
    s = kscales.from_planes(leaf[:, 0], leaf[:, 1])
    m = kscales.from_planes(leaf[:, 2], leaf[:, 3]) if leaf.shape[1] == Q5_ROWS["Q5_1"] else -16.0 * s
    return s, m, kscales.high_bits(leaf[:, leaf.shape[1] - HIGH :])


def is_q5(sm) -> bool:
    """Static: is a logical 4-bit scale leaf in this form?"""
    return jnp.dtype(sm.dtype) == jnp.uint8 and sm.shape[1] in Q5_ROWS.values()
