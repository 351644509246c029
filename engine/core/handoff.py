"""Moving a stage's output to the next stage's devices (pipeline parallelism).

In one process every device is addressable and ``jax.device_put`` copies (asynchronously). Across
processes (multi-host, a stage per host) no process can write another's devices, so the hand-off
is a tiny SPMD program over the two stages' devices: a ``(2, tp)`` mesh, the array laid out as
``[2 * rows, ...]`` split over the pair (the sender's devices hold the data, the receiver's a
zero block), and a ``ppermute`` from the first half to the second; both processes call it (the
others do nothing). Only ``rows x features`` values cross: the lecture's ``2D`` bytes per token.

Across processes every program is also waited for (``settle``) before the next is dispatched.
XLA:CPU starts a program on a device as soon as its inputs are ready, not in dispatch order, so
a hand-off whose inputs are ready (the receiver's zero block) could start on one local device
while the other was still in the previous stage graph's tensor-parallel all-reduce: each waited
for the other (seen as a hang in about one run in ten of a 2-process pipeline). One program in
flight per process keeps every device's collectives in the same order; the processes (stages)
still overlap each other.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PP = "pp"


def hand_off(src, dst, x, shape: tuple, dtype):
    """``x`` (replicated on ``src``'s devices; None where ``src`` is another process's) onto
    ``dst``'s devices, replicated. Returns None where ``dst`` is another process's."""
    if jax.process_count() == 1:
        return jax.device_put(x, dst.replicated)
    if not (src.local or dst.local):
        return None
    src_devs, dst_devs = list(src.mesh.devices.flat), list(dst.mesh.devices.flat)
    mesh, fn = _program(tuple(src_devs), tuple(dst_devs))
    shards = []
    if src.local:
        by_dev = {s.device: s.data for s in x.addressable_shards}
        shards += [by_dev[d] for d in src_devs]
    if dst.local:
        shards += [_zeros(d, shape, np.dtype(dtype)) for d in dst_devs]
    spec = NamedSharding(mesh, PartitionSpec(PP))
    pair = jax.make_array_from_single_device_arrays((2 * shape[0], *shape[1:]), spec, shards)
    out = settle(fn(pair))
    if not dst.local:
        return None
    got = {s.device: s.data for s in out.addressable_shards}
    return jax.make_array_from_single_device_arrays(tuple(shape), dst.replicated, [got[d] for d in dst_devs])


def settle(tree):
    """``tree`` once computed, when several processes share the pipeline (see the module
    docstring); at once (asynchronous dispatch kept) in one process."""
    if jax.process_count() > 1:
        jax.block_until_ready(tree)
    return tree


@functools.cache
def _program(src_devs: tuple, dst_devs: tuple):
    """The pair mesh and the jitted send (first half -> second half) over it."""
    mesh = Mesh(np.array([src_devs, dst_devs]), (PP, "tp"))
    spec = PartitionSpec(PP)
    send = jax.shard_map(
        lambda a: jax.lax.ppermute(a, PP, [(0, 1)]), mesh=mesh, in_specs=spec, out_specs=spec
    )
    return mesh, jax.jit(send, out_shardings=NamedSharding(mesh, spec))


@functools.lru_cache(maxsize=256)
def _zeros(device, shape: tuple, dtype):
    """The receiver's placeholder block (reused: the program does not donate it)."""
    return jax.device_put(np.zeros(shape, dtype), device)
