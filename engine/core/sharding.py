"""Device mesh, GQA strategy and the logical-axis -> mesh-axis rules (Megatron tensor parallelism).

Every parameter declares its logical axes once (``aotlm.models.axes.LOGICAL_AXES``); this
module only decides which logical axis goes on the ``"tp"`` mesh axis. XLA's SPMD
partitioner then inserts the collectives implied by the shardings, so model code stays
free of communication calls. Layout (checked in the compiled HLO by ``tests/core/test_sharding.py``):

* q/k/v and MLP up/gate column-parallel (``heads`` / ``kv_heads`` / ``mlp`` on ``tp``),
  attention output and MLP down row-parallel: one all-reduce after attention and one
  after the MLP per layer;
* embedding and lm_head sharded on ``vocab``, padded to a multiple of tp (the padded
  logit columns are sliced off by ``decoder.logits`` before any sampling);
* the intermediate (``mlp``) dim is zero-padded to a multiple of tp (zero up/gate columns
  and zero down rows contribute exactly 0);
* the KV cache sharded on kv heads (or on batch with ``shard-over-batch``).

GQA strategies (transformers-neuronx names):

* ``shard-over-heads``: kv heads split over tp (needs ``n_kv_heads % tp == 0``).
* ``replicated-heads``: each kv head is repeated ``r = lcm(K, tp) / K`` times on the host
  before sharding, so every device holds exactly the kv head(s) its query heads read:
  exact (copies), no collective in attention, per-device KV cache ``K/gcd(K, tp)`` heads.
* ``shard-over-batch``: the KV cache and attention are split over batch rows; attention
  weights are replicated, the MLP and vocab stay tensor-parallel (one all-gather of the
  attention output per layer instead of an all-reduce). Needs ``batch_size % tp == 0``.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from aotlm.models.fusing import regroup_qkv
from aotlm.models.packing import logical_axes

TP = "tp"
GQA_STRATEGIES = ("shard-over-heads", "replicated-heads", "shard-over-batch")
KV_LEAVES = (
    "wk",
    "wv",
    "bk",
    "bv",
    "wk_scale",
    "wv_scale",
    "wk_lora_b",
    "wv_lora_b",
)  # kv-heads axis (repeated by replicated-heads)
FUSED_KV_LEAVES = ("wqkv", "bqkv", "wqkv_scale")  # fused q/k/v: [.., K, G+2, Dh], regrouped instead
PADDED_AXES = ("vocab", "mlp")  # logical axes zero-padded to a multiple of tp


def make_mesh(tp_degree: int) -> Mesh:
    """A 1-D ``("tp",)`` mesh over the first ``tp_degree`` devices of the *global* device list.

    In a multi-process run (``aotlm.core.distributed.initialize``) the mesh must span every
    process, so ``tp_degree`` must equal the global device count there.
    """
    if tp_degree < 1:
        raise ValueError(f"tp_degree must be >= 1, got {tp_degree}")
    devices = global_devices(tp_degree, f"tp_degree={tp_degree}")
    if jax.process_count() > 1 and tp_degree != len(devices):
        raise ValueError(
            f"tp_degree={tp_degree} in a {jax.process_count()}-process run: the mesh must span every "
            f"process, so use tp_degree={len(devices)} (the global device count)"
        )
    return Mesh(np.array(devices[:tp_degree]), (TP,))


def global_devices(need: int, what: str) -> list:
    """Every device of the run, process by process, or a clear error when fewer than ``need``."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if need > len(devices):
        hint = (
            f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} before importing jax"
            if jax.process_count() == 1
            else "start more processes or give each more devices"
        )
        raise ValueError(
            f"{what} needs {need} devices but only {len(devices)} are visible "
            f"({devices[0].platform}, {jax.process_count()} process(es)); {hint}"
        )
    return devices


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _set(xs: list[int]) -> str:
    return "{" + ", ".join(map(str, xs)) + "}"


def valid_gqa(n_heads: int, n_kv_heads: int, batch: int, tp: int) -> list[str]:
    """The GQA strategies possible for this shape, in order of preference (first = default)."""
    valid = ["shard-over-heads"] if n_kv_heads % tp == 0 else []
    valid.append("replicated-heads")
    if batch % tp == 0:
        valid.append("shard-over-batch")
    return valid


def choose_gqa(n_heads: int, n_kv_heads: int, batch: int, tp: int, gqa: str | None) -> str:
    """The GQA sharding strategy: the requested one if possible, else a clear error.

    Default: ``shard-over-heads`` when tp divides the kv heads, else ``replicated-heads``.
    """
    if tp < 1:
        raise ValueError(f"tp_degree must be >= 1, got {tp}")
    if n_heads % tp:
        raise ValueError(
            f"{n_heads} attention heads cannot be split over tp={tp}; use tp in {_set(divisors(n_heads))}"
        )
    if gqa is not None and gqa not in GQA_STRATEGIES:
        raise ValueError(f"unknown gqa strategy {gqa!r}; choose one of {list(GQA_STRATEGIES)}")
    valid = valid_gqa(n_heads, n_kv_heads, batch, tp)
    if gqa is None or gqa in valid:
        return gqa or valid[0]
    others = " or ".join(f"gqa={v!r}" for v in valid)
    if gqa == "shard-over-heads":
        kv_ok = [d for d in divisors(n_kv_heads) if n_heads % d == 0]
        raise ValueError(
            f"{n_kv_heads} kv heads cannot be sharded over tp={tp}; use tp in {_set(kv_ok)} or {others}"
        )
    batch_ok = [b for b in range(tp, 4 * tp + 1, tp)]
    raise ValueError(
        f"batch_size={batch} cannot be sharded over tp={tp} (gqa='shard-over-batch' needs batch_size % tp "
        f"== 0, e.g. {batch_ok[:3]}); use such a batch_size or {others}"
    )


