"""Weight-storage options: amp dtypes, int8 weights (``quant="int8"``) and ``fuse_qkv``.

Error bounds are relative to the largest fp32 logit, ``max|z - z32| <= REL * max|z32|``, measured
on two tiny random checkpoints (the peaked Llama below, untied int8 lm_head included, and the
conftest GPT-2 with biases / layernorm / tied embedding) and set at ~3x the worst value measured:

* bf16: measured 3.2e-3 as bf16 compute, 1.35e-3 on CPU with the kernels (bf16 matrices, f32
  activations: ``aotlm.core.precision``), bound 1e-2 (8 significant bits: unit roundoff 2^-9 ~ 2e-3)
* f16: measured 5.1e-4 as f16 compute, 1.4e-4 with the kernels, bound 1.5e-3 (11 bits: 2^-12 ~ 2.4e-4)
* int8 weights, amp f32: measured 4.0e-3, bound 1e-2 (per weight error <= max|w of its channel| / 254)
* int8 weights + bf16: measured 5.1e-3, bound 1.5e-2

Greedy tokens are compared on a *peaked* checkpoint: its lm_head rows are a permutation of the
embedding rows, so the model mostly maps a token to a fixed successor and the fp32 top-1 margin
along the greedy path is >= 20% of the largest logit (asserted, with transformers' fp32 logits),
an order of magnitude above every bound above: tokens must then agree exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from builders import PROMPTS, V, llama_config, rel_error, save_checkpoint
from conformance import hf_model

from aotlm import AutoModelForSampling, kernels
from aotlm.core import sharding
from aotlm.core.compile_cache import entry_key
from aotlm.models import decoder, packing
from aotlm.models.axes import CONTRACT_AXES
from aotlm.models.fusing import fuse_qkv_heads, regroup_qkv
from aotlm.models.quant import QuantizationConfig, quantize_int8

T = transformers
N_POS, NEW = 32, 16
REL = {"bf16": 1e-2, "f16": 1.5e-3, "bf16w": 1e-2, "int8": 1e-2, "int8_bf16": 1.5e-2}
VARIANTS = {
    "f32": {},
    "bf16": {"amp": "bf16"},
    "f16": {"amp": "f16"},
    "bf16w": {"quant": "bf16"},  # bf16 weights, f32 activations
    "int8": {"quant": "int8"},
    "int8_bf16": {"quant": "int8", "amp": "bf16"},
}


def _load(path, **kw):
    return AutoModelForSampling.from_pretrained(
        path, batch_size=2, n_positions=N_POS, context_length_estimate=N_POS, compile_cache=False, **kw
    )


# ------------------------------------------------------------- tp=2 runs (started first, run in parallel)
@pytest.fixture(scope="module")
def tp_proc(ckpt_dir, tmp_path_factory):
    """int8 / fuse_qkv at tp=1 and tp=2 on 2 forced CPU devices, in a subprocess started now."""
    gqa = save_checkpoint(
        ckpt_dir / "wo_llama_kv2", llama_config(intermediate_size=90), scale=2.0, noisy_1d=True
    )
    mqa = save_checkpoint(
        ckpt_dir / "wo_llama_kv1", llama_config(num_key_value_heads=1), scale=2.0, noisy_1d=True
    )
    cases = [  # name, path, tp, gqa, quant, fuse
        ["kv2 int8 tp1", str(gqa), 1, None, "int8", False],
        ["kv2 int8 tp2", str(gqa), 2, None, "int8", False],
        ["kv2 int8+fuse tp2", str(gqa), 2, None, "int8", True],
        ["kv1 f32 tp1", str(mqa), 1, None, None, False],
        ["kv1 fuse tp2", str(mqa), 2, None, None, True],  # MQA at tp=2: replicated-heads, regrouped
        ["kv1 int8 tp1", str(mqa), 1, None, "int8", False],
        ["kv1 int8+fuse tp2", str(mqa), 2, None, "int8", True],
        ["kv2 fp8 tp1", str(gqa), 1, None, "fp8", False],
        ["kv2 fp8+fuse tp2", str(gqa), 2, None, "fp8", True],  # x's rows' max over K shards: a collective
        ["kv1 fp8 tp1", str(mqa), 1, None, "fp8", False],
        ["kv1 fp8+fuse tp2", str(mqa), 2, None, "fp8", True],  # K-minor wqkv regrouped (replicated-heads)
    ]
    tmp = tmp_path_factory.mktemp("wo_tp")
    (tmp / "job.json").write_text(json.dumps({"out": str(tmp / "out.json"), "cases": cases}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    worker = str(Path(__file__).parents[1] / "support" / "wo_worker.py")
    proc = subprocess.Popen(
        [sys.executable, worker, str(tmp / "job.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    yield proc, tmp / "out.json"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module", autouse=True)
def _start_tp_early(tp_proc):
    return tp_proc


# ------------------------------------------------------------------ amp + int8 accuracy
@pytest.fixture(scope="module")
def peaked_runs(peaked):
    return peaked, {k: _run(peaked, kw) for k, kw in VARIANTS.items()}


def _run(path, kw, tokens: bool = True):
    m = _load(path, **kw)
    return m.forward(PROMPTS), (m.sample(PROMPTS, max_new_tokens=NEW) if tokens else None), m


def test_peaked_checkpoint_has_large_fp32_margins(peaked_runs):
    path, runs = peaked_runs
    tokens = runs["f32"][1]
    with torch.no_grad():
        lg = hf_model(path)(torch.tensor(tokens)).logits[:, PROMPTS.shape[1] - 1 : -1].numpy()
    top2 = np.sort(lg, -1)[..., -2:]
    margin = (top2[..., 1] - top2[..., 0]).min() / np.abs(lg).max()
    assert margin >= 0.2, f"fp32 top-1 margin {margin:.3f} of max|logit|: checkpoint not peaked"
    assert len(set(tokens[0, PROMPTS.shape[1] :].tolist())) > 8  # a varied sequence, not a repeat


@pytest.mark.parametrize("variant", ["bf16", "f16", "bf16w", "int8", "int8_bf16"])
def test_logits_error_bounded_and_greedy_tokens_agree(peaked_runs, variant):
    _, runs = peaked_runs
    ref_logits, ref_tokens, _ = runs["f32"]
    logits, tokens, _ = runs[variant]
    err = rel_error(logits, ref_logits)
    print(f"peaked llama {variant}: max|dz| / max|z32| = {err:.2e}")
    assert err <= REL[variant], f"{variant}: logits error {err:.2e} of max|logit| > {REL[variant]}"
    assert err > 0  # really a different precision
    np.testing.assert_array_equal(tokens, ref_tokens)  # all NEW (16) generated tokens


def test_gpt2_logits_error_bounded(gpt2_path):
    """GPT-2 (layernorm, biases, gelu, tied embedding: lm_head not quantized): last-position logits."""
    ref = _run(gpt2_path, {}, tokens=False)[0]
    for variant in ("bf16", "f16", "bf16w", "int8", "int8_bf16"):
        err = rel_error(_run(gpt2_path, VARIANTS[variant], tokens=False)[0], ref)
        print(f"gpt2 {variant}: max|dz| / max|z32| = {err:.2e}")
        assert 0 < err <= REL[variant], f"gpt2 {variant}: logits error {err:.2e} of max|logit|"


# ------------------------------------------------------------------ int8 storage
def test_int8_weights_are_stored_as_int8(peaked_runs):
    _, runs = peaked_runs
    m32, m8 = runs["f32"][2], runs["int8"][2]
    big = lambda p: {k: v for k, v in p.items() if k in CONTRACT_AXES}
    n_big = n_packed = 0
    for tree in [m8.params, *m8.params["layers"]]:
        for name, w in big(tree).items():
            n_big += 1
            assert w.dtype == np.int8, name
            if packing.is_packed(name, w.ndim):  # the kernels' panel layout (aotlm.models.packing)
                n_packed += 1
                kd, nd = packing.logical_dims(name, w.shape)
                shape = (*kd, *nd)
            else:
                shape = w.shape
            scale = tree[name + "_scale"]
            assert scale.dtype == np.float32
            assert scale.shape == tuple(n for i, n in enumerate(shape) if i not in CONTRACT_AXES[name])
    assert n_big == 1 + 7 * m8.cfg.n_layers  # lm_head + q/k/v/o/gate/up/down per layer
    assert n_packed == (n_big if kernels.enabled() else 0)
    assert m8.params["embed"].dtype == np.float32  # the embedding is not quantized
    layer_bytes = lambda ps: sum(w.nbytes for p in ps["layers"] for k, w in p.items() if k in CONTRACT_AXES)
    assert layer_bytes(m8.params) * 4 == layer_bytes(m32.params)
    v, v8 = m32.params["lm_head"].shape[1], m8.params["lm_head_scale"].shape[0]  # int8 vocab: padded to 16
    assert m8.params["lm_head"].size == m32.params["lm_head"].size // v * v8 and v8 - v < 16
    scales = sum(
        s.nbytes for p in [m8.params, *m8.params["layers"]] for k, s in p.items() if k.endswith("_scale")
    )
    assert scales < layer_bytes(m8.params) / 8  # one float per output channel


def test_bf16_weights_are_stored_as_bf16_with_f32_activations(peaked_runs):
    _, runs = peaked_runs
    m32, mb = runs["f32"][2], runs["bf16w"][2]
    for name, w in mb.params["layers"][0].items():
        ref = m32.params["layers"][0][name]
        want = jnp.bfloat16 if name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down") else ref.dtype
        assert w.dtype == want, name
    assert mb.params["embed"].dtype == np.float32 and mb.params["lm_head"].dtype == jnp.bfloat16
    assert not {"wq_scale", "w_up_scale", "lm_head_scale"} & (set(mb.params["layers"][0]) | set(mb.params))
    for name in ("wq", "w_down"):  # the kernels' panel layout, as for int8 (aotlm.models.packing)
        assert packing.is_packed(name, mb.params["layers"][0][name].ndim) == kernels.enabled()


def test_quantize_int8_is_per_output_channel_symmetric():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 3, 5)).astype(np.float32)  # [D, H, Dh]: contract over D
    w[:, 1, 2] = 0.0  # an all-zero channel (e.g. tp padding) -> scale 0, no NaN
    q, s = quantize_int8(w, (0,))
    assert q.dtype == np.int8 and s.shape == (3, 5) and s[1, 2] == 0 and not q[:, 1, 2].any()
    np.testing.assert_allclose(s, np.abs(w).max(0) / 127, rtol=1e-6)
    assert np.abs(q).max() == 127 and (np.abs(q).max(0)[s > 0] == 127).all()  # every channel hits +-127
    assert np.abs(q * s - w).max() <= s.max() / 2 + 1e-7


CHUNKED = [((3000, 40), (0,)), ((40, 3000), (1,)), ((70, 9, 130), (0, 1))]


@pytest.mark.parametrize(("shape", "contract"), CHUNKED)
def test_quantize_int8_in_row_chunks_equals_the_whole_array_formula(shape, contract):
    """quantize_int8 rounds a few rows at a time (several chunks at these shapes): the same codes and
    scales, bit for bit, as the formula over the whole array, all-zero channels included."""
    rng = np.random.default_rng(1)
    w = (rng.normal(size=shape) * 3).astype(np.float32)
    w.reshape(-1)[::7] = 0.0
    w[(slice(None),) * (len(shape) - 1) + (0,)] = 0.0  # whole channels (or rows) of zeros
    amax = np.max(np.abs(w), axis=contract, keepdims=True)
    scale = amax / 127.0
    want = np.clip(np.rint(w / np.where(scale > 0, scale, 1.0)), -127, 127).astype(np.int8)
    q, s = quantize_int8(w, contract)
    np.testing.assert_array_equal(q, want)
    np.testing.assert_array_equal(s.view(np.int32), np.squeeze(scale, axis=contract).view(np.int32))


def test_options_change_the_compile_fingerprint(peaked_runs, ckpt_dir):
    path, runs = peaked_runs
    fused = _load(path, fuse_qkv=True)
    ms = [runs["f32"][2], runs["int8"][2], fused, _load(path, quant=QuantizationConfig(lm_head=False))]
    keys = {entry_key(m.fingerprint(), ("decode", N_POS), m.mesh)[0] for m in ms}
    assert len(keys) == len(ms)
    with pytest.raises(ValueError, match="quant='int2' is not supported"):
        _load(path, quant="int2")
    with pytest.raises(ValueError, match="quant_dtype='f4' is not supported"):
        QuantizationConfig(quant_dtype="f4")


# ------------------------------------------------------------------ fuse_qkv
def _tiny(**kw):
    return dict(vocab_size=V, **kw)


FAMILIES = {  # one tiny config per family module (1 layer: fused vs unfused is per layer)
    "gpt2": lambda: T.GPT2Config(n_embd=32, n_layer=1, n_head=4, n_positions=64, **_tiny()),
    "llama": lambda: T.LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_hidden_layers=1,
        **_tiny(),
    ),
    "mixtral": lambda: T.MixtralConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        num_hidden_layers=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        **_tiny(),
    ),
    "qwen2": lambda: T.Qwen2Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_hidden_layers=1,
        **_tiny(),
    ),
    "gemma": lambda: T.GemmaConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=48,
        num_hidden_layers=1,
        pad_token_id=0,
        **_tiny(),
    ),
    "phi3": lambda: T.Phi3Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_hidden_layers=1,
        pad_token_id=0,
        **_tiny(),
    ),
    "gptj": lambda: T.GPTJConfig(n_embd=32, n_head=4, n_layer=1, rotary_dim=4, n_positions=64, **_tiny()),
    "gpt_neox": lambda: T.GPTNeoXConfig(
        hidden_size=32, num_attention_heads=4, intermediate_size=48, num_hidden_layers=1, **_tiny()
    ),
    "opt": lambda: T.OPTConfig(
        hidden_size=32, num_attention_heads=4, ffn_dim=48, num_hidden_layers=1, **_tiny()
    ),
    "bloom": lambda: T.BloomConfig(hidden_size=32, n_head=4, n_layer=1, **_tiny()),
    "mpt": lambda: T.MptConfig(
        d_model=32, n_heads=4, n_layers=1, max_seq_len=64, expansion_ratio=2, **_tiny()
    ),
    "falcon": lambda: T.FalconConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        num_hidden_layers=1,
        new_decoder_architecture=True,
        bias=True,
        **_tiny(),
    ),
    "gpt_bigcode": lambda: T.GPTBigCodeConfig(n_embd=32, n_head=4, n_layer=1, multi_query=True, **_tiny()),
}


def test_every_family_module_has_a_fuse_case():
    from aotlm.models import _FAMILIES

    assert {f.replace("qwen", "qwen2") for f in _FAMILIES} == set(FAMILIES)


def _greedy(cfg, params, prompts, new: int):
    """Cache-free greedy search in one traced function: step ``i`` re-runs the whole buffer with
    the not-yet-generated slots as padding (position -1, invisible). Returns (tokens, logits of
    the last prompt position). Lets every family's fused and unfused model share ONE compile."""
    b, t = prompts.shape
    n, dh, kv = t + new, cfg.head_dim, cfg.n_kv_heads
    cache = {
        "k": [jnp.zeros((b, kv, n, dh))] * cfg.n_layers,
        "v": [jnp.zeros((b, kv, dh, n))] * cfg.n_layers,
        "pos": jnp.full((b, n), -1, jnp.int32),
    }
    slots = jnp.arange(n, dtype=jnp.int32)

    def step(i, carry):
        toks, first = carry
        pos = jnp.broadcast_to(jnp.where(slots < t + i, slots, -1), (b, n))
        h, _ = decoder.forward(cfg, params, cache, toks, pos, 0, 0)
        lg = decoder.logits(cfg, params, jax.lax.dynamic_index_in_dim(h, t + i - 1, 1, keepdims=False))
        return toks.at[:, t + i].set(jnp.argmax(lg, -1).astype(jnp.int32)), jnp.where(i == 0, lg, first)

    toks = jnp.zeros((b, n), jnp.int32).at[:, :t].set(prompts)
    return jax.lax.fori_loop(0, new, step, (toks, jnp.zeros((b, cfg.vocab_size))))


