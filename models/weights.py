"""HF weight-name tables and the generic loader that applies them.

A family lists ``Row``s: which HF tensor fills which parameter(s), through which small
layout transform. The loader reads tensors one at a time (memory-mapped), converts
them to the compute dtype on the host and hands each finished parameter to ``place``
(which puts it on its device(s), sharded), so host memory never holds the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from aotlm.models.axes import LOGICAL_AXES, QUANT_SCALES, Path
from aotlm.models.checkpoint import CheckpointError, WeightReader, transposed
from aotlm.models.codes4 import Codes, Groups4
from aotlm.models.lookup import GroupedRows
from aotlm.models.quant import Int8Matrix, int8_from_rows


def same(a: np.ndarray) -> np.ndarray:
    """A row's tensor as stored (no layout change)."""
    return a


@dataclass(frozen=True)
class Row:
    """HF tensor ``hf`` -> parameter(s) ``targets`` via ``fn(array) -> array | tuple``."""

    targets: tuple[Path, ...]
    hf: str
    fn: Callable[[np.ndarray], np.ndarray | tuple[np.ndarray, ...]] = same
    optional: bool = False
    more: tuple[str, ...] = ()  # further HF tensors, passed as ``fn(hf, *more)`` (MoE expert stacks)

    @property
    def is_copy(self) -> bool:
        """One tensor taken as stored (no layout change, no further tensors)."""
        return self.fn is same and not self.more


def row(
    target: Path | Sequence[Path], hf: str, fn=None, optional: bool = False, more: Sequence[str] = ()
) -> Row:
    targets = tuple(target) if isinstance(target[0], tuple) else (tuple(target),)
    return Row(targets, hf, fn if fn is not None else same, optional, tuple(more))


# ---- common layout transforms (HF stores torch Linear weights as [out, in])
def linear_t(a: np.ndarray) -> np.ndarray:
    return transposed(a)


linear_t.out_only = True  # HF [out, X] -> [X, *out]: any X (a matrix's groups as well as its weights)


def heads_in(n_heads: int, head_dim: int, transpose: bool = True):
    """[out=H*Dh, in=D] (or [D, H*Dh] if not transpose) -> [D, H, Dh]."""

    def fn(a: np.ndarray) -> np.ndarray:
        return (transposed(a) if transpose else np.ascontiguousarray(a)).reshape(-1, n_heads, head_dim)

    fn.out_only = transpose  # as linear_t, the output axis then split into heads
    return fn


def heads_out(n_heads: int, head_dim: int, transpose: bool = True):
    """[out=D, in=H*Dh] (or [H*Dh, D]) -> [H, Dh, D]."""
    return lambda a: (transposed(a) if transpose else np.ascontiguousarray(a)).reshape(n_heads, head_dim, -1)


def bias_heads(n_heads: int, head_dim: int):
    return lambda a: a.reshape(n_heads, head_dim)