def kv_replication(n_kv_heads: int, tp: int, strategy: str) -> int:
    """How many times each kv head is repeated (``replicated-heads``: lcm(K, tp) / K, else 1)."""
    if strategy != "replicated-heads" or tp == 1:
        return 1
    return math.lcm(n_kv_heads, tp) // n_kv_heads


def rules(strategy: str, tp: int) -> dict[str, str | None]:
    """Logical axis -> mesh axis for one GQA strategy (absent axis = replicated)."""
    if tp == 1:
        return {}
    r: dict[str, str | None] = {"heads": TP, "kv_heads": TP, "mlp": TP, "vocab": TP, "experts": None}
    r["mlp_groups"] = TP  # 4-bit scales' groups of MLP rows (aotlm.models.packing): split, never padded
    if strategy == "shard-over-batch":  # attention runs batch-parallel with whole weights
        r["heads"] = r["kv_heads"] = None
    return r


def prepare_param(path: tuple, arr: np.ndarray, tp: int, strategy: str, n_kv_heads: int) -> np.ndarray:
    """Host-side layout fix-ups before sharding: pad ``vocab``/``mlp`` axes, repeat kv heads.

    Both are exact: padded vocab columns are sliced off the logits, padded MLP units are
    zero in and out, and repeated kv heads are copies serving the same query heads.
    """
    if tp == 1:
        return arr
    axes = logical_axes(path, arr.ndim)
    r = kv_replication(n_kv_heads, tp, strategy)
    if r > 1 and path[-1] in KV_LEAVES:
        arr = np.repeat(arr, r, axis=axes.index("kv_heads"))
    if r > 1 and path[-1] in FUSED_KV_LEAVES:  # each group: G/r query heads + a copy of its k, v
        arr = regroup_qkv(arr, axes.index("kv_heads"), r)
    widths = [(0, -n % tp if a in PADDED_AXES else 0) for a, n in zip(axes, arr.shape, strict=True)]
    if any(w for _, w in widths):
        arr = np.pad(arr, widths)
    return arr


def prepared_shape(path: tuple, shape: tuple, tp: int, strategy: str, n_kv_heads: int) -> tuple:
    """The shape ``prepare_param`` gives a parameter of ``shape`` (for memory plans, no data)."""
    if tp == 1:
        return tuple(shape)
    axes = logical_axes(path, len(shape))
    r = kv_replication(n_kv_heads, tp, strategy) if path[-1] in KV_LEAVES + FUSED_KV_LEAVES else 1
    out = []
    for a, n in zip(axes, shape, strict=True):
        n = n * r if a == "kv_heads" else n
        out.append(n + (-n % tp if a in PADDED_AXES else 0))
    if r > 1 and path[-1] in FUSED_KV_LEAVES:  # [.., K*r, (G+2) -> G/r + 2, Dh]
        i = axes.index("kv_heads") + 1
        out[i] = (out[i] - 2) // r + 2
    return tuple(out)


def param_spec(path: tuple, ndim: int, rule: dict) -> PartitionSpec:
    axes = logical_axes(path, ndim)
    return PartitionSpec(*(rule.get(a) if a else None for a in axes))


def spec_of(rule: dict):
    """``(leaf name, ndim) -> partition spec`` for the kernels' ``mesh_context`` (``aotlm.kernels``)."""
    return lambda name, ndim: param_spec((name,), ndim, rule)


def param_sharding(mesh: Mesh, path: tuple, ndim: int, rule: dict) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path, ndim, rule))


def cache_spec(strategy: str, tp: int) -> PartitionSpec:
    """Partitioning of a KV cache leaf ``k [B, K, S, Dh]`` / ``v [B, K, Dh, S]``."""
    if tp == 1:
        return PartitionSpec()
    if strategy == "shard-over-batch":
        return PartitionSpec(TP, None, None, None)
    return PartitionSpec(None, TP, None, None)


def cache_sharding(mesh: Mesh, strategy: str, tp: int) -> dict:
    """Shardings of the KV cache leaves ``k [B,K,S,Dh]`` / ``v [B,K,Dh,S]`` and ``pos`` ``[B,S]``."""
    return {
        "kv": NamedSharding(mesh, cache_spec(strategy, tp)),
        "pos": NamedSharding(mesh, PartitionSpec()),
    }


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put(x, sharding: NamedSharding) -> jax.Array:
    """A host array as a global ``jax.Array``; each process fills only its own devices' shards.

    Works when the mesh spans several processes (every process passes the same value).
    """
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: np.asarray(x[idx]))


def zeros(shape: tuple, dtype, sharding: NamedSharding, fill=0) -> jax.Array:
    """A filled global array built shard by shard (no full-size host buffer)."""
    one = np.full((), fill, dtype)

    def shard(idx):
        return np.broadcast_to(one, tuple(len(range(*s.indices(n))) for s, n in zip(idx, shape, strict=True)))

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def fetch(x) -> np.ndarray:
    """A device result as numpy, also when the array spans processes (read the local replica)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
