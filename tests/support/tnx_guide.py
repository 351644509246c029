"""The transformers-neuronx developer guide's code examples, run on aotlm (a subprocess worker).

Each ``example_*`` is one example of the guide with ``transformers_neuronx`` renamed to ``aotlm``
and hub names replaced by tiny local checkpoints (``HUB``); calls, arguments and control flow are
the guide's. Prompts and class bodies are our own. Each returns what the example shows, for
``test_tnx_guide.py`` to assert. Run: ``python tnx_guide.py WORKDIR OUT.json`` (8 forced CPU
devices: some examples use ``tp_degree=8``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count=8 {os.environ.get('AOTLM_TEST_XLA_FLAGS', '')}".strip()
)
sys.path.insert(0, str(Path(__file__).parent))

WORK = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/tnx-guide")
HUB: dict[str, str] = {}  # hub name -> local checkpoint dir (filled by make_checkpoints)
SHORT = "The quick brown fox wants to be a language model,"
LONG = " ".join(["Models write text one token at a time, and each new token reads every earlier one."] * 4)
CHAT = "[INST] Which sauce goes with fries? [/INST]"


def make_checkpoints() -> None:
    """Tiny random-init checkpoints + one BPE tokenizer (trained on the prompts: few tokens each)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([SHORT, LONG, CHAT] * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="</s>", pad_token="</s>")
    n = len(fast)
    ids = dict(eos_token_id=0, bos_token_id=0, pad_token_id=0)
    llama = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2)
    configs = {
        "gpt2": transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, n_positions=256, vocab_size=n, **ids),
        "bigscience/bloom-560m": transformers.BloomConfig(
            hidden_size=64, n_layer=1, n_head=4, vocab_size=n, **ids
        ),
        "openlm-research/open_llama_3b_v2": transformers.LlamaConfig(
            num_hidden_layers=1, max_position_embeddings=256, vocab_size=n, **llama, **ids
        ),
        "openlm-research/open_llama_3b": transformers.LlamaConfig(
            num_hidden_layers=1, max_position_embeddings=256, vocab_size=n, **llama, **ids
        ),
        "openlm-research/open_llama_13b": transformers.LlamaConfig(
            num_hidden_layers=2, max_position_embeddings=256, vocab_size=n, **llama, **ids
        ),
        "mistralai/Mistral-7B-Instruct-v0.2": transformers.MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=1,
            max_position_embeddings=256,
            sliding_window=64,
            vocab_size=n,
            **ids,
        ),
    }
    for i, (name, cfg) in enumerate(configs.items()):
        path = WORK / name.replace("/", "--")
        HUB[name] = str(path)
        if (path / "config.json").is_file():
            continue
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():  # peaked logits: greedy tokens without near-ties
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(4.0)
        model.save_pretrained(str(path))
        fast.save_pretrained(str(path))


# ---------------------------------------------------------------------------------- the examples
def example_01_from_pretrained():
    from aotlm import NeuronAutoModelForCausalLM

    model = NeuronAutoModelForCausalLM.from_pretrained(
        HUB["gpt2"], batch_size=1, n_positions=128, tp_degree=2, amp="f16", context_length_estimate=64
    )
    model.to_neuron()
    return {"graphs": len(model.graph_keys()), "tp": model.tp_degree, "amp": model.amp}


def example_02_auto_model():
    from aotlm import NeuronAutoModelForCausalLM

    bloom = NeuronAutoModelForCausalLM.from_pretrained(HUB["bigscience/bloom-560m"])
    bloom.to_neuron()
    llama = NeuronAutoModelForCausalLM.from_pretrained(HUB["openlm-research/open_llama_3b_v2"])
    llama.to_neuron()

    from aotlm import BloomForSampling

    model = BloomForSampling.from_pretrained(HUB["bigscience/bloom-560m"])
    model.to_neuron()

    from aotlm import LlamaForSampling

    llama2 = LlamaForSampling.from_pretrained(HUB["openlm-research/open_llama_3b_v2"])
    llama2.to_neuron()
    return {
        "classes": [type(m).__name__ for m in (bloom, llama, model, llama2)],
        "n_positions": [bloom.n_positions, llama.n_positions],
        "compiled_second": sum(not r.get("hit", False) for r in model.compile_report + llama2.compile_report),
    }


