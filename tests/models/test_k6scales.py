"""GGUF Q6_K, Q5_K, Q5_0 and Q5_1 matrices kept as stored (``aotlm.models.k6scales``, ``kscales.pack5``,
``q5scales``): the file's codes and scales read from its blocks give gguf-py's values, and the leaves
give back each weight's code and its group's scale."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from aotlm.models import k6scales, kscales, packing, q5scales
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


def test_q5k_blocks_unpack_to_gguf_values():
    """``gguf_q4k.unpack`` of Q5_K: codes 0..31 under Q4_K's scales equal gguf-py's values bit for bit."""
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (8, 176), dtype=np.uint8)
    raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.02], np.float16).tobytes(), np.uint8)
    q, scale, minimum, k = gguf_q4k.unpack("Q5_K", raw)
    assert q.max() == 31 and len(k) == 4
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K).reshape(-1)
    np.testing.assert_array_equal(q * np.repeat(scale, 32) + np.repeat(minimum, 32), want)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_q5_blocks_unpack_to_gguf_values_and_round_trip_their_leaf(qtype):
    """``gguf_q4k.unpack`` of Q5_0 / Q5_1: codes 0..31 with their f16 ``d`` (``m``) equal gguf-py's values
    bit for bit; ``q5scales.pack`` then ``parts`` (XLA's reading) give each code's high bit and each
    group's scale and minimum back."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 64)).astype(np.float32)  # 64 groups of 32
    raw = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, qtype))
    q, scale, minimum, k = gguf_q4k.unpack(qtype, raw)
    assert q.max() == 31 and q.min() == 0 and k is None and (minimum is None) == (qtype == "Q5_0")
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).reshape(-1)
    low_m = -16.0 * scale if minimum is None else minimum
    np.testing.assert_array_equal(q * np.repeat(scale, 32) + np.repeat(low_m, 32), want)
    codes = q.reshape(64, 32)  # 64 groups as 32 rows x 64 columns: K = 32 rows a column's group
    d = scale.reshape(1, 64).astype(np.float16)
    m = None if minimum is None else minimum.reshape(1, 64).astype(np.float16)
    low, leaf = q5scales.pack(codes.T, d, m)
    assert low.max() <= 15 and leaf.shape == (1, 6 + 2 * (m is not None), 64) and q5scales.is_q5(leaf)
    s, mn, high = (np.asarray(a) for a in q5scales.parts(jnp.asarray(leaf)))
    np.testing.assert_array_equal(high.astype(np.uint8) + low, codes.T)
    np.testing.assert_array_equal(s, scale.reshape(1, 64))
    np.testing.assert_array_equal(mn, low_m.reshape(1, 64))


def test_q5k_leaf_round_trips_the_high_bits():
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 32, (512, 2, 32)).astype(np.uint8)
    leaf = kscales.pack(*(rng.integers(0, 64, (16, 2, 32)) for _ in range(2)), *np.ones((2, 2, 2, 32)))
    low, leaf5 = kscales.pack5(codes, leaf)
    assert low.max() <= 15 and leaf5.shape == (2, 52, 2, 32) and kscales.is_k5(leaf5)
    assert not kscales.is_kform(leaf5) and not kscales.is_k5(leaf)
    np.testing.assert_array_equal(np.asarray(kscales.high5(jnp.asarray(leaf5))).astype(np.uint8) + low, codes)
    np.testing.assert_array_equal(leaf5[:, :20], leaf)


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


def test_a_shard_that_splits_a_block_is_refused():
    """A row-parallel shard of a Q6_K matrix must keep whole blocks of 256 (the codes' high bits live in
    them): one line saying so, not a wrong split."""
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 64, (256, 32)).astype(np.uint8)
    _, leaf = k6scales.pack(codes, np.ones((16, 32), np.int8), np.ones((1, 32), np.float16))
    with pytest.raises(ValueError, match="blocks of 256 rows .* do not split over tp=2"):
        packing.prepare("w_down_scale", leaf, ("mlp", None, None), 2)
