"""Shared building blocks: norms, activations, rotary / ALiBi positions, cached attention, MLPs.

Every family in ``models/`` is assembled from these; no family has its own attention.
Shapes: ``B`` batch, ``T`` query tokens of this call, ``S`` cache slots, ``W`` attended
slots (the bucket width, static), ``H`` query heads, ``K`` kv heads, ``Dh`` head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aotlm import kernels
from aotlm.models import lowp, packing, quant4, quant8, quant_fp8

NEG_INF = -1e30  # finite, so a fully masked (padding) query row gives no NaN


# --------------------------------------------------------------------------- norms
def layer_norm(x, scale, bias, eps):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + eps)
    y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def rms_norm(x, scale, eps, offset=0.0):
    """RMSNorm; ``offset=1`` gives Gemma's ``x * (1 + w)``."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    return (y * (offset + scale.astype(jnp.float32))).astype(x.dtype)


def norm(kind: str, x, p: dict, prefix: str, eps: float, offset: float = 0.0):
    """Apply the norm whose params are ``p[prefix + '_scale']`` (and ``_bias``)."""
    if kind == "layernorm":
        return layer_norm(x, p[prefix + "_scale"], p.get(prefix + "_bias"), eps)
    if kind == "rmsnorm":
        return rms_norm(x, p[prefix + "_scale"], eps, offset)
    raise ValueError(f"unknown norm kind {kind!r}")


# --------------------------------------------------------------------------- activations
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_tanh")


def activation(name: str, x):
    if name in GELU_TANH:
        return jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name in ("silu", "swish"):
        return jax.nn.silu(x)
    if name == "relu":
        return jax.nn.relu(x)
    raise ValueError(f"unsupported activation {name!r}")


# --------------------------------------------------------------------------- rotary
def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict | None, factors: list[float] | None = None
) -> tuple[float, ...]:
    """Inverse frequencies (host side, static) for the HF rope types aotlm supports. ``factors``: a
    divisor per frequency instead of a ``scaling`` rule (llama.cpp's ``rope_freqs`` of a Llama 3.x GGUF
    file, which says its llama3 scaling so; ``config.json``'s ``rope_freq_factors``)."""
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    if factors is not None:
        if len(factors) != len(inv):
            raise ValueError(f"rope_freq_factors has {len(factors)} values for {len(inv)} rotary frequencies")
        return tuple(float(v) for v in (inv / np.asarray(factors, np.float64)).astype(np.float32))
    rtype = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rtype == "default":
        pass
    elif rtype == "linear":
        inv = inv / float(scaling["factor"])
    elif rtype == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, smoothed, scaled)
    else:
        raise ValueError(
            f"rope_type {rtype!r} is not supported (supported: default, linear, llama3); "
            "dynamic scaling changes with sequence length and cannot be a static graph"
        )
    return tuple(float(v) for v in inv.astype(np.float32))


def rotary_tables(positions, inv_freq: tuple[float, ...]):
    """``(cos, sin)`` of ``positions [B,T]`` times ``inv_freq``, ``[B,T,1,len(inv_freq)]`` each: made once
    per call and shared by every layer with these frequencies (``decoder.forward``). Each layer making
    its own let XLA:CPU fuse them into the rotation and evaluate cos and sin once per element of q and
    k (SmolLM2's 128-token prefill: 0.5 ms per layer)."""
    freqs = positions.astype(jnp.float32)[..., None, None] * jnp.asarray(inv_freq, jnp.float32)
    # made in a two-step loop (cos, then sin), which XLA keeps as a loop: it fuses through everything
    # else (an optimization barrier and a conditional on a sharded value included) into every consumer
    both = lax.map(lambda k: jnp.where(k == 0, jnp.cos(freqs), jnp.sin(freqs)), jnp.arange(2))
    return both[0], both[1]


