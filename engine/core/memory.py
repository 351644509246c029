"""Per-device memory plan: weights + KV cache bytes from shapes alone (no weights read).

transformers-neuronx rule: the weights and the KV cache must both fit in each device's
memory. With tensor parallelism each device holds ``1/tp`` of every sharded weight (after
padding vocab / MLP dims to a multiple of tp), a full copy of every replicated one (norms,
biases of row-parallel layers, position embeddings; attention weights under
``shard-over-batch``) and ``1/tp`` of the KV cache (per kv head or per batch row; with
``replicated-heads`` the kv heads are first repeated to ``lcm(K, tp)``). Activations and
executables are not counted (small next to weights + cache for inference).

Weights are counted as the loader stores them (``stored_leaves``): int8 matrices at 1 byte plus an f32
scale per output channel (a GGUF file's Q8_0 blocks: an f16 scale per 32 rows, ``aotlm.models.quant8``),
4-bit groups (``aotlm.models.quant4``) at half a byte plus an f16 scale (and minimum) per group, bf16 /
f16 storage at 2 bytes, the copy of the embedding a tied lm_head gets when quantized, and the vocab
padding of the kernels' panel layout; the rest in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from aotlm import kernels
from aotlm.core import buckets as bk
from aotlm.core import pipeline, precision, sharding
from aotlm.core.spec import DEFAULT_N_POSITIONS, check_shapes
from aotlm.kernels import gpu_matmul, layout
from aotlm.models import family_for, kscales, quant4, quant8
from aotlm.models.arch import ArchConfig
from aotlm.models.axes import CONTRACT_AXES
from aotlm.models.checkpoint import gguf, load_hf_config
from aotlm.models.packing import PACK_CONTRACT, PANEL, SCALE_OF, VOCAB_LEAVES
from aotlm.models.quant import FLOAT_DTYPES, INT4_KEEPS, Q8_BLOCK_TYPES, QuantizationConfig

GIB = 2**30
K_ROWS = {"Q4_K": kscales.ROWS, "Q5_K": layout.K5_ROWS, "Q6_K": layout.K6_ROWS}  # scale leaf rows per 256


class MemoryPlanError(ValueError):
    """The model does not fit the device memory with this configuration."""


def estimate_param_shapes(cfg: ArchConfig, biases: bool = False) -> dict[tuple, tuple[int, ...]]:
    """Parameter shapes (before tp padding) implied by ``cfg``.

    Bias vectors are not part of ``ArchConfig``; ``biases=True`` adds the usual q/k/v/o and
    MLP biases (GPT-2 style). They are < 0.1% of any real model.
    """
    d, h, k, dh, f, v = (
        cfg.hidden_size,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    shapes: dict[tuple, tuple[int, ...]] = {("embed",): (v, d)}
    if cfg.position == "learned":
        shapes[("pos_embed",)] = (cfg.max_positions + cfg.learned_pos_offset, d)
    norms = ("scale", "bias") if cfg.norm == "layernorm" else ("scale",)
    for i in range(cfg.n_layers):
        p = ("layers", i)
        names = ["ln1"] + ([] if cfg.shared_input_norm else ["ln2"])
        for n in names:
            shapes.update({p + (f"{n}_{s}",): (d,) for s in norms})
        shapes.update({p + ("wq",): (d, h, dh), p + ("wk",): (d, k, dh), p + ("wv",): (d, k, dh)})
        shapes[p + ("wo",)] = (h, dh, d)
        if cfg.qk_norm:
            shapes.update({p + ("q_norm_scale",): (dh,), p + ("k_norm_scale",): (dh,)})
        if cfg.n_experts:
            e = cfg.n_experts
            shapes.update({p + ("router",): (d, e), p + ("e_up",): (e, d, f), p + ("e_down",): (e, f, d)})
            if cfg.gated_mlp:
                shapes[p + ("e_gate",)] = (e, d, f)
        else:
            shapes.update({p + ("w_up",): (d, f), p + ("w_down",): (f, d)})
            if cfg.gated_mlp:
                shapes[p + ("w_gate",)] = (d, f)
        if biases:
            shapes.update(
                {p + ("bq",): (h, dh), p + ("bk",): (k, dh), p + ("bv",): (k, dh), p + ("bo",): (d,)}
            )
            if not cfg.n_experts:
                shapes.update({p + ("b_up",): (f,), p + ("b_down",): (d,)})
                if cfg.gated_mlp:
                    shapes[p + ("b_gate",)] = (f,)
    shapes.update({("final_norm_" + s,): (d,) for s in norms})
    if not cfg.tie_embeddings:
        shapes[("lm_head",)] = (d, v)
    return shapes


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class Storage:
    """What the loader (``aotlm.models.quant.ParamRewriter``, ``aotlm.models.packing``) stores for a
    parameter, from shapes alone: leaves with their logical shapes and bytes per element."""

    def __init__(
        self, q: QuantizationConfig | None, compute: int, kernels_on: bool, gguf_blocks: bool, lookup=None,
        head: str | None = None, types: Mapping[tuple, str] | None = None,
    ):  # fmt: skip
        self.q, self.compute, self.gguf_blocks = q, compute, gguf_blocks
        # a GGUF file's block type of each parameter (``plan_for_checkpoint``): each matrix's own form (K /
        # Q5 scale leaves, Q8_0 / Q5_* int8 groups)
        self.types = types
        self.head = head  # a GGUF file's tied embedding's block type (its logits' copy may keep them)
        self.lookup = lookup  # bytes per weight of a GGUF embedding kept as its codes (aotlm.models.lookup)
        int4 = q is not None and q.int4
        # the embedding copy for a tied lm_head: the CPU kernels', or the GPU int8 kernel's (not packed)
        self.view = q is not None and (kernels_on or gpu_matmul.head_copy(q) or q.fp8)  # fp8: on any backend
        self.packed = (q is not None and kernels_on) or int4 or (kernels_on and compute == 4)  # panel layout

    def leaves(self, path: tuple, shape: tuple, tied: bool) -> list[tuple[tuple, tuple, float]]:
        """``(leaf path, logical shape, bytes per element)`` of what parameter ``path`` becomes."""
        q, name, up = self.q, path[-1], path[:-1]
        if name == "embed" and q is not None:
            copy = tied and q.lm_head and (self.view or (q.int4 and not self.gguf_blocks))  # embed_q
            grouped = self.lookup and self.compute == 4 and (copy or not tied)  # as the loader decides
            own = [(path, shape, self.lookup if grouped else self.compute)]
            return own + (self._matrix((*up, "embed_q"), shape, (1,)) if copy else [])
        if q is None or name not in CONTRACT_AXES or (name == "lm_head" and not q.lm_head):
            return [(path, shape, self.compute)]
        return self._matrix(path, shape, CONTRACT_AXES[name])

    def _matrix(self, path: tuple, shape: tuple, contract: tuple) -> list[tuple[tuple, tuple, float]]:
        q, name, up = self.q, path[-1], path[:-1]
        scale = (*up, f"{name}_scale")
        if q.quant_dtype in FLOAT_DTYPES:
            per_row = [(scale, (shape[0],), 4)] if name == "embed_q" else []  # unit scales
            return [(path, shape, 2), *per_row]
        vocab = name in ("embed_q", "lm_head")
        kept = self._head(path, shape) if name == "embed_q" and self.gguf_blocks else None
        if kept:
            return kept
        known = self.types is not None and name != "embed_q"  # this matrix's own block type is known
        typ = self.types.get(path) if known else None
        # int4 takes every matrix of a file without kept blocks (re-rounded), and a file's kept types only
        four = not known or not self.gguf_blocks or typ in INT4_KEEPS  # others: int8 (groups / per channel)
        if q.int4 and four and name in PACK_CONTRACT and (name != "embed_q" or not self.gguf_blocks):
            contract = PACK_CONTRACT[name]
            if quant4.packable(shape, contract, q.group_size, vocab):
                k = _prod(shape[c] for c in contract)
                nd = tuple(n for i, n in enumerate(shape) if i not in contract)
                rows = K_ROWS.get(typ) if q.group_size == 32 and k % kscales.BLOCK == 0 else None
                if rows and self.blocks_kept(typ):
                    return [(path, shape, 0.5), (scale, (k // kscales.BLOCK, rows, *nd), 1)]
                if typ in layout.Q5_ROWS and q.group_size == 32 and self.blocks_kept(typ):
                    return [(path, shape, 0.5), (scale, (k // 32, layout.Q5_ROWS[typ], *nd), 1)]
                groups = (k // q.group_size, 2 if q.asymmetric else 1, *nd)
                return [(path, shape, 0.5), (scale, groups, 2)]
        channels = tuple(n for i, n in enumerate(shape) if i not in contract)
        # scale rows of a file's Q8_0 / Q5_* groups (1, or 2 with minimums)
        s8 = quant8.scale_rows(typ) if typ in Q8_BLOCK_TYPES else 0
        if name == "embed_q":  # a tied table's logits copy: its own groups where the table has them
            s8 = quant8.scale_rows(self.head)
        if s8 and not q.w8a8 and not q.fp8 and name in PACK_CONTRACT:
            if quant8.packable(shape, contract, vocab):  # as ParamRewriter.int8_groups decides
                k = _prod(shape[c] for c in contract)
                return [(path, shape, 1), (scale, (k // quant8.GROUP, s8, *channels), 2)]
        return [(path, shape, 1), (scale, channels, 4)]

    def _head(self, path: tuple, shape: tuple) -> list[tuple[tuple, tuple, float]] | None:
        """``embed_q [V, D]`` as the tied embedding's own blocks (``ParamRewriter.keeps_head``, the forms
        of ``codes4.Groups4.stored``), or None (an int8 copy)."""
        q, typ, (_, d) = self.q, self.head, shape
        if not (q.int4 and q.group_size == 32 and self.blocks_kept(typ)):
            return None
        whole = d % kscales.BLOCK == 0
        rows = K_ROWS.get(typ)
        if typ in ("Q6_K", "Q5_K") and not whole:
            return None
        if rows and whole:
            scale = ((d // kscales.BLOCK, rows, shape[0]), 1)
        elif typ in layout.Q5_ROWS:  # Q5_0 / Q5_1: their own scales and high bits per 32 (models.q5scales)
            scale = ((d // 32, layout.Q5_ROWS[typ], shape[0]), 1)
        else:  # Q4_0 / Q4_1: f16 scales (and minimums) per 32
            scale = ((d // 32, 2 if q.asymmetric else 1, shape[0]), 2)
        return [(path, shape, 0.5), ((*path[:-1], "embed_q_scale"), *scale)]

    def blocks_kept(self, typ: str | None) -> bool:
        """Are blocks of ``typ`` kept under this storage (those with a minimum need an asymmetric one)?"""
        return typ in INT4_KEEPS and (self.q.asymmetric or typ in ("Q4_0", "Q5_0", "Q6_K"))

    def pad_vocab(self, leaf: tuple, shape: tuple, per: float, tp: int) -> tuple:
        """``shape`` with the vocab padded to whole panels per device (``packing.prepare``)."""
        name = leaf[-1]
        if not self.packed or name not in VOCAB_LEAVES or (name == "lm_head" and per == 4):  # f32: row-major
            return shape
        axes = sharding.logical_axes(leaf, len(shape))
        return tuple(n + (-n % (PANEL * tp) if a == "vocab" else 0) for a, n in zip(axes, shape, strict=True))


def _kform_split(leaf: tuple, shape: tuple, per: float, split: bool, tp: int) -> bool:
    """Does a Q4_K scale leaf (``models.kscales``: a byte an element) have its blocks of 256 split over
    the mesh, so that ``models.packing.prepare`` stores f16 scales per group of 32 instead?"""
    return per == 1 and leaf[-1] in SCALE_OF and split and shape[0] % tp != 0


def memory_plan(
    cfg: ArchConfig,
    batch_size: int,
    n_positions: int,
    amp: str = "f32",
    tp: int = 1,
    gqa: str | None = None,
    param_shapes: Mapping[tuple, tuple[int, ...]] | None = None,
    pp: int = 1,
    micro_batches: int | None = None,
    kv_cache_dtype: str | None = None,
    quant: str | QuantizationConfig | None = None,
    kernels_on: bool | None = None,
    gguf_blocks: bool = False,
    gguf_lookup: float | None = None,
    gguf_head: str | None = None,
    gguf_types: Mapping[tuple, str] | None = None,
) -> dict:
    """Bytes per device of the weights and the KV cache for one configuration.

    ``param_shapes`` maps parameter paths (``("layers", 0, "wq")``) to their unpadded shapes;
    default: ``estimate_param_shapes(cfg)``. ``gqa=None`` picks the strategy the engine would
    pick (invalid tp / gqa raise the engine's errors). ``kv_cache_dtype``: the model's option
    (None follows amp). ``quant``: the weight storage (``"int8"``, a ``QuantizationConfig``, ...);
    ``kernels_on`` (default: this backend's); ``gguf_*``: a converted GGUF file's facts as the loader has
    them (``gguf.q4_types``, ``lookup_bytes``, ``embedding_type``, each parameter's type from
    ``hf_types``: ``Storage``)."""
    # amp on this backend (aotlm.core.precision; unknown names: the engine's errors)
    prec = precision.resolve(amp, quant, kernels_on, kv_cache_dtype)
    kernels_on = kernels.enabled() if kernels_on is None else kernels_on
    stages = pipeline.split_layers(cfg.n_layers, pp)
    n_micro = pipeline.micro_batches(batch_size, pp, micro_batches) if pp > 1 else 1
    strategy = sharding.choose_gqa(cfg.n_heads, cfg.n_kv_heads, batch_size // n_micro, tp, gqa)
    rule = sharding.rules(strategy, tp)
    shapes = dict(param_shapes) if param_shapes is not None else estimate_param_shapes(cfg)
    tied = ("lm_head",) not in shapes
    facts = (gguf_blocks, gguf_lookup, gguf_head, gguf_types)
    store = Storage(prec.quant, jnp.dtype(prec.compute).itemsize, kernels_on, *facts)
    w_total, w_stage = 0, [0] * pp  # per stage: the bytes on each of its devices
    for path, shape in shapes.items():
        for leaf, lshape, per in store.leaves(path, tuple(shape), tied):
            padded = sharding.prepared_shape(leaf, lshape, tp, strategy, cfg.n_kv_heads)
            padded = store.pad_vocab(leaf, padded, per, tp)
            spec = sharding.param_spec(leaf, len(padded), rule)
            axes = tuple(spec) + (None,) * (len(padded) - len(spec))
            if _kform_split(leaf, padded, per, axes[0] == sharding.TP, tp):  # f16 scales per 32 instead
                lshape, padded, per = (padded[0] * 8, 2, *padded[2:]), (padded[0] * 8, 2, *padded[2:]), 2
            local = [n // tp if ax == sharding.TP else n for n, ax in zip(padded, axes, strict=True)]
            w_total += int(_prod(lshape) * per)
            owner = ("lm_head",) if leaf[-1] in ("embed_q", "embed_q_scale") else path  # the logits' copy
            for st in pipeline.owners(stages, owner, tied):
                w_stage[st.index] += int(_prod(local) * per)
    rep = sharding.kv_replication(cfg.n_kv_heads, tp, strategy)
    kv_heads = cfg.n_kv_heads * rep
    kv_item = jnp.dtype(prec.kv).itemsize
    per_layer = batch_size * n_positions * kv_heads * cfg.head_dim * kv_item
    kv_total = 2 * cfg.n_layers * batch_size * n_positions * cfg.n_kv_heads * cfg.head_dim * kv_item
    # each stage: its layers' cache (every micro-batch's) + the replicated slot positions
    kv_dev = 2 * stages[0].count * per_layer // tp + batch_size * n_positions * 4
    w_dev = max(w_stage)  # the fullest stage's devices
    return {
        "pp": pp,
        "micro_batches": n_micro,
        "weights_bytes_per_stage_device": w_stage,
        "tp": tp,
        "gqa": strategy,
        "amp": amp,
        "weights": prec.quant.label if prec.quant is not None else jnp.dtype(prec.compute).name,
        "kv_dtype": jnp.dtype(prec.kv).name,
        "batch_size": batch_size,
        "n_positions": n_positions,
        "kv_heads_per_device": kv_heads if strategy == "shard-over-batch" else kv_heads // tp,
        "weights_bytes": w_total,
        "kv_cache_bytes": kv_total,
        "weights_bytes_per_device": w_dev,
        "kv_cache_bytes_per_device": kv_dev,
        "total_bytes_per_device": w_dev + kv_dev,
    }


def check_fits(plan: dict, device_memory_gb: float) -> None:
    """Raise ``MemoryPlanError`` unless weights + KV cache fit ``device_memory_gb`` GiB per device."""
    cap = float(device_memory_gb) * GIB
    need = plan["total_bytes_per_device"]
    if need <= cap:
        return
    w, kv = plan["weights_bytes_per_device"] / GIB, plan["kv_cache_bytes_per_device"] / GIB
    raise MemoryPlanError(
        f"the model needs {need / GIB:.2f} GiB per device (weights {w:.2f} GiB + KV cache {kv:.2f} GiB "
        f"for batch_size={plan['batch_size']} x n_positions={plan['n_positions']}, amp={plan['amp']}, "
        f"tp={plan['tp']}, gqa={plan['gqa']!r}) but each device has {float(device_memory_gb):.2f} GiB; "
        "use a larger tp_degree, amp='bf16', kv_cache_dtype='bf16', a smaller batch_size or n_positions"
    )


def format_plan(plan: dict) -> str:
    """One readable line for ``--dry-run`` output."""
    g = lambda b: f"{b / GIB:.3f} GiB"
    pp = f"pp={plan['pp']} ({plan['micro_batches']} micro-batches) " if plan.get("pp", 1) > 1 else ""
    return (
        f"{pp}tp={plan['tp']} gqa={plan['gqa']} amp={plan['amp']} weights={plan.get('weights', '?')} "
        f"kv={plan.get('kv_dtype', '?')}: "
        "per device weights "
        f"{g(plan['weights_bytes_per_device'])} + KV cache {g(plan['kv_cache_bytes_per_device'])} = "
        f"{g(plan['total_bytes_per_device'])} (whole model: weights {g(plan['weights_bytes'])}, "
        f"KV cache {g(plan['kv_cache_bytes'])})"
    )


def plan_for_checkpoint(
    path,
    batch_size: int = 1,
    n_positions=None,
    context_length_estimate=None,
    tp_degree: int = 1,
    gqa: str | None = None,
    amp: str = "f32",
    pp_degree: int = 1,
    micro_batches: int | None = None,
    kv_cache_dtype: str | None = None,
    quant: str | QuantizationConfig | None = None,
) -> dict:
    """The memory plan plus the list of graphs for a checkpoint, from its config.json only (and, for a
    converted GGUF model, its default storage: ``aotlm.models.checkpoint.gguf``)."""
    hf = load_hf_config(path)
    if quant is None:  # as the engine does (core/model.py)
        quant = gguf.default_quant(path, tp_degree)
    quant = gguf.int4_form(path, quant)
    q4 = gguf.q4_types(path)
    cfg = family_for(hf.model_type).arch_config(hf)
    if n_positions is None:  # the engine's default (core/model.py)
        n_positions = min(DEFAULT_N_POSITIONS, cfg.max_positions)
    tg = bk.token_buckets(n_positions)
    check_shapes(cfg, batch_size, tg)
    ctx = bk.context_buckets(context_length_estimate, tg)
    plan = memory_plan(
        cfg, batch_size, max(tg), amp, tp_degree, gqa, None, pp_degree, micro_batches, kv_cache_dtype,
        quant, gguf_blocks=bool(q4), gguf_lookup=gguf.lookup_bytes(path), gguf_head=gguf.embedding_type(path),
        gguf_types=_param_types(path, hf, cfg),
    )  # fmt: skip
    if pp_degree == 1:
        plan["graphs"] = bk.graph_keys(ctx, tg)
    else:  # every stage: prefill shapes and a decode step per token bucket; the last also "select"
        per = [("pp_prefill", c, w) for c, w in bk.prefill_graph_shapes(ctx, tg)] + [
            ("pp_step", w) for w in tg
        ]
        plan["graphs"] = [
            ("stage", s, *k) for s in range(pp_degree) for k in per + [("select",)] * (s == pp_degree - 1)
        ]
    return plan


def _param_types(path, hf, cfg: ArchConfig) -> dict[tuple, str] | None:
    """A converted GGUF model's block type of each parameter its loader fills from one of the file's
    2-D tensors (``gguf.hf_types`` through the family's weight rows); None for any other checkpoint."""
    types = gguf.hf_types(path)
    if types is None:
        return None
    family = family_for(hf.model_type)
    out = {}
    for row in family.weight_rows(cfg, hf):
        name = next((p + row.hf for p in family.PREFIXES if p + row.hf in types), None)  # as the loader
        out |= dict.fromkeys(row.targets, types[name]) if name is not None else {}
    return out
