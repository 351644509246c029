"""A GGUF file's Q4_K group scales and minimums, for ``quant="int4"`` to keep the file's codes.

Q4_K stores super-blocks of 256 weights along a row: 8 sub-blocks of 32, each with a 6-bit scale
``sc`` and 6-bit minimum ``m``, under the block's f16 ``d`` and ``dmin``; a weight is
``(d * sc) * q - (dmin * m)`` with a 4-bit code ``q`` (gguf-py computes it so, in float32). The
loader reads those values (``gguf_weights.GGUFWeights``); to keep the codes under ``quant="int4"``
(``aotlm.models.quant4.from_blocks``) it also needs each 32-group's scale ``d * sc`` and minimum
``-(dmin * m)``, both exact in float32 but not in float16: :func:`group_scales` computes them from the
tensor's bytes, and :class:`BlockScales` hands them to the loader, repeated back to the weight's
shape so that a family's layout transform (reshape, transpose, split, fusion) moves them exactly as
it moves the weights.
"""

from __future__ import annotations

import numpy as np

from aotlm.models.checkpoint.gguf_file import Plan, Tensor
from aotlm.models.checkpoint.gguf_names import transform, transposed

GROUP = 32  # Q4_K's sub-block: 32 weights along the input dim


def group_scales(plan: Plan, t: Tensor, meta: dict, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, minimum)`` float32 of Q4_K tensor ``t``'s 32-groups (``raw``: its stored bytes), in its HF
    layout (input dim / 32)."""
    from gguf.quants import Q4_K  # local: optional dependency, present whenever a GGUF file is read

    rows = np.asarray(raw).reshape(-1, 144)  # 144 bytes: d, dmin (f16), 12 scale bytes, 128 code bytes
    d = rows[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = rows[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(rows[:, 4:16])
    logical = t.shape[::-1] if transposed(plan.arch_name, t.gguf) else t.shape  # [rows, K] as stored
    grouped = (*logical[:-1], logical[-1] // GROUP)
    scale = (d * sc.astype(np.float32)).reshape(grouped)
    minimum = -(dmin * m.astype(np.float32)).reshape(grouped)
    fn = transform(plan.arch_name, t.gguf, meta)  # layout transforms only reach matrices
    if fn is not None:
        scale, minimum = fn(scale), fn(minimum)
    return np.ascontiguousarray(scale, np.float32), np.ascontiguousarray(minimum, np.float32)


class BlockScales:
    """The Q4_K group scales of a GGUF model's matrices, for the loader (``reader``: a
    ``gguf_weights.GGUFWeights``; any other reader has none)."""

    def __init__(self, reader):
        self._reader = reader if hasattr(reader, "blocks") else None

    def __bool__(self) -> bool:
        return self._reader is not None

    def full(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
        """Tensor ``name``'s group scale and minimum repeated over its groups (``shape``), or None."""
        got = self._reader.blocks(name) if self._reader is not None else None
        if got is None:
            return None
        s, m = got
        axes = [i for i, (a, b) in enumerate(zip(s.shape, shape, strict=True)) if a != b]
        if len(axes) != 1 or s.shape[axes[0]] * GROUP != shape[axes[0]]:
            return None
        return np.repeat(s, GROUP, axis=axes[0]), np.repeat(m, GROUP, axis=axes[0])

    def through(self, fn, names: list[str], arrays: list[np.ndarray], n_out: int) -> list | None:
        """Row ``fn``'s outputs for the group scales and minimums of its inputs ``names`` (shapes from
        ``arrays``): ``[(scale, minimum)]`` per output, or None when an input has no Q4_K groups."""
        fulls = [self.full(n, a.shape) for n, a in zip(names, arrays, strict=True)]
        if not fulls or any(f is None for f in fulls):
            return None
        try:
            s, m = fn(*(f[0] for f in fulls)), fn(*(f[1] for f in fulls))
        except ValueError:
            return None
        s, m = (s if isinstance(s, tuple) else (s,)), (m if isinstance(m, tuple) else (m,))
        if len(s) != n_out:
            return None
        return [(np.asarray(a), np.asarray(b)) for a, b in zip(s, m, strict=True)]
