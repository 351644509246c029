"""The embedding lookup from a quantized file's own blocks: int8 codes with each group's scale and offset.

A GGUF file stores its token embedding in blocks (Q4_K, Q6_K, Q8_0, ...): groups of 16 or 32 weights
along a row, each weight a small integer code under its group's scale (and, for some types, an
offset). Expanding that table to float32 for the lookup cost four bytes a weight (0.8 GB for a
49k x 4096 table); kept as :class:`GroupedRows` it costs one byte plus 8 per group, and a token's row
is rebuilt in the graph as ``code * scale + offset``, as the file's dequantization computes it (equal
within float32 rounding). The leaves: ``embed`` (int8 codes ``[V, D]``; a 4-bit type's two codes a
byte, uint8 ``[V, D / 2]``: weight ``2j`` in the low nibble, ``2j + 1`` in the high one, signed
-8..7 where the type has no offset, else 0..15), ``embed_gscale`` and, where the type has one,
``embed_gmin`` (float32 ``[V, D / group]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

LEAVES = ("embed_gscale", "embed_gmin")  # beside the codes in "embed"
CHUNK = 4096  # rows rebuilt at a time on the host


@dataclass(frozen=True)
class GroupedRows:
    """A ``[V, D]`` table as int8 ``codes`` (or 4-bit ones, two a byte: ``pack4``), float32 ``scale``
    ``[V, D / g]`` and optional ``offset``."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        v, d = self.codes.shape
        return (v, 2 * d if self.codes.dtype == np.uint8 else d)

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def values(self) -> np.ndarray:
        """The table in float32 (a few thousand rows at a time)."""
        out = np.empty(self.shape, np.float32)
        for i in range(0, out.shape[0], CHUNK):
            out[i : i + CHUNK] = rebuild(
                self.codes[i : i + CHUNK], self.scale[i : i + CHUNK], _rows(self.offset, i)
            )
        return out

    def leaves(self, path: tuple) -> list[tuple[tuple, np.ndarray]]:
        """The ``(path, array)`` leaves this table is stored as (``path``: the embedding's)."""
        up = path[:-1]
        out = [(path, self.codes), ((*up, LEAVES[0]), self.scale)]
        return out + ([((*up, LEAVES[1]), self.offset)] if self.offset is not None else [])


def _rows(a: np.ndarray | None, i: int) -> np.ndarray | None:
    return None if a is None else a[i : i + CHUNK]


def pack4(codes: np.ndarray) -> np.ndarray:
    """int8 codes ``[..., D]`` in -8..15 (signed -8..7 or unsigned 0..15) -> two a byte ``[..., D / 2]``."""
    u = codes.view(np.uint8) & np.uint8(15)
    return np.ascontiguousarray(u[..., 0::2] | (u[..., 1::2] << np.uint8(4)))


def unpack4(packed, signed: bool):
    """``pack4``'s bytes -> int8 codes ``[..., D]`` (numpy or jax arrays)."""
    xp = jnp if not isinstance(packed, np.ndarray) else np
    q = xp.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(xp.int8)
    return (q ^ 8) - 8 if signed else q


def rebuild(codes, scale, offset=None):
    """``codes * scale + offset`` group by group (numpy or jax arrays; ``[..., D]`` codes, or ``pack4``'s
    uint8 ``[..., D / 2]``: signed where there is no offset)."""
    xp = jnp if not isinstance(codes, np.ndarray) else np
    if codes.dtype == xp.uint8:
        codes = unpack4(codes, signed=offset is None)
    g = codes.shape[-1] // scale.shape[-1]
    shape = (*codes.shape[:-1], scale.shape[-1], g)
    x = codes.astype(xp.float32).reshape(shape) * scale.astype(xp.float32)[..., None]
    if offset is not None:
        x = x + offset.astype(xp.float32)[..., None]
    return x.reshape(codes.shape)


def take(params: dict, tokens):
    """The embedding rows of ``tokens``: a plain gather, or rebuilt from the grouped codes."""
    if LEAVES[0] not in params:
        return jnp.take(params["embed"], tokens, axis=0)
    gather = lambda name: jnp.take(params[name], tokens, axis=0)  # noqa: E731
    return rebuild(gather("embed"), gather(LEAVES[0]), gather(LEAVES[1]) if LEAVES[1] in params else None)