def split_qkv(n_heads: int, n_kv_heads: int, head_dim: int, grouped: bool):
    """A fused q/k/v ``Linear`` weight ``[out, D]`` (or bias ``[out]``) -> ``(q, k, v)`` in aotlm layout.

    ``grouped``: ``out`` is ``[K, H/K + 2, Dh]``, each kv head's query heads then its k and v
    (GPT-NeoX, BLOOM, SantaCoder MHA, Falcon: with ``K == H`` this is per-head ``q, k, v``).
    Otherwise ``out`` is ``[q heads | k heads | v heads]`` (MPT, Falcon-7B / SantaCoder MQA).
    """
    g = n_heads // n_kv_heads

    def fn(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        w = a if a.ndim == 1 else a.T  # [..., out]
        lead = w.shape[:-1]
        if grouped:
            w = w.reshape(*lead, n_kv_heads, g + 2, head_dim)
            q, k, v = w[..., :g, :].reshape(*lead, n_heads, head_dim), w[..., g, :], w[..., g + 1, :]
        else:
            q, k, v = np.split(w, [n_heads * head_dim, (n_heads + n_kv_heads) * head_dim], axis=-1)
            q, k, v = (x.reshape(*lead, -1, head_dim) for x in (q, k, v))
        return tuple(np.ascontiguousarray(x) for x in (q, k, v))

    return fn


def _resolve(reader: WeightReader, name: str, prefixes: Sequence[str]) -> str | None:
    for pre in prefixes:
        if pre + name in reader:
            return pre + name
    return None


def check_shape(path: Path, arr: np.ndarray, cfg, tensor: str, where) -> None:
    """Refuse a tensor whose shape contradicts ``config.json`` before it reaches a graph.

    Without this, a vocabulary or position table of the wrong length is silently clamped by the
    embedding gather (wrong tokens, no error) and other mismatches surface as XLA shape errors
    that do not name the tensor. Checked: the vocabulary axis everywhere, the learned-position
    rows, and the hidden / head / expert axes of per-layer matrices; norm vectors must be 1-D.
    """
    if cfg is None:
        return
    axes = LOGICAL_AXES.get(path[-1])
    want: dict[str, int] = {"vocab": cfg.vocab_size}
    if path[0] == "layers":
        want.update(embed=cfg.hidden_size, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads)  # not mlp: MPT differs
        if cfg.n_experts:
            want["experts"] = cfg.n_experts
    problem = None
    if axes is None:
        if arr.ndim == 0:
            problem = "is a scalar where a vector is expected"
        elif path[-1].startswith(("ln", "final_norm")) and arr.shape != (cfg.hidden_size,):
            problem = f"has shape {arr.shape} where config.json says ({cfg.hidden_size},)"
    elif arr.ndim != len(axes):
        problem = f"has {arr.ndim} dims where {len(axes)} are expected"
    elif path[-1] == "pos_embed" and arr.shape[0] < cfg.max_positions + cfg.learned_pos_offset:
        problem = f"has {arr.shape[0]} position rows, config.json needs {cfg.max_positions}"
    else:
        for i, a in enumerate(axes):
            if a in want and arr.shape[i] != want[a]:
                problem = f"has {a} size {arr.shape[i]} where config.json says {want[a]}"
                break
    if problem is not None:
        raise CheckpointError(
            f"tensor {tensor!r} in {where} {problem} (loaded as {'.'.join(map(str, path))} {arr.shape}); "
            "the weights do not match config.json: use the config.json saved with these weights"
        )


def load_params(
    rows: Sequence[Row],
    reader: WeightReader,
    prefixes: Sequence[str],
    dtype,
    place: Callable[[Path, np.ndarray], object],
    rewriter=None,
    cfg=None,
) -> dict:
    """Fill the params pytree from ``rows``; ``place(path, array)`` returns the leaf.

    ``rewriter`` (optional, ``aotlm.models.quant.ParamRewriter``): host-side rewrite of each finished
    parameter into the leaves actually placed (int8 + scale, bf16 / f16, fused q/k/v); quantization
    scales keep their dtype (float32; int4's float16), leaves it stores in bf16 / f16 keep that dtype,
    other floats become ``dtype``. ``cfg`` (the ``ArchConfig``): check each parameter's shape against it.
    """
    params: dict = {}
    stored_type = getattr(reader, "stored_type", lambda name: None)

    def put(path: Path, arr: np.ndarray) -> None:
        # quantization scales keep their dtype (f32; int4's f16), the rewriter's f16 leaves stay f16
        if arr.dtype.kind == "f" and path[-1] not in QUANT_SCALES and path[-1] != "embed_q_scale":
            stored = rewriter.float_dtype(path[-1]) if rewriter is not None else None
            arr = arr.astype(dtype if stored is None else stored)
        _set(params, path, place(path, arr))

    for r in rows:
        name = _resolve(reader, r.hf, prefixes)
        extra = [_resolve(reader, m, prefixes) for m in r.more]
        if name is None or None in extra:
            if r.optional:
                continue
            missing = r.hf if name is None else r.more[extra.index(None)]
            raise CheckpointError(
                f"tensor {missing!r} (tried prefixes {list(prefixes)}) is missing from the checkpoint "
                f"in {reader.path}; the checkpoint is incomplete or not of this architecture"
            )
        outs = None
        if rewriter is not None and rewriter.keeps_codes(r):  # a GGUF file's 4-bit codes, kept as stored
            outs = _groups4(r, reader, name, extra, rewriter) or rewriter.blocks.row(
                r.fn, [name, *extra], len(r.targets)
            )
        src = stored_type(name) if not extra else None  # a GGUF tensor's block type (Q4_0, Q6_K, ...)
        if outs is None and rewriter is not None:
            outs = _streamed(r, reader, name, src, rewriter)
        if outs is None:
            outs = _convert(r, reader, name, extra)
        for path, arr in zip(r.targets, outs, strict=True):
            arr = arr if isinstance(arr, (Codes, Groups4, GroupedRows, Int8Matrix)) else np.asarray(arr)
            check_shape(path, arr, cfg, name, reader.path)
            head = _head_blocks(r, reader, name, src, rewriter)
            for p, a in rewriter.rewrite(path, arr, src, head) if rewriter is not None else [(path, arr)]:
                put(p, a)
    for p, a in rewriter.finish() if rewriter is not None else []:
        put(p, a)
    params["layers"] = [params["layers"][i] for i in sorted(params.get("layers", {}))]
    return params


def _groups4(r: Row, reader, name: str, extra: list[str], rewriter) -> tuple | None:
    """A 4-bit matrix's codes and group scales moved by an out-only layout function (``linear_t``,
    ``heads_in``) as two small arrays (``codes4.Groups4``), without each weight carrying its group."""
    if extra or len(r.targets) != 1 or not getattr(r.fn, "out_only", False) or rewriter.fuses(r.targets[0]):
        return None
    got = reader.groups4(name, r.fn) if hasattr(reader, "groups4") else None
    return None if got is None else (got,)


def _head_blocks(r: Row, reader, name: str, src: str | None, rewriter):
    """A tied embedding's blocks moved to ``[D, V]`` (``codes4.Groups4``) for the logits' copy, where the
    rewriter keeps them (``ParamRewriter.keeps_head``); else None."""
    if rewriter is None or not rewriter.keeps_head(r, src) or not hasattr(reader, "groups4"):
        return None
    return reader.groups4(name, linear_t)


def _streamed(r: Row, reader, name: str, src: str | None, rewriter) -> tuple | None:
    """Row ``r``'s output read from a GGUF file's blocks without a float32 copy of the tensor: an
    embedding's codes for the lookup (``lookup.GroupedRows``), or a ``Linear`` weight bound for int8
    rounded a few rows at a time (``quant.Int8Matrix``); None when neither applies."""
    got = None
    if rewriter.keeps_lookup(r) and hasattr(reader, "lookup"):
        got = reader.lookup(name)
    elif len(r.targets) == 1 and r.fn is linear_t and rewriter.rounds_rows(r.targets[0], src):
        chunks = reader.row_chunks(name) if hasattr(reader, "row_chunks") else None
        if chunks is not None:  # a file's Q8_0 / Q5_* blocks: int8 groups as stored (quant8)
            groups = rewriter.int8_groups(r.targets[0], reader.shape(name)[::-1], src)
            blocks = reader.q8_blocks(name) if groups and hasattr(reader, "q8_blocks") else None
            if blocks is not None:  # Q8_0: the codes and scales themselves, transposed
                got = Int8Matrix(transposed(blocks[0]), transposed(blocks[1])[:, None])
            else:
                got = int8_from_rows(chunks, reader.shape(name), src if groups else None)
    return None if got is None else (got,)


def _convert(r: Row, reader: WeightReader, name: str, extra: list[str]) -> tuple:
    """Row ``r``'s outputs from its tensors read as floats."""
    try:
        out = r.fn(reader.get(name), *(reader.get(m) for m in extra))
    except ValueError as e:  # a layout transform's reshape refused the tensor's shape
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"tensor {name!r} in {reader.path} has a shape that does not fit config.json ({e}); "
            "use the config.json saved with these weights"
        ) from e
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != len(r.targets):
        raise ValueError(f"row for {r.hf} produced {len(outs)} arrays for {len(r.targets)} targets")
    return outs


def _set(tree: dict, path: Path, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