def test_fuse_qkv_is_exact_for_every_family(ckpt_dir):
    """Fused vs unfused: last-prompt logits within 1e-5 and 8 greedy tokens identical, per family."""
    pairs = {}
    for fam, make in FAMILIES.items():
        path = save_checkpoint(ckpt_dir / f"wo_fuse_{fam}", make(), scale=3.0, noisy_1d=True)
        plain, fused = _load(path), _load(path, fuse_qkv=True)
        lp, c = fused.params["layers"][0], fused.cfg
        assert "wqkv" in lp and not {"wq", "wk", "wv"} & set(lp), fam
        assert lp["wqkv"].shape[1:] == (c.n_kv_heads, c.n_heads // c.n_kv_heads + 2, c.head_dim), fam
        assert ("bqkv" in lp) == ("bq" in plain.params["layers"][0]), fam
        if c.gated_mlp:
            assert ("e_gu" if c.n_experts else "w_gu") in lp, fam
        pairs[fam] = (plain, fused)
    group = [m for pair in pairs.values() for m in pair]
    run = jax.jit(lambda ps, x: [_greedy(m.cfg, p, x, 8) for m, p in zip(group, ps, strict=True)])
    out = run([m.params for m in group], jnp.asarray(PROMPTS, jnp.int32))
    bad = []
    for i, fam in enumerate(pairs):
        (t0, l0), (t1, l1) = (jax.tree.map(np.asarray, o) for o in out[2 * i : 2 * i + 2])
        diff = np.abs(l0 - l1).max()
        if diff > 1e-5 or not (t0 == t1).all():
            bad.append(f"{fam}: logits diff {diff:.2e}, tokens equal {(t0 == t1).all()}")
    assert not bad, bad
    # the cache-free reference really is the engine's forward (so the comparison means something)
    llama = pairs["llama"][1]
    np.testing.assert_allclose(np.asarray(out[3][1]), llama.forward(PROMPTS), atol=1e-5, rtol=0)


def test_fused_regroup_equals_fusing_the_replicated_heads():
    """replicated-heads at tp=4 with 2 kv heads: regrouping the fused weight on the host equals
    fusing the separately prepared (kv-repeated) q/k/v, so each device keeps its heads together."""
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(8, 8, 3)), rng.normal(size=(8, 2, 3)), rng.normal(size=(8, 2, 3))
    prep = lambda name, a: sharding.prepare_param(("layers", 0, name), a, 4, "replicated-heads", 2)
    want = fuse_qkv_heads(prep("wq", q), prep("wk", k), prep("wv", v), 1)
    got = prep("wqkv", fuse_qkv_heads(q, k, v, 1))
    assert got.shape == (8, 4, 4, 3)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(regroup_qkv(want, 1, 1), want)
    assert sharding.prepared_shape(("layers", 0, "wqkv"), (8, 2, 6, 3), 4, "replicated-heads", 2) == got.shape


