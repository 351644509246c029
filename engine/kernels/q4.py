"""Group-scaled weights on the kernels: products and dequantized matrices of packed 4-bit codes
(``int4.h``, ``aotlm.models.quant4``) or int8 codes in the int8 panel layout (``group8.h``: a GGUF
file's Q8_0 blocks, ``aotlm.models.quant8``) with their f16 scales / minimums per group of rows, per
shard under tensor parallelism. The leaf's dtype says which: uint8 4-bit, int8 8-bit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from aotlm.kernels import build as kernels
from aotlm.kernels import layout, padding
from aotlm.kernels.context import GEMM_ACTS, X_DTYPES, current, logical_ndim, one_device, weight_spec


def q4_supported(x, name: str | None = None) -> bool:
    """Static: can ``matmul_q4`` / ``unpack_q4`` take a 4-bit weight with activations ``x`` in this
    trace (kernels on; one device, or a named leaf whose sharding the mesh context gives)?"""
    if jnp.dtype(x.dtype) not in X_DTYPES or not kernels.enabled():
        return False
    return one_device() or name is not None


def q4_fuses(x, name: str | None, act: str | None) -> bool:
    """Static: does ``matmul_q4(..., b=, act=)`` apply the bias and ``act`` (None or one of ``GEMM_ACTS``)
    in the kernel's output pass (one device)?"""
    return (act is None or act in GEMM_ACTS) and one_device() and q4_supported(x, name)


def q4_group(k: int, sm, nn: int) -> int:
    """The group size of a 4-bit weight with ``k`` contracted rows, ``nn`` output dims and scales ``sm
    [G, S, *Nd]`` (f16), or a GGUF Q4_K / Q6_K matrix's own ``[K / 256, 20 or 82, *Nd]`` (uint8,
    ``aotlm.models.kscales`` / ``k6scales``: groups of 32 / 16), or a Q5_0 / Q5_1 one's ``[K / 32, 6 or 8,
    *Nd]`` (``q5scales``), either panel-major
    (``layout.scale_groups``); a clear error when the groups do not tile ``k`` (e.g. a tensor-parallel
    shard split inside a group)."""
    groups = layout.scale_groups(sm.shape, nn)
    if jnp.dtype(sm.dtype) == jnp.uint8 and layout.scale_rows(sm.shape, nn) in layout.Q5_ROWS.values():
        if k != 32 * groups:  # a Q5_0 / Q5_1 matrix's own scales (aotlm.models.q5scales)
            raise ValueError(f"a Q5_0 / Q5_1 weight with {k} contracted rows has {groups} groups of 32")
        return 32
    if jnp.dtype(sm.dtype) == jnp.uint8:
        if groups == 0 or k != 256 * groups:
            raise ValueError(
                f"a Q4_K / Q6_K weight with {k} contracted rows has {groups} blocks of 256: a shard or "
                "padding split a block; use a tp_degree that keeps 256 rows together (or tp_degree=1)"
            )
        return 16 if layout.scale_rows(sm.shape, nn) == layout.K6_ROWS else 32
    if groups == 0 or k % groups or k // groups not in layout.Q4_GROUPS:
        raise ValueError(
            f"a 4-bit weight with {k} contracted rows has {groups} groups of scales: a shard or padding "
            "split a group; use a group size that divides each shard's rows (or tp_degree=1)"
        )
    return k // groups


def logical_dims(w, packed_k: int) -> tuple[tuple, tuple]:
    """``(Kd, Nd)`` of a packed group-scaled leaf (or a local shard of one): 4-bit codes (uint8, 8 rows a
    64-byte block) or int8 codes (the int8 panels, pairs of rows)."""
    if jnp.dtype(w.dtype) == jnp.int8:
        return layout.logical_dims(w.shape, packed_k)
    return layout.q4_logical_dims(w.shape, packed_k)


def _kernel_group(k: int, sm, nn: int) -> np.int32:
    """``q4_group`` for a kernel call, whose scales must be panel-major
    (``aotlm.models.packing.pack_scales``): a clear error otherwise."""
    if sm.ndim != nn + 3 or sm.shape[-1] != layout.PANEL:
        raise ValueError(
            f"group scales of shape {sm.shape} are not panel-major [..N / 16, G, S, 16]: "
            "pack them with aotlm.models.packing.pack_scales"
        )
    return np.int32(q4_group(k, sm, nn))


