"""``scripts/bench_gpu.py``'s variants, checked on CPU so a GPU session does not find a typo: each sets
the environment its name says, every fixed-tile setting parses, and under each the Pallas kernels take
every decode product and attention step of the Llama-3.2-1B / 3.1-8B shapes it benches (a tile that
does not divide a shape would silently leave that product on XLA's dot)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_gpu  # noqa: E402

from aotlm.kernels import gpu_attention, gpu_matmul  # noqa: E402


def products(shape: str) -> list[tuple[int, int]]:
    """(K, N) of a decode step's products: q / k / v / o, gate / up / down, the lm_head."""
    c = {**bench_gpu.COMMON, **bench_gpu.SHAPES[shape]}
    d, f, dh = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * dh, c["num_key_value_heads"] * dh
    return [(d, q), (d, kv), (q, d), (d, f), (f, d), (d, c["vocab_size"])]


@pytest.mark.parametrize("name", list(bench_gpu.VARIANTS))
def test_variants_set_their_environment(name, monkeypatch):
    for var in ("AOTLM_DECODE_GROUP", "AOTLM_XLA_OPTIONS", gpu_matmul.ENV, gpu_attention.ENV):
        monkeypatch.setenv(var, "")  # recorded as it was, so the variant's os.environ edits are undone
        monkeypatch.delenv(var)
    bench_gpu.use_variant(name)
    v = bench_gpu.VARIANTS[name]
    assert os.environ.get("AOTLM_DECODE_GROUP") == (str(v["group"]) if "group" in v else None)
    assert os.environ[gpu_matmul.ENV] == v.get("gpu_matmul", "xla")
    assert os.environ[gpu_attention.ENV] == v.get("gpu_attention", "xla")
    attention_steps_take_the_kernel(name, "gpu_attention" in v)
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


def attention_steps_take_the_kernel(name: str, on: bool) -> None:
    """Under an attention variant, every decode step the bench runs (batch 1 / 64, the buckets of a
    128-token prompt, 128 new tokens, and of the 1,024-token one) gets blocks; else the setting is XLA's."""
    setting = gpu_attention.setting()  # parses, or raises naming the variable
    if not on:
        assert setting == "xla"
        return
    for shape in ("1b", "8b"):
        c = {**bench_gpu.COMMON, **bench_gpu.SHAPES[shape]}
        h, kh, dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        for b in (1, 64):
            for width in (128, 256, 1024, 1152):
                q = jax.ShapeDtypeStruct((b * kh, h // kh, dh), jnp.bfloat16)
                keys = jax.ShapeDtypeStruct((b * kh, 1152, dh), jnp.bfloat16)
                assert gpu_attention.config(q, keys, width) is not None, (name, shape, b, width)


def test_gpu_check_steps_pass_arguments_the_bench_takes(monkeypatch):
    """Every step of ``scripts/gpu_check.sh`` that runs the bench passes arguments ``bench_gpu.parse``
    takes (a typo there would cost a GPU session's step), and every mode builds a precision."""
    from aotlm.core.precision import resolve

    script = (Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh").read_text()
    defaults = re.findall(r'\$\{[A-Z0-9]+_ARGS:-(--[^}"]+)\}', script)
    assert len(defaults) >= 4, defaults  # bench, attn, fp8, profile
    for line in defaults:
        monkeypatch.setattr(sys, "argv", ["bench_gpu.py", *line.split()])
        args = bench_gpu.parse()
        assert all(v in bench_gpu.VARIANTS for v in args.variants), line
    for kw in bench_gpu.MODES.values():
        resolve(kw["amp"], kw.get("quant"), kernels_on=False)  # raises for a bad option
    assert "fp8" in re.search(r'FP8_ARGS:-([^}"]+)', script).group(1)
