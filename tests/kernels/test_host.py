"""The kernels' host-side transpose (``host.h``), which the weight loader uses for ``[out, in]`` ->
``[in, out]`` (``aotlm.models.checkpoint.transposed``)."""

from __future__ import annotations

import numpy as np
import pytest

from aotlm import kernels
from aotlm.models.checkpoint import transposed

SHAPES = [(1, 1), (7, 300), (64, 64), (130, 70), (256, 1030), (1031, 129)]


@pytest.mark.skipif(not kernels.enabled(), reason="the aotlm kernels are not built on this machine")
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.float32, np.uint32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_transpose_equals_numpy(shape, dtype):
    a = np.random.default_rng(0).integers(0, 250, shape).astype(dtype)
    for src in (a, a[:, ::2], np.asfortranarray(a)):  # contiguous, strided, column-major
        got = kernels.transpose(src)
        assert got is not None and got.flags.c_contiguous and got.dtype == src.dtype
        np.testing.assert_array_equal(got, src.T)


def test_kernel_transpose_declines_what_it_does_not_move():
    assert kernels.transpose(np.zeros((2, 3, 4), np.float32)) is None  # not 2-D
    assert kernels.transpose(np.zeros((4, 4), np.complex128)) is None  # 16-byte values


@pytest.mark.parametrize("kernels_on", ["1", "0"])
def test_loader_transpose_with_and_without_the_kernels(kernels_on, monkeypatch):
    """``transposed``: the kernels' tiles, else numpy in blocks of rows; small arrays numpy's own copy."""
    monkeypatch.setenv("AOTLM_KERNELS", kernels_on)
    rng = np.random.default_rng(1)
    for shape in [(3, 5), (300, 301), (1030, 257)]:
        a = rng.standard_normal(shape).astype(np.float32)
        got = transposed(a)
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, a.T)
    cube = np.arange(24).reshape(2, 3, 4)
    np.testing.assert_array_equal(transposed(cube), cube.T)


PACK_CASES = [
    ((64, 48), (0,)),
    ((48, 64), (1,)),
    ((32, 4, 16), (0,)),
    ((4, 16, 32), (0, 1)),
    ((8, 4, 2, 32), (0,)),
]


@pytest.mark.skipif(not kernels.enabled(), reason="the aotlm kernels are not built on this machine")
@pytest.mark.parametrize(("shape", "contract"), PACK_CASES)
def test_kernel_panels_equal_numpys(shape, contract, monkeypatch):
    """``packing.pack`` / ``pack_q4`` by the kernels (``pack_panels``) give numpy's panels bit for bit:
    int8 / bf16 / f16 / f32 pairs of rows and 4-bit codes, contracted dims first or last, several dims."""
    import ml_dtypes

    from aotlm.models import packing

    rng = np.random.default_rng(2)
    dtypes = (np.int8, ml_dtypes.bfloat16, np.float16, np.float32)
    arrays = [rng.integers(-100, 100, shape).astype(d) for d in dtypes]
    codes = rng.integers(0, 16, shape).astype(np.uint8)
    got = [packing.pack(a, contract) for a in arrays] + [packing.pack_q4(codes, contract)]
    monkeypatch.setenv("AOTLM_KERNELS", "0")
    want = [packing.pack(a, contract) for a in arrays] + [packing.pack_q4(codes, contract)]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