def _q4_call(x, w, sm, axes: int, packed_k: int, b=None, act: str | None = None, parts: int = 1):
    """The kernel on local arrays: ``x [..., *K] @ W`` for packed 4-bit ``w`` (``packed_k`` contracted
    dims) and its panel-major scales ``sm [..N / 16, G, S, 16]``; ``b`` / ``act`` applied in the output
    pass; ``parts``: of x (``matmul_q4``)."""
    kernels.ensure_registered()
    kd, nd = logical_dims(w, packed_k)
    k, n = math.prod(kd), math.prod(nd)
    lead = x.shape[: x.ndim - axes]
    bias = jnp.zeros((0,), jnp.float32) if b is None else b.reshape(-1).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((math.prod(lead), n), x.dtype)
    g, act_id = _kernel_group(k, sm, len(nd)), np.int32(GEMM_ACTS[act] if act else 0)
    live = padding.live_rows(lead if one_device() else ())
    y = jax.ffi.ffi_call("aotlm_wmm_q4", out)(
        x.reshape(-1, k), w, sm, bias, live, group=g, act=act_id, parts=np.int32(parts)
    )
    return y.reshape(*lead, *nd)


def matmul_q4(x, w, sm, axes: int = 1, name: str | None = None, packed_k: int = 1, nt: bool = False, b=None,
              act: str | None = None, parts: int = 1):  # fmt: skip
    """``x [..., *K] @ W`` in ``x``'s dtype for a packed 4-bit weight ``w`` with scales (and minimums)
    ``sm`` (``aotlm.models.quant4``), f32 accumulation. ``parts`` (4-bit ``w``; 1 to 3): each group of x
    rounded to int8 (1); to int16, multiplied as two int8 digits (2: 2x the integer products); or to
    int8, then what that left, twice more, each part multiplied (3: as closely as f32 holds x, 3x;
    ``int4.h``, ``q4x.h``). ``nt``: the logical leaf is ``[N, K]``
    (a tied lm_head's rows), which says how its partition spec splits. ``b`` / ``act``: one device only
    (``GEMM_ACTS``). Under tensor parallelism: ``shard_map`` with the leaves' specs, ``psum`` over
    the mesh axes of the contracted dims."""
    if one_device():
        return _q4_call(x, w, sm, axes, packed_k, b, act, parts)
    mesh, spec_of = current()
    wspec = weight_spec(name, logical_ndim(packed_k, w), spec_of)
    contract, outs = (wspec[1:], wspec[:1]) if nt else (wspec[:axes], wspec[axes:])
    lead = (None,) * (x.ndim - axes)
    summed = tuple(a for a in contract if a is not None)
    sm_spec = P(*outs, summed[0] if summed else None, None, None)  # panel-major

    def local(xl, wl, sl):
        y = _q4_call(xl, wl, sl, axes, packed_k, parts=parts)
        return jax.lax.psum(y, summed) if summed else y

    specs = (P(*lead, *contract), P(*weight_spec(name, w.ndim, spec_of)), sm_spec)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(*lead, *outs))(x, w, sm)


def unpack_q4(w, sm, dtype, packed_k: int, name: str | None = None, after=None, nt: bool = False):
    """The dequantized logical matrix ``[*K, *N]`` of a packed 4-bit ``w`` in ``dtype`` (prefill's XLA
    dot), computed by the kernel once ``after`` (an activation) is ready, as ``convert`` does."""
    dep = jnp.zeros((1,), jnp.float32) if after is None else after.reshape(-1)[:1].astype(jnp.float32)

    def local(wl, sl, d):
        kernels.ensure_registered()
        kd, nd = logical_dims(wl, packed_k)
        k, n = math.prod(kd), math.prod(nd)
        out = jax.ShapeDtypeStruct((k, n), dtype)
        y = jax.ffi.ffi_call("aotlm_unpack_q4", out)(wl, sl, d, group=_kernel_group(k, sl, len(nd)))
        return y.reshape(*kd, *nd)

    if one_device():
        return local(w, sm, dep)
    mesh, spec_of = current()
    wspec = weight_spec(name, logical_ndim(packed_k, w), spec_of)
    kspec, nspec = (wspec[1:], wspec[:1]) if nt else (wspec[:packed_k], wspec[packed_k:])
    ksum = tuple(a for a in kspec if a is not None)
    specs = (P(*weight_spec(name, w.ndim, spec_of)), P(*nspec, ksum[0] if ksum else None, None, None), P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(*kspec, *nspec))(w, sm, dep)
