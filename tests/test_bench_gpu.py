"""``scripts/bench_gpu.py``'s variants, checked on CPU so a GPU session does not find a typo: each sets
the environment its name says, every fixed-tile setting parses, and under each the Pallas kernel takes
every decode product of the Llama-3.2-1B / 3.1-8B shapes it benches (a tile that does not divide a
shape would silently leave that product on XLA's dot)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_gpu  # noqa: E402

from aotlm.kernels import gpu_matmul  # noqa: E402


def products(shape: str) -> list[tuple[int, int]]:
    """(K, N) of a decode step's products: q / k / v / o, gate / up / down, the lm_head."""
    c = {**bench_gpu.COMMON, **bench_gpu.SHAPES[shape]}
    d, f, dh = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * dh, c["num_key_value_heads"] * dh
    return [(d, q), (d, kv), (q, d), (d, f), (f, d), (d, c["vocab_size"])]


@pytest.mark.parametrize("name", list(bench_gpu.VARIANTS))
def test_variants_set_their_environment(name, monkeypatch):
    for var in ("AOTLM_DECODE_GROUP", "AOTLM_XLA_OPTIONS", gpu_matmul.ENV):
        monkeypatch.setenv(var, "")  # recorded as it was, so the variant's os.environ edits are undone
        monkeypatch.delenv(var)
    bench_gpu.use_variant(name)
    v = bench_gpu.VARIANTS[name]
    assert os.environ.get("AOTLM_DECODE_GROUP") == (str(v["group"]) if "group" in v else None)
    assert os.environ[gpu_matmul.ENV] == v.get("gpu_matmul", "xla")
    setting = gpu_matmul.setting()  # parses, or raises naming the variable
    if "gpu_matmul" not in v:
        assert setting == "xla"
        return
    for shape in ("1b", "8b"):
        for rows in (1, 64):
            for k, n in products(shape):
                x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
                w = jax.ShapeDtypeStruct((k, n), jnp.int8)
                assert gpu_matmul.config(x, w) is not None, (name, shape, rows, k, n)
