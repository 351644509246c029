"""fp8 weights and activations (``quant="fp8"``): the products of a GPU with fp8 tensor cores (Hopper, Ada).

Storage: every big matrix (``CONTRACT_AXES``, as int8's) is ``float8_e4m3fn`` with a float32 scale per
output channel, ``max|w| / 448`` over the contracted dims (448: e4m3's largest finite value), leaf
``<name>_scale``. The dense layers' matrices are stored K-minor, ``[*Nd, *Kd, 1]`` (``TN_LEAVES``; the
trailing 1 tells the layout apart from the logical ``[*Kd, *Nd]``, as the CPU panels' two extra dims
do, so sharding reads its axes from the leaf alone: ``tn_axes``): cuBLASLt's fp8 GEMM takes both
operands with K contiguous, and XLA:GPU transposes a row-major ``[K, N]`` weight on every call to get
that (a copy of every weight each decode step). MoE experts (an einsum, weights widened) stay logical.
A tied lm_head gets its own fp8 copy of the embedding rows (``embed_q [V, D]``: K-minor already, a
scale per vocab row) on every backend, so the logits read one byte a weight too.

Math (every product, prefill and decode alike, so a row's numbers do not depend on its batch): each row
of x is rounded to e4m3 with its own scale ``max|x| / 448`` (computed in the graph: no calibration),
the two fp8 operands go to one ``dot_general`` with float32 results at ``HIGHEST`` precision (float32
sums; on a GPU that is also what keeps cuBLASLt's fp8 "fast accumulation" off), then
``* s_x[row] * scale[col]``. XLA:GPU lowers a dot of two fp8 operands to cuBLASLt's fp8 GEMM on
Hopper / Ada (other GPUs convert them); XLA:CPU converts them to f32 (correct, no faster than f32
weights: aotlm's CPU kernels have no fp8 path, use ``int8`` / ``int4`` there). The same rounding as
vLLM's dynamic fp8 (per-token activation scales, per-channel weight scales).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from aotlm import kernels
from aotlm.models import rounding
from aotlm.models.axes import CONTRACT_AXES, LOGICAL_AXES

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (no infinities: past it a cast gives NaN)
FP8 = ml_dtypes.float8_e4m3fn
# leaves stored K-minor ([*Nd, *Kd, 1]): the dense layers' matrices (not MoE experts' einsum operands)
TN_LEAVES = tuple(n for n in CONTRACT_AXES if not n.startswith("e_"))


def is_tn(name: str | None, ndim: int) -> bool:
    """Static: is a leaf ``name`` of ``ndim`` dims in the K-minor form (one dim more than logical)?"""
    return name in TN_LEAVES and ndim == len(LOGICAL_AXES[name]) + 1


def tn(q: np.ndarray, contract: tuple[int, ...]) -> np.ndarray:
    """Logical ``[*Kd, *Nd]`` (contracted dims ``contract``) -> K-minor ``[*Nd, *Kd, 1]``."""
    moved = np.moveaxis(q, contract, tuple(range(q.ndim - len(contract), q.ndim)))
    return np.ascontiguousarray(moved)[..., None]


def tn_axes(name: str, axes: tuple) -> tuple:
    """Logical axes of a K-minor leaf: the output axes, the contracted ones, then the marker (none)."""
    contract = CONTRACT_AXES[name]
    return (*(a for i, a in enumerate(axes) if i not in contract), *(axes[i] for i in contract), None)


def is_fp8(w, scale) -> bool:
    """Static: is ``w`` an fp8 matrix with its per-channel ``scale`` (this module's storage)?"""
    return scale is not None and jnp.dtype(w.dtype) == jnp.dtype(jnp.float8_e4m3fn)


def quantize(w: np.ndarray, contract: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Host side: ``(q e4m3 of w's shape, s float32 of w's shape without the contract axes)`` with
    ``q * s ~ w``, ``s = max|w| / 448`` per output channel, round to nearest even; an all-zero channel
    (tp padding) gets scale 0 and zero codes."""
    return rounding.per_channel(w, contract, E4M3_MAX, FP8)


def quantize_rows(x, axes: int = 1):
    """In the graph: each row of ``x [..., *K]`` (its last ``axes`` dims) as e4m3 with scale
    ``max|x| / 448`` (1 for an all-zero row): ``(q [..., *K] e4m3, s [...] f32)``, ``q * s ~ x``."""
    return rounding.per_row(x, axes, E4M3_MAX, jnp.float8_e4m3fn)


def dense(x, w, scale, axes: int = 1, nt: bool = False, name: str | None = None):
    """``x @ (w * scale)`` in float32 as fp8 x fp8: ``x [..., *K]`` (its last ``axes`` dims contracted
    with ``w``'s first ``axes``; ``nt``: ``w [N, K]``; a K-minor leaf ``name``, ``is_tn``: ``[*N, *K, 1]``),
    ``scale`` per output channel. Output ``[..., *N]``. Decode rows on a GPU with
    ``AOTLM_GPU_MATMUL=pallas`` take the Pallas kernel (``kernels.matmul_gpu``: the e4m3 operands widened
    to bf16 in registers, the same products)."""
    xq, sx = quantize_rows(x, axes)
    lead = x.shape[: x.ndim - axes]
    if is_tn(name, w.ndim):
        w, nt = w[..., 0], True  # [*N, *K]
    n_dims = w.shape[: w.ndim - axes] if nt else w.shape[axes:]
    w = w.reshape(-1, *w.shape[w.ndim - axes :]) if nt else w  # [N, *K]: one output dim
    flat = w.reshape(w.shape[0], -1) if nt else w  # the kernel's nt operand, [N, K]
    if kernels.gpu_matmul_ok(xq, flat, scale, axes, nt):
        y = kernels.matmul_gpu(xq, flat, scale, axes, nt)
    else:
        lhs = tuple(range(x.ndim - axes, x.ndim))
        rhs = tuple(range(w.ndim - axes, w.ndim)) if nt else tuple(range(axes))
        dims = ((lhs, rhs), ((), ()))
        y = lax.dot_general(xq, w, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        y = y * (scale.reshape(-1) if nt else scale).astype(jnp.float32)
    y = y.reshape(*lead, *n_dims)
    return y * sx.reshape(*sx.shape, *(1,) * (y.ndim - sx.ndim))
