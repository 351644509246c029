"""JAX side of the kernels: the ``ffi_call``s, and ``shard_map`` over the ``"tp"`` mesh.

A custom call is opaque to XLA's SPMD partitioner, so under tensor parallelism each matmul is
wrapped in ``jax.shard_map`` with the weight's own partition spec: column-parallel weights give an
output sharded like the weight's output dims, row-parallel ones (contracted dims sharded) a
partial product summed with ``psum`` over the mesh axes of the contracted dims -- the same
collectives XLA inserts for its own dot. The mesh and a leaf name -> partition spec function
are known while a graph is traced (``mesh_context``, set by the model around lowering), so this
module needs nothing from the layers above it. A weight in the panel layout says so by
``packed_k`` (its number of contracted dims, ``aotlm.models.packing.packed_k``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from aotlm.kernels import build as kernels  # the build and its switches (enabled, MAX_ROWS)
from aotlm.kernels import layout, padding

W_DTYPES = (jnp.int8, jnp.bfloat16, jnp.float16, jnp.float32)
X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_ctx = threading.local()


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


def supported(x, w, axes: int = 1, name: str | None = None) -> bool:
    """Static check (shapes/dtypes only): can ``matmul`` take this product?"""
    rows = math.prod(x.shape[: x.ndim - axes])
    dtypes = jnp.dtype(w.dtype) in W_DTYPES and jnp.dtype(x.dtype) in X_DTYPES
    return dtypes and 1 <= rows <= row_limit(w) and kernels.enabled() and (_one_device() or name is not None)


def row_limit(w) -> int:
    """Most rows the row kernels take for this weight: ``ROW_KERNEL_ROWS`` for int8 / bf16 / f16
    (GPT-2-small, 64 rows, same process: int8 87 vs 98 ms on the GEMM, bf16 106 vs 149 ms on XLA's
    dot of the converted matrix; batch-32 int8 decode 1.39x), ``MAX_ROWS`` for f32, whose row kernel
    lost to XLA's GEMM there (195 vs 106 ms; even at 32 rows)."""
    return kernels.MAX_ROWS if jnp.dtype(w.dtype) == jnp.float32 else kernels.ROW_KERNEL_ROWS


def _one_device() -> bool:
    """No mesh in this trace, or a mesh of one device (no ``shard_map`` needed)."""
    ctx = getattr(_ctx, "value", None)
    return ctx is None or ctx[0].size == 1


def _weight_spec(name: str, ndim: int, spec_of) -> tuple:
    """The partition spec of the weight leaf ``name`` (one entry per dim, ``None`` = replicated)."""
    return (tuple(spec_of(name, ndim)) + (None,) * ndim)[:ndim]


def _logical_ndim(packed_k: int | None, w) -> int:
    """Dims of the weight's logical form (a packed leaf has two more)."""
    return w.ndim - 2 if packed_k else w.ndim


def gemm_supported(x, w, axes: int = 1, name: str | None = None, packed_k: int | None = None) -> bool:
    """Static check: can ``matmul`` take this product of more rows than ``row_limit(w)`` (prefill;
    int8 x of W8A8: more than ``MAX_ROWS``) with a GEMM kernel (``gemm.h``)? f32 x with an f32
    row-major ``w`` or a packed int8 / bf16 / f16 one; int8 x with a packed int8 one; bf16 x
    (``quant="bf16a"``) with a packed bf16 one."""
    rows = math.prod(x.shape[: x.ndim - axes])
    xd, wd = jnp.dtype(x.dtype), jnp.dtype(w.dtype)
    least = kernels.MAX_ROWS if xd == jnp.int8 else row_limit(w)  # W8A8 from 17 rows
    if rows <= least or not kernels.enabled() or not (_one_device() or name is not None):
        return False
    if packed_k:
        return xd == jnp.float32 or wd == xd == jnp.int8 or wd == xd == jnp.bfloat16
    return wd == xd == jnp.float32


def w8a8_fused(x, w, axes: int, name: str | None, packed_k: int | None) -> bool:
    """Static: can the W8A8 GEMM round this f32 ``x`` to int8 itself (``matmul(quant_x=True)``)? One
    device only: a row's scale is its max over all of K, which a shard of a row-parallel weight lacks."""
    xd = jnp.dtype(x.dtype)
    rows = math.prod(x.shape[: x.ndim - axes])
    ok = bool(packed_k) and xd == jnp.float32 and jnp.dtype(w.dtype) == jnp.int8 and rows > kernels.MAX_ROWS
    return ok and kernels.enabled() and _one_device()


