"""Matmuls with low-precision activations (prefill; W8A8 decode rows too): a static option of the graph.

* ``"s8"`` (``quant="w8a8"``): int8 weights times activations rounded to int8 per row (dynamic scale
  ``max|x| / 127``, computed in the graph), summed in int32 (exact), then ``* s_x[row] * scale[col]``.
* ``"bf16"`` (``quant="bf16a"``): bf16 weights times activations rounded to bf16 (round to nearest
  even), each product exact in f32, summed in f32 -- what a bf16 model's matmul inputs are, with the
  rest of the layer (norms, attention, residuals) kept in f32. On CPUs with AVX512-BF16 the GEMM
  kernel runs it on ``vdpbf16ps`` (twice the f32 FMA rate); elsewhere the same products go through
  the f32 path.

Prefill products (more than ``kernels.MAX_ROWS`` rows) change; of decode's, W8A8's too: its row kernel
rounds each row to int8 itself (``kernels.w8a8_rows``) and multiplies on ``vpdpbusd`` where the CPU has
AVX512-VNNI -- a 16-row step's int16 products were compute-bound (SmolLM2-135M's matmuls 15.8 -> 10.1
ms per 16-row step in a profile) -- so decode rounds as prefill does, a row's numbers do not depend on
the decode batch, and XLA's integer dot (kernels off) forms the same int32 sums; under tensor
parallelism decode rows stay f32 (a shard of a row lacks its max over K). bf16 activations stay a
prefill option: decode reads the weights, where reading, not the arithmetic, is the cost. The model
sets the option around lowering like the kernels' mesh
(``layers.dense`` has no config to read it from).
"""

from __future__ import annotations

import contextlib
import math
import threading

import jax.numpy as jnp

from aotlm import kernels
from aotlm.models import packing, rounding

# "s16" / "f32": 4-bit weights' x as int16 in two int8 digits / in three int8 parts (quant4.dense4), every row
KINDS = (None, "s8", "bf16", "s16", "f32")
_opts = threading.local()


@contextlib.contextmanager
def activations(kind: str | None):
    """Graphs traced inside take matmul activations of ``kind`` (one of ``KINDS``): prefill's, and with
    ``"s8"`` decode rows' too (``layers.dense``)."""
    if kind not in KINDS:
        raise ValueError(f"prefill activations {kind!r} are not one of {KINDS}")
    old = getattr(_opts, "kind", None)
    _opts.kind = kind
    try:
        yield
    finally:
        _opts.kind = old


def kind() -> str | None:
    """The low-precision activations of the graph being traced (``activations``), None: the compute dtype."""
    return getattr(_opts, "kind", None)


def quantize_rows(x, axes: int = 1):
    """Per-row symmetric int8 of ``x [..., *K]`` over its last ``axes`` dims: ``(q int8, s f32 [...])``
    with ``s = max|x| / 127`` (1 for an all-zero row), ``q * s ~ x``. Dynamic (computed in the graph
    from each prompt's activations), so no calibration data is needed."""
    return rounding.per_row(x, axes, 127.0, jnp.int8)


def dense(
    kind: str, x, w, scale, axes: int, name: str | None, pk: int | None, b=None, act: str | None = None
):
    """``layers.dense``'s product under ``activations(kind)``: ``(y, fused)``, ``fused`` when the GEMM
    applied the bias ``b`` and ``act`` (a ``kernels.GEMM_ACTS`` name) in its output pass (else the
    caller does). W8A8 fuses them where the GEMM rounds x itself (one device): ``(sum * s_x) * scale``
    stays the graph's, then ``+ b`` and ``act`` as ``gemm.h``'s other GEMMs apply them."""
    if kind == "bf16":
        return bf16a(x, w, axes, name, pk, b, act)
    if kernels.w8a8_fused(x, w, axes, name, pk) and kernels.gemm_fuses(x, w, axes, name, pk, act):
        return kernels.matmul(x, w, scale, axes, name, packed_k=pk, b=b, act=act, quant_x=True), True
    return w8a8(x, w, scale, axes, name, pk), False


def w8a8(x, w, scale, axes: int, name: str | None, pk: int | None):
    """``x @ (w * scale)`` as W8A8: int8 rows of x times int8 w summed in int32 (exact), then
    ``* s_x[row] * scale[col]`` -- in the GEMM kernel (``aotlm_gemm_pk``) or XLA's integer dot,
    the same numbers either way."""
    if kernels.w8a8_fused(x, w, axes, name, pk):  # the GEMM rounds x itself: no separate pass over x
        return kernels.matmul(x, w, scale, axes, name, packed_k=pk, quant_x=True)
    xq, sx = quantize_rows(x, axes)
    if kernels.gemm_supported(xq, w, axes, name, pk):
        return kernels.matmul(xq, w, scale, axes, name, packed_k=pk, sx=sx)
    wl = packing.unpack(w, name) if pk else w
    acc = jnp.tensordot(xq, wl, axes=axes, preferred_element_type=jnp.int32).astype(jnp.float32)
    return acc * sx.reshape(*sx.shape, *(1,) * (acc.ndim - sx.ndim)) * scale.astype(jnp.float32)


def w8a8_rows(x, w, scale, axes: int, name: str | None, pk: int | None) -> tuple[bool, bool]:
    """Static, for W8A8 decode rows (``kind() == "s8"``, int8 ``w`` with ``scale``, at most
    ``kernels.MAX_ROWS`` rows of ``x``): ``(kernel, graph)``, whether the row kernel rounds ``x`` to int8
    itself (``kernels.matmul(a8=True)``) or, without the kernels, the graph does (``w8a8``). Neither
    for other products, nor under tensor parallelism on the kernels (a shard of a row lacks its max)."""
    if scale is None or kind() != "s8" or math.prod(x.shape[: x.ndim - axes]) > kernels.MAX_ROWS:
        return False, False
    if not kernels.supported(x, w, axes, name):
        return False, True
    return kernels.w8a8_rows(x, w, axes, name, pk), False


def bf16a(x, w, axes: int, name: str | None, pk: int | None, b=None, act: str | None = None):
    """``x @ w`` for bf16 ``w`` with ``x`` rounded to bf16, f32 result: ``(y, fused)``, ``fused`` when
    the bias ``b`` and ``act`` (a ``kernels.GEMM_ACTS`` name) were applied by the kernel. The GEMM
    kernel (``vdpbf16ps`` or x widened), the row kernels (x rounded, passed as f32) or XLA's dot of
    the bf16 operands with f32 products and sums: the same products on every path."""
    xb = x.astype(jnp.bfloat16)
    if kernels.gemm_supported(xb, w, axes, name, pk):
        fuse = kernels.gemm_fuses(xb, w, axes, name, pk, act)
        fused = {"b": b, "act": act} if fuse else {}
        return kernels.matmul(xb, w, None, axes, name, packed_k=pk, **fused), fuse
    xr = xb.astype(jnp.float32)
    if kernels.supported(xr, w, axes, name):
        return kernels.matmul(xr, w, None, axes, name, packed_k=pk), False  # f32 x: f32 out
    wl = packing.unpack(w, name) if pk else w
    return jnp.tensordot(xb, wl.astype(jnp.bfloat16), axes=axes, preferred_element_type=jnp.float32), False
