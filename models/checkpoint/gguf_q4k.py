"""A GGUF file's 4-bit blocks (Q4_0, Q4_1, Q4_K) read as codes, for ``quant="int4"`` to keep them.

Every one of these types holds 32-weight groups along a row, each a 4-bit code ``q`` under its
group's scale and minimum:

* Q4_0: blocks of 32, f16 ``d``: ``d * (q - 8)``;
* Q4_1: blocks of 32, f16 ``d`` and ``m``: ``d * q + m``;
* Q4_K: super-blocks of 256 with 8 sub-blocks of 32, each a 6-bit scale ``sc`` and minimum ``m``
  under the block's f16 ``d`` and ``dmin``: ``(d * sc) * q - (dmin * m)`` (gguf-py computes it so, in
  float32: exact in float32, not in float16);
* Q5_0 / Q5_1 (kept beside them by ``quant="int4"``): Q4_0's / Q4_1's blocks with 5-bit codes, ``d * (q -
  16)`` / ``d * q + m`` (32 high bits after the scales);
* Q5_K (kept beside them by ``quant="int4"``): Q4_K's scales with 5-bit codes (a plane of high bits);
* Q6_K (kept beside them by ``quant="int4"``): super-blocks of 256 with 16 groups of 16, each an int8
  scale ``sc`` under the block's f16 ``d``, 6-bit codes: ``(d * sc) * (q - 32)``.

:func:`codes` unpacks a tensor's bytes into ``codes4.Codes`` (each weight's group id and code in one
uint32, the groups' scales and minimums beside) in the HF layout, and :class:`BlockCodes` hands a
loader row's outputs over: the row's layout transform runs on the packed array, so each weight
carries its group along and nothing is dequantized, repeated or re-rounded.
"""

from __future__ import annotations

import numpy as np

from aotlm.models.checkpoint.gguf_file import Plan, Tensor
from aotlm.models.checkpoint.gguf_names import transform, transposed
from aotlm.models.codes4 import Codes, Groups4, group_of

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
# the types read as codes (4-, 5- and 6-bit)
CODE_BYTES = {**BLOCK_BYTES, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176, "Q6_K": 210}
BITS = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}  # code widths other than 4