def w8a8_rows(x, w, axes: int, name: str | None, packed_k: int | None) -> bool:
    """Static: can the row kernel round this f32 ``x`` (decode rows) to int8 itself (``matmul(a8=True)``)?"""
    ok = bool(packed_k) and jnp.dtype(x.dtype) == jnp.float32 and jnp.dtype(w.dtype) == jnp.int8
    return ok and supported(x, w, axes, name) and _one_device()  # one device, as w8a8_fused


# Activations the packed GEMM applies to its output (gemm.h: finish), by ``models.layers`` name.
GEMM_ACTS = {"gelu_tanh": 1, "relu": 2}


def gemm_fuses(x, w, axes: int, name: str | None, packed_k: int | None, act: str | None) -> bool:
    """Static: does ``matmul(..., b=, act=)`` of this product apply the bias and ``act`` (one of
    ``GEMM_ACTS`` or None) in the kernel's output pass (one device): a GEMM (prefill rows, f32 or bf16 x)
    or a packed weight's row kernel (decode rows)? Saves XLA's separate pass over the
    output (GPT-2-small's gelu: 1.5 ms per layer of a batch-8 prefill, 77 us of a batch-8 decode step)."""
    if (act is not None and act not in GEMM_ACTS) or not _one_device():
        return False
    if packed_k and supported(x, w, axes, name):
        return True
    return gemm_supported(x, w, axes, name, packed_k) and jnp.dtype(x.dtype) in (jnp.float32, jnp.bfloat16)


def _call(
    x,
    w,
    scale,
    axes: int,
    nt: bool,
    packed_k: int | None = None,
    sx=None,
    b=None,
    act: str | None = None,
    quant_x: bool = False,
    a8: bool = False,
):
    """The kernel on local arrays: ``x [..., *K] @ w [*K, *N]`` (or ``w [N, K]`` when ``nt``, or
    ``w`` in the panel layout with ``packed_k`` contracted dims, ``layout``). More rows than
    ``row_limit(w)``, or int8 ``x`` with per-row scales ``sx`` (W8A8), take the GEMMs (``gemm.h``):
    ``aotlm_gemm_pk`` for packed ``w``, ``aotlm_gemm`` for f32. Packed ``w`` (GEMM or row kernel)
    applies the bias ``b`` and activation ``act`` of ``gemm_fuses`` to its output (``a8``: matmul's)."""
    kernels.ensure_registered()
    lead = x.shape[: x.ndim - axes]
    k = math.prod(x.shape[x.ndim - axes :])
    x2 = x.reshape(-1, k)
    s = scale.reshape(-1) if scale is not None else jnp.zeros((0,), jnp.float32)
    bias = jnp.zeros((0,), jnp.float32) if b is None else b.reshape(-1).astype(jnp.float32)
    act_id, a8_id = np.int32(GEMM_ACTS[act] if act else 0), np.int32(a8)
    if (x2.shape[0] > row_limit(w) or sx is not None or quant_x) and not nt:
        if packed_k:
            tail = layout.logical_dims(w.shape, packed_k)[1]
            out = jax.ShapeDtypeStruct((x2.shape[0], math.prod(tail)), jnp.float32)
            r = sx.reshape(-1) if sx is not None else jnp.zeros((0,), jnp.float32)
            qx = {"act": act_id, "quant_x": np.int32(quant_x)}
            live = padding.live_rows(lead if _one_device() else ())
            y = jax.ffi.ffi_call("aotlm_gemm_pk", out)(x2, w, s.astype(jnp.float32), r, bias, live, **qx)
        else:
            tail = w.shape[axes:]
            out = jax.ShapeDtypeStruct((x2.shape[0], math.prod(tail)), jnp.float32)
            y = jax.ffi.ffi_call("aotlm_gemm", out)(x2, w.reshape(k, -1), bias, act=act_id)
            y = y * s if scale is not None else y
        return y.reshape(*lead, *tail)
    if packed_k:
        tail = layout.logical_dims(w.shape, packed_k)[1]
        out = jax.ShapeDtypeStruct((x2.shape[0], math.prod(tail)), x.dtype)
        y = jax.ffi.ffi_call("aotlm_wmm_pk", out)(x2, w, s.astype(jnp.float32), bias, act=act_id, a8=a8_id)
        return y.reshape(*lead, *tail)
    if nt:
        target, w2, tail = "aotlm_wmm_nt", w, (w.shape[0],)
    else:
        target, w2, tail = "aotlm_wmm_nn", w.reshape(k, -1), w.shape[axes:]
    out = jax.ShapeDtypeStruct((x2.shape[0], math.prod(tail)), x.dtype)
    y = jax.ffi.ffi_call(target, out)(x2, w2, s.astype(jnp.float32))
    return y.reshape(*lead, *tail)


