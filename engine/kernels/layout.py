"""Shape arithmetic of the panel layout the packed kernels read (``packed.h``).

A weight with contracted dims ``Kd`` and output dims ``Nd`` is stored as
``[*Nd[:-1], Nd[-1] // PANEL, *Kd[:-1], Kd[-1] // 2, PANEL, 2]``. Which leaves are packed is the
models' business (``aotlm.models.packing``); the kernels only need how many dims are
contracted (``nk``) to recover the logical shape, so callers pass that number.
"""

from __future__ import annotations

PANEL = 16  # output columns per panel (packed.h)
Q4_ROWS = 8  # rows of W per 64-byte block of a 4-bit panel (int4.h): [.., Kd[-1] // 8, 16, 4] bytes
Q4_GROUPS = (32, 64, 128)  # rows of W per scale (quant="int4"; GGUF's Q4 blocks: 32)
K5_ROWS = 52  # rows per 256 of a Q5_K matrix's uint8 scale leaf (aotlm.models.kscales; int4.h)
K6_ROWS = 82  # rows per 256 of a Q6_K matrix's uint8 scale leaf (aotlm.models.k6scales; int4.h)
Q5_ROWS = {"Q5_0": 6, "Q5_1": 8}  # rows per 32 of a Q5_0 / Q5_1 matrix's uint8 scale leaf (models.q5scales)


def logical_dims(shape: tuple, nk: int) -> tuple[tuple, tuple]:
    """``(Kd, Nd)`` of a packed leaf (or of a local shard of one) with ``nk`` contracted dims."""
    nn = len(shape) - 2 - nk
    nd = (*shape[: nn - 1], shape[nn - 1] * PANEL)
    kd = (*shape[nn : nn + nk - 1], shape[nn + nk - 1] * 2)
    return kd, nd


def q4_logical_dims(shape: tuple, nk: int) -> tuple[tuple, tuple]:
    """``(Kd, Nd)`` of a packed 4-bit leaf ``[*Nd[:-1], Nd[-1] // 16, *Kd[:-1], Kd[-1] // 8, 16, 4]``."""
    nn = len(shape) - 2 - nk
    nd = (*shape[: nn - 1], shape[nn - 1] * PANEL)
    kd = (*shape[nn : nn + nk - 1], shape[nn + nk - 1] * Q4_ROWS)
    return kd, nd


def scale_groups(shape: tuple, nn: int) -> int:
    """The groups (first dim) of a group-scale leaf with ``nn`` output dims: ``[G, S, *Nd]``, or
    panel-major ``[*Nd[:-1], Nd[-1] // 16, G, S, 16]`` (``aotlm.models.packing.pack_scales``)."""
    return shape[nn] if len(shape) == nn + 3 else shape[0]


def scale_rows(shape: tuple, nn: int) -> int:
    """The rows per group (``S``: 1 / 2, or a K form's 20 / 82 per 256) of a group-scale leaf, as
    ``scale_groups`` reads it."""
    return shape[nn + 1] if len(shape) == nn + 3 else shape[1]