def example_03_hf_generate():
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from aotlm import GPT2ForSamplingWithContextBroadcasting, HuggingFaceGenerationModelAdapter

    model = GPT2ForSamplingWithContextBroadcasting.from_pretrained(HUB["gpt2"])
    model.to_neuron()
    config = AutoConfig.from_pretrained(HUB["gpt2"])
    model = HuggingFaceGenerationModelAdapter(config, model)
    tokenizer = AutoTokenizer.from_pretrained(HUB["gpt2"])
    tokenizer.pad_token_id = tokenizer.eos_token_id
    tokenizer.padding_side = "left"
    encoded_input = tokenizer(SHORT, return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.reset_generation()
        generated_sequence = model.generate(
            input_ids=encoded_input.input_ids,
            attention_mask=encoded_input.attention_mask,
            do_sample=True,
            max_length=256,
            temperature=0.7,
        )
    texts = [tokenizer.decode(tok) for tok in generated_sequence]
    return {
        "shape": list(generated_sequence.shape),
        "prompt_len": encoded_input.input_ids.shape[1],
        "n": len(texts),
    }


def example_04_int8():
    import torch
    from transformers import AutoTokenizer

    from aotlm import GPT2ForSamplingWithContextBroadcasting, NeuronConfig, QuantizationConfig

    neuron_config = NeuronConfig(quant=QuantizationConfig(quant_dtype="s8", dequant_dtype="bf16"))
    model = GPT2ForSamplingWithContextBroadcasting.from_pretrained(
        HUB["gpt2"], amp="bf16", neuron_config=neuron_config
    )
    model.to_neuron()
    tokenizer = AutoTokenizer.from_pretrained(HUB["gpt2"])
    encoded_input = tokenizer(SHORT, return_tensors="pt")
    with torch.inference_mode():
        generated_sequence = model.sample(encoded_input.input_ids, sequence_length=256, start_ids=None)
    return {"shape": list(generated_sequence.shape), "weights": str(model.params["layers"][0]["w_up"].dtype)}


def example_05_context_length_estimate():
    import torch
    from transformers import AutoTokenizer

    from aotlm import GPT2ForSamplingWithContextBroadcasting

    model = GPT2ForSamplingWithContextBroadcasting.from_pretrained(HUB["gpt2"], context_length_estimate=256)
    model.to_neuron()
    tokenizer = AutoTokenizer.from_pretrained(HUB["gpt2"])
    encoded_input = tokenizer(LONG, return_tensors="pt")
    with torch.inference_mode():
        generated_sequence = model.sample(encoded_input.input_ids, sequence_length=256)
    return {"shape": list(generated_sequence.shape), "ctx": list(model.ctx_buckets)}


def example_06_prompt_batch_size():
    import torch
    from transformers import AutoTokenizer

    from aotlm import GPT2ForSamplingWithContextBroadcasting

    model = GPT2ForSamplingWithContextBroadcasting.from_pretrained(
        HUB["gpt2"], prompt_batch_size=1, batch_size=5, context_length_estimate=256
    )
    model.to_neuron()
    tokenizer = AutoTokenizer.from_pretrained(HUB["gpt2"])
    encoded_input = tokenizer(LONG, return_tensors="pt")
    with torch.inference_mode():
        generated_sequence = model.sample(encoded_input.input_ids, sequence_length=256)
    outputs = [tokenizer.decode(output) for output in generated_sequence]
    sampled = model.sample(encoded_input.input_ids, sequence_length=96, do_sample=True, seed=3)
    return {"n_outputs": len(outputs), "distinct_sampled": len({tuple(r.tolist()) for r in sampled})}


def example_07_save_load():
    import torch
    from transformers import AutoTokenizer

    from aotlm import GPT2ForSamplingWithContextBroadcasting

    artifacts = str(WORK / "gpt2-compiled-artifacts")
    model = GPT2ForSamplingWithContextBroadcasting.from_pretrained(HUB["gpt2"])
    model.to_neuron()
    model.save(artifacts)
    model = GPT2ForSamplingWithContextBroadcasting.from_pretrained(HUB["gpt2"])
    model.load(artifacts)
    model.to_neuron()
    tokenizer = AutoTokenizer.from_pretrained(HUB["gpt2"])
    encoded_input = tokenizer(SHORT, return_tensors="pt")
    with torch.inference_mode():
        generated_sequence = model.sample(encoded_input.input_ids, sequence_length=256, start_ids=None)
    return {"compiled_after_load": len(model.compile_report), "shape": list(generated_sequence.shape)}


def example_08_gqa():
    import torch
    from transformers import AutoTokenizer

    from aotlm import GQA, MistralForSampling, NeuronConfig

    neuron_config = NeuronConfig(group_query_attention=GQA.SHARD_OVER_HEADS)
    model_neuron = MistralForSampling.from_pretrained(
        HUB["mistralai/Mistral-7B-Instruct-v0.2"], amp="bf16", neuron_config=neuron_config
    )
    model_neuron.to_neuron()
    tokenizer = AutoTokenizer.from_pretrained(HUB["mistralai/Mistral-7B-Instruct-v0.2"])
    encoded_input = tokenizer(CHAT, return_tensors="pt")
    with torch.inference_mode():
        generated_sequence = model_neuron.sample(encoded_input.input_ids, sequence_length=256, start_ids=None)
    ngram = model_neuron.sample(encoded_input.input_ids, sequence_length=64, no_repeat_ngram_size=3)
    return {"shape": list(generated_sequence.shape), "gqa": model_neuron.gqa, "ngram": ngram[0].tolist()}


def example_09_top_k():
    import torch
    from transformers import AutoTokenizer

    from aotlm import LlamaForSampling
    from aotlm.config import GenerationConfig, NeuronConfig

    neuron_config = NeuronConfig(
        on_device_generation=GenerationConfig(max_length=128, top_k=10, do_sample=True)
    )
    model_neuron = LlamaForSampling.from_pretrained(
        HUB["openlm-research/open_llama_3b"],
        batch_size=1,
        tp_degree=8,
        n_positions=128,
        neuron_config=neuron_config,
    )
    model_neuron.to_neuron()
    tokenizer = AutoTokenizer.from_pretrained(HUB["openlm-research/open_llama_3b"])
    encoded_input = tokenizer(SHORT, return_tensors="pt")
    with torch.inference_mode():
        generated_sequence = model_neuron.sample(encoded_input.input_ids, sequence_length=128, top_k=10)
        runs = [
            model_neuron.sample(encoded_input.input_ids, sequence_length=40)[0].tolist() for _ in range(3)
        ]
    return {"shape": list(generated_sequence.shape), "distinct_runs": len({tuple(r) for r in runs})}


class LatencyStreamer:
    """Records the time between ``put`` calls (our own streamer in the guide's shape)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self):
        self.token_latencies = []
        self.shapes = []
        self.iter = 0
        self.now = time.time()

    def put(self, tokens):
        now = time.time()
        self.token_latencies.append(now - self.now)
        self.shapes.append(list(tokens.shape))
        self.now = now
        self.iter += 1

    def end(self):
        self.ended = True


def example_10_streamer():
    import torch
    from transformers import AutoTokenizer

    from aotlm import MistralForSampling

    model_neuron = MistralForSampling.from_pretrained(HUB["mistralai/Mistral-7B-Instruct-v0.2"], amp="bf16")
    model_neuron.to_neuron()
    tokenizer = AutoTokenizer.from_pretrained(HUB["mistralai/Mistral-7B-Instruct-v0.2"])
    encoded_input = tokenizer(CHAT, return_tensors="pt")
    streamer = LatencyStreamer()
    with torch.inference_mode():
        generated_sequence = model_neuron.sample(
            encoded_input.input_ids, sequence_length=256, start_ids=None, streamer=streamer
        )
    return {
        "puts": streamer.iter,
        "prompt_len": encoded_input.input_ids.shape[1],
        "total_len": generated_sequence.shape[1],
        "shapes": streamer.shapes[:3],
        "ended": getattr(streamer, "ended", False),
    }


def example_11_stopping_criteria():
    import torch
    from transformers import AutoTokenizer

    from aotlm import MistralForSampling
    from aotlm.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    class TimeLimit(StoppingCriteria):
        """Stops once ``max_time`` seconds have passed since construction."""

        def __init__(self, max_time: float):
            self.max_time = max_time
            self.start = time.time()

        def __call__(self, input_ids, scores, **kwargs) -> bool:
            return time.time() - self.start > self.max_time

    model_neuron = MistralForSampling.from_pretrained(HUB["mistralai/Mistral-7B-Instruct-v0.2"], amp="bf16")
    model_neuron.to_neuron()
    tokenizer = AutoTokenizer.from_pretrained(HUB["mistralai/Mistral-7B-Instruct-v0.2"])
    encoded_input = tokenizer(CHAT, return_tensors="pt")

    class SlowStreamer(LatencyStreamer):
        def put(self, tokens):  # 20 ms per token, so 0.5 s is a few dozen tokens
            super().put(tokens)
            time.sleep(0.02)

    stopping_criteria_list = StoppingCriteriaList([TimeLimit(0.5)])
    streamer = SlowStreamer()
    t0 = time.time()
    with torch.inference_mode():
        out = model_neuron.sample(
            input_ids=encoded_input.input_ids,
            sequence_length=256,
            stopping_criteria_list=stopping_criteria_list,
            streamer=streamer,
        )
    return {"seconds": time.time() - t0, "total_len": out.shape[1], "n_positions": model_neuron.n_positions}


def example_12_speculative():
    from transformers import LlamaTokenizer

    from aotlm import LlamaForSampling
    from aotlm.speculation import SpeculativeGenerator

    draft_neuron_model = LlamaForSampling.from_pretrained(
        HUB["openlm-research/open_llama_3b"], n_positions=256, batch_size=1, tp_degree=8, amp="f32"
    )
    draft_neuron_model.to_neuron()
    target_neuron_model = LlamaForSampling.from_pretrained(
        HUB["openlm-research/open_llama_13b"], n_positions=256, batch_size=1, tp_degree=8, amp="f32"
    )
    target_neuron_model.enable_speculative_decoder(4)
    target_neuron_model.to_neuron()
    tokenizer = LlamaTokenizer.from_pretrained(HUB["openlm-research/open_llama_13b"])
    input_ids = tokenizer(SHORT, return_tensors="pt").input_ids
    spec_gen = SpeculativeGenerator(draft_neuron_model, target_neuron_model, 4)
    response = spec_gen.sample(input_ids=input_ids, sequence_length=30)
    greedy = target_neuron_model.sample(input_ids, sequence_length=30)
    return {"equal": response.tolist() == greedy.tolist(), "len": response.shape[1], "stats": spec_gen.stats}


def example_13_fuse_qkv_and_buckets():
    from aotlm import NeuronAutoModelForCausalLM, NeuronConfig

    neuron_config = NeuronConfig(fuse_qkv=True)
    context_length_estimate = [64, 96, 128]
    n_positions = [128, 256]
    model = NeuronAutoModelForCausalLM.from_pretrained(
        HUB["gpt2"],
        batch_size=1,
        n_positions=n_positions,
        tp_degree=2,
        amp="f16",
        context_length_estimate=context_length_estimate,
        neuron_config=neuron_config,
    )
    return {
        "ctx": list(model.ctx_buckets),
        "tg": list(model.tg_buckets),
        "fused": "wqkv" in model.params["layers"][0],
    }


def main() -> int:
    import numpy as np

    out_file = Path(sys.argv[2])
    os.environ.setdefault("AOTLM_CACHE_DIR", str(WORK / "cache"))
    make_checkpoints()
    results = {}
    for name, fn in sorted((k, v) for k, v in globals().items() if k.startswith("example_")):
        t0 = time.time()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                value = fn()
            results[name] = {"ok": True, "value": value}
        except Exception as e:  # noqa: BLE001 - reported per example
            results[name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(),
            }
        results[name]["seconds"] = round(time.time() - t0, 2)
        print(name, results[name]["seconds"], results[name]["ok"], file=sys.stderr, flush=True)
    out_file.write_text(
        json.dumps(results, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
