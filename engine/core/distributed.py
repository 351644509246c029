"""Multi-host runs: several processes (one per host) form one device mesh.

Call ``initialize`` first thing in every process, before any JAX computation (JAX
refuses to join a cluster once a backend is running). Every process then loads the same
checkpoint and builds the model with ``tp_degree`` = the global device count; each process
places only the weight shards of its own devices, every executable runs SPMD on all of
them, and every process reads the (replicated) results from its local devices. On CPU the
cross-process collectives use gloo.
"""

from __future__ import annotations

import os

import jax

ENV_COORDINATOR = "AOTLM_COORDINATOR"
ENV_NUM_PROCESSES = "AOTLM_NUM_PROCESSES"
ENV_PROCESS_ID = "AOTLM_PROCESS_ID"


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} must be an integer") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    initialization_timeout: int = 300,
) -> bool:
    """Join the cluster described by the arguments or ``$AOTLM_COORDINATOR`` / ``$AOTLM_NUM_PROCESSES``
    / ``$AOTLM_PROCESS_ID``. Returns ``False`` (and does nothing) for a single-process run.

    ``coordinator_address`` is ``host:port`` of process 0 (it listens there, the others
    connect); ``num_processes`` the total count; ``process_id`` this process's rank.
    """
    addr = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    n = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if addr is None and n in (None, 1):
        return False
    missing = [
        name
        for name, val in ((ENV_COORDINATOR, addr), (ENV_NUM_PROCESSES, n), (ENV_PROCESS_ID, pid))
        if val is None
    ]
    if missing:
        raise ValueError(
            f"a multi-process run needs the coordinator address, the process count and this process's "
            f"id; missing: {missing} (pass them to initialize() or set the environment variables)"
        )
    if n < 1 or not 0 <= pid < n:
        raise ValueError(f"process_id={pid} must be in [0, {n}) for num_processes={n}")
    if jax.distributed.is_initialized():
        if jax.process_count() != n or jax.process_index() != pid:
            raise RuntimeError(
                f"jax.distributed is already initialized as process {jax.process_index()} of "
                f"{jax.process_count()}, not {pid} of {n}"
            )
        return True
    try:
        jax.distributed.initialize(
            coordinator_address=addr,
            num_processes=n,
            process_id=pid,
            initialization_timeout=initialization_timeout,
        )
    except RuntimeError as e:
        if "before any JAX" in str(e) or "must be called before" in str(e):
            raise RuntimeError(
                "aotlm.core.distributed.initialize() must run before any JAX computation or device query in "
                "this process (call it first, before loading a model)"
            ) from e
        raise
    return True


def shutdown() -> None:
    """Leave the cluster (optional; also happens at process exit)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def describe() -> dict:
    """Process / device counts of this run (for logs and reports)."""
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(),
    }
