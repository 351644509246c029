"""JAX side of the kernels: the ``ffi_call``s, and ``shard_map`` over the ``"tp"`` mesh.

A custom call is opaque to XLA's SPMD partitioner, so under tensor parallelism each matmul is
wrapped in ``jax.shard_map`` with the weight's own partition spec (``aotlm.sharding`` rules of
its leaf name): column-parallel weights give an output sharded like the weight's output dims,
row-parallel ones (contracted dims sharded) a partial product summed with ``psum`` -- the
same collectives XLA inserts for its own dot. The mesh and rules are known while a graph is
traced (``mesh_context``, set by the model around lowering).
"""

from __future__ import annotations

import contextlib
import math
import threading

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from aotlm import kernels
from aotlm.models import packing

W_DTYPES = (jnp.int8, jnp.bfloat16, jnp.float16, jnp.float32)
X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_ctx = threading.local()


@contextlib.contextmanager
def mesh_context(mesh, rules: dict):
    """Tell kernel calls traced inside this block the mesh and logical-axis rules of the params."""
    old = getattr(_ctx, "value", None)
    _ctx.value = (mesh, rules)
    try:
        yield
    finally:
        _ctx.value = old


def supported(x, w, axes: int = 1, name: str | None = None) -> bool:
    """Static check (shapes/dtypes only): can ``matmul`` take this product?"""
    if jnp.dtype(w.dtype) not in W_DTYPES or jnp.dtype(x.dtype) not in X_DTYPES:
        return False
    rows = math.prod(x.shape[: x.ndim - axes])
    if not 1 <= rows <= kernels.MAX_ROWS or not kernels.enabled():
        return False
    return _one_device() or name is not None


def _one_device() -> bool:
    """No mesh in this trace, or a mesh of one device (no ``shard_map`` needed)."""
    ctx = getattr(_ctx, "value", None)
    return ctx is None or ctx[0].size == 1


def _weight_spec(name: str, ndim: int, rules: dict) -> tuple:
    """The partition spec of the weight leaf ``name`` (one entry per dim, ``None`` = replicated)."""
    from aotlm import sharding

    return (tuple(sharding.param_spec((name,), ndim, rules)) + (None,) * ndim)[:ndim]


def _logical_ndim(name: str | None, w) -> int:
    """Dims of the weight's logical form (a packed leaf has two more)."""
    return w.ndim - 2 if packing.is_packed(name, w.ndim) else w.ndim


def _call(x, w, scale, axes: int, nt: bool, name: str | None = None):
    """The kernel on local arrays: ``x [..., *K] @ w [*K, *N]`` (or ``w [N, K]`` when ``nt``, or
    ``w`` in the packed int8 layout of ``aotlm.models.packing``)."""
    kernels.ensure_registered()
    lead = x.shape[: x.ndim - axes]
    k = math.prod(x.shape[x.ndim - axes :])
    x2 = x.reshape(-1, k)
    s = scale.reshape(-1) if scale is not None else jnp.zeros((0,), jnp.float32)
    if packing.is_packed(name, w.ndim):
        target, w2, tail = "aotlm_wmm_pk", w, packing.logical_dims(name, w.shape)[1]
    elif nt:
        target, w2, tail = "aotlm_wmm_nt", w, (w.shape[0],)
    else:
        target, w2, tail = "aotlm_wmm_nn", w.reshape(k, -1), w.shape[axes:]
    out = jax.ShapeDtypeStruct((x2.shape[0], math.prod(tail)), x.dtype)
    y = jax.ffi.ffi_call(target, out)(x2, w2, s.astype(jnp.float32))
    return y.reshape(*lead, *tail)


