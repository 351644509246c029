"""What the kernels' JAX wrappers share: the mesh of the graph being traced and its leaves' specs.

A custom call is opaque to XLA's SPMD partitioner, so under tensor parallelism each kernel call is
wrapped in ``jax.shard_map`` with the weight's own partition spec: column-parallel weights give an
output sharded like the weight's output dims, row-parallel ones (contracted dims sharded) a
partial product summed with ``psum`` over the mesh axes of the contracted dims -- the same
collectives XLA inserts for its own dot. The mesh and a leaf name -> partition spec function
are known while a graph is traced (``mesh_context``, set by the model around lowering), so the
kernel modules need nothing from the layers above them. A weight in the panel layout says so by
``packed_k`` (its number of contracted dims, ``aotlm.models.packing.packed_k``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

import jax.numpy as jnp

X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Activations the packed GEMM applies to its output (gemm.h: finish), by ``models.layers`` name.
GEMM_ACTS = {"gelu_tanh": 1, "relu": 2}
_ctx = threading.local()  # (mesh, spec_of) while a graph is traced


@contextlib.contextmanager
def mesh_context(mesh, spec_of: Callable[[str, int], Sequence]):
    """Tell kernel calls traced inside this block the mesh and ``spec_of(leaf name, ndim)``, the
    partition spec of a stored param leaf (one entry per dim: a mesh axis name or ``None``)."""
    old = getattr(_ctx, "value", None)
    _ctx.value = (mesh, spec_of)
    try:
        yield
    finally:
        _ctx.value = old


def one_device() -> bool:
    """No mesh in this trace, or a mesh of one device (no ``shard_map`` needed)."""
    ctx = getattr(_ctx, "value", None)
    return ctx is None or ctx[0].size == 1


def weight_spec(name: str, ndim: int, spec_of) -> tuple:
    """The partition spec of the weight leaf ``name`` (one entry per dim, ``None`` = replicated)."""
    return (tuple(spec_of(name, ndim)) + (None,) * ndim)[:ndim]


def logical_ndim(packed_k: int | None, w) -> int:
    """Dims of the weight's logical form (a packed leaf has two more)."""
    return w.ndim - 2 if packed_k else w.ndim


def current():
    """``(mesh, spec_of)`` of the ``mesh_context`` being traced (only where ``one_device()`` is False)."""
    return _ctx.value
