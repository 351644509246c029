"""A GGUF file's block-quantized embedding read as ``lookup.GroupedRows``: each weight's code with its
group's scale and offset, for the lookup to rebuild a token's row from the file's own numbers.

Per type, the group (weights along a row under one scale), and the value gguf-py dequantizes to:

* Q4_0 / Q5_0 (32): ``d * (q - 8)`` / ``d * (q - 16)``; Q8_0 (32): ``d * q``;
* Q4_1 / Q5_1 (32): ``d * q + m``;
* Q4_K / Q5_K (32 of a 256 super-block): ``(d * sc) * q - (dmin * m)``;
* Q6_K (16 of a 256 super-block): ``(d * sc) * (q - 32)``.

The 4-bit types' codes are read straight from their nibbles (``gguf_q4k.unpack``) and kept two a byte
(``lookup.pack4``); the others' (int8) from
gguf-py's dequantized values, ``rint((value - offset) / scale)`` with the scales and offsets read
from the block headers (exact: each value is one rounding of ``scale * code + offset``). Rows are
converted a few thousand at a time. Any other type, or an embedding stored with a layout change,
gives None (the lookup then keeps float32).
"""

from __future__ import annotations

import numpy as np

from aotlm.models.checkpoint.gguf_q4k import BLOCK_BYTES as Q4_BYTES
from aotlm.models.checkpoint.gguf_q4k import unpack
from aotlm.models.lookup import GroupedRows, pack4

# type -> (block bytes, weights per block, group)
BLOCKS = {
    "Q4_0": (18, 32, 32),
    "Q4_1": (20, 32, 32),
    "Q4_K": (144, 256, 32),
    "Q5_0": (22, 32, 32),
    "Q5_1": (24, 32, 32),
    "Q5_K": (176, 256, 32),
    "Q6_K": (210, 256, 16),
    "Q8_0": (34, 32, 32),
}
NO_OFFSET = ("Q4_0", "Q5_0", "Q6_K", "Q8_0")  # a code times its group's scale, nothing added
ROWS = 2048  # table rows converted at a time


def bytes_per_weight(qtype: str | None) -> float | None:
    """What a ``qtype`` embedding kept for the lookup costs a weight (None: not kept so)."""
    if qtype not in BLOCKS:
        return None
    return (0.5 if qtype in Q4_BYTES else 1) + 4 * (1 + (qtype not in NO_OFFSET)) / BLOCKS[qtype][2]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32 ``[blocks, 1]``."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _scales(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Each group's scale and offset (None: none) ``[blocks, groups per block]`` for the non-4-bit types."""
    if qtype in ("Q5_0", "Q8_0"):
        return _f16(blocks, 0), None
    if qtype == "Q5_1":
        return _f16(blocks, 0), _f16(blocks, 2)
    if qtype == "Q5_K":
        from gguf.quants import Q4_K  # local: optional dependency, present whenever a GGUF file is read

        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        return _f16(blocks, 0) * sc.astype(np.float32), -(_f16(blocks, 2) * m.astype(np.float32))
    if qtype == "Q6_K":
        return _f16(blocks, 208) * blocks[:, 192:208].copy().view(np.int8).astype(np.float32), None
    raise ValueError(qtype)


def _codes(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(int8 codes [weights], scale [groups], offset [groups] or None)`` of whole blocks."""
    if qtype in Q4_BYTES:
        q, scale, offset, _ = unpack(qtype, blocks)
        if offset is None:  # Q4_0: d * (q - 8)
            return (q.astype(np.int8) - np.int8(8)), scale, None
        return q.astype(np.int8), scale, offset
    from gguf.constants import GGMLQuantizationType  # local: optional dependency (GGUF files only)
    from gguf.quants import dequantize  # local: as above

    scale, offset = _scales(qtype, blocks)
    x = dequantize(blocks, GGMLQuantizationType[qtype]).reshape(*scale.shape, -1)
    if offset is not None:
        x = x - offset[..., None]
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    q = np.rint(x / safe).astype(np.int8)
    q[np.broadcast_to(scale[..., None] == 0, q.shape)] = 0
    return q.reshape(-1), scale.reshape(-1), None if offset is None else offset.reshape(-1)


def grouped_rows(qtype: str, raw: np.ndarray, shape: tuple[int, ...]) -> GroupedRows | None:
    """A ``[V, D]`` table stored in ``qtype`` blocks (``raw``: its bytes, rows in the file's order) as
    ``GroupedRows``; None for a type without a group form here or a row that is not whole blocks."""
    if qtype not in BLOCKS or len(shape) != 2:
        return None
    nbytes, per_block, group = BLOCKS[qtype]
    v, d = shape
    if d % per_block:
        return None
    blocks = np.asarray(raw).reshape(v, d // per_block, nbytes)
    four = qtype in Q4_BYTES  # two codes a byte (lookup.pack4)
    codes = np.empty((v, d // 2 if four else d), np.uint8 if four else np.int8)
    scale = np.empty((v, d // group), np.float32)
    offset = None if qtype in NO_OFFSET else np.empty_like(scale)
    for i in range(0, v, ROWS):
        part = blocks[i : i + ROWS]
        n = part.shape[0]
        q, s, o = _codes(qtype, part.reshape(-1, nbytes))
        q = q.reshape(n, d)
        codes[i : i + n], scale[i : i + n] = pack4(q) if four else q, s.reshape(n, -1)
        if offset is not None:
            offset[i : i + n] = o.reshape(n, -1)
    return GroupedRows(codes, scale, offset)
