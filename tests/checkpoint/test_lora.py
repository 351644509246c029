"""PEFT LoRA adapters merged into the weights (``lora_adapters={name: dir}, merge_lora=True``) against
transformers + PEFT (``PeftModel``, unmerged) on the same tiny checkpoint and adapter: logits within
1e-4 in f32 and greedy tokens equal, for Llama (every projection, plain and rsLoRA) and GPT-2 (its
fused ``Conv1D`` modules, ``fan_in_fan_out``); what cannot be applied is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conformance import hf_generate, hf_last_logits, hf_model

from aotlm import AutoModelForSampling
from aotlm.models.checkpoint import CheckpointError

peft = pytest.importorskip("peft", reason="the LoRA reference needs peft (the [test] extra)")

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path, out, targets, **kw):
    """A PEFT LoRA adapter with random (non-zero) A and B, saved to ``out``."""
    torch.manual_seed(3)
    model = hf_model(base_path)
    cfg = peft.LoraConfig(target_modules=targets, init_lora_weights=False, **kw)
    peft.get_peft_model(model, cfg).save_pretrained(str(out))
    return out


def check(base_path, adapter, vocab: int = 101):
    ref = peft.PeftModel.from_pretrained(hf_model(base_path), str(adapter)).eval()
    model = AutoModelForSampling.from_pretrained(
        base_path, batch_size=1, n_positions=64, context_length_estimate=16, compile_cache=False,
        lora_adapters={"tuned": str(adapter)}, merge_lora=True,
    )  # fmt: skip
    ids = np.random.default_rng(0).integers(0, vocab, (1, 11))
    want = hf_last_logits(ref, ids)
    assert np.abs(want - hf_last_logits(hf_model(base_path), ids)).max() > 1e-2, "the adapter changes nothing"
    got = model.forward(ids)
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    np.testing.assert_array_equal(model.sample(ids, max_new_tokens=16), hf_generate(ref, ids, 16))


@pytest.mark.parametrize("kw", [dict(r=4, lora_alpha=8), dict(r=8, lora_alpha=4, use_rslora=True)])
def test_llama_adapter_merged_equals_peft(llama_path, tmp_path, kw):
    check(llama_path, make_adapter(llama_path, tmp_path / "adapter", LLAMA_TARGETS, **kw))


def test_gpt2_conv1d_adapter_merged_equals_peft(gpt2_path, tmp_path):
    adapter = make_adapter(gpt2_path, tmp_path / "adapter", ["c_attn", "c_proj", "c_fc"], r=4, lora_alpha=16)
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"]
    check(gpt2_path, adapter)


def test_what_cannot_be_applied_is_refused(llama_path, gpt2_path, tmp_path):
    adapter = make_adapter(llama_path, tmp_path / "a", ["q_proj"], r=2, lora_alpha=4)
    load = lambda path=llama_path, **kw: AutoModelForSampling.from_pretrained(  # noqa: E731
        path, batch_size=1, n_positions=64, compile_cache=False, **kw
    )
    with pytest.raises(CheckpointError, match="q_proj.weight' \\(a module aotlm does not read\\)"):
        load(gpt2_path, lora_adapters={"a": str(adapter)})  # per-row slots refuse it as well
    with pytest.raises(ValueError, match="merges one adapter, got 2"):
        load(lora_adapters={"a": str(adapter), "b": str(adapter)}, merge_lora=True)
    with pytest.raises(ValueError, match="merge_lora=True needs an adapter"):
        load(merge_lora=True)
    with pytest.raises(CheckpointError, match="does not hold: the adapter was trained on another base model"):
        load(gpt2_path, lora_adapters={"a": str(adapter)}, merge_lora=True)
    dora = make_adapter(llama_path, tmp_path / "dora", ["q_proj"], r=2, use_dora=True)
    with pytest.raises(CheckpointError, match="DoRA adapters are not supported"):
        load(lora_adapters={"a": str(dora)}, merge_lora=True)
    with pytest.raises(CheckpointError, match="is not a PEFT adapter: no adapter_config.json"):
        load(lora_adapters={"a": str(tmp_path)}, merge_lora=True)
    with pytest.raises(CheckpointError, match="is not a PEFT adapter: the directory does not exist"):
        load(lora_adapters={"a": str(tmp_path / "typo")}, merge_lora=True)


def test_a_merged_adapter_has_its_own_converted_weights(llama_path, tmp_path, monkeypatch):
    """Converted (int8) weights are cached per adapter: the base model's entry never stands in for
    the merged one, and a second load of the merged model gives the same logits from its entry."""
    monkeypatch.setenv("AOTLM_WEIGHT_CACHE", str(tmp_path / "weights"))
    adapter = make_adapter(llama_path, tmp_path / "adapter", LLAMA_TARGETS, r=4, lora_alpha=8)
    ids = np.random.default_rng(0).integers(0, 101, (1, 11))
    load = lambda **kw: AutoModelForSampling.from_pretrained(  # noqa: E731
        llama_path, batch_size=1, n_positions=64, compile_cache=False, quant="int8", **kw
    ).forward(ids)
    base = load()
    merged = [load(lora_adapters={"tuned": str(adapter)}, merge_lora=True) for _ in range(2)]
    assert len(list((tmp_path / "weights").iterdir())) == 2
    np.testing.assert_array_equal(merged[0], merged[1])
    ref = hf_last_logits(peft.PeftModel.from_pretrained(hf_model(llama_path), str(adapter)).eval(), ids)
    assert np.abs(merged[0] - ref).max() < 0.1 * np.abs(base - ref).max()


def test_generate_command_merges_an_adapter(tmp_path, capsys):
    """``aotlm generate --lora DIR`` answers as the merged model does (and not as the base)."""
    from textkit import make_text_checkpoint

    from aotlm.cli import main
    from aotlm.text.tokens import tokenizer_for

    ckpt = make_text_checkpoint(tmp_path / "llama")
    adapter = make_adapter(ckpt, tmp_path / "adapter", LLAMA_TARGETS, r=4, lora_alpha=32)
    tok, prompt = tokenizer_for(ckpt), "def fibonacci(n):"
    ids = np.array([tok(prompt)["input_ids"]])
    ref = peft.PeftModel.from_pretrained(hf_model(ckpt), str(adapter)).eval()
    new = lambda m: hf_generate(m, ids, 6, eos=tok.eos_token_id)[0, ids.shape[1] :]  # noqa: E731
    want, base = new(ref), new(hf_model(ckpt))
    assert list(want) != list(base), "the adapter must change the answer"
    argv = ["generate", "--model", str(ckpt), "--prompt", prompt, "--max-new-tokens", "6", "--greedy"]
    assert main([*argv, "--lora", str(adapter), "--cache-dir", str(tmp_path / "cc")]) == 0
    text = json.loads(capsys.readouterr().out.splitlines()[-1])["completion"]
    assert text == tok.decode([t for t in want if t != tok.eos_token_id], skip_special_tokens=True)
