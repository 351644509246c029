"""int8 / bf16 / f16 weights stored in the CPU kernels' panel layout, chosen while loading.

Why: one decode step reads every weight once, and the int8 one-row kernel on a row-major
``W [K, N]`` kept its N partial sums in memory and unpacked every pair of rows (12 uops per 32
weights): GPT-2-small's int8 decode matmuls streamed 11-14 GB/s where two threads can read ~18.
In the panel layout (``aotlm/kernels/packed.h``) each group of 16 output columns is one
contiguous stream whose sums stay in registers over all of K (6 uops per 32 weights): 15-18
GB/s in the same harness run. bf16 weights (``quant="bf16"``) use the same layout with 2-byte
elements: a 32-bit word holds one column's pair of rows, split into two f32 by a shift and a mask.
f16 weights (``quant="f16"``, ``amp="f16"`` on CPU) too: F16C converts 4 columns' pairs at once
and the kernel adds each column's even and odd rows at the end (row-major f16 decoded GPT-2-small
at ~1.55x f32, panels as fast as bf16's).

Layout: a weight with contracted dims ``Kd`` and output dims ``Nd`` is stored as
``[*Nd[:-1], Nd[-1] // 16, *Kd[:-1], Kd[-1] // 2, 16, 2]`` -- panels of 16 columns outermost,
then pairs of rows, each pair interleaved per column. It keeps every logical dim (split, not
merged), so the leaf's logical axes still say how to shard it (``packed_axes``): a tensor-parallel
shard of a packed weight is the packed form of the logical shard, as long as the sharded dim
splits into whole panels / pairs (``pack_if`` checks that and leaves the weight row-major
otherwise). Only int8 / bf16 / f16 leaves the kernels multiply are packed (``PACK_CONTRACT``), only when
the kernels are in use, and XLA (prefill, other backends) gets the logical matrix back from
``aotlm_unpack`` or ``unpack``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from aotlm import kernels
from aotlm.kernels import layout
from aotlm.kernels.layout import PANEL, Q5_ROWS
from aotlm.models import kscales, quant_fp8
from aotlm.models.axes import CONTRACT_AXES, LOGICAL_AXES, QUANT_SCALES, Path

DTYPES = ("int8", "bfloat16", "float16", "float32")  # stored dtypes the panel kernels read
# leaf -> its contracted dims. ``embed_q`` (the tied lm_head's int8 rows) is [V, D]: D contracted.
PACK_CONTRACT: dict[str, tuple[int, ...]] = {
    **{n: c for n, c in CONTRACT_AXES.items() if not n.startswith("e_")},  # not MoE experts (einsum)
    "embed_q": (1,),
}
# Leaves whose vocab axis is padded to a multiple of 16 * tp so the tied / untied lm_head packs
# (the extra logits are zero and sliced off by ``decoder.logits``; their scales are 0).
VOCAB_LEAVES = ("embed_q", "embed_q_scale", "lm_head", "lm_head_scale")


def split_dims(shape: tuple, contract: tuple[int, ...]) -> tuple[tuple, tuple]:
    kd = tuple(shape[i] for i in contract)
    nd = tuple(n for i, n in enumerate(shape) if i not in contract)
    return kd, nd


def packed_shape(shape: tuple, contract: tuple[int, ...]) -> tuple:
    """The packed form's shape of a logical ``shape``."""
    kd, nd = split_dims(shape, contract)
    return (*nd[:-1], nd[-1] // PANEL, *kd[:-1], kd[-1] // 2, PANEL, 2)


def packed_axes(name: str, axes: tuple) -> tuple:
    """Logical axes of a packed leaf: each dim keeps its logical axis (the two inner dims none)."""
    ka, na = split_dims(axes, PACK_CONTRACT[name])
    return (*na, *ka, None, None)


def is_packed(name: str | None, ndim: int) -> bool:
    """Static: is a leaf ``name`` of ``ndim`` dims in the packed layout (2 dims more than logical)?"""
    return name in PACK_CONTRACT and ndim == len(LOGICAL_AXES[name]) + 2


# scale leaf -> its weight, for the group scales ``[G, S, *Nd]`` (4-bit: ``aotlm.models.quant4``, int8 groups:
# ``aotlm.models.quant8``), stored panel-major (``pack_scales``) beside a packed weight
SCALE_OF = {**{s: n for s, n in QUANT_SCALES.items() if n in PACK_CONTRACT}, "embed_q_scale": "embed_q"}


def pack_scales(sm: np.ndarray) -> np.ndarray:
    """Group scales ``[G, S, *Nd]`` (f16, or a Q4_K / Q6_K matrix's uint8 ``[K / 256, 20 / 82, *Nd]``) ->
    panel-major ``[*Nd[:-1], Nd[-1] // 16, G, S, 16]``: each panel's scales one contiguous stream, read
    beside its codes (``aotlm/kernels/int4.h``, ``group8.h``); in ``[G, S, *Nd]`` a panel's groups are a
    cache line each, ``Nd`` apart. Every logical dim is kept, so a tensor-parallel shard is the packed
    form of the logical shard, as the weights' panels."""
    g, s, nd = sm.shape[0], sm.shape[1], sm.shape[2:]
    a = sm.reshape(g, s, *nd[:-1], nd[-1] // PANEL, PANEL)
    nn = len(nd)
    return np.ascontiguousarray(a.transpose(*range(2, 2 + nn), 0, 1, 2 + nn))


def unpack_scales(sm, nn: int):
    """``pack_scales``'s inverse (jnp or numpy) for ``nn`` output dims; a logical leaf as it is."""
    if sm.ndim != nn + 3:
        return sm
    lead, g, s = sm.shape[:nn], sm.shape[nn], sm.shape[nn + 1]
    a = sm.transpose(nn, nn + 1, *range(nn), nn + 2)
    return a.reshape(g, s, *lead[:-1], lead[-1] * PANEL)


def logical_axes(path: Path, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a parameter (norm scales and other small leaves: replicated); a leaf in
    the kernels' packed int8 layout (this module) has two more dims, and so has a group-scaled weight's
    scale leaf ``[G, S, *Nd]`` (its group axis: the weight's first contracted axis), three packed; an fp8
    matrix stored K-minor (``quant_fp8.is_tn``) one more."""
    axes = LOGICAL_AXES.get(path[-1], (None,) * ndim)
    if len(axes) + 2 == ndim and is_packed(path[-1], ndim):
        return packed_axes(path[-1], axes)
    if quant_fp8.is_tn(path[-1], ndim):
        return quant_fp8.tn_axes(path[-1], axes)
    if len(axes) + 2 <= ndim <= len(axes) + 3 and path[-1] in SCALE_OF:
        w = SCALE_OF[path[-1]]
        group_axis = LOGICAL_AXES[w][PACK_CONTRACT[w][0]]
        # "mlp" is zero-padded for tp (core.sharding), which would add groups the rows do not have
        groups = "mlp_groups" if group_axis == "mlp" else group_axis
        return (groups, None, *axes) if len(axes) + 2 == ndim else (*axes, groups, None, None)  # pack_scales
    if len(axes) != ndim:
        raise ValueError(f"parameter {path} has {ndim} dims but its logical axes are {axes}")
    return axes


def packed_k(name: str | None, ndim: int) -> int | None:
    """Static: the number of contracted dims of a packed leaf (what the kernels need), else None."""
    return len(PACK_CONTRACT[name]) if is_packed(name, ndim) else None


def logical_dims(name: str, shape: tuple) -> tuple[tuple, tuple]:
    """``(Kd, Nd)``: contracted and output dims of a packed leaf (or of a local shard of one)."""
    return layout.logical_dims(shape, len(PACK_CONTRACT[name]))


def _kernel_pack(arr: np.ndarray, contract: tuple[int, ...], codes: bool) -> np.ndarray | None:
    """``pack`` / ``pack_q4`` by the kernels' threads (``kernels.pack_panels``; numpy's strided copies took
    ~10% of converting an 8B model): the layout is that of the flattened ``[K, N]`` matrix, each dim
    split back out. None without the kernels."""
    if not kernels.enabled():
        return None
    nk = len(contract)
    a = np.moveaxis(arr, contract, tuple(range(nk)))  # [*Kd, *Nd]: a view
    kd, nd = a.shape[:nk], a.shape[nk:]
    k, n = math.prod(kd), math.prod(nd)
    m = kernels.transpose(arr) if arr.ndim == 2 and contract == (1,) else None  # [N, K] -> [K, N]
    m = m if m is not None else np.ascontiguousarray(a).reshape(k, n)
    out = kernels.pack_panels(m, codes)
    if out is None:
        return None
    rows = layout.Q4_ROWS if codes else 2
    return out.reshape(*nd[:-1], nd[-1] // PANEL, *kd[:-1], kd[-1] // rows, *out.shape[2:])


def pack(arr: np.ndarray, contract: tuple[int, ...]) -> np.ndarray:
    """Logical int8 / bf16 / f16 weight -> packed (host side, while loading)."""
    done = _kernel_pack(arr, contract, codes=False)
    if done is not None:
        return done
    nk = len(contract)
    a = np.moveaxis(arr, contract, tuple(range(nk)))  # [*Kd, *Nd]
    kd, nd = a.shape[:nk], a.shape[nk:]
    a = a.reshape(*kd[:-1], kd[-1] // 2, 2, *nd[:-1], nd[-1] // PANEL, PANEL)
    # dims of a: K-blocks 0..nk (pair dim at nk-1, then the "2" at nk), N-blocks nk+1.. (16 last)
    k_blocks = list(range(nk))
    n_blocks = list(range(nk + 1, a.ndim - 1))
    return np.ascontiguousarray(a.transpose(*n_blocks, *k_blocks, a.ndim - 1, nk))


def unpack(w, name: str):
    """Packed -> logical ``[*Kd, *Nd]`` in jnp (XLA's path when the kernels are not used)."""
    kd, nd = logical_dims(name, w.shape)
    nk, nn = len(kd), len(nd)
    # w dims: N-blocks 0..nn-1, K-blocks nn..nn+nk-1, PANEL, 2
    order = (*range(nn, nn + nk), nn + nk + 1, *range(nn), nn + nk)
    return jnp.transpose(w, order).reshape(*kd, *nd)


def pad_vocab(name: str, arr: np.ndarray, tp: int) -> np.ndarray:
    """Zero-pad the vocab axis of an lm_head leaf (``VOCAB_LEAVES``) to a multiple of 16 * tp."""
    axis = logical_axes((name,), arr.ndim).index("vocab")
    extra = -arr.shape[axis] % (PANEL * tp)
    if not extra:
        return arr
    widths = [(0, extra if i == axis else 0) for i in range(arr.ndim)]
    return np.pad(arr, widths)


def pack_if(name: str, arr: np.ndarray, sharded: tuple[bool, ...], tp: int) -> np.ndarray:
    """``arr`` packed if it is an int8 / bf16 / f16 leaf the kernels multiply and its shape
    allows, else as is.

    ``sharded``: per logical dim, whether tensor parallelism splits it over ``tp`` devices; such a
    dim must split into whole panels (output) or pairs of rows (contracted) per device.
    """
    codes = arr.dtype == np.uint8  # a 4-bit leaf's codes (aotlm.models.quant4): always packed
    if name not in PACK_CONTRACT or arr.ndim != len(LOGICAL_AXES[name]):
        return arr
    if not (codes or arr.dtype.name in DTYPES):
        return arr
    contract = PACK_CONTRACT[name]
    kd, nd = split_dims(arr.shape, contract)
    rows = layout.Q4_ROWS if codes else 2  # rows of W per packed unit along the last contracted dim
    pshape = (*nd[:-1], nd[-1] // PANEL, *kd[:-1], kd[-1] // rows)
    ks, ns = split_dims(sharded, contract)
    split = any(s and n % tp for s, n in zip((*ns, *ks), pshape, strict=False))
    if kd[-1] % rows or nd[-1] % PANEL or math.prod(arr.shape) == 0 or split:
        if codes:
            raise ValueError(
                f"4-bit {name} {arr.shape} does not split into whole panels of 16 columns / pairs of rows "
                f"over tp={tp}; use another tp_degree or quant='int8'"
            )
        return arr
    return pack_q4(arr, contract) if codes else pack(arr, contract)


def pack_q4(codes: np.ndarray, contract: tuple[int, ...]) -> np.ndarray:
    """Logical 4-bit codes (one per byte, ``aotlm.models.quant4``) -> ``[*Nd[:-1], Nd[-1] // 16,
    *Kd[:-1], Kd[-1] // 8, 16, 4]``: per block of 8 rows, byte ``(c, t)`` holds rows ``t`` (low nibble)
    and ``t + 4`` (high) of column ``c`` (``aotlm/kernels/int4.h``)."""
    done = _kernel_pack(codes, contract, codes=True)
    if done is not None:
        return done
    nk = len(contract)
    a = np.moveaxis(codes, contract, tuple(range(nk)))  # [*Kd, *Nd]
    kd, nd = a.shape[:nk], a.shape[nk:]
    a = a.reshape(*kd[:-1], kd[-1] // layout.Q4_ROWS, 2, 4, *nd[:-1], nd[-1] // PANEL, PANEL)
    # dims: K-blocks 0..nk-1, half nk, t nk+1, N-blocks nk+2.., column last
    n_blocks = list(range(nk + 2, a.ndim - 1))
    a = a.transpose(*n_blocks, *range(nk), a.ndim - 1, nk + 1, nk)  # [..N, ..K, 16, 4, 2]
    return np.ascontiguousarray(a[..., 0] | (a[..., 1] << 4))


def prepare(name: str, arr: np.ndarray, spec: tuple, tp: int) -> np.ndarray:
    """Host-side, after ``sharding.prepare_param``: pad an lm_head leaf's vocab, then ``pack_if``.

    ``spec``: the leaf's partition spec (``None`` = a dim not split over the mesh). An f32 lm_head stays
    row-major and unpadded: f32 is the reference layout (memory plan, logits sharding under tp, where
    a padded vocab moves the shard boundaries and slicing the logits back costs a collective each step).
    """
    if name == "lm_head" and arr.dtype == np.float32:  # (its scale leaf is f32 too: padded below)
        return arr
    if name in VOCAB_LEAVES:
        arr = pad_vocab(name, arr, tp)
    q4_scales = name in SCALE_OF and arr.ndim == len(LOGICAL_AXES[name]) + 2
    if q4_scales and kscales.is_kform(arr) and spec and spec[0] is not None and arr.shape[0] % tp:
        arr = kscales.to_groups(arr)  # Q4_K blocks of 256 split over the mesh: f16 scales per 32 instead
    if q4_scales and arr.dtype == np.uint8 and spec and spec[0] is not None and arr.shape[0] % tp:
        rows = 32 if arr.shape[1] in Q5_ROWS.values() else 256  # Q5_0 / Q5_1's groups, K-quants' blocks
        raise ValueError(
            f"{name}: {arr.shape[0]} blocks of {rows} rows (a GGUF file's 5- / 6-bit codes, whose high bits "
            f"live in the blocks) do not split over tp={tp}; use another tp_degree or quant='int8'"
        )
    if q4_scales and spec and spec[0] is not None and arr.shape[0] % tp:  # groups split over the mesh
        raise ValueError(
            f"{name}: {arr.shape[0]} groups of weights do not split over tp={tp}; use another tp_degree, "
            "a smaller group size (quant='int4' is groups of 32) or per-channel scales (4-bit: quant='int8'; "
            "a GGUF file's Q8_0 / Q5_* blocks: quant='w8a8')"
        )
    if q4_scales:  # panel-major where its weight is packed: whole panels of 16 columns on each device
        nd = arr.shape[2:]
        panels = (*nd[:-1], nd[-1] // PANEL)
        split = any(s is not None and n % tp for s, n in zip(spec[2:], panels, strict=False))
        return arr if nd[-1] % PANEL or split else pack_scales(arr)
    return pack_if(name, arr, tuple(s is not None for s in spec), tp)