def _q6k(rows: np.ndarray) -> tuple:
    """Q6_K blocks ``[blocks, 210]`` -> ``(codes uint8 0..63 [n], scale f32 [n / 16], None, (sc int8 [n /
    16], d f16 [n / 256]))``, in gguf-py's order of the weights."""
    nb = rows.shape[0]
    ql = rows[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = rows[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (ql & np.uint8(15)).reshape(nb, 8, 32) | ((qh & np.uint8(3)).reshape(nb, 8, 32) << np.uint8(4))
    sc = rows[:, 192:208].copy().view(np.int8)  # [blocks, 16]
    d = rows[:, 208:210].copy().view(np.float16)  # [blocks, 1]
    scale = (d.astype(np.float32) * sc.astype(np.float32)).reshape(-1)
    return q.reshape(-1), scale, None, (sc.reshape(-1), d.reshape(-1))


def unpack(qtype: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple | None]:
    """``(codes uint8 [n], scale float32 [n / 32], minimum float32 [n / 32] or None, k)`` of a tensor's
    stored bytes in the file's order (``minimum`` None: Q4_0's ``d * (q - 8)``, Q5_0's ``d * (q - 16)``;
    ``k``: Q4_K's / Q5_K's own ``(sc, mb uint8 [n / 32], d, dmin f16 [n / 256])`` for
    ``aotlm.models.kscales``, else None; Q5_*'s codes 0..31, Q6_K's: ``_q6k``)."""
    rows = np.asarray(raw).reshape(-1, CODE_BYTES[qtype])
    if qtype == "Q6_K":
        return _q6k(rows)
    f16 = lambda at: rows[:, at : at + 2].copy().view(np.float16)  # noqa: E731  [blocks, 1]
    k = None
    if qtype in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K  # local: optional dependency, present whenever a GGUF file is read

        sc, m = (a.astype(np.uint8) for a in Q4_K.get_scale_min(rows[:, 4:16]))  # [blocks, 8] 6-bit each
        k = (sc.reshape(-1), m.reshape(-1), f16(0).reshape(-1), f16(2).reshape(-1))
        scale = (f16(0).astype(np.float32) * sc).reshape(-1)
        minimum = -(f16(2).astype(np.float32) * m).reshape(-1)
        qs = rows[:, 16 + 32 * (qtype == "Q5_K") :].reshape(-1, 4, 1, 32)  # sub-blocks 2j (low nibbles), 2j+1
    else:
        scale = f16(0).astype(np.float32).reshape(-1)
        minimum = f16(2).astype(np.float32).reshape(-1) if qtype in ("Q4_1", "Q5_1") else None
        at = 2 + 2 * (minimum is not None)  # Q5_*: 4 bytes of high bits, then the low nibbles
        qs = rows[:, at + 4 * (qtype[1] == "5") :].reshape(-1, 1, 1, 16)  # weights j (low), j + 16 (high)
    codes = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=2)
    if qtype in ("Q5_0", "Q5_1"):  # bit i of the little-endian uint32: weight i's high bit
        qh = rows[:, at : at + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)
        codes = codes.reshape(-1, 32) | ((qh & 1).astype(np.uint8) << np.uint8(4))
    if qtype == "Q5_K":  # bit j of byte i of the 32 after the scales: weight i of sub-block j's high bit
        qh = rows[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        codes = codes.reshape(-1, 8, 32) | ((qh & np.uint8(1)) << np.uint8(4))
    return codes.reshape(-1), scale, minimum, k


def codes(plan: Plan, t: Tensor, meta: dict, raw: np.ndarray) -> Codes:
    """4-bit tensor ``t`` (``raw``: its stored bytes) as ``Codes`` in its HF layout."""
    q, scale, minimum, k = unpack(t.qtype, raw)
    bits = BITS.get(t.qtype, 4)
    ids = np.arange(scale.size, dtype=np.uint32)[:, None] << np.uint32(bits)
    logical = t.shape[::-1] if transposed(plan.arch_name, t.gguf) else t.shape  # [rows, K] as stored
    packed = (ids | q.reshape(-1, group_of(bits))).reshape(logical)
    fn = transform(plan.arch_name, t.gguf, meta)  # layout transforms only reach matrices
    return Codes(np.ascontiguousarray(packed if fn is None else fn(packed)), scale, minimum, k, bits)


def groups(plan: Plan, t: Tensor, meta: dict, raw: np.ndarray, fn) -> Groups4 | None:
    """4-bit tensor ``t`` moved by ``fn``, a layout function that transposes an HF ``[out, X]`` array to
    ``[X, *out]`` for any ``X`` (``weights.linear_t``, ``heads_in``): applied to the ``[out, K]`` codes
    (uint8) and to the ``[out, K / 32]`` group scales and minimums, so each group stays with its weights
    and no per-weight group id is made; None for a GPT-2 ``Conv1D`` matrix or a function that did not
    move the groups as it moved the codes."""
    if transposed(plan.arch_name, t.gguf) or len(t.shape) != 2:
        return None
    q, scale, minimum, ks = unpack(t.qtype, raw)
    rows, k = t.shape
    fix = transform(plan.arch_name, t.gguf, meta)  # llama's q / k rows: a permutation of [out, X] arrays
    hf = lambda a: a.reshape(rows, -1) if fix is None else fix(a.reshape(rows, -1))  # noqa: E731
    codes, sc = fn(hf(q)), fn(hf(scale))
    mn = None if minimum is None else fn(hf(minimum))
    if codes.shape[0] != k or sc.shape != (k // group_of(BITS.get(t.qtype, 4)), *codes.shape[1:]):
        return None
    ks = None if ks is None else tuple(np.ascontiguousarray(fn(hf(a))) for a in ks)
    return Groups4(codes, sc, mn, ks, BITS.get(t.qtype, 4))


class BlockCodes:
    """The 4-bit matrices of a GGUF model, for the loader (``reader``: a ``gguf_weights.GGUFWeights``,
    or a reader wrapping one; any other reader has none)."""

    def __init__(self, reader):
        self._reader = reader if hasattr(reader, "codes") else None

    def __bool__(self) -> bool:
        return self._reader is not None

    def row(self, fn, names: list[str], n_out: int) -> list[Codes] | None:
        """A loader row's outputs (``fn`` of tensor ``names``) as ``Codes``, or None: a row of several
        tensors (expert stacks), a tensor not in 4-bit blocks, or a transform that refused them."""
        got = self._reader.codes(names[0]) if self._reader is not None and len(names) == 1 else None
        if got is None:
            return None
        try:
            out = fn(got.packed)
        except ValueError:
            return None
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) != n_out or any(np.asarray(o).dtype != np.uint32 for o in outs):
            return None
        return [got.moved(o) for o in outs]
