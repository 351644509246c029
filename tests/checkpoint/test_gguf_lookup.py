"""A GGUF embedding in blocks kept for the lookup as codes with their groups' scales and offsets
(``gguf_lookup``, ``aotlm.models.lookup``): its rows rebuilt equal gguf-py's dequantization of the same
bytes, for every type it keeps; a model loaded from a file with the default storage looks its tokens up
from those codes (int8 leaves), and its embedding rows equal transformers' load of the file."""

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
    assert got.codes.dtype == np.int8 and got.scale.shape == (V, D // BLOCKS[qtype][2])
    assert (got.offset is None) == (qtype in ("Q4_0", "Q5_0", "Q6_K", "Q8_0"))
    tol = 2e-7 * np.abs(want).max()  # one float32 rounding apart at most
    np.testing.assert_allclose(got.values(), want, rtol=0, atol=tol)
    ids = jnp.asarray([[3, 0, V - 1]])
    params = {path[0]: leaf for path, leaf in got.leaves(("embed",))}
    rows = np.asarray(lookup.take(params, ids))
    np.testing.assert_allclose(rows, want[[3, 0, V - 1]][None], rtol=0, atol=tol)


def test_other_types_and_shapes_are_not_grouped():
    raw = gguf.quants.quantize(np.zeros((4, 32), np.float32), T.Q8_0)
    assert grouped_rows("Q2_K", raw, (4, 256)) is None
    assert grouped_rows("Q8_0", raw, (4, 32, 1)) is None