# ------------------------------------------------------------------ tensor parallel (subprocess)
def test_int8_and_fuse_qkv_under_tp2(tp_proc):
    proc, out = tp_proc
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    runs = {r["case"][0]: r for r in json.loads(out.read_text())}
    for name, ref in [
        ("kv2 int8 tp2", "kv2 int8 tp1"),
        ("kv2 int8+fuse tp2", "kv2 int8 tp1"),
        ("kv1 fuse tp2", "kv1 f32 tp1"),
        ("kv1 int8+fuse tp2", "kv1 int8 tp1"),
        ("kv2 fp8+fuse tp2", "kv2 fp8 tp1"),
        ("kv1 fp8+fuse tp2", "kv1 fp8 tp1"),
    ]:
        got, want = runs[name], runs[ref]
        diff = np.abs(np.array(got["logits"]) - np.array(want["logits"])).max()
        assert diff <= 1e-4, f"{name}: logits differ from {ref} by {diff}"
        assert got["tokens"] == want["tokens"], name
        bad = [k for k, leaf in got["leaves"].items() if leaf["sharded_evenly"] is False]
        assert not bad, f"{name}: uneven shards {bad}"
    assert runs["kv1 fuse tp2"]["gqa"] == "replicated-heads"
    fp8 = runs["kv2 fp8+fuse tp2"]["leaves"]  # K-minor [*N, *K, 1] (models.quant_fp8): the same axes split
    assert fp8["['layers'][0]['wqkv']"]["spec"] == ["tp", "None", "None", "None", "None"]
    assert fp8["['layers'][0]['w_down']"]["spec"] == ["None", "tp", "None"]
    leaves = runs["kv2 int8 tp2"]["leaves"]
    layer = "['layers'][0]"

    def spec(leaves, path, w, logical):  # a packed leaf (aotlm.models.packing): output dims first
        got = leaves[f"{path}['{w}']"]["spec"]
        if len(got) == len(logical):
            return got == logical
        ka, na = packing.split_dims(tuple(logical), packing.PACK_CONTRACT[w])
        return got == [*na, *ka, "None", "None"]

    for w, logical in [
        ("wq", ["None", "tp", "None"]),
        ("wk", ["None", "tp", "None"]),
        ("w_down", ["tp", "None"]),
    ]:
        assert leaves[f"{layer}['{w}']"]["dtype"] == "int8"
        assert spec(leaves, layer, w, logical), w
    assert leaves[f"{layer}['wq_scale']"]["spec"] == ["tp", "None"]  # sharded with its weight's heads
    assert leaves[f"{layer}['w_up_scale']"]["spec"] == ["tp"]
    assert leaves["['lm_head_scale']"]["spec"] == ["tp"]  # vocab-sharded (101 padded to 102, or 128 packed)
    fused = runs["kv1 int8+fuse tp2"]["leaves"]
    assert spec(fused, layer, "wqkv", ["None", "tp", "None", "None"])
    assert fused[f"{layer}['wqkv_scale']"]["spec"] == ["tp", "None", "None"]
    assert spec(fused, layer, "w_gu", ["None", "None", "tp"])
    assert len(fused[f"{layer}['w_gu']"]["spec"]) == (5 if kernels.enabled() else 3)  # packed with kernels
