"""A GGUF Q6_K matrix kept as stored (``aotlm.models.k6scales``): the file's codes and scales read from its
blocks give gguf-py's values, and the K6 leaf gives back each weight's 6-bit code and its group's scale."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from aotlm.models import k6scales, packing
from aotlm.models.checkpoint import gguf_q4k

gguf = pytest.importorskip("gguf")


def random_q6k(rng, rows: int, k: int) -> np.ndarray:
    """Raw Q6_K blocks of a ``[rows, k]`` tensor (random codes, int8 scales and f16 ``d``)."""
    raw = rng.integers(0, 256, (rows * k // 256, 210), dtype=np.uint8)
    raw[:, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


def test_blocks_unpack_to_gguf_values():
    """``gguf_q4k.unpack`` of Q6_K: codes 0..63, scales ``d * sc`` per 16, ``scale * (q - 32)`` equal to
    gguf-py's dequantization bit for bit."""
    raw = random_q6k(np.random.default_rng(0), 4, 512)
    q, scale, minimum, (sc, d) = gguf_q4k.unpack("Q6_K", raw)
    assert minimum is None and q.max() == 63 and q.min() == 0 and sc.dtype == np.int8
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(-1)
    got = (q.astype(np.float32) - 32) * np.repeat(scale, 16)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(scale, np.repeat(d.astype(np.float32), 16) * sc)


@pytest.mark.parametrize("nd", [(48,), (3, 32)])
def test_leaf_round_trips_codes_and_scales(nd):
    """``pack`` then ``parts`` (XLA's reading) give each weight's high bits and each group's ``d * sc``;
    the low 4 bits stay in the codes; panel-major packing round-trips; a shape off the panels is refused."""
    rng = np.random.default_rng(1)
    k = 512
    codes = rng.integers(0, 64, (k, *nd)).astype(np.uint8)
    sc = rng.integers(-128, 128, (k // 16, *nd)).astype(np.int8)
    d = rng.standard_normal((k // 256, *nd)).astype(np.float16)
    low, leaf = k6scales.pack(codes, sc, d)
    assert low.max() <= 15 and leaf.shape == (2, 82, *nd) and leaf.dtype == np.uint8
    s, high = (np.asarray(a) for a in k6scales.parts(jnp.asarray(leaf)))
    np.testing.assert_array_equal(high.astype(np.uint8) + low, codes)
    np.testing.assert_array_equal(s, np.repeat(d.astype(np.float32), 16, 0) * sc)
    assert k6scales.is_k6(leaf) and not k6scales.is_k6(leaf[:, :20])
    np.testing.assert_array_equal(packing.unpack_scales(packing.pack_scales(leaf), len(nd)), leaf)
    with pytest.raises(ValueError, match="do not fit"):
        k6scales.pack(codes[..., :8], sc[..., :8], d[..., :8])