def matmul(
    x,
    w,
    scale=None,
    axes: int = 1,
    name: str | None = None,
    nt: bool = False,
    packed_k: int | None = None,
    sx=None,
    b=None,
    act: str | None = None,
    quant_x: bool = False,
    a8: bool = False,
):
    """``x @ w`` (times ``scale`` per output channel) in ``x``'s dtype, f32 accumulation.

    ``nt``: ``w`` is ``[N, K]`` (embedding rows) instead of ``[K, N]``. ``name`` is the weight's leaf
    name, which gives its sharding under tensor parallelism. ``packed_k``: ``w`` is in the panel layout
    with that many contracted dims. ``sx`` (W8A8 prefill): ``x`` is int8 and ``sx [...]`` its per-row
    scales; the result is then f32. ``b`` / ``act``: only where ``gemm_fuses`` says so, the bias and
    activation applied in the GEMM. ``quant_x`` (W8A8 prefill where ``w8a8_fused`` says so): f32 ``x``
    rounded to int8 per row by the GEMM itself, the graph's ``quantize_rows`` math bit for bit, without
    its separate pass over x; ``a8`` (decode rows where ``w8a8_rows`` says so): the same, by the row kernel.
    """
    if quant_x and not w8a8_fused(x, w, axes, name, packed_k):
        raise ValueError("quant_x: only a one-device W8A8 GEMM (f32 x, packed int8 w) quantizes x itself")
    if a8 and not w8a8_rows(x, w, axes, name, packed_k):
        raise ValueError("a8: only one-device row kernels (f32 x, packed int8 w) round x to int8 themselves")
    if _one_device():
        return _call(x, w, scale, axes, nt, packed_k, sx, b, act, quant_x, a8)
    mesh, spec_of = _ctx.value
    pspec = _weight_spec(name, w.ndim, spec_of)  # the stored leaf's (packed or not)
    wspec = _weight_spec(name, _logical_ndim(packed_k, w), spec_of)
    contract, outs = (wspec[1:], wspec[:1]) if nt else (wspec[:axes], wspec[axes:])
    lead = (None,) * (x.ndim - axes)
    x_spec, out_spec = P(*lead, *contract), P(*lead, *outs)
    s_spec = P(*outs)
    summed = tuple(a for a in contract if a is not None)  # mesh axes a contracted dim is split over

    # the optional operands (scale, sx) join the shard_map only when given
    extra = [(a, spec) for a, spec in ((scale, s_spec), (sx, P(*lead))) if a is not None]

    def local(xl, wl, *rest):
        it = iter(rest)
        sl, sxl = (next(it) if a is not None else None for a in (scale, sx))
        y = _call(xl, wl, sl, axes, nt, packed_k, sxl)
        return jax.lax.psum(y, summed) if summed else y

    specs = (x_spec, P(*pspec), *(spec for _, spec in extra))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_spec)(x, w, *(a for a, _ in extra))


