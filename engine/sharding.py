"""Device mesh and the logical-axis -> mesh-axis rules (Megatron tensor parallelism).

Every parameter declares its logical axes once (``models.weights.LOGICAL_AXES``); this
module only decides which logical axis goes on the ``"tp"`` mesh axis. XLA's SPMD
partitioner then inserts the collectives implied by the shardings (one all-reduce after
the row-parallel attention output and MLP down projections), so model code stays free of
communication calls.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.weights import logical_axes

TP = "tp"
GQA_STRATEGIES = ("shard-over-heads", "replicated-heads", "shard-over-batch")


def make_mesh(tp_degree: int) -> Mesh:
    devices = jax.devices()
    if tp_degree < 1:
        raise ValueError(f"tp_degree must be >= 1, got {tp_degree}")
    if tp_degree > len(devices):
        raise ValueError(
            f"tp_degree={tp_degree} needs {tp_degree} devices but only {len(devices)} are visible "
            f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{tp_degree} before importing jax"
        )
    return Mesh(np.array(devices[:tp_degree]), (TP,))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_gqa(n_heads: int, n_kv_heads: int, batch: int, tp: int, gqa: str | None) -> str:
    """The GQA sharding strategy: the requested one if possible, else a clear error."""
    if n_heads % tp:
        raise ValueError(
            f"{n_heads} attention heads cannot be split over tp={tp}; use tp in {divisors(n_heads)}"
        )
    valid = []
    if n_kv_heads % tp == 0:
        valid.append("shard-over-heads")
    valid.append("replicated-heads")
    if batch % tp == 0:
        valid.append("shard-over-batch")
    if gqa is None:
        return valid[0]
    if gqa not in GQA_STRATEGIES:
        raise ValueError(f"unknown gqa strategy {gqa!r}; choose one of {list(GQA_STRATEGIES)}")
    if gqa not in valid:
        kv_ok = [d for d in divisors(n_kv_heads) if n_heads % d == 0]
        raise ValueError(
            f"gqa={gqa!r} is impossible: {n_kv_heads} kv heads cannot be sharded over tp={tp} "
            f"(shard-over-heads needs tp in {kv_ok}; shard-over-batch needs batch_size % tp == 0); "
            f"valid choices here: {valid}"
        )
    return gqa


def rules(strategy: str, tp: int) -> dict[str, str | None]:
    """Logical axis -> mesh axis for one GQA strategy."""
    if tp == 1:
        return {}
    r: dict[str, str | None] = {"heads": TP, "mlp": TP, "vocab": TP, "experts": None}
    r["kv_heads"] = TP if strategy == "shard-over-heads" else None
    return r


def param_sharding(mesh: Mesh, path: tuple, ndim: int, rule: dict) -> NamedSharding:
    axes = logical_axes(path, ndim)
    return NamedSharding(mesh, PartitionSpec(*(rule.get(a) if a else None for a in axes)))


def cache_sharding(mesh: Mesh, strategy: str, tp: int) -> dict:
    """Shardings of the KV cache leaves ``k``/``v`` ``[B,S,K,Dh]`` and ``pos`` ``[B,S]``."""
    if tp == 1 or strategy == "replicated-heads":
        kv = PartitionSpec()
    elif strategy == "shard-over-heads":
        kv = PartitionSpec(None, None, TP, None)
    else:
        kv = PartitionSpec(TP, None, None, None)
    return {"kv": NamedSharding(mesh, kv), "pos": NamedSharding(mesh, PartitionSpec())}


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
