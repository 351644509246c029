"""A GGUF file's Q4_0 / Q4_1 blocks under ``quant="int4"``: stored as they are (``aotlm.models.quant4``),
dequantized values equal to gguf-py's dequantization (which the float32 load of the same file holds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from gguf_builders import logical_matrix, tiny_llama_files

from aotlm import AutoModelForSampling
from aotlm.models import quant4

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """``gguf_file(type)``: the tiny Llama GGUF in that type (a fresh conversion cache)."""
    root = tmp_path_factory.mktemp("int4_gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOTLM_GGUF_CACHE", str(root / "cache"))
    yield tiny_llama_files(root)
    mp.undo()


@pytest.mark.parametrize(("qtype", "form"), [("Q4_0", "int4-g32"), ("Q4_1", "int4-g32-asym")])
def test_q4_blocks_load_without_requantizing(gguf_file, qtype, form, monkeypatch):
    from aotlm.models.checkpoint.gguf_weights import GGUFWeights

    path = gguf_file(qtype)
    kw = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False)
    ref = AutoModelForSampling.from_pretrained(path, quant="none", **kw)
    as_floats, get = [], GGUFWeights.get  # the 4-bit matrices are read as codes, never as floats
    monkeypatch.setenv("AOTLM_WEIGHT_CACHE", "0")  # read the file, not an earlier load's leaves
    monkeypatch.setattr(GGUFWeights, "get", lambda self, n: as_floats.append(n) or get(self, n))
    m = AutoModelForSampling.from_pretrained(path, quant="int4", **kw)
    assert as_floats and not [n for n in as_floats if n.endswith("proj.weight")]
    assert m.spec.precision.describe().startswith(f"amp=f32: {form} weights")
    layer = m.params["layers"][0]
    for leaf in MATRICES:
        w, sm = layer[leaf], layer[f"{leaf}_scale"]
        assert w.dtype == np.uint8 and sm.dtype == np.float16, leaf
        deq = np.asarray(quant4.dequantize(jnp.asarray(w), jnp.asarray(sm), leaf))
        np.testing.assert_array_equal(deq, logical_matrix(ref, leaf), err_msg=leaf)
    assert "embed_q" not in m.params or m.params["embed_q"].dtype == np.int8  # a tied copy stays int8
    ids = np.arange(1, 9)[None]
    lg, lg_ref = m.forward(ids), ref.forward(ids)  # x rounded to int8 per group: close, not equal
    assert np.abs(lg - lg_ref).max() <= 0.05 * np.abs(lg_ref).max()


def test_explicit_group_size_is_kept_and_requantizes(gguf_file):
    """Another group size than the blocks' 32 is a re-quantization, as asked (not silently changed)."""
    m = AutoModelForSampling.from_pretrained(
        gguf_file("Q4_0"), quant="int4-g64", batch_size=1, n_positions=32, compile_cache=False
    )
    assert m.params["layers"][0]["wq_scale"].shape[-3] * 64 == 256  # [H, Dh / 16, G, 1, 16]


GGUF_OF = dict(
    wq="attn_q",
    wk="attn_k",
    wv="attn_v",
    wo="attn_output",
    w_gate="ffn_gate",
    w_up="ffn_up",
    w_down="ffn_down",
)


