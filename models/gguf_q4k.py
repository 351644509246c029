"""A GGUF file's Q4_K group scales and minimums, kept beside the dequantized checkpoint.

Q4_K stores super-blocks of 256 weights along a row: 8 sub-blocks of 32, each with a 6-bit scale
``sc`` and 6-bit minimum ``m``, under the block's f16 ``d`` and ``dmin``; a weight is
``(d * sc) * q - (dmin * m)`` with a 4-bit code ``q`` (gguf-py computes it so, in float32). The
converted ``model.safetensors`` holds those values; to keep the codes under ``quant="int4"``
(``aotlm.models.quant4.from_blocks``) the loader also needs each 32-group's scale ``d * sc`` and
minimum ``-(dmin * m)``, both exact in float32 but not in float16. :func:`write_sidecar` writes them
at conversion time to ``aotlm_q4k.safetensors`` (float32, ``<hf name>.scale`` / ``<hf name>.min``,
the HF tensor's shape with its input dim divided by 32; transformers reads only
``model.safetensors``), and :class:`BlockScales` hands them to the loader, repeated back to the
weight's shape so that a family's layout transform (reshape, transpose, split, fusion) moves them
exactly as it moves the weights.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from aotlm.models.gguf_file import Plan, Tensor
from aotlm.models.gguf_names import transform, transposed
from aotlm.models.gguf_safetensors import write_safetensors

SIDECAR = "aotlm_q4k.safetensors"
GROUP = 32  # Q4_K's sub-block: 32 weights along the input dim


def q4k_tensors(plan: Plan) -> list[Tensor]:
    """The file's Q4_K matrices (2-D tensors dequantized to float32)."""
    return [t for t in plan.tensors if t.qtype == "Q4_K" and len(t.shape) == 2 and t.dtype == "F32"]


def group_scales(reader, plan: Plan, t: Tensor, meta: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, minimum)`` float32 of Q4_K tensor ``t``'s 32-groups, in its HF layout (input dim / 32)."""
    from gguf.quants import Q4_K  # local: optional dependency, present whenever a GGUF file is read

    rt = reader.tensors[t.index]
    rows = np.asarray(rt.data).reshape(-1, 144)  # 144 bytes: d, dmin (f16), 12 scale bytes, 128 code bytes
    d = rows[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = rows[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(rows[:, 4:16])
    logical = tuple(int(n) for n in reversed(rt.shape))  # [rows, K] before the HF layout transform
    grouped = (*logical[:-1], logical[-1] // GROUP)
    scale = (d * sc.astype(np.float32)).reshape(grouped)
    minimum = -(dmin * m.astype(np.float32)).reshape(grouped)
    fn = transform(plan.arch_name, t.gguf, meta)  # layout transforms only reach matrices
    if fn is not None:
        scale, minimum = fn(scale), fn(minimum)
    return np.ascontiguousarray(scale, np.float32), np.ascontiguousarray(minimum, np.float32)


def write_sidecar(out: Path, reader, plan: Plan, meta: dict) -> int:
    """Write ``out / SIDECAR`` for the file's Q4_K matrices (none: nothing written); their count."""
    found = q4k_tensors(plan)
    if not found:
        return 0
    rows = []
    for t in found:  # one read of a tensor's blocks gives both arrays (1/32 of its size each)
        pair = functools.cache(lambda t=t: group_scales(reader, plan, t, meta))
        shape = _grouped_shape(plan, t)
        rows.append((f"{t.hf}.scale", "F32", shape, lambda pair=pair: pair()[0]))
        rows.append((f"{t.hf}.min", "F32", shape, lambda pair=pair: pair()[1]))
    write_safetensors(out / SIDECAR, rows)
    return len(found)


def _grouped_shape(plan: Plan, t: Tensor) -> tuple[int, ...]:
    """The HF shape of ``t``'s group arrays: its input dim (last; first where transposed) / 32."""
    if transposed(plan.arch_name, t.gguf):
        return (t.shape[0] // GROUP, t.shape[1])
    return (t.shape[0], t.shape[1] // GROUP)


class BlockScales:
    """A converted GGUF model's Q4_K group scales (``SIDECAR``), for the loader; empty without one."""

    def __init__(self, checkpoint: str | Path):
        self._handle = None
        f = Path(checkpoint) / SIDECAR
        if f.is_file():
            from safetensors import safe_open  # local: kept out of `import aotlm` until weights are read

            self._handle = safe_open(str(f), framework="numpy")
            self._names = set(self._handle.keys())

    def __bool__(self) -> bool:
        return self._handle is not None

    def full(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
        """Tensor ``name``'s group scale and minimum repeated over its groups (``shape``), or None."""
        if self._handle is None or f"{name}.scale" not in self._names:
            return None
        s, m = self._handle.get_tensor(f"{name}.scale"), self._handle.get_tensor(f"{name}.min")
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