def convert(w, dtype, name: str | None = None, after=None, packed_k: int | None = None):
    """``w.astype(dtype)`` for a whole low-precision weight matrix (prefill), in the kernel.

    XLA:CPU converted int8 / bf16 matrices at ~1 GB/s inside the prefill graph; the kernel streams
    them at memory speed and XLA's GEMM then reads a plain matrix. ``after`` (an activation): the
    call takes one element of it as a dummy operand, so it runs when that is ready instead of at
    the start of the graph -- otherwise every layer's converted matrix was live at once, and the
    fresh pages of that temp buffer (83k page faults, ~170 ms per GPT-2-small int8 prefill) cost
    more than the conversion. A packed leaf (``packed_k`` contracted dims) comes back in its
    logical layout (``aotlm_unpack``). Returns ``None`` when the kernel cannot take it (another
    backend, kernels off, a sharded weight without ``name``).
    """
    dtype = jnp.dtype(dtype)
    low = jnp.dtype(w.dtype) in W_DTYPES[:3]  # f32 only to unpack (a packed leaf)
    if not (low or packed_k) or dtype not in X_DTYPES or not kernels.enabled():
        return None
    if not (_one_device() or name is not None):
        return None
    dep = jnp.zeros((1,), jnp.float32) if after is None else after.reshape(-1)[:1].astype(jnp.float32)

    packed = bool(packed_k)

    def local(wl, d):
        kernels.ensure_registered()
        if not packed:
            return jax.ffi.ffi_call("aotlm_convert", jax.ShapeDtypeStruct(wl.shape, dtype))(wl, d)
        kd, nd = layout.logical_dims(wl.shape, packed_k)
        out = jax.ShapeDtypeStruct((math.prod(kd), math.prod(nd)), dtype)
        return jax.ffi.ffi_call("aotlm_unpack", out)(wl, d).reshape(*kd, *nd)

    if _one_device():
        return local(w, dep)
    mesh, spec_of = _ctx.value
    spec = P(*_weight_spec(name, w.ndim, spec_of))
    out_spec = P(*_weight_spec(name, _logical_ndim(packed_k, w), spec_of)) if packed else spec
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=out_spec)(w, dep)


def attention_ok(t: int) -> bool:
    """Static check: can decode attention with ``t`` query tokens use ``bdot`` in this trace?

    Only on one device (under tensor parallelism XLA's einsum keeps its own partitioning) and
    for few query tokens (decode steps, speculative checks); prefill stays on XLA's dot.
    """
    return 1 <= t <= kernels.MAX_ROWS and kernels.enabled() and _one_device()


def decode_attention_ok(q) -> bool:
    """Static check: can ``q [B,1,H,Dh]`` (one query token per row) attend with ``decode_attention``
    (kernels on, one device)?"""
    return q.ndim == 4 and q.shape[1] == 1 and kernels.enabled() and _one_device()


def causal_attention_ok(x) -> bool:
    """Static check: can a prefill call whose activations are ``x [B,T,...]`` attend over its own
    tokens with ``causal_attention``? More than ``MAX_ROWS`` query tokens (decode keeps ``bdot``),
    f32, one device (under tensor parallelism XLA's einsum keeps its own partitioning)."""
    f32 = jnp.dtype(x.dtype) == jnp.float32
    return x.shape[1] > kernels.MAX_ROWS and f32 and kernels.enabled() and _one_device()


def causal_attention(q, k, v, mask, scale: float):
    """Softmax attention of ``q [B,T,H,Dh]`` over the call's own ``k, v [B,T,K,Dh]`` (``H`` a
    multiple of ``K``) with ``mask [B,T,T]`` (bool, causal: ``j <= i`` only is computed), scores
    ``scale * q.k`` in f32; a query row with no visible key gives zeros (``attn.h``). ``k`` and
    ``v`` None: ``q`` is the fused projection ``[B,T,K,G+2,Dh]`` (per kv head its ``G`` query heads,
    then k and v), read in place. Returns ``(o [B,T,H,Dh], k [B,K,T,Dh], v [B,K,Dh,T])``: k and v
    also in the KV cache's layouts."""
    kernels.ensure_registered()
    if k is None:
        b, t, kh, g2, dh = q.shape
        h, empty = kh * (g2 - 2), jnp.zeros((0,), jnp.float32)
        k = v = empty
    else:
        b, t, h, dh = q.shape
        kh = k.shape[2]
    out = (
        jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, t, dh), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, dh, t), jnp.float32),
    )
    return jax.ffi.ffi_call("aotlm_attn", out)(q, k, v, mask.astype(jnp.bool_), scale=np.float32(scale))