def apply_rotary(x, tables, interleaved: bool = False):
    """Rotate the first ``2 * F`` dims of ``x [B,T,H,Dh]`` by ``tables`` (``rotary_tables``' cos and sin,
    ``F`` frequencies wide).

    ``interleaved`` pairs dims (0,1),(2,3)... (GPT-J); otherwise halves (GPT-NeoX/Llama).
    """
    cos, sin = tables
    rot = 2 * cos.shape[-1]
    xr, xp = x[..., :rot].astype(jnp.float32), x[..., rot:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xr.shape)
    else:  # halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with the halves swapped by a reverse:
        # XLA:CPU ran the concatenate form as a per-element select
        halves = xr.reshape(*xr.shape[:-1], 2, rot // 2)
        signed_sin = jnp.asarray([-1.0, 1.0], jnp.float32)[:, None] * sin[..., None, :]
        out = (halves * cos[..., None, :] + halves[..., ::-1, :] * signed_sin).reshape(xr.shape)
    return jnp.concatenate([out.astype(x.dtype), xp], axis=-1) if rot < x.shape[-1] else out.astype(x.dtype)


# --------------------------------------------------------------------------- alibi
def alibi_slopes(n_heads: int) -> tuple[float, ...]:
    """ALiBi head slopes for any head count (BLOOM / MPT / the ALiBi paper)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(n_heads - closest)]
    return tuple(slopes)


# --------------------------------------------------------------------------- attention
def write_at(buf, x, write_idx, axis: int):
    """Write ``x [B,...]`` into ``buf`` at index ``write_idx`` of ``axis``.

    ``write_idx`` is a scalar (every row at the same slot: batched prompts) or ``[B]`` (each
    row at its own slot: the serving slots of ``aotlm.batching.slots``). Per-row writes of one
    token are one scatter per buffer, which XLA does in place (a 16-row SmolLM2-135M step: 60
    scatters, ~0.6 ms, where one ``dynamic_update_slice`` per row took 960 ops, ~1.6 ms); longer
    per-row writes one ``dynamic_update_slice`` per row. A one-hot select would rewrite the cache.
    """
    if jnp.ndim(write_idx) == 0:
        return lax.dynamic_update_slice_in_dim(buf, x, write_idx, axis)
    if x.shape[0] > 1 and x.shape[axis] == 1:  # one token per row: one scatter, in place
        idx = [jnp.arange(x.shape[0])] + [slice(None)] * (buf.ndim - 1)
        idx[axis] = write_idx
        return buf.at[tuple(idx)].set(jnp.squeeze(x, axis), mode="promise_in_bounds")
    for b in range(x.shape[0]):
        start = [jnp.int32(b)] + [jnp.int32(0)] * (buf.ndim - 1)
        start[axis] = write_idx[b]
        buf = lax.dynamic_update_slice(buf, x[b : b + 1], start)
    return buf


def cache_view(buf):
    """A KV-cache buffer (or a slice of it) as its float dtype: a ``uint16`` buffer holds bf16 bits.

    Why bits: XLA:CPU upcasts a bf16 ``dynamic_update_slice`` to f32, so every cache write converted
    the whole layer's cache to f32 and back (48 whole-cache converts per GPT-2-small decode step; a
    bf16 cache then decoded at ~0.7x the f32 one). An integer buffer is updated in place; the
    ``bdot`` kernel reads the bits as bf16 directly, XLA's path through this view.
    """
    return lax.bitcast_convert_type(buf, jnp.bfloat16) if buf.dtype == jnp.uint16 else buf


def cache_store(x, dtype):
    """``x`` ready to be written into a cache buffer of ``dtype`` (rounded; bf16 bits for ``uint16``)."""
    if jnp.dtype(dtype) == jnp.uint16:
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


def update_cache(cache_k, cache_v, k, v, write_idx):
    """Write ``k, v [B,T,K,Dh]`` at slot ``write_idx`` of ``cache_k [B,K,S,Dh]``, ``cache_v [B,K,Dh,S]``.

    These are the operand layouts XLA's CPU dot wants (contracting dim last: ``Dh`` for
    ``q.k``, slots for ``p.v``); any other layout made XLA transpose-copy the whole cache in
    every layer of every decode step. ``write_idx``: a scalar or one slot per row (``write_at``).
    """
    return write_cache(cache_k, cache_v, jnp.swapaxes(k, 1, 2), jnp.transpose(v, (0, 2, 3, 1)), write_idx)


def write_cache(cache_k, cache_v, kt, vt, write_idx):
    """``update_cache`` for keys and values already in the cache's layouts: ``kt [B,K,T,Dh]``,
    ``vt [B,K,Dh,T]`` (as ``kernels.causal_attention`` returns them)."""
    k, v = cache_store(kt, cache_k.dtype), cache_store(vt, cache_v.dtype)
    return write_at(cache_k, k, write_idx, 2), write_at(cache_v, v, write_idx, 3)


def attention_mask(kv_pos, positions, write_idx, width: int, sliding_window: int | None):
    """Visibility masks of the two key segments a call attends to.

    Returns ``(old [B,T,W] | None, new [B,T,T])``: ``old`` covers the cache slots
    ``0..width-1`` written by earlier calls (only slots ``< write_idx`` holding a real token,
    ``write_idx`` a scalar or one slot per row,
    ``kv_pos >= 0``), ``new`` the call's own tokens (causal, padding ``positions < 0``
    hidden). With a sliding window, keys more than ``window - 1`` slots behind the query are
    hidden, counted in slots as transformers does. ``width == 0`` means no old segment.
    """
    t = positions.shape[1]
    w_idx = jnp.reshape(write_idx, (-1, 1, 1))  # [1|B, 1, 1]: one write slot, or one per row
    q_slot = w_idx + jnp.arange(t, dtype=jnp.int32)[None, :, None]  # [1|B, T, 1]
    q_idx = jnp.arange(t, dtype=jnp.int32)
    new = q_idx[None, :] <= q_idx[:, None]
    if sliding_window is not None:
        new &= q_idx[None, :] > q_idx[:, None] - sliding_window
    new = new[None] & (positions[:, None, :] >= 0)
    if width == 0:
        return None, new
    k_slot = jnp.arange(width, dtype=jnp.int32)[None, None, :]
    old = k_slot < w_idx
    if sliding_window is not None:
        old &= k_slot > q_slot - sliding_window
    return old & (kv_pos[: positions.shape[0], None, :width] >= 0), new


def attend(q, segments, scale: float, softcap: float | None = None):
    """Grouped-query attention of ``q [B,T,H,Dh]`` over key/value segments, one softmax.

    Each segment is ``(keys [R,K,S,Dh], values [R,K,Dh,S], mask [B,T,W], bias | None, limit)``
    with ``bias`` (ALiBi) ``[B,H,1|T,W]``; only the first ``W <= S`` slots of the first ``B <= R``
    rows are attended (the cache is passed whole: a serving call may run its first rows only),
    and ``limit`` (traced slot count, one per row ``[B]``, or None) says that no slot at or past
    it is visible to any row (to that row), so the kernel path skips them. Attending to the old cache
    and to the call's own new keys as two segments means the cache is only written, never read
    back, in the same step, so XLA updates it in place (reading the updated cache made it copy
    the cache every step). Scores
    and softmax run in float32. Few query tokens on one CPU device take the ``bdot`` kernel
    (``aotlm.kernels``), which reads the cache slots in place (a bf16 / f16 cache converted in
    registers); otherwise XLA's einsum, on the cache converted to the compute dtype. Long
    prefill calls take ``flash.attend`` instead (key blocks, no whole ``[T, W]`` scores or mask;
    ``decoder.visibility`` chooses).
    """
    b, t, h, dh = q.shape
    k_heads = segments[0][0].shape[1]
    g = h // k_heads
    qg = q.reshape(b, t, k_heads, g, dh)
    fast = kernels.attention_ok(t)
    if fast:  # [B*K, G*T, Dh] rows for the kernel (a reshape when t == 1)
        qk = jnp.transpose(qg, (0, 2, 3, 1, 4)).reshape(b * k_heads, g * t, dh)
    scores = []
    for keys, _, mask, bias, limit in segments:
        w = mask.shape[-1]
        if fast:  # the cache may hold more rows than the call: the kernel reads the first b
            s = kernels.bdot(qk, keys.reshape(-1, keys.shape[2], dh), w, n_limit=kernel_rows(limit, k_heads))
            s = s.reshape(b, k_heads, g, t, w) * scale
        else:
            kw = cache_view(keys[:b, :, :w])
            s = jnp.einsum("btkgd,bksd->bkgts", qg, kw, preferred_element_type=jnp.float32)
            s = s * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        if bias is not None:
            s = s + bias.reshape(b, k_heads, g, bias.shape[-2], bias.shape[-1])
        scores.append(jnp.where(mask[:, None, None], s, NEG_INF))
    p = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    o, start = 0.0, 0
    for (_, values, _, _, limit), s in zip(segments, scores, strict=True):
        w = s.shape[-1]
        if fast:
            pw = p[..., start : start + w].reshape(b * k_heads, g * t, w)
            vals = values.reshape(-1, dh, values.shape[-1])
            ov = kernels.bdot(pw, vals, dh, l_limit=kernel_rows(limit, k_heads))
            o = o + jnp.transpose(ov.reshape(b, k_heads, g, t, dh), (0, 3, 1, 2, 4))
        else:
            vw = cache_view(values[:b, ..., :w])
            dt = jnp.promote_types(q.dtype, vw.dtype)  # a bf16 cache under f32 compute: read as f32
            pw, vw = p[..., start : start + w].astype(dt), vw.astype(dt)
            o = o + jnp.einsum("bkgts,bkds->btkgd", pw, vw, preferred_element_type=jnp.float32)
        start += w
    return o.reshape(b, t, h, dh).astype(q.dtype)


def kernel_rows(limit, k_heads: int):
    """A slot limit for the kernels' rows (one per batch row and kv head): None or a scalar as it
    is, one per batch row ``[B]`` repeated over the kv heads."""
    return limit if limit is None or jnp.ndim(limit) == 0 else jnp.repeat(limit, k_heads)


def attend_decode(q, k, v, kv, m_old, m_new, limit, scale: float, gpu: bool = False):
    """``attend`` for one query token per row over the cache ``kv`` (``[R,K,S,Dh]`` keys,
    ``[R,K,Dh,S]`` values) and the row's own ``k, v [B,1,K,Dh]``, in one kernel call
    (``kernels.decode_attention``; ``gpu``: the Pallas kernel, ``kernels.decode_attention_gpu``): the
    scores never leave the kernel. ``m_old [B,1,W]``, ``m_new [B,1,1]`` as ``attend``'s masks,
    ``limit`` a scalar or ``[B]`` (``attend``'s)."""
    b, _, h, dh = q.shape
    kh = k.shape[2]
    mask = jnp.concatenate([m_old[:, 0], m_new[:, 0]], axis=-1)  # [B, W + 1]: once per forward
    flat = lambda x: x.reshape(b * kh, -1)
    keys, values = (cache_view(c) for c in kv) if gpu else kv
    kernel = kernels.decode_attention_gpu if gpu else kernels.decode_attention
    o = kernel(
        q.reshape(b * kh, h // kh, dh), keys.reshape(-1, keys.shape[2], dh),
        values.reshape(-1, dh, values.shape[3]), flat(k), flat(v), mask, kernel_rows(limit, kh), scale,
    )  # fmt: skip
    return o.reshape(b, 1, h, dh).astype(q.dtype)


# --------------------------------------------------------------------------- dense helpers
def dense(x, w, b=None, scale=None, axes: int = 1, name: str | None = None, act: str | None = None):
    """``x [..., D] @ w [D, ...]`` (+ bias), accumulating in float32.

    ``scale`` (int8 weights, ``models/quant.py``): ``w`` is converted to ``x``'s dtype (the
    dequant dtype) and the per-output-channel scale multiplies the float32 product, which
    equals ``x @ (w * scale)`` because the scale is constant along the contracted dims.
    Weights with few rows of x (decode) go to the CPU kernels (``aotlm.kernels``), which read the
    stored bytes instead of converting the whole matrix; ``name`` (the weight's leaf name) gives
    them its sharding under tensor parallelism. More rows (prefill): on CPU packed weights (int8 /
    bf16 / f16 / f32 in the panel layout) take the GEMM kernel (``gemm.h``), which beat XLA's dot;
    packed int8 on a CPU with AVX512-VNNI keeps the row kernel (``kernels.row_limit``), faster still.
    Under ``lowp.activations`` prefill rounds x first, on any backend: to int8 per row with int8
    weights (W8A8, ``lowp.w8a8``), to bf16 with bf16 weights (``lowp.bf16a``); W8A8 decode rows too
    (the row kernel rounds them itself, ``kernels.w8a8_rows``; under tensor parallelism they stay f32).
    ``act`` (an ``activation`` name) is applied to the result: by the kernel itself, with the bias,
    where ``kernels.gemm_fuses`` says it can (one pass over the output instead of XLA's two). fp8 weights
    (``quant="fp8"``): every product fp8 x fp8 (``quant_fp8.dense``) on any backend.
    """
    if quant_fp8.is_fp8(w, scale):
        y = add_bias(quant_fp8.dense(x, w, scale, axes, name=name), b)
        return (y if act is None else activation(act, y)).astype(x.dtype)
    four = quant4.is_int4(w, scale)
    if four or quant8.is_int8_groups(w, scale):  # group-scaled codes (quant4, quant8): kernel or dequantized
        kact = "gelu_tanh" if act in GELU_TANH else act
        dense_g = quant4.dense4 if four else quant8.dense8
        packed = four or packing.packed_k(name, w.ndim) is not None
        if packed and kernels.q4_fuses(x, name, kact):  # bias and activation in the kernel's output pass
            return dense_g(x, w, scale, axes, name, b, kact).astype(x.dtype)
        y = dense_g(x, w, scale, axes, name)
        y = y if b is None else y + b
        return (y if act is None else activation(act, y)).astype(x.dtype)
    pk = packing.packed_k(name, w.ndim)
    rows = math.prod(x.shape[: x.ndim - axes])
    kact = "gelu_tanh" if act in GELU_TANH else act
    low = lowp.kind() if rows > kernels.MAX_ROWS else None  # prefill with low-precision activations
    a8, graph_a8 = lowp.w8a8_rows(x, w, scale, axes, name, pk)
    low = "s8" if graph_a8 else low
    if (scale is not None and low == "s8") or (scale is None and low == "bf16" and w.dtype == jnp.bfloat16):
        y, fused = lowp.dense(low, x, w, scale, axes, name, pk, b, kact)
        if not fused:
            y = y if b is None else y + b
            y = y if act is None else activation(act, y)
        return y.astype(x.dtype)
    fusable = pk and kernels.supported(x, w, axes, name, pk) or _prefill_gemm(x, w, axes, name, pk)
    if fusable and kernels.gemm_fuses(x, w, axes, name, pk, kact):
        y = kernels.matmul(x, w, scale, axes, name, packed_k=pk, b=b, act=kact, a8=a8)
        return y.astype(x.dtype)
    if kernels.supported(x, w, axes, name, pk):
        y = kernels.matmul(x, w, scale, axes, name, packed_k=pk, a8=a8)
    elif _prefill_gemm(x, w, axes, name, pk):
        y = kernels.matmul(x, w, scale, axes, name, packed_k=pk)
    elif kernels.gpu_matmul_ok(x, w, scale, axes):  # GPU decode rows: each stored byte read once
        y = kernels.matmul_gpu(x, w, scale, axes)
    elif scale is not None:
        y = jnp.tensordot(x, xla_weight(w, x, True, name), axes=axes, preferred_element_type=jnp.float32)
        y = y * scale.astype(jnp.float32)
    else:
        y = jnp.tensordot(x, xla_weight(w, x, False, name), axes=axes)
    if b is not None:
        y = y + b
    return (y if act is None else activation(act, y)).astype(x.dtype)


# Prefill on the GEMM kernels instead of XLA's dot, where measured faster (GPT-2-small prefill, 2-core
# EPYC Zen 2): packed int8 / bf16 / f16 weights on aotlm_gemm_pk (each panel block widened to f32,
# f32 x) at every row count. f32 weights: aotlm_gemm (16 columns of the row-major matrix copied per
# block) was 1-2% slower than XLA's dot in the model (158 vs 155 ms at batch 1, 1054 vs 1042 at 8).
GEMM_F32 = False
GEMM_PACKED = True


def _prefill_gemm(x, w, axes: int, name: str | None, pk: int | None) -> bool:
    """Static: does this prefill product take a GEMM kernel (``GEMM_F32`` / ``GEMM_PACKED``)?"""
    if not kernels.gemm_supported(x, w, axes, name, pk):
        return False
    return GEMM_PACKED if pk else GEMM_F32


def xla_weight(w, x, scaled: bool, name: str | None = None):
    """A whole weight ready for XLA's own dot with ``x`` (prefill): int8 weights with a scale
    (``scaled``) in ``x``'s dtype, others promoted with it. A low-precision matrix is converted
    by the CPU kernel, run once ``x`` is ready (XLA:CPU's convert ran at ~1 GB/s there and was
    scheduled at the start of the graph), else by ``astype``; a packed leaf
    (``aotlm.models.packing``) comes back in its logical layout either way."""
    dtype = x.dtype if scaled else jnp.promote_types(x.dtype, w.dtype)
    pk = packing.packed_k(name, w.ndim)
    if jnp.dtype(w.dtype) == jnp.dtype(dtype) and not pk:
        return w
    out = kernels.convert(w, dtype, name, x, packed_k=pk)
    if out is not None:
        return out
    return (packing.unpack(w, name) if packing.is_packed(name, w.ndim) else w).astype(dtype)


def dense_in(x, w, b=None, scale=None, name: str | None = None):
    """Contract the trailing two dims of ``x [B,T,H,Dh]`` with ``w [H,Dh,D]``."""
    return dense(x, w, b, scale, axes=2, name=name)


def add_bias(y, b):
    return y if b is None else (y + b).astype(y.dtype)
