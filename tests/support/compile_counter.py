"""Counting JAX compilations through ``jax.monitoring`` events."""

from __future__ import annotations

import contextlib

import jax

EVENTS = {
    "/jax/core/compile/backend_compile_duration": "backend",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/core/compile/jaxpr_trace_duration": "tracing",
}
_counts = {"backend": 0, "lowering": 0, "tracing": 0}
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    if event in EVENTS:
        _counts[EVENTS[event]] += 1


@contextlib.contextmanager
def count_compiles():
    """Yields a dict filled, on exit, with the compiles/lowerings/traces done inside."""
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _registered = True
    before = dict(_counts)
    result: dict = {}
    try:
        yield result
    finally:
        result.update({k: _counts[k] - before[k] for k in _counts})