def bdot(a, b, n: int, n_limit=None, l_limit=None):
    """``c[i, m, j] = sum_l a[i, m, l] * b[i, j, l]`` for ``j < n``, ``l < a.shape[2]`` (f32).

    ``b [IB >= I, NB >= n, LB >= L]`` may be a whole KV cache: only its leading blocks are read
    (a decode call over the first rows of a serving batch passes the whole cache). ``b`` is
    f32, bf16, f16, or uint16 holding bf16 bits (how CPU models store a bf16 cache); converted in
    registers, accumulated in f32.
    ``n_limit`` / ``l_limit`` (traced ints, scalars or one per row ``i`` ``[I]``): only
    ``j < n_limit`` (other outputs are 0) and ``l < l_limit`` are computed -- the cache slots
    written so far (per row: each serving row reads its own slots, not the longest row's).
    """
    kernels.ensure_registered()
    big = jnp.iinfo(jnp.int32).max
    lims = [jnp.asarray(big if v is None else v, jnp.int32) for v in (n_limit, l_limit)]
    if any(v.ndim for v in lims):  # one (n, l) pair per row
        lims = [jnp.broadcast_to(v, (a.shape[0],)) for v in lims]
    lim = jnp.stack(lims, axis=-1)
    out = jax.ShapeDtypeStruct((a.shape[0], a.shape[1], n), jnp.float32)
    return jax.ffi.ffi_call("aotlm_bdot", out)(a, b, lim)


def decode_attention(q, keys, values, k_new, v_new, mask, limit, scale: float):
    """One decode step's attention in one call (``dattn.h``): ``q [I, G, Dh]`` (``I = B * Kh``: row
    ``i // Kh``, kv head ``i % Kh``) over cache slots ``j < limit[i]`` of ``keys [IB >= I, S, Dh]`` /
    ``values [IB, Dh, S]`` that ``mask [B, W + 1]`` shows (its last column: the row's own token,
    ``k_new`` / ``v_new [I, Dh]``), softmax of ``scale * q . k`` over them. Returns ``[I, G, Dh]``
    f32; a row that sees nothing gets zeros. The cache is read in place (f32, bf16, its bits as
    uint16, f16)."""
    kernels.ensure_registered()
    f32 = lambda x: x.astype(jnp.float32)
    lim = jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (q.shape[0],))
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("aotlm_dattn", out)(
        f32(q), keys, values, f32(k_new), f32(v_new), mask.astype(jnp.bool_), lim, scale=np.float32(scale)
    )


def argmax_ok(x) -> bool:
    """Static check: can ``argmax`` take ``x [B, V]`` in this trace (f32, kernels on, one device)?"""
    f32 = jnp.dtype(x.dtype) == jnp.float32
    return x.ndim >= 1 and x.shape[-1] >= 1 and f32 and kernels.enabled() and _one_device()


def argmax(x):
    """``jnp.argmax(x, -1)`` as int32 (the first index of the largest value; a NaN counts as the
    largest, as in ``jnp.argmax``) in one vectorized pass per row (``argmax.h``): XLA:CPU's
    fused reduce took 0.68 ms of a batch-8 GPT-2-small decode step."""
    kernels.ensure_registered()
    return jax.ffi.ffi_call("aotlm_argmax", jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32))(x)


# ------------------------------------------------------------------ 4-bit weights (int4.h)
def q4_supported(x, name: str | None = None) -> bool:
    """Static: can ``matmul_q4`` / ``unpack_q4`` take a 4-bit weight with activations ``x`` in this
    trace (kernels on; one device, or a named leaf whose sharding the mesh context gives)?"""
    if jnp.dtype(x.dtype) not in X_DTYPES or not kernels.enabled():
        return False
    return _one_device() or name is not None


def q4_fuses(x, name: str | None, act: str | None) -> bool:
    """Static: does ``matmul_q4(..., b=, act=)`` apply the bias and ``act`` (None or one of ``GEMM_ACTS``)
    in the kernel's output pass (one device)?"""
    return (act is None or act in GEMM_ACTS) and _one_device() and q4_supported(x, name)


def q4_group(k: int, sm) -> int:
    """The group size of a 4-bit weight with ``k`` contracted rows and scales ``sm [G, S, ...]``;
    a clear error when the groups do not tile ``k`` (e.g. a tensor-parallel shard split inside a group)."""
    groups = sm.shape[0]
    if groups == 0 or k % groups or k // groups not in layout.Q4_GROUPS:
        raise ValueError(
            f"a 4-bit weight with {k} contracted rows has {groups} groups of scales: a shard or padding "
            "split a group; use a group size that divides each shard's rows (or tp_degree=1)"
        )
    return k // groups


