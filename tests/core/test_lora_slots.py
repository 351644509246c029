"""Per-row LoRA adapters (``max_loras`` slots, ``sample(adapter=...)``) against transformers + PEFT
(``PeftModel``, one per adapter) on the same tiny checkpoints: every row of a batch mixing three
adapters and the base model has its logits within 1e-4 and its greedy tokens equal; loading,
unloading and replacing adapters and mixing them compiles nothing; a batch smaller than the slots
(each row gathers its slot) and GPT-2's fused ``Conv1D`` q/k/v (``fan_in_fan_out``, one module split
into three projections) as well; int8 base weights; what cannot run is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conformance import hf_generate, hf_last_logits, hf_model
from safetensors.numpy import save_file

import aotlm.kernels
from aotlm import AutoModelForSampling
from aotlm.models.checkpoint import CheckpointError

peft = pytest.importorskip("peft", reason="the LoRA reference needs peft (the [test] extra)")

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = dict(n_positions=64, context_length_estimate=16, compile_cache=False)


def make_adapter(base, out, targets, seed, **kw):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(target_modules=targets, init_lora_weights=False, **kw)
    peft.get_peft_model(hf_model(base), cfg).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(llama_path, d / "a", LLAMA_ALL, 1, r=4, lora_alpha=8),
        "b": make_adapter(llama_path, d / "b", ["q_proj", "v_proj"], 2, r=8, lora_alpha=4, use_rslora=True),
        "c": make_adapter(llama_path, d / "c", ["down_proj", "o_proj"], 3, r=2, lora_alpha=16),
    }


def reference(base, adapter):
    return (
        hf_model(base)
        if adapter is None
        else peft.PeftModel.from_pretrained(hf_model(base), str(adapter)).eval()
    )


def check_rows(model, base, adapters, names, ids, new: int = 12):
    """Every row's last logits and greedy tokens against its own reference."""
    logits = model.forward(ids, adapter=names)
    tokens = model.sample(ids, max_new_tokens=new, adapter=names)
    for i, name in enumerate(names):
        ref = reference(base, None if name is None else adapters[name])
        want = hf_last_logits(ref, ids[i : i + 1])[0]
        assert np.abs(logits[i] - want).max() <= 1e-4, (name, np.abs(logits[i] - want).max())
        np.testing.assert_array_equal(tokens[i], hf_generate(ref, ids[i : i + 1], new)[0])


@pytest.mark.parametrize("kernels", ["1", "0"])  # the kernel's in-place rows; XLA's product with every slot
def test_a_batch_mixing_adapters_equals_peft_row_by_row_and_never_recompiles(
    llama_path, adapters, monkeypatch, kernels
):
    monkeypatch.setenv("AOTLM_KERNELS", kernels)
    model = AutoModelForSampling.from_pretrained(
        llama_path, batch_size=4, max_loras=4, max_lora_rank=8,
        lora_adapters={"a": str(adapters["a"]), "b": str(adapters["b"])}, **SHAPES,
    )  # fmt: skip
    assert model.load_adapter("c", adapters["c"]) == 2 and model.adapters == ["a", "b", "c"]
    ids = np.random.default_rng(0).integers(0, 101, (4, 11))
    base = hf_last_logits(hf_model(llama_path), ids)
    for name in "abc":  # every adapter changes its row
        assert np.abs(model.forward(ids, adapter=name)[0] - base[0]).max() > 1e-2
    check_rows(model, llama_path, adapters, ["a", "b", None, "c"], ids)
    graphs = len(model.compile_report)
    model.unload_adapter("b")
    assert model.adapters == ["a", "c"]
    with pytest.raises(ValueError, match="no LoRA adapter named 'b'"):
        model.sample(ids, max_new_tokens=2, adapter="b")
    assert model.load_adapter("b2", adapters["b"]) == 1  # the freed slot
    model.load_adapter("a", adapters["c"])  # replaced in place: "a" now holds c's weights
    check_rows(model, llama_path, {"a": adapters["c"], "b2": adapters["b"], "c": adapters["c"]},
               ["b2", "a", "c", None], ids, new=4)  # fmt: skip
    np.testing.assert_allclose(model.forward(ids)[:, :], base, atol=1e-4)  # no adapter: the base model
    assert len(model.compile_report) == graphs, "an adapter change compiled a graph"
    uses_kernel = "aotlm_lora" in model.executable(("decode", 64)).as_text()
    assert uses_kernel == (kernels == "1" and aotlm.kernels.enabled())


