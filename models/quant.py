"""Weight-storage options applied on the host while loading: int8 weights and fused projections.

Both are rewrites of finished parameters (after a family's HF-name table, before sharding), so
no family needs code of its own: they act on the generic leaf names every family produces.

* ``QuantizationConfig(quant_dtype="s8")`` (transformers-neuronx semantics): every big matrix
  (``CONTRACT_AXES`` in ``aotlm.models.axes``: q/k/v/o, MLP, MoE experts, untied ``lm_head``, and
  their fused forms) is stored as int8 plus a per-output-channel scale
  ``max|w| / 127`` over its input (contracted) dims, leaf ``<name>_scale``. Inside the graph
  the int8 weight is converted to the compute (amp) dtype -- the dequant dtype -- and the scale
  is applied to the float32-accumulated product, which equals ``x @ (q * scale)`` since the
  scale is constant along the contracted dims. The embedding, norms, biases and the MoE router
  stay in the amp dtype. With the CPU kernels (``embed_view``) a tied lm_head gets its own int8
  copy of the embedding, ``embed_q [V, D]`` + ``embed_q_scale [V]`` (per vocab row; a GGUF file's
  Q8_0 / Q5_* table: its own groups, ``quant8``), which the logits read whole every token (31% of
  GPT-2-small's bytes); 1/4 (f32) or 1/2 (bf16) of the embedding's memory, dropped when untied.
* ``QuantizationConfig(quant_dtype="bf16" | "f16")``: the same matrices stored as bfloat16 / float16,
  no scales (``embed_q`` in that dtype, unit scales), as ``amp="bf16"`` / ``"f16"`` store weights on CPU
  with the kernels (``aotlm.core.precision``).
* ``fuse_qkv``: ``wq/wk/wv`` become one ``wqkv [D, K, G+2, Dh]`` (per kv head: its ``G = H/K``
  query heads, then its k and v), so one matmul per layer computes q, k and v; the kv-heads axis
  is the sharded one, so every device keeps its query heads with the k/v they read. Gate and up
  become ``w_gu [D, 2, F]`` (MoE: ``e_gu [E, D, 2, F]``). Biases fuse the same way; a bias set
  that is only partly present stays unfused and is added after the fused matmul.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from aotlm.models import codes4, quant4, quant8, quant_fp8, rounding
from aotlm.models.axes import CONTRACT_AXES, Path
from aotlm.models.checkpoint import transposed
from aotlm.models.fusing import fuse_qkv_heads
from aotlm.models.lookup import GroupedRows
from aotlm.models.packing import PACK_CONTRACT

logger = logging.getLogger("aotlm.models.quant")

QUANT_DTYPES = ("s8", "int8", "bf16", "f16", "int4", "f8")
DEQUANT_DTYPES = ("bf16", "f16", "f32")  # transformers-neuronx's names; must equal the model's amp
FLOAT_DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}  # weight-only float storage

# fused leaf -> (its parts in order, the axis of the new "part" axis in the fused array)
FUSED = {
    "w_gu": (("w_gate", "w_up"), 1),  # [D, 2, F]
    "b_gu": (("b_gate", "b_up"), 0),  # [2, F]
    "e_gu": (("e_gate", "e_up"), 2),  # [E, D, 2, F]
    "wqkv": (("wq", "wk", "wv"), 1),  # [D, K, G+2, Dh] (grouped, see fuse_qkv_heads)
    "bqkv": (("bq", "bk", "bv"), 0),  # [K, G+2, Dh]
}
_PART_OF = {part: fused for fused, (parts, _) in FUSED.items() for part in parts}


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight quantization (transformers-neuronx ``QuantizationConfig`` subset).

    ``quant_dtype``: storage dtype, ``"s8"`` (int8, symmetric, per output channel), ``"bf16"`` or
    ``"f16"`` (weight-only bfloat16 / float16, no scales: half the bytes of f32, activations stay
    in the compute dtype, as llama.cpp runs f16 weights with f32 activations). ``dequant_dtype``
    (transformers-neuronx's field): ``"bf16"``, ``"f16"``, ``"f32"`` or None; as in
    transformers-neuronx it must equal the model's ``amp`` (checked when the model is built,
    ``aotlm.core.precision``), None meaning the amp. int8 weights are dequantized to the compute
    dtype (the amp's, or f32 where the CPU kernels take amp as weight storage). ``lm_head``: also
    quantize an untied lm_head (a tied one is the embedding, which is never quantized).
    ``activations`` (aotlm's, not transformers-neuronx's): ``"s8"`` with int8 weights (``quant="w8a8"``)
    also rounds prefill's activations to int8 per row (dynamic scale ``max|x| / 127``, in the graph)
    and sums int8 x int8 products in int32 (W8A8); ``"bf16"`` with bf16 weights (``quant="bf16a"``)
    rounds them to bf16 (``aotlm.models.lowp``; ``vdpbf16ps`` with AVX512-BF16). Decode keeps float
    activations, where reading the weights, not the arithmetic, is the cost.
    ``quant_dtype="int4"`` (aotlm's): 4-bit codes in groups of ``group_size`` (32, 64, 128) input rows with
    f16 scales, ``asymmetric`` adding a per-group minimum (``aotlm.models.quant4``); activations rounded
    to int8 per group as llama.cpp's, as int16 (two int8 digits, 2x the integer products) with
    ``activations="s16"`` (``"int4-a16"``), or in three int8 parts (3x, f32's precision) with ``"f32"``.
    ``quant_dtype="f8"`` (``quant="fp8"``): e4m3 weights per output channel, every product's rows rounded
    to e4m3 too (``aotlm.models.quant_fp8``: GPUs with fp8 tensor cores)."""

    quant_dtype: str = "s8"
    lm_head: bool = True
    dequant_dtype: str | None = None
    activations: str | None = None
    group_size: int = 32
    asymmetric: bool = False

    def __post_init__(self):
        if self.quant_dtype not in QUANT_DTYPES:
            raise ValueError(f"quant_dtype={self.quant_dtype!r} is not supported; use one of {QUANT_DTYPES}")
        if self.dequant_dtype is not None and self.dequant_dtype not in DEQUANT_DTYPES:
            raise ValueError(
                f"dequant_dtype={self.dequant_dtype!r} is not supported; choose one of "
                f"{DEQUANT_DTYPES} (the model's amp) or None"
            )
        if self.group_size not in quant4.GROUPS:
            raise ValueError(f"group_size={self.group_size!r} is not supported; use one of {quant4.GROUPS}")
        int8 = self.quant_dtype in ("s8", "int8")
        ok = {None: True, "s8": int8, "bf16": self.quant_dtype == "bf16", "s16": self.int4, "f32": self.int4}
        if not ok.get(self.activations, False):
            raise ValueError(
                f"activations={self.activations!r} is not supported; use None, 's8' with int8 weights, "
                "'bf16' with bf16 weights, 's16' or 'f32' with int4 weights"
            )

    @property
    def w8a8(self) -> bool:
        """int8 activations in prefill (``activations="s8"``)."""
        return self.activations == "s8"

    @property
    def bf16a(self) -> bool:
        """bf16 activations in prefill (``activations="bf16"``, ``quant="bf16a"``)."""
        return self.activations == "bf16"

    @property
    def fp8(self) -> bool:
        """e4m3 weights and activations (``aotlm.models.quant_fp8``)."""
        return self.quant_dtype == "f8"

    @property
    def int4(self) -> bool:
        """4-bit group-wise weights (``aotlm.models.quant4``)."""
        return self.quant_dtype == "int4"

    @property
    def label(self) -> str:
        """The storage in one word, e.g. ``int8``, ``bf16``, ``int4-g32``, ``int4-g64-asym``."""
        if self.int4:
            return f"int4-g{self.group_size}" + "-asym" * self.asymmetric + X_SUFFIX.get(self.activations, "")
        return {"s8": "int8", "f8": "fp8"}.get(self.quant_dtype, self.quant_dtype)


