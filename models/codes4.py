"""A GGUF file's 4-, 5- and 6-bit blocks as codes, for the int4 storage to keep them as stored.

:class:`Codes` holds a matrix as each weight's group id and code (so a layout transform moves each
weight's group with it), :class:`Groups4` one whose groups run along its first axis (an out-only layout:
two small arrays moved), and :func:`from_codes` / :meth:`Groups4.stored` turn them into the leaves
``aotlm.models.quant4`` stores: the file's codes with their own scales (f16 per 32 for Q4_0 / Q4_1, the
K forms of ``kscales`` / ``k6scales`` for Q4_K / Q5_K / Q6_K, ``q5scales`` for Q5_0 / Q5_1), or None where
the layout did not keep a group together (the caller re-rounds the values).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from aotlm.kernels.layout import PANEL
from aotlm.models import k6scales, kscales, q5scales


def along_k(w: np.ndarray, contract: tuple[int, ...], group: int) -> np.ndarray:
    """``w`` as groups ``[G, group, *Nd]`` along its contracted dims (moved first, flattened)."""
    nk = len(contract)
    a = np.moveaxis(np.asarray(w), contract, tuple(range(nk)))  # [*Kd, *Nd]
    return a.reshape(math.prod(a.shape[:nk]) // group, group, *a.shape[nk:])


def from_k(q: np.ndarray, shape: tuple, contract: tuple[int, ...]) -> np.ndarray:
    """Inverse of ``along_k`` for an array of ``shape``'s layout."""
    nk = len(contract)
    kd_nd = (*(shape[c] for c in contract), *(n for i, n in enumerate(shape) if i not in contract))
    return np.ascontiguousarray(np.moveaxis(q.reshape(kd_nd), tuple(range(nk)), contract))


def group_of(bits: int) -> int:
    """Rows per group of a GGUF file's codes of ``bits`` (Q6_K's 6-bit ones: 16, the others 32)."""
    return 16 if bits == 6 else 32


@dataclasses.dataclass(frozen=True)
class Codes:
    """A matrix as a GGUF file's 4-bit blocks hold it (Q4_0, Q4_1, Q4_K; Q5_0's, Q5_1's and Q5_K's 5-bit
    codes; Q6_K's 6-bit ones in groups of 16): ``packed`` (uint32, the matrix's shape) is each weight's
    group id ``<< bits`` or'ed with its code, so a layout transform (transpose, head reshape, split, q/k/v
    fusion) moves each weight's group with it and no scale array is moved or repeated; ``scale`` /
    ``minimum`` (``[groups]`` float32, exact; ``minimum`` None for Q4_0's ``d * (q - 8)``, Q5_0's ``d * (q
    - 16)`` / Q6_K's ``d * sc * (q - 32)``) are the groups' own. A weight is ``scale * q + minimum``."""

    packed: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    # Q4_K / Q5_K: per group sc, mb (uint8), per 8 groups d, dmin (f16): kscales' parts; Q6_K: per group
    # sc (int8), per 16 groups d (f16): k6scales'; None for the others (Q5_0 / Q5_1: q5scales)
    k: tuple | None = None
    bits: int = 4  # 4, 5 (Q5_0, Q5_1, Q5_K) or 6 (Q6_K)

    @property
    def group(self) -> int:
        return group_of(self.bits)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.packed.shape

    @property
    def ndim(self) -> int:
        return self.packed.ndim

    def moved(self, packed: np.ndarray) -> Codes:
        """The same groups with the weights moved (a layout transform's output of ``packed``)."""
        return Codes(np.ascontiguousarray(packed), self.scale, self.minimum, self.k, self.bits)

    def minimums(self) -> np.ndarray:
        return -float(1 << (self.bits - 1)) * self.scale if self.minimum is None else self.minimum

    def values(self) -> np.ndarray:
        """The float32 weights (what gguf-py's dequantization gives) for a storage that re-rounds."""
        gid = self.packed >> self.bits
        code = self.packed & np.uint32((1 << self.bits) - 1)
        return code.astype(np.float32) * self.scale[gid] + self.minimums()[gid]


