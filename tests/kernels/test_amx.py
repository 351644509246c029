"""bf16 weight panels on AMX tiles (``engine/kernels/amx16.h``, the ``amx`` level): f32 x in three bf16
parts (``amp="bf16"`` / ``quant="bf16"`` prefill) and bf16 x (``quant="bf16a"``), against float64 products
on odd shapes (K off the tile's 32, one panel or an odd count of them, rows off the tiles' 32), held to f32
summation error, tighter than the widened-panel GEMM's tests; x's infinities and NaN come through as the
float64 product has them; int8 panels times x rounded to int16 (``quant="int8"`` prefill, ``amx16i.h``)
equal to the row kernels bit for bit. On a CPU without AMX (or where Linux refuses the tile state) they
skip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import rel_error

from aotlm import kernels
from aotlm.models import packing

pytestmark = pytest.mark.skipif(
    not (kernels.enabled() and kernels.amx_tiles()),
    reason="needs the amx kernel level with the tile state granted (a Sapphire Rapids class CPU)",
)
ROWS = (17, 31, 32, 33, 100, 300)  # past kernels.MAX_ROWS: the GEMM; 300 spans two 256-row passes
SHAPES = ((38, 16), (1030, 48), (2048, 80), (64, 32))  # K % 32: 6, 6, 0, 0; panels 1, 3, 5, 2


def _bf16(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.bfloat16))


def _gelu(y):
    return 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3)))


def _row_errors(y, ref) -> np.ndarray:
    """Each row's ``max|y - ref| / max|ref|``: rows of 1e-3 and of 1e3 each held to their own scale."""
    ref = np.asarray(ref, np.float64)
    return np.abs(np.asarray(y, np.float64) - ref).max(1) / np.abs(ref).max(1)


def test_f32_x_on_tiles_holds_f32_precision():
    """x split into h + m + l: each row within f32 summation error of x (f32) @ w (bf16) in float64 (median
    <= 1e-6, max <= 4e-6) where h + m alone is 4e-6 - 8e-6 off at the median and h alone ~1e-3, so a
    dropped or doubled part fails; bias + gelu fused in the output pass."""
    rng = np.random.default_rng(0)
    f = jax.jit(lambda x, w: kernels.matmul(x, w, None, packed_k=1))
    fb = jax.jit(lambda x, w, b: kernels.matmul(x, w, None, packed_k=1, b=b, act="gelu_tanh"))
    errs = []
    for m in ROWS:
        for k, n in SHAPES:
            x = rng.standard_normal((m, k)).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3], (m, 1))
            w = _bf16(rng.standard_normal((k, n)))
            ref = x.astype(np.float64) @ w.astype(np.float64)
            wp = packing.pack(w, (0,))
            errs.append(_row_errors(f(x, wp), ref))
            assert errs[-1].max() <= 4e-6, (m, k, n, errs[-1].max())
            b = rng.standard_normal(n).astype(np.float32)
            x = x / np.abs(x).max(1, keepdims=True)
            got, want = fb(x, wp, b), _gelu(x.astype(np.float64) @ w.astype(np.float64) + b)
            assert rel_error(got, want) <= 2e-6, (m, k, n)
    assert np.median(np.concatenate(errs)) <= 1e-6


def test_bf16_x_on_tiles_sums_the_exact_products():
    """bf16 x (``quant="bf16a"``'s GEMM): within 1e-6 of the float64 product of the bf16 operands."""
    rng = np.random.default_rng(1)
    f = jax.jit(lambda x, w: kernels.matmul(x, w, None, packed_k=1).astype(jnp.float32))
    for m in (65, 100, 300):  # bf16 x takes the GEMM past the row kernels' 64 rows
        for k, n in SHAPES:
            x, w = _bf16(rng.standard_normal((m, k))), _bf16(rng.standard_normal((k, n)))
            y = f(jnp.asarray(x), packing.pack(w, (0,)))
            assert rel_error(y, x.astype(np.float64) @ w.astype(np.float64)) <= 1e-6, (m, k, n)


def test_infinities_and_nan_in_x_come_through():
    """An inf in x gives the float64 product's +-inf in its row (its lower parts are 0, not inf - inf); a
    NaN gives NaN; the other rows are untouched."""
    rng = np.random.default_rng(2)
    m, k, n = 40, 70, 32
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[3, 5], x[7, 0], x[9, 69] = np.inf, -np.inf, np.nan
    w = _bf16(rng.standard_normal((k, n)))
    y = np.asarray(jax.jit(lambda x, w: kernels.matmul(x, w, None, packed_k=1))(x, packing.pack(w, (0,))))
    with np.errstate(invalid="ignore"):
        ref = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_array_equal(np.isposinf(y), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(y), np.isneginf(ref))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    rest = np.ones(m, bool)
    rest[[3, 7, 9]] = False
    assert rel_error(y[rest], ref[rest]) <= 1e-6


def _int16_rows_reference(x: np.ndarray, w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The int8 row kernels' math (``packed.h``): x rounded to int16 per row (``sx = max|x| / 32767``), exact
    int32 sums per block of 256 rows of K, each converted to f32 and added in order, times ``s * sx``."""
    sx = np.where(np.abs(x).max(1) > 0, np.abs(x).max(1) / np.float32(32767), 1).astype(np.float32)
    q = np.rint((x * (np.float32(1) / sx)[:, None]).astype(np.float32)).astype(np.int64)
    acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for k0 in range(0, x.shape[1], 256):
        acc = acc + (q[:, k0 : k0 + 256] @ w[k0 : k0 + 256].astype(np.int64)).astype(np.float32)
    return acc * (s[None, :] * sx[:, None]).astype(np.float32)


def test_int8_prefill_rows_on_tiles_equal_the_row_kernels():
    """int16 x in two int8 digits on tiles (``amx16i.h``, more than 32 rows): bit for bit the row kernels'
    sums (the reference above, and the same rows called 16 at a time, as decode rows run), with K over
    several 256-row blocks and off the tiles' 64; an inf / NaN row gives NaN in its own outputs only."""
    rng = np.random.default_rng(3)
    f = jax.jit(lambda a, b, s: kernels.matmul(a, b, s, packed_k=1))
    for m in (33, 64, 100, 300):
        for k, n in ((38, 16), (250, 48), (600, 32), (1030, 16)):
            w = rng.integers(-127, 128, (k, n)).astype(np.int8)
            s = (rng.random(n) / 100).astype(np.float32)
            x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
            x[1] = 0.0
            wp = jnp.asarray(packing.pack(w, (0,)))
            got = np.asarray(f(jnp.asarray(x), wp, s))
            np.testing.assert_array_equal(got, _int16_rows_reference(x, w, s), err_msg=str((m, k, n)))
            rows16 = np.concatenate(
                [np.asarray(f(jnp.asarray(x[i : i + 16]), wp, s)) for i in range(0, m, 16)]
            )
            np.testing.assert_array_equal(got, rows16, err_msg=str((m, k, n)))
            x[0, k - 1], x[2, 3] = np.inf, np.nan
            bad = np.asarray(f(jnp.asarray(x), wp, s))
            assert np.isnan(bad[[0, 2]]).all() and np.array_equal(bad[3:], got[3:]) and (bad[1] == 0).all()