def matmul(x, w, scale=None, axes: int = 1, name: str | None = None, nt: bool = False):
    """``x @ w`` (times ``scale`` per output channel) in ``x``'s dtype, f32 accumulation.

    ``nt``: ``w`` is ``[N, K]`` (embedding rows) instead of ``[K, N]``. ``name`` is the
    weight's leaf name, which gives its sharding under tensor parallelism.
    """
    if _one_device():
        return _call(x, w, scale, axes, nt, name)
    from aotlm import sharding

    mesh, rules = _ctx.value
    pspec = _weight_spec(name, w.ndim, rules)  # the stored leaf's (packed or not)
    wspec = _weight_spec(name, _logical_ndim(name, w), rules)
    contract, outs = (wspec[1:], wspec[:1]) if nt else (wspec[:axes], wspec[axes:])
    lead = (None,) * (x.ndim - axes)
    x_spec, out_spec = P(*lead, *contract), P(*lead, *outs)
    s_spec = P(*outs)
    partial = any(a is not None for a in contract)

    def local(xl, wl, sl):
        y = _call(xl, wl, sl, axes, nt, name)
        return jax.lax.psum(y, sharding.TP) if partial else y

    if scale is None:
        fn = lambda xl, wl: local(xl, wl, None)
        return jax.shard_map(fn, mesh=mesh, in_specs=(x_spec, P(*pspec)), out_specs=out_spec)(x, w)
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, P(*pspec), s_spec), out_specs=out_spec)(
        x, w, scale
    )


def convert(w, dtype, name: str | None = None, after=None):
    """``w.astype(dtype)`` for a whole low-precision weight matrix (prefill), in the kernel.

    XLA:CPU converted int8 / bf16 matrices at ~1 GB/s inside the prefill graph; the kernel streams
    them at memory speed and XLA's GEMM then reads a plain matrix. ``after`` (an activation): the
    call takes one element of it as a dummy operand, so it runs when that is ready instead of at
    the start of the graph -- otherwise every layer's converted matrix was live at once, and the
    fresh pages of that temp buffer (83k page faults, ~170 ms per GPT-2-small int8 prefill) cost
    more than the conversion. A packed int8 leaf (``aotlm.models.packing``) comes back in its
    logical layout (``aotlm_unpack``). Returns ``None`` when the kernel cannot take it (another
    backend, kernels off, a sharded weight without ``name``).
    """
    dtype = jnp.dtype(dtype)
    if jnp.dtype(w.dtype) not in W_DTYPES[:3] or dtype not in X_DTYPES or not kernels.enabled():
        return None
    if not (_one_device() or name is not None):
        return None
    dep = jnp.zeros((1,), jnp.float32) if after is None else after.reshape(-1)[:1].astype(jnp.float32)

    packed = packing.is_packed(name, w.ndim)

    def local(wl, d):
        kernels.ensure_registered()
        if not packed:
            return jax.ffi.ffi_call("aotlm_convert", jax.ShapeDtypeStruct(wl.shape, dtype))(wl, d)
        kd, nd = packing.logical_dims(name, wl.shape)
        out = jax.ShapeDtypeStruct((math.prod(kd), math.prod(nd)), dtype)
        return jax.ffi.ffi_call("aotlm_unpack", out)(wl, d).reshape(*kd, *nd)

    if _one_device():
        return local(w, dep)
    mesh, rules = _ctx.value
    spec = P(*_weight_spec(name, w.ndim, rules))
    out_spec = P(*_weight_spec(name, _logical_ndim(name, w), rules)) if packed else spec
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=out_spec)(w, dep)


def attention_ok(t: int) -> bool:
    """Static check: can decode attention with ``t`` query tokens use ``bdot`` in this trace?

    Only on one device (under tensor parallelism XLA's einsum keeps its own partitioning) and
    for few query tokens (decode steps, speculative checks); prefill stays on XLA's dot.
    """
    return 1 <= t <= kernels.MAX_ROWS and kernels.enabled() and _one_device()


def bdot(a, b, n: int, n_limit=None, l_limit=None):
    """``c[i, m, j] = sum_l a[i, m, l] * b[i, j, l]`` for ``j < n``, ``l < a.shape[2]`` (f32).

    ``b [I, NB >= n, LB >= L]`` may be a whole KV cache: only its leading block is read.
    ``n_limit`` / ``l_limit`` (traced ints): only ``j < n_limit`` (other outputs are 0) and
    ``l < l_limit`` are computed -- the cache slots written so far.
    """
    kernels.ensure_registered()
    big = jnp.iinfo(jnp.int32).max
    lim = jnp.stack([jnp.asarray(big if v is None else v, jnp.int32) for v in (n_limit, l_limit)])
    out = jax.ShapeDtypeStruct((a.shape[0], a.shape[1], n), jnp.float32)
    return jax.ffi.ffi_call("aotlm_bdot", out)(a, b, lim)