@dataclasses.dataclass(frozen=True)
class Groups4:
    """A matrix of a GGUF file's 4-bit blocks in aotlm's layout, its groups of 32 along axis 0 (the
    contracted one): ``codes`` (uint8 0..15, ``[K, *Nd]``) and per group ``scale`` / ``minimum``
    (float32 ``[K / 32, *Nd]``; ``minimum`` None for Q4_0's ``d * (q - 8)``); ``k``: a Q4_K matrix's
    own ``(sc, mb [K / 32, *Nd], d, dmin [K / 256, *Nd])`` (``aotlm.models.kscales``). ``bits`` 6: a
    Q6_K matrix, codes 0..63 in groups of 16, ``k`` its ``(sc int8 [K / 16, *Nd], d [K / 256, *Nd])``
    (``aotlm.models.k6scales``); ``bits`` 5: Q5_K's codes 0..31 under Q4_K's scales, or with ``k`` None
    Q5_0's / Q5_1's under their own (``aotlm.models.q5scales``)."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    k: tuple | None = None
    bits: int = 4

    @property
    def group(self) -> int:
        return group_of(self.bits)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def stored(self, asymmetric: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """``(codes, scales)`` as ``from_codes`` gives them (Q4_K: its own, ``kscales``); None where it
        gives None."""
        if not asymmetric and self.minimum is not None:
            return None
        fits = self.codes.shape[0] % k6scales.BLOCK == 0 and self.codes.shape[-1] % PANEL == 0
        if self.bits == 6:  # Q6_K: its own form only (symmetric or not), whole blocks and panels
            return k6scales.pack(self.codes, *self.k) if fits else None
        if self.bits == 5 and self.k is None:  # Q5_0 / Q5_1: f16 scales and the codes' high bits
            return (
                q5scales.pack(self.codes, self.scale, self.minimum)
                if self.codes.shape[-1] % PANEL == 0
                else None
            )
        if self.bits == 5:  # Q5_K: Q4_K's scales and the codes' high bits
            return kscales.pack5(self.codes, kscales.pack(*self.k)) if fits and asymmetric else None
        if asymmetric and self.k is not None and self.codes.shape[0] % kscales.BLOCK == 0:
            return self.codes, kscales.pack(*self.k)
        parts = (self.scale, self.minimums()) if asymmetric else (self.scale,)
        return self.codes, np.stack(parts, axis=1).astype(np.float16)

    def lm_head(self, asymmetric: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """A tied embedding's blocks (here ``[D, V]``, groups along D) as the logits' copy ``embed_q``:
        ``(codes [V', D], scales)`` in ``stored``'s form, the vocab zero-padded to whole panels of 16
        (zero scales: those logits are 0 and sliced off); None where ``stored`` gives None."""
        kept = self.panels().stored(asymmetric)
        return None if kept is None else (np.ascontiguousarray(kept[0].T), kept[1])

    def panels(self) -> Groups4:
        """The same matrix with its output (last) axis zero-padded to whole panels of 16 (zero scales: a
        vocabulary's padded logits are 0 and sliced off), so the 5- and 6-bit forms take any vocabulary."""
        k = None if self.k is None else tuple(map(_panels, self.k))
        return Groups4(_panels(self.codes), _panels(self.scale), _panels(self.minimum), k, self.bits)

    def minimums(self) -> np.ndarray:
        return -float(1 << (self.bits - 1)) * self.scale if self.minimum is None else self.minimum

    def values(self) -> np.ndarray:
        """The float32 weights (for a storage that re-rounds them)."""
        rep = lambda a: np.repeat(a, self.group, axis=0)  # noqa: E731
        return self.codes.astype(np.float32) * rep(self.scale) + rep(self.minimums())


def _panels(a: np.ndarray | None) -> np.ndarray | None:
    """``a`` with its last (output) axis zero-padded to whole panels of 16."""
    return None if a is None else np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -a.shape[-1] % PANEL)])


def fuse_codes(parts: Sequence[Codes], fuse: Callable) -> Codes | None:
    """``fuse`` (a layout function of the parts' arrays: q/k/v heads, gate/up stacks) of ``parts``,
    their group ids renumbered into one table; None for parts of different code widths."""
    bits = {p.bits for p in parts}
    if len(bits) != 1:
        return None
    b = bits.pop()
    offsets = np.cumsum([0, *(p.scale.size for p in parts[:-1])])
    packed = fuse([p.packed + np.uint32(int(o) << b) for p, o in zip(parts, offsets, strict=True)])
    sym = all(p.minimum is None for p in parts)
    minimum = None if sym else np.concatenate([p.minimums() for p in parts])
    k = (
        None
        if any(p.k is None for p in parts)
        else tuple(np.concatenate(a) for a in zip(*(p.k for p in parts), strict=True))
    )
    return Codes(np.ascontiguousarray(packed), np.concatenate([p.scale for p in parts]), minimum, k, b)


