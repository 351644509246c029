"""Dense matmuls on the kernels: the row kernels (decode), the GEMMs (prefill) and the whole-matrix
conversions, as ``ffi_call``s (int8 / bf16 / f16 / f32 weights, row-major or in the panel layout).
Under tensor parallelism each call runs per shard in ``shard_map`` (``aotlm.kernels.context``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from aotlm.kernels import build as kernels  # the build and its switches (enabled, MAX_ROWS)
from aotlm.kernels import layout, padding
from aotlm.kernels.context import GEMM_ACTS, X_DTYPES, current, logical_ndim, one_device, weight_spec

W_DTYPES = (jnp.int8, jnp.bfloat16, jnp.float16, jnp.float32)


def supported(x, w, axes: int = 1, name: str | None = None, packed_k: int | None = None) -> bool:
    """Static check (shapes/dtypes only): can ``matmul`` take this product (``packed_k``: as ``matmul``'s)?"""
    rows = math.prod(x.shape[: x.ndim - axes])
    dtypes = jnp.dtype(w.dtype) in W_DTYPES and jnp.dtype(x.dtype) in X_DTYPES
    ok = 1 <= rows <= row_limit(w, packed_k)
    return dtypes and ok and kernels.enabled() and (one_device() or name is not None)


# CPU levels whose int8 row kernel sums on vpdpwssd: there it beat the int8 GEMM (panels widened to f32)
# at prefill sizes too, 1.6-2.6x at 128-512 rows x 2048-14336 (Xeon family 6 model 207, one process).
VNNI_LEVELS = ("avx512vnni", "avx512bf16", "amx")


def row_limit(w, packed_k: int | None = None) -> int:
    """Most rows the row kernels take for this weight: ``ROW_KERNEL_ROWS`` for int8 / bf16 / f16
    (GPT-2-small, 64 rows, same process: int8 87 vs 98 ms on the GEMM, bf16 106 vs 149 ms on XLA's
    dot of the converted matrix; batch-32 int8 decode 1.39x), ``MAX_ROWS`` for f32, whose row kernel
    lost to XLA's GEMM there (195 vs 106 ms; even at 32 rows); any number for packed int8 weights on a
    ``VNNI_LEVELS`` CPU (x rounded to int16 per row, as in decode)."""
    wd = jnp.dtype(w.dtype)
    if wd == jnp.int8 and packed_k and kernels.enabled() and kernels.isa_level() in VNNI_LEVELS:
        return 1 << 30
    return kernels.MAX_ROWS if wd == jnp.float32 else kernels.ROW_KERNEL_ROWS


def gemm_supported(x, w, axes: int = 1, name: str | None = None, packed_k: int | None = None) -> bool:
    """Static check: can ``matmul`` take this product of more rows than ``row_limit(w)`` (prefill;
    int8 x of W8A8: more than ``MAX_ROWS``) with a GEMM kernel (``gemm.h``)? f32 x with an f32
    row-major ``w`` or a packed int8 / bf16 / f16 one; int8 x with a packed int8 one; bf16 x
    (``quant="bf16a"``) with a packed bf16 one."""
    rows = math.prod(x.shape[: x.ndim - axes])
    xd, wd = jnp.dtype(x.dtype), jnp.dtype(w.dtype)
    least = kernels.MAX_ROWS if xd == jnp.int8 else row_limit(w, packed_k)  # W8A8 from 17 rows
    if rows <= least or not kernels.enabled() or not (one_device() or name is not None):
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
    return ok and kernels.enabled() and one_device()


def w8a8_rows(x, w, axes: int, name: str | None, packed_k: int | None) -> bool:
    """Static: can the row kernel round this f32 ``x`` (decode rows) to int8 itself (``matmul(a8=True)``)?"""
    ok = bool(packed_k) and jnp.dtype(x.dtype) == jnp.float32 and jnp.dtype(w.dtype) == jnp.int8
    return ok and supported(x, w, axes, name) and one_device()  # one device, as w8a8_fused (decode rows)


def gemm_fuses(x, w, axes: int, name: str | None, packed_k: int | None, act: str | None) -> bool:
    """Static: does ``matmul(..., b=, act=)`` of this product apply the bias and ``act`` (one of
    ``GEMM_ACTS`` or None) in the kernel's output pass (one device): a GEMM (prefill rows, f32 or bf16 x)
    or a packed weight's row kernel (decode rows)? Saves XLA's separate pass over the
    output (GPT-2-small's gelu: 1.5 ms per layer of a batch-8 prefill, 77 us of a batch-8 decode step)."""
    if (act is not None and act not in GEMM_ACTS) or not one_device():
        return False
    if packed_k and supported(x, w, axes, name, packed_k):
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
    if (x2.shape[0] > row_limit(w, packed_k) or sx is not None or quant_x) and not nt:
        if packed_k:
            tail = layout.logical_dims(w.shape, packed_k)[1]
            out = jax.ShapeDtypeStruct((x2.shape[0], math.prod(tail)), jnp.float32)
            r = sx.reshape(-1) if sx is not None else jnp.zeros((0,), jnp.float32)
            qx = {"act": act_id, "quant_x": np.int32(quant_x)}
            live = padding.live_rows(lead if one_device() else ())
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
        live = padding.live_rows(lead if one_device() else ())  # prefill rows (int8 row kernel): live ones
        s32 = s.astype(jnp.float32)
        y = jax.ffi.ffi_call("aotlm_wmm_pk", out)(x2, w, s32, bias, live, act=act_id, a8=a8_id)
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
    if one_device():
        return _call(x, w, scale, axes, nt, packed_k, sx, b, act, quant_x, a8)
    mesh, spec_of = current()
    pspec = weight_spec(name, w.ndim, spec_of)  # the stored leaf's (packed or not)
    wspec = weight_spec(name, logical_ndim(packed_k, w), spec_of)
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
    if not (one_device() or name is not None):
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

    if one_device():
        return local(w, dep)
    mesh, spec_of = current()
    spec = P(*weight_spec(name, w.ndim, spec_of))
    out_spec = P(*weight_spec(name, logical_ndim(packed_k, w), spec_of)) if packed else spec
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=out_spec)(w, dep)
