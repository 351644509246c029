"""int8 weights with a scale per group of 32 rows (``aotlm.models.quant8``, ``aotlm/kernels/group8.h``):
the rounding that finds a Q8_0 block's own codes again, the kernel against NumPy on odd shapes (at every
ISA level: ``test_isa.VARIANT_TESTS``), prefill rows equal decode rows, the unpack kernel and XLA's path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aotlm import kernels
from aotlm.models import packing, quant8

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")


def blocks(rng, k: int, n: int, minimum: bool = False):
    """Random Q8_0-like W [k, n] (k a multiple of 32): codes int8, f16 scales [k / 32, S, n] (S = 2 adds
    f16 minimums) -> (codes, scales, W as f32)."""
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    s = rng.uniform(1e-3, 2e-2, (k // 32, 1, n)).astype(np.float16)  # Q8_0's d: max|w| / 127 > 0
    sm = np.concatenate([s, rng.normal(0, 0.1, s.shape).astype(np.float16)], 1) if minimum else s
    w = (q.reshape(k // 32, 32, n) * sm[:, :1].astype(np.float32)).reshape(k, n)
    if minimum:
        w = w + np.repeat(sm[:, 1].astype(np.float32), 32, axis=0)
    return q, sm, w


def round_x(x: np.ndarray) -> np.ndarray:
    """NumPy reference of the kernel's activations: int16 per row and group of 32, scale max|x| / 32767."""
    xg = x.reshape(x.shape[0], -1, 32)
    s = np.abs(xg).max(-1, keepdims=True) / np.float32(32767)
    inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s > 0)
    return (np.rint(xg * inv) * s).reshape(x.shape)


def kernel(x, w, sm, n: int):
    kernels.ensure_registered()
    out = jax.ShapeDtypeStruct((x.shape[0], n), x.dtype)
    call = jax.ffi.ffi_call("aotlm_wmm_q4", out)
    none, every = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int8)
    return jax.jit(
        lambda a, b, c: call(a, b, c, none, every, group=np.int32(32), act=np.int32(0), parts=np.int32(1))
    )(x, w, sm)


def test_groups_find_a_q8_0_blocks_codes_and_scale():
    """Dequantized Q8_0 values (``d * q``, largest |q| 127) round back to the same codes and ``d`` bit for
    bit; along the contracted dims of a 3-D leaf too; gguf-py's Q5_0 / Q5_1 blocks give their values back
    bit for bit (Q5_1 with its minimums); arbitrary floats within half a step."""
    rng = np.random.default_rng(0)
    q, s, w = blocks(rng, 96, 48)
    q[::32] = 127  # llama.cpp's quantizer: each block's largest value is code +-127
    w = (q.reshape(3, 32, 48) * s.astype(np.float32)).reshape(96, 48)
    codes, sm = quant8.quantize_groups(w, (0,))
    np.testing.assert_array_equal(codes, q)
    np.testing.assert_array_equal(sm, s)
    heads = np.moveaxis(w.reshape(96, 3, 16), 0, 2)  # [3, 16, 96]: contracted last
    codes3, sm3 = quant8.quantize_groups(heads, (2,))
    np.testing.assert_array_equal(codes3, np.moveaxis(q.reshape(96, 3, 16), 0, 2))
    assert sm3.shape == (3, 1, 3, 16)
    for qtype in ("Q5_0", "Q5_1"):  # gguf-py's own blocks of these types, dequantized
        from gguf import GGMLQuantizationType as T
        from gguf.quants import dequantize, quantize

        x = (rng.standard_normal((48, 96)) * rng.uniform(0.1, 3, (48, 1))).astype(np.float32)
        vals = dequantize(quantize(x, T[qtype]), T[qtype])  # [out, in]: groups along in
        codes, sm = quant8.quantize_groups(vals, (1,), *quant8.TYPES[qtype])
        assert sm.shape == (3, 1 + quant8.TYPES[qtype][1], 48), qtype
        back = codes.reshape(48, 3, 32) * sm[:, :1].astype(np.float32).transpose(2, 0, 1)
        if qtype == "Q5_1":
            back = back + sm[:, 1:].astype(np.float32).transpose(2, 0, 1)
        np.testing.assert_array_equal(back.reshape(48, 96), vals, err_msg=qtype)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    c, s2 = quant8.quantize_groups(x, (0,))
    step = np.repeat(s2[:, 0].astype(np.float32), 32, axis=0)
    assert np.all(np.abs(c * step - x) <= 0.5 * step + 1e-7)


