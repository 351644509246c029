"""Per-device memory plan: weights + KV cache bytes from shapes alone (no weights read).

transformers-neuronx rule: the weights and the KV cache must both fit in each device's
memory. With tensor parallelism each device holds ``1/tp`` of every sharded weight (after
padding vocab / MLP dims to a multiple of tp), a full copy of every replicated one (norms,
biases of row-parallel layers, position embeddings; attention weights under
``shard-over-batch``) and ``1/tp`` of the KV cache (per kv head or per batch row; with
``replicated-heads`` the kv heads are first repeated to ``lcm(K, tp)``). Activations and
executables are not counted (small next to weights + cache for inference).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from aotlm.core import buckets as bk
from aotlm.core import pipeline, precision, sharding
from aotlm.core.spec import DEFAULT_N_POSITIONS
from aotlm.models import family_for
from aotlm.models.arch import ArchConfig
from aotlm.models.axes import CONTRACT_AXES
from aotlm.models.checkpoint import load_hf_config

GIB = 2**30


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
) -> dict:
    """Bytes per device of the weights and the KV cache for one configuration.

    ``param_shapes`` maps parameter paths (``("layers", 0, "wq")``) to their unpadded shapes;
    default: ``estimate_param_shapes(cfg)``. ``gqa=None`` picks the strategy the engine would
    pick (invalid tp / gqa raise the engine's errors). ``kv_cache_dtype``: the model's option
    (None follows amp), so a bf16 cache counts half an f32 one.
    """
    # what amp means on this backend (aotlm.core.precision): on CPU with the kernels, bf16 / f16
    # matrices with f32 activations, embedding, norms and (unless kv_cache_dtype says) KV cache
    prec = precision.resolve(amp, None, None, kv_cache_dtype)  # unknown names: the engine's errors
    item, other = jnp.dtype(precision.amp_dtype(amp)).itemsize, jnp.dtype(prec.compute).itemsize
    stages = pipeline.split_layers(cfg.n_layers, pp)
    n_micro = pipeline.micro_batches(batch_size, pp, micro_batches) if pp > 1 else 1
    strategy = sharding.choose_gqa(cfg.n_heads, cfg.n_kv_heads, batch_size // n_micro, tp, gqa)
    rule = sharding.rules(strategy, tp)
    shapes = dict(param_shapes) if param_shapes is not None else estimate_param_shapes(cfg)
    tied = ("lm_head",) not in shapes
    w_total, w_stage = 0, [0] * pp  # per stage: the bytes on each of its devices
    for path, shape in shapes.items():
        padded = sharding.prepared_shape(path, tuple(shape), tp, strategy, cfg.n_kv_heads)
        spec = sharding.param_spec(path, len(padded), rule)
        axes = tuple(spec) + (None,) * (len(padded) - len(spec))
        local = [n // tp if ax == sharding.TP else n for n, ax in zip(padded, axes, strict=True)]
        size = item if path[-1] in CONTRACT_AXES or path[-1] == "lm_head" else other
        w_total += _prod(shape) * size
        for st in pipeline.owners(stages, path, tied):
            w_stage[st.index] += _prod(local) * size
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
        f"{pp}tp={plan['tp']} gqa={plan['gqa']} amp={plan['amp']} kv={plan.get('kv_dtype', '?')}: "
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
) -> dict:
    """The memory plan plus the list of graphs for a checkpoint, from its config.json only."""
    hf = load_hf_config(path)
    cfg = family_for(hf.model_type).arch_config(hf)
    if n_positions is None:  # the engine's default (core/model.py)
        n_positions = min(DEFAULT_N_POSITIONS, cfg.max_positions)
    tg = bk.token_buckets(n_positions)
    ctx = bk.context_buckets(context_length_estimate, tg)
    plan = memory_plan(
        cfg, batch_size, max(tg), amp, tp_degree, gqa, None, pp_degree, micro_batches, kv_cache_dtype
    )
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
