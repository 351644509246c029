"""f32 means f32 on every backend: f32 graphs lower every product at HIGHEST precision.

XLA:GPU runs float32 matmuls as TF32 unless an op asks for more (logits ~1e-3 off transformers'), so
the precision must be in the graph itself. CI has no GPU: these tests read the lowered HLO, which is
the same on every backend, so a regression shows on CPU.
"""

from __future__ import annotations

import re

import pytest

from aotlm import AutoModelForSampling
from aotlm.core.precision import resolve

DOT = re.compile(r"stablehlo\.dot_general.*?precision = \[(\w+), (\w+)\]")


def lowered_dots(model, key) -> list[tuple[str, str]]:
    text = model.lower(key).as_text()
    return DOT.findall(text)


@pytest.fixture
def xla_only(monkeypatch):
    """The CPU kernels off, so every product is XLA's (as on a GPU)."""
    monkeypatch.setenv("AOTLM_KERNELS", "0")


@pytest.mark.parametrize("kind", ["prefill", "decode", "score"])
def test_f32_graphs_lower_every_product_at_highest(llama_path, xla_only, kind):
    model = AutoModelForSampling.from_pretrained(
        llama_path,
        batch_size=2,
        n_positions=64,
        context_length_estimate=32,
        compile_cache=False,
        scoring=True,
    )
    assert model.precision.matmul == "highest"
    assert model.fingerprint()["matmul_precision"] == "highest"  # part of the compile-cache key
    key = next(k for k in model.graph_keys() if k[0] == kind)
    dots = lowered_dots(model, key)
    assert dots, f"no dot_general in the {key} graph"
    assert set(dots) == {("HIGHEST", "HIGHEST")}, dots


def test_bf16_graphs_keep_the_backend_default(llama_path, xla_only):
    model = AutoModelForSampling.from_pretrained(
        llama_path, batch_size=1, n_positions=64, context_length_estimate=32, compile_cache=False, amp="bf16"
    )
    assert model.precision.matmul is None  # bf16 compute without the kernels (as on a GPU)
    dots = lowered_dots(model, ("decode", 64))
    assert dots and ("HIGHEST", "HIGHEST") not in dots


def test_precision_follows_the_compute_dtype():
    f32, bf16 = resolve("f32", None, kernels_on=False), resolve("bf16", None, kernels_on=False)
    assert (f32.matmul, bf16.matmul) == ("highest", None)
    # the CPU kernels' weights-only bf16 keeps f32 activations: f32 products, so HIGHEST as well
    assert resolve("bf16", None, kernels_on=True).matmul == "highest"