def check_odd_shapes(seed: int = 0) -> float:
    """Largest relative error of the kernel against NumPy (x rounded as the kernel rounds it) over rows
    1..100, symmetric and with minimums (also run in a child process per ISA level)."""
    rng, worst = np.random.default_rng(seed), 0.0
    cases = [(64, 37, False), (96, 16, True), (256, 50, False), (160, 129, True)]
    for k, n, minimum in cases + [(32, 5125, True)]:  # wide N: long panel ranges per thread
        q, sm, w = blocks(rng, k, n, minimum)
        np_ = -(-n // 16) * 16
        qp, smp = np.zeros((k, np_), np.int8), np.zeros((*sm.shape[:2], np_), np.float16)
        qp[:, :n], smp[..., :n] = q, sm
        wp = jnp.asarray(packing.pack(qp, (0,)))
        for m in (1, 2, 3, 7, 9, 16, 17, 64, 100):
            x = rng.standard_normal((m, k)).astype(np.float32)
            ref = round_x(x).astype(np.float64) @ w.astype(np.float64)
            y = np.asarray(kernel(jnp.asarray(x), wp, jnp.asarray(packing.pack_scales(smp)), n), np.float64)
            worst = max(worst, float(np.abs(y - ref).max() / np.abs(ref).max()))
    return worst


@needs_kernels
def test_kernel_matches_numpy_on_odd_shapes():
    assert check_odd_shapes() < 2e-6


@needs_kernels
def test_prefill_rows_get_the_bits_of_decode_rows_and_unpack_is_exact():
    """Exact int32 group sums and the same f32 order per group: a row's result does not depend on how
    many rows share the call; ``aotlm_unpack_q4`` and XLA's ``dequantize`` give the matrix exactly."""
    rng = np.random.default_rng(5)
    for n in (48, 5136):
        q, sm, w = blocks(rng, 128, n, minimum=True)
        wp, smj = jnp.asarray(packing.pack(q, (0,))), jnp.asarray(packing.pack_scales(sm))
        x = jnp.asarray(rng.standard_normal((70, 128)).astype(np.float32))
        whole = np.asarray(kernel(x, wp, smj, n))
        parts = [kernel(x[i : i + 7], wp, smj, n) for i in range(0, 70, 7)]
        np.testing.assert_array_equal(whole, np.concatenate(parts))
    np.testing.assert_array_equal(np.asarray(kernels.unpack_q4(wp, smj, jnp.float32, 1)), w)
    np.testing.assert_array_equal(np.asarray(quant8.dequantize(wp, smj, "w_up")), w)
    y = np.asarray(quant8.dense8(x, jnp.asarray(q), jnp.asarray(sm), 1, "w_up"))  # row-major leaf: XLA's path
    np.testing.assert_allclose(y, whole, rtol=0, atol=1e-5 * np.abs(whole).max())


@needs_kernels
def test_rows_with_inf_or_nan_give_nan_only_in_their_own_outputs():
    """x rounded per group (8 lanes and a scalar tail): a row holding inf / NaN comes out all NaN, the
    other rows as without it; a group of zeros costs its row nothing."""
    q, sm, w = blocks(np.random.default_rng(4), 96, 32)
    wp, smj = jnp.asarray(packing.pack(q, (0,))), jnp.asarray(packing.pack_scales(sm))
    x = np.random.default_rng(5).standard_normal((4, 96)).astype(np.float32)
    x[3, 32:64] = 0.0
    clean = np.asarray(kernel(jnp.asarray(x), wp, smj, 32))
    np.testing.assert_allclose(clean[3], round_x(x)[3] @ w, rtol=1e-6, atol=1e-6)
    x[1, 95], x[2, 5] = np.inf, np.nan
    got = np.asarray(kernel(jnp.asarray(x), wp, smj, 32))
    assert np.isnan(got[1:3]).all() and np.array_equal(got[[0, 3]], clean[[0, 3]])


@needs_kernels
def test_refusals_name_the_problem():
    q, sm, _ = blocks(np.random.default_rng(1), 64, 16)
    wp = jnp.asarray(packing.pack(q, (0,)))
    with pytest.raises(Exception, match="scales of int8 groups must be f16"):
        kernel(jnp.ones((1, 64), jnp.float32), wp, jnp.asarray(sm.astype(np.float32)), 16).block_until_ready()
    assert not quant8.packable((48, 16), (0,)) and not quant8.packable((64, 20), (0,))
    assert quant8.packable((64, 20), (0,), vocab=True) and quant8.packable((4, 16, 64), (2,))
