"""Per-row LoRA updates on the kernels (``lora.h``): each row's adapter slot read in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aotlm.kernels import build as kernels
from aotlm.kernels.context import one_device

TABLE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


def lora_ok(x, a, b) -> bool:
    """Static check: can ``lora_add`` take ``x [M, K]`` (f32) with tables ``a [N, K, R]``, ``b [N, R, O]``
    (both f32, bf16 or int8) in this trace (kernels on, one device)?"""
    types = (
        jnp.dtype(x.dtype) == jnp.float32 and a.dtype == b.dtype and any(a.dtype == t for t in TABLE_DTYPES)
    )
    shapes = (
        x.ndim == 2 and a.ndim == 3 and b.ndim == 3 and a.shape[1] == x.shape[1] and b.shape[1] == a.shape[2]
    )
    return types and shapes and kernels.enabled() and one_device()


def lora_add(y, x, slots, a, b, scale=None):
    """``y[m] + (x[m] @ a[slots[m]]) @ b[slots[m]]`` for every row ``m`` (``y [M, O]``, ``x [M, K]`` f32;
    rows with ``slots[m] < 0`` unchanged), reading each row's slot of the tables in place and updating
    ``y`` in place (the output aliases it). int8 tables take ``scale [N, R]``: ``h = (x @ a) * scale``."""
    return lora_add_many([y], x, slots, [(a, b, scale)])[0]


def lora_add_many(ys, x, slots, tables) -> tuple:
    """``lora_add`` for several projections of the same ``x`` (q / k / v, gate / up) in one call:
    ``ys[i]`` updated with ``tables[i] = (a, b, scale or None)``."""
    kernels.ensure_registered()
    out = tuple(jax.ShapeDtypeStruct(y.shape, jnp.float32) for y in ys)
    call = jax.ffi.ffi_call("aotlm_lora", out, input_output_aliases={2 + 4 * i: i for i in range(len(ys))})
    none = jnp.zeros((0,), jnp.float32)
    operands = [
        o
        for y, (a, b, s) in zip(ys, tables, strict=True)
        for o in (y.astype(jnp.float32), a, b, none if s is None else s.astype(jnp.float32))
    ]
    return tuple(call(x, slots.astype(jnp.int32), *operands))