def test_fewer_rows_than_slots_gather_each_rows_slot(llama_path, adapters, monkeypatch):
    monkeypatch.setenv("AOTLM_KERNELS", "0")  # XLA's gathered slots (the kernel: the test above)
    model = AutoModelForSampling.from_pretrained(
        llama_path, batch_size=2, max_lora_rank=8, **SHAPES,
        lora_adapters={k: str(v) for k, v in adapters.items()},
    )  # fmt: skip
    ids = np.random.default_rng(1).integers(0, 101, (2, 9))
    check_rows(model, llama_path, adapters, ["c", "a"], ids, new=6)


def test_gpt2_fused_conv1d_adapter_per_row(gpt2_path, tmp_path):
    adapter = make_adapter(gpt2_path, tmp_path / "g", ["c_attn", "c_proj", "c_fc"], 4, r=4, lora_alpha=16)
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"]
    model = AutoModelForSampling.from_pretrained(
        gpt2_path, batch_size=2, lora_adapters={"g": str(adapter)}, **SHAPES
    )
    ids = np.random.default_rng(2).integers(0, 101, (2, 10))
    check_rows(model, gpt2_path, {"g": adapter}, [None, "g"], ids, new=8)


@pytest.mark.parametrize(  # the kernel, XLA's stacked and gathered forms; an int4 base
    ("kernels", "slots", "quant"), [("1", 1, "int8"), ("0", 1, "int8"), ("0", 4, "int8"), ("1", 2, "int4")]
)
def test_quantized_base_weights_take_adapters(llama_path, adapters, monkeypatch, kernels, slots, quant):
    """Over a quantized base the tables are int8 with per slot and rank scales."""
    monkeypatch.setenv("AOTLM_KERNELS", kernels)
    model = AutoModelForSampling.from_pretrained(
        llama_path,
        batch_size=2,
        quant=quant,
        lora_adapters={"a": str(adapters["a"])},
        max_loras=slots,
        **SHAPES,
    )
    layer = model.params["layers"][0]
    assert layer["wq_lora_a"].dtype == np.int8 and layer["wq_lora_s"].shape == (slots, 16)
    ids = np.random.default_rng(3).integers(0, 101, (2, 9))
    got = model.forward(ids, adapter=[None, "a"])
    base_err = np.abs(got[0] - hf_last_logits(hf_model(llama_path), ids[:1])[0]).max()
    want = hf_last_logits(reference(llama_path, adapters["a"]), ids[1:])[0]
    effect = np.abs(want - hf_last_logits(hf_model(llama_path), ids[1:])[0]).max()
    assert np.abs(got[1] - want).max() <= 3 * base_err + 1e-3 < effect / 3


def test_what_cannot_run_is_refused(llama_path, adapters, tmp_path):
    load = lambda **kw: AutoModelForSampling.from_pretrained(llama_path, batch_size=1, **SHAPES, **kw)  # noqa: E731
    with pytest.raises(
        CheckpointError, match="rank 8 > max_lora_rank=4; load the model with max_lora_rank=8"
    ):
        load(lora_adapters={"b": str(adapters["b"])}, max_lora_rank=4)
    with pytest.raises(ValueError, match="3 adapters given for max_loras=2"):
        load(lora_adapters={k: str(v) for k, v in adapters.items()}, max_loras=2, max_lora_rank=8)
    model = load(lora_adapters={"a": str(adapters["a"])})
    ids = np.ones((1, 4), np.int64)
    with pytest.raises(ValueError, match="all 1 adapter slots are taken"):
        model.load_adapter("c", adapters["c"])
    with pytest.raises(ValueError, match="no LoRA adapter named 'x' is loaded"):
        model.forward(ids, adapter="x")
    with pytest.raises(ValueError, match="adapter has 2 entries for 1 prompts"):
        model.sample(ids, max_new_tokens=2, adapter=["a", None])
    with pytest.raises(ValueError, match="run without num_beams, a draft model or prompt lookup"):
        model.sample(ids, max_new_tokens=2, adapter="a", num_beams=2)
    with pytest.raises(ValueError, match="run without num_beams, a draft model or prompt lookup"):
        model.sample(ids, max_new_tokens=2, adapter="a", prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="has no adapter slots; load it with max_loras=N"):
        load().load_adapter("a", adapters["a"])
    head = tmp_path / "head"  # an adapter on lm_head: a module per-row slots do not take
    head.mkdir()
    (head / "adapter_config.json").write_text(json.dumps(dict(peft_type="LORA", r=2, lora_alpha=2)))
    stem = "base_model.model.lm_head.lora_"
    ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
    save_file(
        {stem + "A.weight": ones(2, 64), stem + "B.weight": ones(101, 2)},
        str(head / "adapter_model.safetensors"),
    )
    with pytest.raises(CheckpointError, match="changes 'lm_head.weight'.*merge this adapter instead"):
        model.load_adapter("head", head)
    assert model.adapters == ["a"]