def _q4_call(x, w, sm, axes: int, packed_k: int, b=None, act: str | None = None):
    """The kernel on local arrays: ``x [..., *K] @ W`` for packed 4-bit ``w`` (``packed_k`` contracted
    dims) and its scales ``sm [G, S, *N]``; ``b`` / ``act`` applied in the output pass."""
    kernels.ensure_registered()
    kd, nd = layout.q4_logical_dims(w.shape, packed_k)
    k, n = math.prod(kd), math.prod(nd)
    lead = x.shape[: x.ndim - axes]
    bias = jnp.zeros((0,), jnp.float32) if b is None else b.reshape(-1).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((math.prod(lead), n), x.dtype)
    g, act_id = np.int32(q4_group(k, sm)), np.int32(GEMM_ACTS[act] if act else 0)
    live = padding.live_rows(lead if _one_device() else ())
    y = jax.ffi.ffi_call("aotlm_wmm_q4", out)(x.reshape(-1, k), w, sm, bias, live, group=g, act=act_id)
    return y.reshape(*lead, *nd)


def matmul_q4(x, w, sm, axes: int = 1, name: str | None = None, packed_k: int = 1, nt: bool = False, b=None,
              act: str | None = None):  # fmt: skip
    """``x [..., *K] @ W`` in ``x``'s dtype for a packed 4-bit weight ``w`` with scales (and minimums)
    ``sm`` (``aotlm.models.quant4``), f32 accumulation. ``nt``: the logical leaf is ``[N, K]``
    (a tied lm_head's rows), which says how its partition spec splits. ``b`` / ``act``: one device only
    (``GEMM_ACTS``). Under tensor parallelism: ``shard_map`` with the leaves' specs, ``psum`` over
    the mesh axes of the contracted dims."""
    if _one_device():
        return _q4_call(x, w, sm, axes, packed_k, b, act)
    mesh, spec_of = _ctx.value
    wspec = _weight_spec(name, _logical_ndim(packed_k, w), spec_of)
    contract, outs = (wspec[1:], wspec[:1]) if nt else (wspec[:axes], wspec[axes:])
    lead = (None,) * (x.ndim - axes)
    summed = tuple(a for a in contract if a is not None)
    sm_spec = P(summed[0] if summed else None, None, *outs)

    def local(xl, wl, sl):
        y = _q4_call(xl, wl, sl, axes, packed_k)
        return jax.lax.psum(y, summed) if summed else y

    specs = (P(*lead, *contract), P(*_weight_spec(name, w.ndim, spec_of)), sm_spec)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(*lead, *outs))(x, w, sm)


def unpack_q4(w, sm, dtype, packed_k: int, name: str | None = None, after=None, nt: bool = False):
    """The dequantized logical matrix ``[*K, *N]`` of a packed 4-bit ``w`` in ``dtype`` (prefill's XLA
    dot), computed by the kernel once ``after`` (an activation) is ready, as ``convert`` does."""
    dep = jnp.zeros((1,), jnp.float32) if after is None else after.reshape(-1)[:1].astype(jnp.float32)

    def local(wl, sl, d):
        kernels.ensure_registered()
        kd, nd = layout.q4_logical_dims(wl.shape, packed_k)
        k, n = math.prod(kd), math.prod(nd)
        out = jax.ShapeDtypeStruct((k, n), dtype)
        y = jax.ffi.ffi_call("aotlm_unpack_q4", out)(wl, sl, d, group=np.int32(q4_group(k, sl)))
        return y.reshape(*kd, *nd)

    if _one_device():
        return local(w, sm, dep)
    mesh, spec_of = _ctx.value
    wspec = _weight_spec(name, _logical_ndim(packed_k, w), spec_of)
    kspec, nspec = (wspec[1:], wspec[:1]) if nt else (wspec[:packed_k], wspec[packed_k:])
    ksum = tuple(a for a in kspec if a is not None)
    specs = (P(*_weight_spec(name, w.ndim, spec_of)), P(ksum[0] if ksum else None, None, *nspec), P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(*kspec, *nspec))(w, sm, dep)
