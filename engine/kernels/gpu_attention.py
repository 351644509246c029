"""One decode step's attention over the KV cache on a GPU: a Pallas kernel (Triton lowering).

XLA's decode attention is several kernels a layer (the scores' batched dot, mask, softmax, the values'
batched dot, their concatenation with the step's own token); here one kernel reads each visible cache
slot once and keeps scores and softmax in registers, as ``kernels.decode_attention`` (``dattn.h``)
does on CPU, with the same operands: ``q [I, G, Dh]`` (``I = B * Kh``: batch row ``i // Kh``, kv head
``i % Kh``), the cache's ``keys [IB >= I, S, Dh]`` and ``values [IB, Dh, S]`` (its layouts, read in
place), the step's own ``k_new`` / ``v_new [I, Dh]``, ``mask [B, W + 1]`` (the bucket's ``W`` slots,
then the row's own token) and ``limit [I]`` (no slot at or past it is read). A program takes one row
and one of ``splits`` slices of the ``W`` slots, in blocks of ``bs`` slots, with an online softmax
(float32 scores; the probabilities rounded to the cache's dtype for the values' product, as XLA's path
rounds them); XLA merges the slices' partial results and the own token's term in a fixed order
(deterministic). The ``G`` query heads of a kv head are padded to 16 rows (Triton's smallest dot).

Off by default: ``AOTLM_GPU_ATTENTION=pallas`` turns it on (``pallas:bs=64,splits=2`` fixes the blocks,
else ``blocks`` picks them); part of the compile-cache key (``cache_tag``). bf16 / f16 only (a float32
model keeps XLA's exact path: Triton's float32 dot would round through TF32). On CPU the kernel runs
in Pallas' interpreter for the tests, and its lowering for ``cuda`` is checked there too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from aotlm.kernels.context import one_device
from aotlm.kernels.gpu_matmul import (
    TARGET_PROGRAMS,
    X_DTYPES,
    on_gpu,
    padded_rows,
    parse_setting,
    pow2,
    setting_tag,
)

ENV = "AOTLM_GPU_ATTENTION"
NEG = -1e30  # a masked score: finite (exp(NEG - NEG) is a number); masked slots' weights are zeroed
INTERPRET = False  # tests on CPU: run the kernel in Pallas' interpreter


@dataclass(frozen=True)
class Blocks:
    """Cache slots per loop step, slices of the bucket's slots (one program each), Triton warps / stages."""

    bs: int
    splits: int = 1
    warps: int = 4
    stages: int = 2


def setting() -> Blocks | str:
    """``AOTLM_GPU_ATTENTION``: ``"xla"`` (the default), ``"pallas"`` (blocks per shape) or ``Blocks``."""
    blocks = parse_setting(ENV, Blocks, "pallas:bs=64,splits=2,warps=4,stages=2 (bs a power of two >= 16)")
    if isinstance(blocks, str):
        return blocks
    ok = pow2(blocks.bs) and pow2(blocks.warps) and blocks.bs >= 16
    if not ok or min(blocks.splits, blocks.stages) < 1:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r}: bs and warps powers of two, bs >= 16, splits and stages >= 1"
        )
    return blocks


def cache_tag() -> str:
    """Compile-cache key field: graphs with the Pallas kernel (and its blocks) differ from XLA's."""
    return setting_tag(setting())


def blocks(rows: int, width: int) -> Blocks | None:
    """A configuration for ``rows`` (``I``) rows over ``width`` slots; None where no block of 64 / 32 /
    16 slots divides ``width``. The slots are cut into as many slices (whole blocks each) as keep the
    grid within ``TARGET_PROGRAMS`` programs: a batch-1 step over a long cache still fills the GPU."""
    bs = next((b for b in (64, 32, 16) if width % b == 0), None)
    if bs is None:
        return None
    n = width // bs
    splits = max(d for d in range(1, n + 1) if n % d == 0 and (d == 1 or rows * d <= TARGET_PROGRAMS))
    return Blocks(bs, splits)


def config(q, keys, width: int) -> Blocks | None:
    """Static (shapes / dtypes of ``attend``'s ``q [I, G, Dh]`` and ``keys [IB, S, Dh]``): the blocks
    ``attend`` would use, None if it cannot take them."""
    rows, g, dh = q.shape
    if jnp.dtype(q.dtype) not in X_DTYPES or jnp.dtype(keys.dtype) != jnp.dtype(q.dtype):
        return None
    if not pow2(dh) or dh < 16 or g > 64 or width > keys.shape[1]:
        return None
    s = setting()
    b = blocks(rows, width) if s in ("xla", "pallas") else s
    return b if b is not None and width % (b.bs * b.splits) == 0 else None


