"""Shape arithmetic of the panel layout the packed kernels read (``packed.h``).

A weight with contracted dims ``Kd`` and output dims ``Nd`` is stored as
``[*Nd[:-1], Nd[-1] // PANEL, *Kd[:-1], Kd[-1] // 2, PANEL, 2]``. Which leaves are packed is the
models' business (``aotlm.models.packing``); the kernels only need how many dims are
contracted (``nk``) to recover the logical shape, so callers pass that number.
"""

from __future__ import annotations

PANEL = 16  # output columns per panel (packed.h)


def logical_dims(shape: tuple, nk: int) -> tuple[tuple, tuple]:
    """``(Kd, Nd)`` of a packed leaf (or of a local shard of one) with ``nk`` contracted dims."""
    nn = len(shape) - 2 - nk
    nd = (*shape[: nn - 1], shape[nn - 1] * PANEL)
    kd = (*shape[nn : nn + nk - 1], shape[nn + nk - 1] * 2)
    return kd, nd
