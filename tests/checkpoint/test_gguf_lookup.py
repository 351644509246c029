"""A GGUF embedding in blocks kept for the lookup as codes with their groups' scales and offsets
(``gguf_lookup``, ``aotlm.models.lookup``): its rows rebuilt equal gguf-py's dequantization of the same
bytes, for every type it keeps; a model loaded from a file with the default storage looks its tokens up
from those codes (int8 leaves; 4-bit types two codes a byte), and its embedding rows equal
transformers' load of the file."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_builders import random_k_blocks

from aotlm.models import lookup
from aotlm.models.checkpoint.gguf_lookup import BLOCKS, grouped_rows

V, D = 40, 512


def blocks_of(qtype: str, rng) -> np.ndarray:
    a = rng.normal(0, 0.05, (V, D)).astype(np.float32)
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        return random_k_blocks(a, T[qtype], rng)
    return gguf.quants.quantize(a, T[qtype])


@pytest.mark.parametrize("qtype", sorted(BLOCKS))
def test_rows_rebuilt_equal_the_files_dequantization(qtype):
    raw = blocks_of(qtype, np.random.default_rng(0))
    want = gguf.quants.dequantize(raw, T[qtype]).reshape(V, D)
    got = grouped_rows(qtype, raw, (V, D))
    four = qtype in ("Q4_0", "Q4_1", "Q4_K")  # two codes a byte (lookup.pack4)
    assert got.codes.dtype == (np.uint8 if four else np.int8) and got.shape == (V, D)
    assert got.codes.shape == (V, D // 2 if four else D) and got.scale.shape == (V, D // BLOCKS[qtype][2])
    assert (got.offset is None) == (qtype in ("Q4_0", "Q5_0", "Q6_K", "Q8_0"))
    tol = 2e-7 * np.abs(want).max()  # one float32 rounding apart at most
    np.testing.assert_allclose(got.values(), want, rtol=0, atol=tol)
    ids = jnp.asarray([[3, 0, V - 1]])
    params = {path[0]: leaf for path, leaf in got.leaves(("embed",))}
    rows = np.asarray(lookup.take(params, ids))
    np.testing.assert_allclose(rows, want[[3, 0, V - 1]][None], rtol=0, atol=tol)


def test_four_bit_codes_round_trip_two_a_byte():
    codes = np.random.default_rng(1).integers(-8, 8, (3, 64)).astype(np.int8)
    packed = lookup.pack4(codes)
    assert packed.dtype == np.uint8 and packed.shape == (3, 32)
    np.testing.assert_array_equal(lookup.unpack4(packed, signed=True), codes)
    np.testing.assert_array_equal(np.asarray(lookup.unpack4(jnp.asarray(packed), signed=True)), codes)
    unsigned = codes + np.int8(8)
    np.testing.assert_array_equal(lookup.unpack4(lookup.pack4(unsigned), signed=False), unsigned)


def test_other_types_and_shapes_are_not_grouped():
    raw = gguf.quants.quantize(np.zeros((4, 32), np.float32), T.Q8_0)
    assert grouped_rows("Q2_K", raw, (4, 256)) is None
    assert grouped_rows("Q8_0", raw, (4, 32, 1)) is None
