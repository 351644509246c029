"""A GGUF file's Q4_0 / Q4_1 blocks under ``quant="int4"``: stored as they are (``aotlm.models.quant4``),
dequantized values equal to gguf-py's dequantization (which the float32 load of the same file holds)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_builders import tiny_config, write_gguf

from aotlm import AutoModelForSampling
from aotlm.models import packing, quant4

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """``gguf_file(type)``: the tiny Llama GGUF in that type (a fresh conversion cache)."""
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("int4_gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOTLM_GGUF_CACHE", str(root / "cache"))
    ckpt = make_checkpoint(root / "hf-llama", tiny_config("llama"), scale=3.0)
    made: dict = {}

    def get(qtype: str):
        if qtype not in made:
            made[qtype] = write_gguf(ckpt, "llama", getattr(T, qtype), root / f"llama-{qtype}.gguf")
        return made[qtype]

    yield get
    mp.undo()


def logical(m, leaf: str) -> np.ndarray:
    """A float32 model's layer-0 matrix in its logical layout (packed f32 panels unpacked)."""
    w = m.params["layers"][0][leaf]
    return np.asarray(packing.unpack(w, leaf) if packing.is_packed(leaf, w.ndim) else w)


@pytest.mark.parametrize(("qtype", "form"), [("Q4_0", "int4-g32"), ("Q4_1", "int4-g32-asym")])
def test_q4_blocks_load_without_requantizing(gguf_file, qtype, form):
    path = gguf_file(qtype)
    kw = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False)
    ref = AutoModelForSampling.from_pretrained(path, quant="none", **kw)
    m = AutoModelForSampling.from_pretrained(path, quant="int4", **kw)
    assert m.spec.precision.describe().startswith(f"amp=f32: {form} weights")
    layer = m.params["layers"][0]
    for leaf in MATRICES:
        w, sm = layer[leaf], layer[f"{leaf}_scale"]
        assert w.dtype == np.uint8 and sm.dtype == np.float16, leaf
        deq = np.asarray(quant4.dequantize(jnp.asarray(w), jnp.asarray(sm), leaf))
        np.testing.assert_array_equal(deq, logical(ref, leaf), err_msg=leaf)
    assert "embed_q" not in m.params or m.params["embed_q"].dtype == np.int8  # a tied copy stays int8
    ids = np.arange(1, 9)[None]
    lg, lg_ref = m.forward(ids), ref.forward(ids)  # x rounded to int8 per group: close, not equal
    assert np.abs(lg - lg_ref).max() <= 0.05 * np.abs(lg_ref).max()


def test_explicit_group_size_is_kept_and_requantizes(gguf_file):
    """Another group size than the blocks' 32 is a re-quantization, as asked (not silently changed)."""
    m = AutoModelForSampling.from_pretrained(
        gguf_file("Q4_0"), quant="int4-g64", batch_size=1, n_positions=32, compile_cache=False
    )
    assert m.params["layers"][0]["wq_scale"].shape[0] * 64 == 256