def takes(q, keys, width: int) -> bool:
    """Static: does a decode step of ``q [B, 1, H, Dh]`` over the cache's ``keys [R, Kh, S, Dh]`` (the
    bucket's first ``width`` slots) take the kernel on this backend (a GPU, ``AOTLM_GPU_ATTENTION`` set,
    one device, a bf16 / f16 cache of the query's dtype, a power-of-two head size)?"""
    if q.ndim != 4 or q.shape[1] != 1 or setting() == "xla" or not on_gpu() or not one_device():
        return False
    b, _, h, dh = q.shape
    r, kh, s, _ = keys.shape
    kd = jnp.bfloat16 if keys.dtype == jnp.uint16 else keys.dtype  # a cache of bf16 bits (layers.cache_view)
    rows = jax.ShapeDtypeStruct((b * kh, h // kh, dh), q.dtype)
    return config(rows, jax.ShapeDtypeStruct((r * kh, s, dh), kd), width) is not None


def _kernel(lim_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, l_ref, *, pl, bs: int, steps: int, scale):
    """One program: one row's padded query heads over one slice of the slots (``pl``: Pallas)."""
    start, lim = pl.program_id(1) * (steps * bs), lim_ref[0]
    n = jnp.clip((lim - start + bs - 1) // bs, 0, steps)  # blocks with a slot under the limit
    q = q_ref[...]
    gp, dh = q.shape
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)
    nt = (((1,), (1,)), ((), ()))  # a @ b.T

    def step(t, carry):
        o, m, l = carry
        s0 = pl.multiple_of(start + t * bs, bs)
        s = jax.lax.dot_general(q, k_ref[pl.ds(s0, bs), :], nt, preferred_element_type=jnp.float32)
        seen = (mask_ref[pl.ds(s0, bs)][None, :] != 0) & (s0 + cols < lim)
        s = jnp.where(seen, s * scale, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
        v = v_ref[:, pl.ds(s0, bs)]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, nt, preferred_element_type=jnp.float32)
        return o * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    f32 = jnp.float32
    init = (jnp.zeros((gp, dh), f32), jnp.full((gp,), NEG, f32), jnp.zeros((gp,), f32))
    o_ref[...], m_ref[...], l_ref[...] = jax.lax.fori_loop(0, n, step, init)


@functools.lru_cache(maxsize=1)
def _pallas():
    from jax.experimental import pallas  # local: imported only where the kernel is traced (~0.1 s)
    from jax.experimental.pallas import triton  # local: as pallas

    return pallas, triton


def _call(lim, q, keys, values, mask, kh: int, b: Blocks, scale: float, interpret: bool):
    """Per slice, each row's unnormalized output ``[splits, I, Gp, Dh]``, running max and sum
    ``[splits, I, Gp]`` (float32) over the slots ``mask [B, W]`` (int32) shows under ``lim [I]``."""
    pl, triton = _pallas()
    rows, gp, dh = q.shape
    width, s = mask.shape[1], keys.shape[1]
    steps = width // (b.bs * b.splits)
    f32 = jnp.float32
    row = lambda *tail: lambda i, j: (i, *tail)
    return pl.pallas_call(
        functools.partial(_kernel, pl=pl, bs=b.bs, steps=steps, scale=scale),
        out_shape=(
            jax.ShapeDtypeStruct((b.splits, rows, gp, dh), f32),
            jax.ShapeDtypeStruct((b.splits, rows, gp), f32),
            jax.ShapeDtypeStruct((b.splits, rows, gp), f32),
        ),
        grid=(rows, b.splits),
        in_specs=[
            pl.BlockSpec((1,), row()),
            pl.BlockSpec((None, gp, dh), row(0, 0)),
            pl.BlockSpec((None, s, dh), row(0, 0)),
            pl.BlockSpec((None, dh, s), row(0, 0)),
            pl.BlockSpec((None, width), lambda i, j: (i // kh, 0)),
        ],
        out_specs=(
            pl.BlockSpec((None, None, gp, dh), lambda i, j: (j, i, 0, 0)),
            pl.BlockSpec((None, None, gp), lambda i, j: (j, i, 0)),
            pl.BlockSpec((None, None, gp), lambda i, j: (j, i, 0)),
        ),
        compiler_params=triton.CompilerParams(num_warps=b.warps, num_stages=b.stages),
        interpret=interpret,
        name="aotlm_gpu_dattn",
    )(lim, q, keys, values, mask)


def attend(q, keys, values, k_new, v_new, mask, limit, scale: float, interpret: bool | None = None,
           blocks: Blocks | None = None):  # fmt: skip
    """``kernels.decode_attention``'s step on the Pallas kernel: returns ``[I, G, Dh]`` float32, zeros for
    a row that sees nothing. ``blocks`` overrides the configuration (tests); ``interpret`` runs Pallas'
    interpreter (CPU; default ``INTERPRET``)."""
    interpret = INTERPRET if interpret is None else interpret
    rows, g, dh = q.shape
    kh, width = rows // mask.shape[0], mask.shape[1] - 1
    b = blocks or config(q, keys, width)
    if b is None:
        raise ValueError(f"no GPU attention blocks for q {q.shape} {q.dtype}, keys {keys.shape} {keys.dtype}")
    gp = padded_rows(g)
    qp = jnp.pad(q, ((0, 0), (0, gp - g), (0, 0))) if gp > g else q
    lim = jnp.minimum(jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (rows,)), width)
    o, m, l = _call(lim, qp, keys, values, mask[:, :width].astype(jnp.int32), kh, b, scale, interpret)
    o, m, l = o[:, :, :g], m[:, :, :g], l[:, :, :g]
    # the row's own token: one more score, visible where the mask's last column says
    f32 = lambda x: x.astype(jnp.float32)
    own = jnp.einsum("igd,id->ig", f32(q), f32(k_new), precision="highest") * scale
    seen = jnp.repeat(mask[:, width], kh)[:, None]
    own = jnp.where(seen, own, NEG)
    top = jnp.maximum(jnp.max(m, axis=0), own)
    w_own = jnp.where(seen, jnp.exp(own - top), 0.0)
    total, out = w_own, w_own[..., None] * f32(v_new)[:, None, :]
    for j in range(b.splits):  # a fixed order: the same bits every call
        w = jnp.exp(m[j] - top)
        total, out = total + l[j] * w, out + o[j] * w[..., None]
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