def quant_config(quant: str | QuantizationConfig | None) -> QuantizationConfig | None:
    """``None``, ``"int8"`` / ``"s8"`` / ``"w8a8"`` / ``"bf16"`` / ``"bf16a"`` / ``"f16"`` or a config ->
    config.

    ``"none"``: float weights, said explicitly (a GGUF model's default storage is then not applied).
    """
    if quant == "none":
        return None
    if quant is None or isinstance(quant, QuantizationConfig):
        return quant
    if isinstance(quant, str) and quant in QUANT_DTYPES:
        return QuantizationConfig(quant_dtype=quant)
    named = {"w8a8": ("s8", "s8"), "bf16a": ("bf16", "bf16"), "fp8": ("f8", None)}  # weights, activations
    if isinstance(quant, str) and quant in named:
        return QuantizationConfig(quant_dtype=named[quant][0], activations=named[quant][1])
    if isinstance(quant, str) and quant in INT4_NAMES:
        return INT4_NAMES[quant]
    raise ValueError(
        f"quant={quant!r} is not supported; use None, 'none', 'int8', 'w8a8', 'bf16', 'bf16a', 'f16', 'fp8', "
        "'int4' "
        "('int4-g64', 'int4-g128', '-asym' for a per-group minimum, '-a16' for int16 activations, "
        "'-f32a' for f32-precise ones) or a QuantizationConfig"
    )