def file_q4k(path, name: str, heads: int | None):
    """Codes, scales and minimums of Q4_K tensor ``name`` read from the file's raw blocks with gguf-py,
    each ``[out, in]`` in the HF layout (llama.cpp's rope permutation of q / k undone)."""
    from gguf import GGUFReader
    from gguf.quants import Q4_K

    from aotlm.models.checkpoint.gguf_names import unpermute_rope

    t = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    assert t.tensor_type.name == "Q4_K"
    raw = np.asarray(t.data).reshape(-1, 144)
    d, dmin = (raw[:, i : i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
    sc, mn = Q4_K.get_scale_min(raw[:, 4:16])
    nib = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    shape = tuple(int(n) for n in reversed(t.shape))
    codes = (nib & 15).reshape(shape)
    scale = np.repeat(d * sc.astype(np.float32), 32, axis=1).reshape(shape)
    minimum = np.repeat(-(dmin * mn.astype(np.float32)), 32, axis=1).reshape(shape)
    fix = (lambda a: unpermute_rope(a, heads)) if heads else (lambda a: a)
    return fix(codes), fix(scale), fix(minimum)


def test_q4k_codes_kept(gguf_file, monkeypatch):
    """Q4_K under int4: every group stores the file's own codes, read from the blocks (no 4-bit matrix
    is dequantized to float32 on the way), and its own scales (``models.kscales``: uint8 sub-scales
    and minimums under the f16 ``d`` / ``dmin``): the stored matrices are the file's values bit for bit."""
    from aotlm.models.checkpoint.gguf_weights import GGUFWeights

    path = gguf_file("Q4_K")
    kw = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False)
    ref = AutoModelForSampling.from_pretrained(path, quant="none", **kw)
    as_floats, get = [], GGUFWeights.get
    monkeypatch.setenv("AOTLM_WEIGHT_CACHE", "0")  # read the file, not an earlier load's leaves
    monkeypatch.setattr(GGUFWeights, "get", lambda self, n: as_floats.append(n) or get(self, n))
    m = AutoModelForSampling.from_pretrained(path, quant="int4", **kw)
    assert as_floats and not [n for n in as_floats if n.endswith("proj.weight")]
    heads = {"wq": 4, "wk": 2}
    layer, zero_groups = m.params["layers"][0], 0
    for leaf, g in GGUF_OF.items():
        codes, scale, minimum = file_q4k(path, f"blk.0.{g}.weight", heads.get(leaf))
        w, sm = layer[leaf], layer[f"{leaf}_scale"]
        stored = np.asarray(quant4.codes(jnp.asarray(w), leaf)).reshape(codes.shape[::-1]).T
        zero_groups += int((scale == 0).sum()) // 32
        np.testing.assert_array_equal(stored, codes, err_msg=leaf)
        want = logical_matrix(ref, leaf).reshape(codes.shape[::-1]).T  # the file's values
        np.testing.assert_array_equal(codes * scale + minimum, want, err_msg=leaf)
        assert sm.dtype == np.uint8 and sm.shape[-3:-1] == (codes.shape[1] // 256, 20), leaf  # the K form
        deq = np.asarray(quant4.dequantize(jnp.asarray(w), jnp.asarray(sm), leaf)).reshape(want.T.shape).T
        np.testing.assert_array_equal(deq, want, err_msg=leaf)
    assert zero_groups > 0  # random 6-bit scales: some are 0, whose codes only the blocks tell
    ids = np.arange(1, 9)[None]
    lg, lg_ref = m.forward(ids), ref.forward(ids)
    assert np.abs(lg - lg_ref).max() <= 0.05 * np.abs(lg_ref).max()


@pytest.mark.parametrize(
    ("qtype", "quant"),
    [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("Q4_0", "int4-asym"), ("Q4_K_M", "int4")]
    + [("Q5_K_M", "int4")],
)
def test_groups_moved_with_the_codes_equal_the_per_weight_ids(gguf_file, monkeypatch, qtype, quant):
    """Where a matrix's layout change moves only its output axis (``linear_t``, ``heads_in``: every
    matrix but ``wo`` here, llama's permuted q / k rows included), the loader moves the codes (uint8)
    and the group scales (``GGUFWeights.groups4``) instead of a uint32 group id per weight
    (``Codes``): the same stored leaves, bit for bit."""
    import jax

    from aotlm.models.checkpoint.gguf_weights import GGUFWeights

    path = gguf_file(qtype)
    kw = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False, quant=quant)
    monkeypatch.setenv("AOTLM_WEIGHT_CACHE", "0")
    seen, groups4 = [], GGUFWeights.groups4
    monkeypatch.setattr(GGUFWeights, "groups4", lambda self, n, fn: seen.append(n) or groups4(self, n, fn))
    fast = AutoModelForSampling.from_pretrained(path, **kw).params
    assert {
        f"model.layers.0.{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")
    } <= set(seen)
    monkeypatch.setattr(GGUFWeights, "groups4", lambda self, n, fn: None)
    slow = AutoModelForSampling.from_pretrained(path, **kw).params
    assert fast["layers"][0]["wq"].dtype == np.uint8
    for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(fast), jax.tree.leaves(slow), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), where


TP_CHILD = """
import json, sys
import numpy as np
from aotlm import AutoModelForSampling
out = {}
for q, (path, quant) in json.loads(sys.argv[1]).items():
    for tp in (1, 2):
        kw = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False, tp_degree=tp)
        m = AutoModelForSampling.from_pretrained(path, **kw, **({"quant": quant} if quant else {}))
        forms = sorted({str(v.dtype) for k, v in m.params["layers"][0].items()
                        if k.startswith("w") and not k.endswith("_scale")})
        out[f"{q}-{tp}"] = {"logits": np.asarray(m.forward([[1, 2, 3, 4, 5]])).tolist(), "forms": forms,
                            "tokens": np.asarray(m.sample([[1, 2, 3, 4, 5]], max_new_tokens=8)).tolist()}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_blocks_as_stored_under_tensor_parallelism(gguf_file):
    """tp=2 of a Q4_K file (Q4_K's own scales column-parallel; a row-parallel shard that splits a block of
    256 takes the f16 form), of Q4_K_M / Q5_K_M ones (Q6_K's 6-bit codes and scales, ``k6scales``, and
    Q5_K's 5-bit codes, split by panels and by blocks) and of a Q8_0 file (int8 groups), the scale leaves
    split by panels and by groups: tp=1's greedy tokens, logits as close as the f16 form's rounding
    allows."""
    files = {q: (str(gguf_file(q)), "int4") for q in ("Q4_K", "Q4_K_M", "Q5_K_M")}
    files["Q8_0"] = (str(gguf_file("Q8_0")), None)
    support = Path(__file__).parents[1] / "support"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=str(support))
    cmd = [sys.executable, "-c", TP_CHILD, json.dumps(files)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["Q4_K-1"]["forms"] == ["uint8"] and out["Q8_0-1"]["forms"] == ["int8"]
    for q, tol in (("Q4_K", 2e-2), ("Q4_K_M", 2e-2), ("Q5_K_M", 2e-2), ("Q8_0", 1e-4)):
        a, b = np.asarray(out[f"{q}-1"]["logits"]), np.asarray(out[f"{q}-2"]["logits"])
        assert np.abs(a - b).max() <= tol * np.abs(a).max(), q
        assert out[f"{q}-1"]["tokens"] == out[f"{q}-2"]["tokens"], q