def from_codes(
    c: Codes, contract: tuple[int, ...], asymmetric: bool, vocab: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Groups of 32 (Q6_K: 16) for ``c`` with the file's own codes: ``(codes, scales)`` as ``quantize_int4``
    gives them: Q4_K's own (``kscales``, exact) when its blocks of 256 stayed whole and in order, else f16
    (exact for Q4_0 / Q4_1, whose ``d`` and ``m`` are f16; Q4_K's ``d * sc`` and ``-dmin * m`` then move
    by <= 2^-11 relative); Q5_K's / Q6_K's K forms and Q5_0's / Q5_1's ``q5scales`` form (their codes'
    high bits in the scale leaf). None when the layout did not keep each group together along
    ``contract`` (the caller re-rounds the values) or the storage is symmetric and the blocks have
    minimums. ``vocab``: the output axis is a vocabulary, which the 5- and 6-bit forms take zero-padded to
    whole panels (``Groups4.panels``)."""
    if not asymmetric and c.minimum is not None:
        return None
    g = along_k(c.packed, contract, c.group)  # [G, group, *Nd]
    codes, gid = np.empty(g.shape, np.uint8), np.empty((g.shape[0], 1, *g.shape[2:]), np.uint32)
    step = max(1, (1 << 15) // max(1, g[0].size))  # groups per pass: its temporaries stay in cache
    mask = (1 << c.bits) - 1
    for i in range(0, g.shape[0], step):
        x = g[i : i + step]
        if (np.bitwise_xor(x, x[:, :1]) > mask).any():  # a group's weights carry two ids
            return None
        np.right_shift(x[:, :1], c.bits, out=gid[i : i + step])
        np.bitwise_and(x, mask, out=codes[i : i + step], casting="unsafe")
    if vocab and c.bits != 4 and contract == (0,) and codes.shape[-1] % PANEL:  # an lm_head [D, V]
        g = _as_groups(c, gid[:, 0], codes.reshape(-1, *codes.shape[2:]))
        return None if g is None else g.panels().stored(asymmetric)
    if c.bits == 6:  # Q6_K: its own form (k6scales), or None: the caller re-rounds the values
        return _k6form(c, gid[:, 0], codes.reshape(-1, *codes.shape[2:]), contract)
    if c.bits == 5 and c.k is None:  # Q5_0 / Q5_1: their own f16 scales and the codes' high bits
        if codes.shape[-1] % PANEL:
            return None
        m = None if c.minimum is None else c.minimum[gid[:, 0]]
        low, leaf = q5scales.pack(codes.reshape(-1, *codes.shape[2:]), c.scale[gid[:, 0]], m)
        return from_k(low, c.shape, contract), leaf
    kept = _kform(c, gid[:, 0]) if asymmetric else None
    if c.bits == 5:  # Q5_K: Q4_K's scales and the codes' high bits, or None as above
        if kept is None or codes.shape[-1] % PANEL:
            return None
        low, leaf = kscales.pack5(codes.reshape(-1, *codes.shape[2:]), kept)
        return from_k(low, c.shape, contract), leaf
    if kept is not None:
        return from_k(codes, c.shape, contract), kept
    s = c.scale[gid]
    sm = np.concatenate([s, c.minimums()[gid]], axis=1) if asymmetric else s
    return from_k(codes, c.shape, contract), sm.astype(np.float16)


def _blocks(gid: np.ndarray, per: int) -> np.ndarray | None:
    """The block of 256 rows of each run of ``per`` groups in ``gid [G, *Nd]`` (group ids) -> ``[G / per,
    *Nd]``, or None: a layout that did not keep each block's groups together and in order."""
    if gid.shape[0] % per:
        return None
    runs = gid.reshape(gid.shape[0] // per, per, *gid.shape[1:])
    first = runs[:, :1]
    steps = np.arange(per, dtype=gid.dtype).reshape(1, per, *(1,) * (gid.ndim - 1))
    if (first % per).any() or (runs != first + steps).any():
        return None
    return first[:, 0] // per


def _as_groups(c: Codes, gid: np.ndarray, codes: np.ndarray) -> Groups4 | None:
    """``c`` as ``Groups4`` from its codes ``[K, *Nd]`` and groups ``gid [K / group, *Nd]``; None where a K
    type's layout did not keep each block's groups together and in order."""
    m = None if c.minimum is None else c.minimum[gid]
    if c.k is None:
        return Groups4(codes, c.scale[gid], m, None, c.bits)
    blocks = _blocks(gid, 16 if c.bits == 6 else 8)
    if blocks is None:
        return None
    k = (
        (c.k[0][gid], c.k[1][blocks])
        if c.bits == 6
        else (*(a[gid] for a in c.k[:2]), *(a[blocks] for a in c.k[2:]))
    )
    return Groups4(codes, c.scale[gid], m, k, c.bits)


def _kform(c: Codes, gid: np.ndarray) -> np.ndarray | None:
    """A Q4_K matrix's own scales (``kscales``) for its groups ``gid [G, *Nd]`` (group ids), or None: not
    Q4_K, or a layout that did not keep each block's 8 groups together and in order."""
    blocks = None if c.k is None else _blocks(gid, 8)
    if blocks is None:
        return None
    sc, mb, d, dmin = c.k
    return kscales.pack(sc[gid], mb[gid], d[blocks], dmin[blocks])


def _k6form(c: Codes, gid: np.ndarray, codes: np.ndarray, contract: tuple[int, ...]) -> tuple | None:
    """A Q6_K matrix's low codes (in ``c``'s layout) and own scales (``k6scales``) from its codes
    ``[K, *Nd]`` (0..63) and groups ``gid [K / 16, *Nd]``, or None: a layout that did not keep each
    block's 16 groups together and in order, or output dims not in whole panels."""
    blocks = None if gid.shape[-1] % PANEL else _blocks(gid, 16)
    if blocks is None:
        return None
    sc, d = c.k
    low, leaf = k6scales.pack(codes, sc[gid], d[blocks])
    return from_k(low, c.shape, contract), leaf