SLOTS = {  # -1: base; 7: no such slot (unchanged too)
    "pairs": [0, -1, 2, 0, 7, 2],
    "fours": [1, 1, -1, 1, 0, 1, 1, 2, 1, 1, 1],  # a slot of 8 rows: two fours of rows, then pairs
}


@pytest.mark.parametrize(
    "dtype,rank,rows",
    [("float32", 16, "pairs"), ("bfloat16", 16, "pairs"), ("float32", 5, "pairs"), ("bfloat16", 32, "pairs")]
    + [("bfloat16", r, "fours") for r in (8, 16, 32, 64)]
    + [("int8", 16, "pairs"), ("int8", 32, "fours"), ("int8", 5, "fours")],
)
def test_the_kernel_reads_each_rows_slot(dtype, rank, rows):
    if not aotlm.kernels.enabled():
        pytest.skip("the CPU kernels are off on this machine")
    import jax.numpy as jnp  # local: the kernel's inputs only

    rng = np.random.default_rng(6)
    slots = np.array(SLOTS[rows], np.int32)
    x = rng.standard_normal((len(slots), 400)).astype(np.float32)  # rank 16, 32: the pool's two passes
    scale = None
    if dtype == "int8":  # codes and per slot and rank scales: h = (x @ A) * scale
        a = jnp.asarray(rng.integers(-127, 128, (3, 400, rank)), jnp.int8)
        b = jnp.asarray(rng.integers(-127, 128, (3, rank, 300)), jnp.int8)
        scale = rng.uniform(1e-5, 1e-4, (3, rank)).astype(np.float32)
    else:
        a = jnp.asarray(rng.standard_normal((3, 400, rank)), dtype)
        b = jnp.asarray(rng.standard_normal((3, rank, 300)), dtype)  # 300 outputs: two blocks of 256, a tail
    y = rng.standard_normal((len(slots), 300)).astype(np.float32)
    sc = None if scale is None else jnp.asarray(scale)
    got = np.asarray(aotlm.kernels.lora_add(jnp.asarray(y), jnp.asarray(x), jnp.asarray(slots), a, b, sc))
    af, bf = np.asarray(a, np.float32), np.asarray(b, np.float32)
    for m, s in enumerate(slots):
        h = (x[m] @ af[s]) * (1.0 if scale is None else scale[s]) if 0 <= s < 3 else None
        want = y[m] + (h @ bf[s] if h is not None else 0.0)
        # f32 sums in another order: within a few ulps of the row's largest value
        np.testing.assert_allclose(got[m], want, rtol=1e-5, atol=1e-4 + 4e-6 * np.abs(want).max())


def test_one_kernel_call_updates_every_projection_of_an_input():
    """q / k / v (gate / up) share x: one call, each output its own tables and width, rows by slot."""
    if not aotlm.kernels.enabled():
        pytest.skip("the CPU kernels are off on this machine")
    import jax.numpy as jnp  # local: the kernel's inputs only

    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    slots = np.array([1, -1, 0], np.int32)
    tables = [
        (
            jnp.asarray(rng.standard_normal((2, 64, 8)), "bfloat16"),
            jnp.asarray(rng.standard_normal((2, 8, o)), "bfloat16"),
            None,
        )
        for o in (64, 16, 40)
    ]
    ys = [rng.standard_normal((3, b.shape[-1])).astype(np.float32) for _, b, _ in tables]
    got = aotlm.kernels.lora_add_many(
        [jnp.asarray(y) for y in ys], jnp.asarray(x), jnp.asarray(slots), tables
    )
    assert len(got) == 3
    for y, out, (a, b, _) in zip(ys, got, tables, strict=True):
        af, bf = np.asarray(a, np.float32), np.asarray(b, np.float32)
        for m, s in enumerate(slots):
            want = y[m] + (x[m] @ af[s] @ bf[s] if s >= 0 else 0.0)
            np.testing.assert_allclose(np.asarray(out)[m], want, rtol=1e-5, atol=1e-4)
