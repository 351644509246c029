"""The transformers-neuronx surface and HF generation conventions, beyond the guide's examples.

``NeuronConfig`` mapping and its errors, family classes, per-token streaming and stopping,
``min_new_tokens`` / ``min_length`` against transformers, and a checkpoint's
``generation_config.json`` as the defaults of ``pipeline()``, ``aotlm generate`` and the adapter.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from conformance import Recorder, hf_model
from textkit import shared_text_checkpoint

from aotlm import (
    GQA,
    AutoModelForSampling,
    GPT2ForSampling,
    HuggingFaceGenerationModelAdapter,
    LlamaForSampling,
    NeuronConfig,
    QuantizationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
    pipeline,
)
from aotlm.config import GenerationConfig

SMALL = dict(n_positions=64, context_length_estimate=16, compile_cache=False)


@pytest.fixture(scope="module")
def gpt2(gpt2_path):
    return AutoModelForSampling.from_pretrained(gpt2_path, batch_size=2, **SMALL)


def test_neuron_config_maps_and_refuses(gpt2_path):
    nc = NeuronConfig(
        quant=QuantizationConfig(quant_dtype="s8"),
        group_query_attention=GQA.REPLICATED_HEADS,
        fuse_qkv=True,
        on_device_generation=GenerationConfig(do_sample=True, top_k=5, max_length=20),
        attention_layout="HSB",  # transformers-neuronx's default: a no-op, accepted
    )
    want = {"quant": QuantizationConfig("s8"), "gqa": "replicated-heads", "fuse_qkv": True}
    assert nc.model_kwargs() == want
    model = GPT2ForSampling.from_pretrained(gpt2_path, neuron_config=nc, **SMALL)
    assert model.gqa == "replicated-heads" and "wqkv" in model.params["layers"][0]
    assert str(model.params["layers"][0]["w_up"].dtype) == "int8"
    ids = np.array([[5, 6, 7]])
    outs = {tuple(model.sample(ids)[0]) for _ in range(4)}
    assert all(len(o) == 20 for o in outs) and len(outs) > 1  # max_length and do_sample from the config
    greedy = model.sample(ids, do_sample=False, max_new_tokens=4)  # explicit arguments win
    assert greedy.shape == (1, 7)

    with pytest.raises(TypeError, match=r"unknown field\(s\) \['bogus'\]"):
        NeuronConfig(bogus=1)
    with pytest.raises(ValueError, match="sparse_attn=.* is not supported"):
        NeuronConfig(sparse_attn=object())
    with pytest.raises(ValueError, match="ALL_GATHER_HEADS is not implemented"):
        NeuronConfig(group_query_attention=GQA.ALL_GATHER_HEADS)
    with pytest.raises(ValueError, match="continuous_batching.*aotlm serve"):
        NeuronConfig(continuous_batching=object())
    with pytest.raises(ValueError, match="quant='bf16' was passed and neuron_config sets"):
        GPT2ForSampling.from_pretrained(gpt2_path, quant="bf16", neuron_config=nc, **SMALL)
    with pytest.raises(TypeError, match="unexpected keyword argument 'dynamic'"):
        GenerationConfig(dynamic=True)


def test_family_class_checks_the_checkpoint(gpt2_path, llama_path):
    msg = r"LlamaForSampling loads \['llama'\].*is 'gpt2'.*AutoModelForSampling"
    with pytest.raises(ValueError, match=msg):
        LlamaForSampling.from_pretrained(gpt2_path, **SMALL)
    assert LlamaForSampling.from_pretrained(llama_path, **SMALL).hf_config.model_type == "llama"


def test_default_n_positions_is_2048_capped_at_the_checkpoint(gpt2_path, llama_path):
    assert AutoModelForSampling.from_pretrained(gpt2_path, compile_cache=False).n_positions == 256
    big = AutoModelForSampling.from_pretrained(llama_path, compile_cache=False)
    assert big.n_positions == 256 and big.tg_buckets == (128, 256)


def test_streamer_gets_every_token_and_criteria_run_after_each(gpt2):
    ids = np.array([[1, 2, 3, 4], [0, 9, 8, 7]])
    mask = np.array([[1, 1, 1, 1], [0, 1, 1, 1]])
    rec = Recorder()
    out = gpt2.sample(ids, attention_mask=mask, max_new_tokens=9, streamer=rec)
    assert rec.calls[-1] == "end" and len(rec.calls) == 1 + 9 + 1
    np.testing.assert_array_equal(rec.calls[0], ids)
    for j, toks in enumerate(rec.calls[1:-1]):
        assert toks.shape == (2,)
        np.testing.assert_array_equal(toks, out[:, 4 + j])
    np.testing.assert_array_equal(out, gpt2.sample(ids, attention_mask=mask, max_new_tokens=9))

    class AtLength(StoppingCriteria):
        def __init__(self, n):
            self.n, self.seen = n, []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(input_ids.shape[1])
            return input_ids.shape[1] >= self.n

    crit = AtLength(7)
    criteria = StoppingCriteriaList([crit])
    out = gpt2.sample(ids, attention_mask=mask, max_new_tokens=20, stopping_criteria_list=criteria)
    assert out.shape[1] == 7 and crit.seen == [5, 6, 7]  # checked after every token: no overshoot


def test_min_new_tokens_per_row_and_min_length_equal_transformers(gpt2, gpt2_path):
    ref = hf_model(gpt2_path)
    ids = np.array([[5, 17, 3, 8], [44, 2, 9, 30]])
    free = gpt2.sample(ids, max_new_tokens=12)
    eos = int(free[0, 6])  # row 0's 3rd token: it stops there without a minimum
    for kw in (dict(min_new_tokens=8), dict(min_length=10)):
        got = gpt2.sample(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, **kw)
        with torch.no_grad():
            want = ref.generate(
                torch.tensor(ids), max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0, **kw
            )
        np.testing.assert_array_equal(got, want.numpy(), err_msg=str(kw))
        assert got.shape[1] > 7
    rows = gpt2.sample(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=0, min_new_tokens=[8, 0])
    alone = gpt2.sample(ids[:1], max_new_tokens=12, eos_token_id=eos, pad_token_id=0, min_new_tokens=8)
    np.testing.assert_array_equal(rows[0, : alone.shape[1]], alone[0])
    with pytest.raises(ValueError, match="min_new_tokens=-1 is invalid"):
        gpt2.sample(ids, min_new_tokens=-1)


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    """The shared tiny text checkpoint, copied, with a generation_config.json."""
    src, _ = shared_text_checkpoint(tmp_path_factory)
    dst = tmp_path_factory.mktemp("gen-defaults") / "llama"
    shutil.copytree(src, dst)
    cfg = {"do_sample": False, "repetition_penalty": 1.5, "max_new_tokens": 9, "no_repeat_ngram_size": 2}
    (dst / "generation_config.json").write_text(json.dumps(cfg))
    return dst


def test_generation_config_json_is_the_default_everywhere(text_ckpt):
    import transformers

    model = AutoModelForSampling.from_pretrained(text_ckpt, batch_size=1, n_positions=64, compile_cache=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(text_ckpt)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(text_ckpt))
    ids = torch.tensor([tok("def fibonacci(n):").input_ids])
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids))  # reads generation_config.json too
    adapter = HuggingFaceGenerationModelAdapter(ref.config, model)
    adapter.reset_generation()
    got = adapter.generate(ids, attention_mask=torch.ones_like(ids))
    torch.testing.assert_close(got, want)
    assert got.shape[1] <= ids.shape[1] + 9

    pipe = pipeline(model=model, tokenizer=tok, progress=False)
    gen = pipe.generate(["def fibonacci(n):"])[0]
    assert gen.tokens == want[0, ids.shape[1] :].tolist()[: len(gen.tokens)] and len(gen.tokens) <= 9
    plain = pipe.generate(["def fibonacci(n):"], repetition_penalty=1.0, no_repeat_ngram_size=0)[0]
    direct = model.sample(ids.numpy(), max_new_tokens=9)
    assert plain.tokens == direct[0, ids.shape[1] :].tolist()[: len(plain.tokens)]  # explicit args win


def test_cli_generate_reads_generation_config_and_greedy_overrides(text_ckpt, tmp_path, capsys):
    from aotlm.cli.app import main

    cfg = json.loads((text_ckpt / "generation_config.json").read_text())
    (text_ckpt / "generation_config.json").write_text(json.dumps(dict(cfg, do_sample=True, temperature=0.9)))
    try:
        argv = ["generate", "--model", str(text_ckpt), "--prompt", "import os", "--quiet"]
        argv += ["--n-positions", "64", "--cache-dir", str(tmp_path / "cache")]
        assert main(argv + ["--seed", "1"]) == 0
        rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        gen = rec["generation"]
        assert gen["do_sample"] is True and gen["temperature"] == 0.9 and gen["top_k"] == 50  # HF's default
        assert gen["repetition_penalty"] == 1.5 and gen["max_new_tokens"] == 9
        assert main(argv + ["--greedy", "--min-new-tokens", "3"]) == 0
        gen = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["generation"]
        assert gen["do_sample"] is False and "temperature" not in gen and gen["min_new_tokens"] == 3
    finally:
        (text_ckpt / "generation_config.json").write_text(json.dumps(cfg))