# "int4", "int4-g64", "int4-asym", "int4-g128-asym", ... -> config ("int4" alone: groups of 32, symmetric;
# "int4-g32" says so explicitly, also for a GGUF file whose Q4_1 blocks "int4" would keep as "int4-asym");
F32A = "-f32a"  # at the end: the same storage, activations held as f32 holds them (activations="f32")
X_SUFFIX = {"s16": "-a16", "f32": F32A}  # "-a16": as int16 (activations="s16")
INT4_NAMES = {
    f"int4{suffix}{'-asym' * a}{X_SUFFIX.get(x, '')}": QuantizationConfig(
        "int4", group_size=g, asymmetric=a, activations=x
    )
    for g in quant4.GROUPS
    for suffix in (("", "-g32") if g == 32 else (f"-g{g}",))
    for a in (False, True)
    for x in (None, "s16", "f32")
}


def to_float(w: np.ndarray, dtype: str) -> np.ndarray:
    """Round to nearest even ``"bf16"`` / ``"f16"`` (as ``jnp.asarray(w, dtype)``)."""
    return np.asarray(w, np.float32).astype(FLOAT_DTYPES[dtype])


def quantize_int8(w: np.ndarray, contract: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8: ``q = round(w / s)``, ``s = max|w| / 127`` over the ``contract`` axes.

    Returns ``(q int8 of w's shape, s float32 of w's shape without the contract axes)``; an
    all-zero channel (e.g. tp padding) gets scale 0.
    """
    return rounding.per_channel(w, contract, 127, np.int8)


@dataclass(frozen=True)
class Int8Matrix:
    """A ``Linear`` weight already in int8 storage: ``q [in, out]`` and its per-output-channel ``scale``."""

    q: np.ndarray
    scale: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim


def int8_from_rows(
    chunks: Iterable[np.ndarray], shape: tuple[int, int], groups: str | None = None
) -> Int8Matrix:
    """A ``[out, in]`` float matrix given a few rows at a time, rounded as ``quantize_int8`` rounds its
    transpose (the same numbers: each output channel is one row here) and then transposed as int8, so
    only one chunk is ever float32. ``groups`` (a GGUF block type of ``quant8.TYPES``): as
    ``quant8.quantize_groups`` rounds the transpose (f16 scales ``[in / 32, S, out]``)."""
    q, at = np.empty(shape, np.int8), 0
    kind = quant8.TYPES.get(groups) if groups else None
    if kind:  # scales [in / 32, S, out]: each chunk's rows are the last axis
        scale = np.empty((shape[1] // quant8.GROUP, quant8.scale_rows(groups), shape[0]), np.float16)
        round_rows = lambda rows: quant8.quantize_groups(rows, (1,), *kind)  # noqa: E731
    else:
        scale, round_rows = np.empty(shape[0], np.float32), lambda rows: quantize_int8(rows, (1,))
    for rows in chunks:
        part = slice(at, at + len(rows))
        q[part], scale[..., part] = round_rows(rows)
        at += len(rows)
    if at != shape[0]:
        raise ValueError(f"{at} rows given for a matrix of {shape[0]}")
    return Int8Matrix(transposed(q), scale)


Q4_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # GGUF 4-bit blocks of 32 input rows: int4 groups keep them
# blocks int4 storage keeps as stored: the 4-bit ones, the 5- and 6-bit ones' codes (q5scales, k*scales)
INT4_KEEPS = (*Q4_BLOCK_TYPES, "Q5_0", "Q5_1", "Q5_K", "Q6_K")
Q8_BLOCK_TYPES = tuple(quant8.TYPES)  # GGUF blocks of 32 input rows held as stored by int8 groups (quant8)


class ParamRewriter:
    """Host-side rewrite of loaded parameters: fusion (``fuse_qkv``) then int8 quantization.

    ``rewrite(path, arr)`` returns the ``(path, array)`` pairs to place now (a part of a fused
    weight is held until its siblings arrive); ``finish()`` returns whatever is still held
    (bias sets that were only partly present), unfused.
    """

    def __init__(
        self,
        quant: QuantizationConfig | None = None,
        fuse_qkv: bool = False,
        embed_view: bool = False,
        gguf_blocks: bool = False,
        blocks=None,
        lookup: bool = False,
        tied: bool = True,
    ):
        self.quant = quant
        self.gguf_blocks = gguf_blocks  # int4 from a GGUF file's Q4 blocks: exact codes, int8 embedding copy
        # a GGUF file's 4-bit codes (checkpoint.gguf_q4k.BlockCodes), read by load_params for int4 g32 only
        int4_g32 = quant is not None and quant.int4 and quant.group_size == 32
        self.blocks = blocks if blocks and int4_g32 and gguf_blocks else None
        # the int4 lm_head copy is made on every backend (the kernels' and XLA's logits then agree)
        # (an untied model's lm_head is its own: no copy)
        # (fp8: its own copy on any backend too)
        own = quant is not None and (quant.int4 and not gguf_blocks or quant.fp8)
        self.embed_view = tied and (embed_view or own)
        # a file's embedding may stay as its grouped codes (lookup.GroupedRows) where the logits do not
        # read it (untied, or a tied lm_head's own copy) and the weights are stored quantized
        head_copy = quant is not None and quant.lm_head and self.embed_view
        self.lookup = lookup and quant is not None and (not tied or head_copy)
        self.fuse_qkv = fuse_qkv
        self._held: dict[tuple, dict[str, np.ndarray]] = {}

    def keeps_codes(self, row) -> bool:
        """Do all of a loader row's outputs become 4-bit matrices (so a file's 4-bit codes can stay)?"""
        return self.blocks is not None and all(t[-1] in PACK_CONTRACT for t in row.targets)

    def fuses(self, path: Path) -> bool:
        """Is parameter ``path`` a part of a fused weight (``fuse_qkv``)?"""
        return self.fuse_qkv and path[-1] in _PART_OF

    def keeps_lookup(self, row) -> bool:
        """Does a loader row fill only the embedding, as stored (so a file's grouped codes can stay)?"""
        return self.lookup and row.targets == (("embed",),) and row.is_copy

    def keeps_head(self, row, src: str | None) -> bool:
        """May a tied embedding's logits' copy keep the file's ``src`` blocks (``rewrite(head=)``)?"""
        kept = self.blocks is not None and self.embed_view and src in INT4_KEEPS
        return kept and row.targets == (("embed",),)

    def rounds_rows(self, path: Path, src: str | None) -> bool:
        """Is matrix ``path`` (a ``Linear`` weight whose contracted axis is its HF rows' own) stored as
        int8, unfused, so a loader may hand it over already rounded (``Int8Matrix``)?"""
        q, name = self.quant, path[-1]
        if q is None or q.quant_dtype in FLOAT_DTYPES or q.fp8 or CONTRACT_AXES.get(name) != (0,):
            return False
        if self.fuses(path) or (name == "lm_head" and not q.lm_head):
            return False
        return not q.int4 or (self.gguf_blocks and src not in INT4_KEEPS)  # int4: a file's other types

    def int8_groups(self, path: Path, shape: tuple, src: str | None) -> bool:
        """Is matrix ``path`` of a GGUF file's ``src`` blocks stored as int8 groups (``quant8``: Q8_0 as
        stored) where this storage would round it per output channel (a tied embedding's logits' copy
        ``embed_q`` too)? Not under W8A8 (int8 x per row)."""
        q, name = self.quant, path[-1]
        if src not in Q8_BLOCK_TYPES or q is None or q.w8a8 or q.fp8 or q.quant_dtype in FLOAT_DTYPES:
            return False
        if name not in PACK_CONTRACT or (name == "lm_head" and not q.lm_head):
            return False
        return quant8.packable(shape, PACK_CONTRACT[name], vocab=name in ("lm_head", "embed_q"))

    def rewrite(self, path: Path, arr, src: str | None = None, head=None) -> list[tuple[Path, np.ndarray]]:
        """``arr``: a float array, or a GGUF file's 4-bit ``codes4.Codes`` (``keeps_codes``); ``src``: its
        GGUF block type (fused: 4-bit if all parts are); ``head``: a tied table's blocks (``keeps_head``)."""
        fused = _PART_OF.get(path[-1]) if self.fuse_qkv else None
        if fused is None:
            return self._quantize(path, arr, src, head)
        parts, axis = FUSED[fused]
        held = self._held.setdefault((*path[:-1], fused), {})
        held[path[-1]] = (arr, src)
        if len(held) < len(parts):
            return []
        del self._held[(*path[:-1], fused)]
        fuse = lambda arrs: (
            fuse_qkv_heads(*arrs, axis) if fused in ("wqkv", "bqkv") else np.stack(arrs, axis=axis)
        )
        arrs, srcs = [held[p][0] for p in parts], {held[p][1] for p in parts}
        src = srcs.pop() if len(srcs) == 1 else "mixed"
        codes = codes4.fuse_codes(arrs, fuse) if all(isinstance(a, codes4.Codes) for a in arrs) else None
        if codes is not None:  # (None: parts of 4- and 6-bit codes, a "mixed" source stored as int8)
            return self._quantize((*path[:-1], fused), codes, src)
        return self._quantize((*path[:-1], fused), fuse([_floats(a) for a in arrs]), src)

    def float_dtype(self, name: str) -> np.dtype | None:
        """The bf16 / f16 dtype leaf ``name`` is stored in by this rewriter, else None."""
        q = self.quant
        if q is None or q.quant_dtype not in FLOAT_DTYPES:
            return None
        if name == "embed_q" or (name in CONTRACT_AXES and (name != "lm_head" or q.lm_head)):
            return np.dtype(FLOAT_DTYPES[q.quant_dtype])
        return None

    def finish(self) -> list[tuple[Path, np.ndarray]]:
        out = []
        for key, held in self._held.items():
            for name, (arr, src) in held.items():
                out += self._quantize((*key[:-1], name), arr, src)
        self._held.clear()
        return out

    def _quantize(self, path: Path, arr, src=None, head=None) -> list[tuple[Path, np.ndarray]]:
        name = path[-1]
        if isinstance(arr, Int8Matrix):  # rounded by the loader (rounds_rows)
            return [(path, arr.q), ((*path[:-1], f"{name}_scale"), arr.scale)]
        if isinstance(arr, (codes4.Codes, codes4.Groups4)):
            if self.quant.int4 and name in PACK_CONTRACT and src in INT4_KEEPS:
                return self._int4(path, arr, PACK_CONTRACT[name])
            arr = arr.values()
        floating = self.quant is not None and self.quant.quant_dtype in FLOAT_DTYPES  # bf16 / f16
        lookup = arr.leaves(path) if isinstance(arr, GroupedRows) else [(path, arr)]
        if name == "embed" and self.quant is not None and self.quant.lm_head and self.embed_view:
            kept = None if head is None else head.lm_head(self.quant.asymmetric)
            if kept is not None:  # the file's own blocks (a tied Q6_K embedding: 0.82 bytes a weight)
                return [*lookup, ((*path[:-1], "embed_q"), kept[0]), ((*path[:-1], "embed_q_scale"), kept[1])]
            arr = arr.values() if isinstance(arr, GroupedRows) else arr  # the logits' copy from floats
            if floating:  # the logits' view: bf16 / f16 rows, unit scales (the lookup keeps its dtype)
                q, scale = to_float(arr, self.quant.quant_dtype), np.ones(arr.shape[0], np.float32)
            elif self.quant.int4 and not self.gguf_blocks and quant4.packable(arr.shape, (1,), 32, True):
                return [*lookup, *self._int4((*path[:-1], "embed_q"), arr, (1,))]
            elif self.quant.fp8:
                q, scale = quant_fp8.quantize(arr, (1,))
            elif self.int8_groups((*path[:-1], "embed_q"), arr.shape, src):  # a Q8_0 table's own groups
                q, scale = quant8.quantize_groups(arr, (1,), *quant8.TYPES[src])
            else:
                q, scale = quantize_int8(arr, (1,))  # per vocab row: the logits' output channel
            return [*lookup, ((*path[:-1], "embed_q"), q), ((*path[:-1], "embed_q_scale"), scale)]
        if isinstance(arr, GroupedRows):
            return lookup
        if self.quant is None or name not in CONTRACT_AXES or (name == "lm_head" and not self.quant.lm_head):
            return [(path, arr)]
        if floating:
            return [(path, to_float(arr, self.quant.quant_dtype))]
        # from a GGUF file with 4-bit blocks, only its kept blocks' matrices take codes (as stored); others
        # (Q8_0, F16, ...; Q5_0 / Q5_1 given as floats) int8, not rounded down to 4 bits
        as_stored = not self.gguf_blocks or src in INT4_KEEPS and src not in Q8_BLOCK_TYPES
        if self.quant.int4 and name in PACK_CONTRACT and as_stored:
            return self._int4(path, arr, PACK_CONTRACT[name]) or [(path, arr)]
        if self.quant.fp8:  # K-minor where a dense layer reads it (quant_fp8.TN_LEAVES)
            q, scale = quant_fp8.quantize(arr, CONTRACT_AXES[name])
            q = quant_fp8.tn(q, CONTRACT_AXES[name]) if name in quant_fp8.TN_LEAVES else q
        elif self.int8_groups(path, arr.shape, src):  # a file's Q8_0 / Q5_* blocks: their own codes, scales
            q, scale = quant8.quantize_groups(arr, PACK_CONTRACT[name], *quant8.TYPES[src])
        else:
            q, scale = quantize_int8(arr, CONTRACT_AXES[name])
        return [(path, q), ((*path[:-1], f"{name}_scale"), scale)]

    def _int4(self, path: Path, arr, contract: tuple[int, ...]) -> list[tuple[Path, np.ndarray]]:
        """4-bit codes and scales of ``path`` (``aotlm.models.quant4``); int8 where the shape does not fit.
        ``arr`` as ``codes4.Codes``: a GGUF file's blocks, whose codes and scales are kept."""
        q = self.quant
        if not quant4.packable(arr.shape, contract, q.group_size, vocab=path[-1] in ("embed_q", "lm_head")):
            q8, scale = quantize_int8(_floats(arr), contract)
            return [(path, q8), ((*path[:-1], f"{path[-1]}_scale"), scale)]
        kept = None
        odd = path[-1] == "lm_head" and getattr(arr, "bits", 4) != 4  # the 5- / 6-bit forms' vocab: panels
        if isinstance(arr, codes4.Codes):
            kept = codes4.from_codes(arr, contract, q.asymmetric, vocab=odd)
        elif isinstance(arr, codes4.Groups4) and contract == (0,):  # groups along axis 0 (out-only layouts)
            kept = (arr.panels() if odd else arr).stored(q.asymmetric)
        if kept is not None:
            return [(path, kept[0]), ((*path[:-1], f"{path[-1]}_scale"), kept[1])]
        if getattr(arr, "bits", 4) != 4:  # 5- / 6-bit blocks a layout split: int8, not rounded to 4 bits
            q8, scale = quantize_int8(arr.values(), contract)
            return [(path, q8), ((*path[:-1], f"{path[-1]}_scale"), scale)]
        exact = self.gguf_blocks and q.group_size == 32
        codes, sm = quant4.quantize_int4(_floats(arr), contract, q.group_size, q.asymmetric, exact)
        return [(path, codes), ((*path[:-1], f"{path[-1]}_scale"), sm)]


def _floats(arr) -> np.ndarray:
    """A float array, or a file's 4-bit codes dequantized (a storage that re-rounds them)."""
    return arr.values() if isinstance(arr, (codes4.Codes, codes4.Groups4)) else arr
