"""Subprocess worker for tests/families/test_conformance_tp.py: every family at tp=1 and tp=2 on 2 forced
CPU devices.

    python tests/support/tpf_worker.py <job.json>   # job: {"ckpt_dir", "out", "cases": [name, ...]}

For each case it builds a tiny random-init transformers checkpoint (biases and norm weights
random too, so their sharded layout is exercised), loads it at tp=1 and tp=2 (default GQA
strategy: ``shard-over-heads``, or ``replicated-heads`` when tp does not divide the kv heads,
e.g. multi-query) and records greedy tokens, last-position logits and what got sharded. A
failing case records its traceback instead of stopping the run; the test makes the assertions.

Importable without side effects (the test reads ``CASES``): ``XLA_FLAGS`` is set, and jax
imported, only when run as a script, since the device count is fixed at jax import.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

TP = 2
if __name__ == "__main__":  # before anything imports jax (test_conformance_gpt_style imports the engine)
    test_flags = os.environ.get("AOTLM_TEST_XLA_FLAGS", "")  # tests/conftest.py
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={TP} {test_flags}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers as T  # noqa: E402

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "families")]

from conformance import gemma3_config  # noqa: E402
from test_conformance_gpt_style import FULL, PREFILL  # noqa: E402

V = 101  # not a multiple of tp: exercises vocab padding
SCALE = 2.0  # peaked logits: fewer near-ties, so a token flip means a real difference
N_POS, CTX, BATCH, NEW = 64, 16, 2, 12
LENGTHS = (5, 11)  # left-padded prompt batch
TINY = dict(vocab_size=V, num_hidden_layers=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)

# case name -> (model_type, config builder). test_conformance_gpt_style's builders are reused; the
# llama-like families' configs mirror tests/families/test_conformance_llama_style.py (whose configs live
# inside the test functions).
CASES: dict[str, tuple[str, Callable[[], T.PretrainedConfig]]] = {
    "gpt2": ("gpt2", lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=128)),
    "llama": (
        "llama",
        lambda: T.LlamaConfig(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, **TINY
        ),
    ),
    # MQA (1 kv head -> replicated-heads), head_dim 48, window 10 < the prompt
    "mistral": (
        "mistral",
        lambda: T.MistralConfig(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=48,
            intermediate_size=96,
            sliding_window=10,
            tie_word_embeddings=False,
            **TINY,
        ),
    ),
    # 4 experts, top-2; intermediate 46 is not a multiple of tp (padded expert MLPs)
    "mixtral": (
        "mixtral",
        lambda: T.MixtralConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=46,
            num_local_experts=4,
            num_experts_per_tok=2,
            **TINY,
        ),
    ),
    "qwen2": (
        "qwen2",
        lambda: T.Qwen2Config(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=96,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=9,
            max_window_layers=1,
            **TINY,
        ),
    ),
    "qwen3": (
        "qwen3",
        lambda: T.Qwen3Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=80,
            intermediate_size=96,
            tie_word_embeddings=False,
            **TINY,
        ),
    ),
    # MQA (gemma-2b shape) -> replicated-heads
    "gemma": (
        "gemma",
        lambda: T.GemmaConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=48,
            intermediate_size=96,
            pad_token_id=0,
            **TINY,
        ),
    ),
    "gemma2": (
        "gemma2",
        lambda: T.Gemma2Config(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=96,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=4.0,
            sliding_window=10,
            pad_token_id=0,
            **TINY,
        ),
    ),
    # q/k norms; layer 0 local (window 4, rope base 100), layer 1 global (base 10000, linear x8)
    "gemma3_text": (
        "gemma3_text",
        lambda: gemma3_config(head_dim=32, final_logit_softcapping=4.0, sliding_window=4, **TINY),
    ),
    "phi3": (
        "phi3",
        lambda: T.Phi3Config(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=96,
            sliding_window=12,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            pad_token_id=0,
            **TINY,
        ),
    ),
    "gptj": ("gptj", FULL["gptj"]),
    "gpt_neox": ("gpt_neox", FULL["gpt_neox_parallel"]),  # 2 heads of 80 dims: one head per device
    "opt": ("opt", FULL["opt_350m_like"]),  # post-norm, project_in/out
    "bloom": ("bloom", FULL["bloom"]),  # ALiBi, 6 heads: 3 slopes per device
    "mpt": ("mpt", FULL["mpt"]),  # ALiBi, 6 heads, clip_qkv
    "falcon": ("falcon", PREFILL["falcon_7b_like"]),  # multi-query -> replicated-heads
    "falcon-alibi": ("falcon", PREFILL["falcon_rw_like"]),  # falcon-rw: ALiBi, MHA
    "gpt_bigcode": ("gpt_bigcode", FULL["gpt_bigcode_mqa"]),  # santacoder MQA -> replicated-heads
}


def prompts():
    import numpy as np

    rng = np.random.default_rng(0)
    n = max(LENGTHS)
    ids = np.zeros((BATCH, n), np.int64)
    mask = np.zeros((BATCH, n), np.int64)
    for i, length in enumerate(LENGTHS):
        ids[i, n - length :] = rng.integers(3, V, length)
        mask[i, n - length :] = 1
    return ids, mask


def run_tp(path: Path, tp: int) -> dict:
    import jax
    import numpy as np

    from aotlm import AutoModelForSampling
    from aotlm.core import sharding

    t0 = time.perf_counter()
    m = AutoModelForSampling.from_pretrained(
        path,
        batch_size=BATCH,
        n_positions=N_POS,
        context_length_estimate=CTX,
        tp_degree=tp,
        compile_cache=False,
    )
    ids, mask = prompts()
    logits = m.forward(ids, attention_mask=mask)
    tokens = m.sample(ids, max_new_tokens=NEW, attention_mask=mask)
    leaves = jax.tree.leaves(m.params)
    sharded = [x for x in leaves if sharding.TP in tuple(x.sharding.spec)]
    return {
        "gqa": m.gqa,
        "n_heads": m.cfg.n_heads,
        "n_kv_heads": m.cfg.n_kv_heads,
        "kv_heads_per_device": m.cache["k"][0].addressable_shards[0].data.shape[1],
        "n_devices": len(m.mesh.devices.flat),
        "n_sharded_leaves": len(sharded),
        "tokens": np.asarray(tokens).tolist(),
        "logits": np.asarray(logits, np.float64).tolist(),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def run_case(name: str, ckpt_dir: Path) -> dict:
    import numpy as np
    from test_conformance_gpt_style import make_checkpoint  # random biases / norm weights, not HF's 0 / 1

    model_type, build = CASES[name]
    res: dict = {"name": name, "model_type": model_type}
    try:
        path = make_checkpoint(ckpt_dir / f"tpf_{name}", build(), scale=SCALE)
        res["tp1"] = run_tp(path, 1)
        res["tp2"] = run_tp(path, TP)
        a, b = np.array(res["tp1"]["logits"]), np.array(res["tp2"]["logits"])
        res["max_logit_diff"] = float(np.abs(a - b).max())
        res["tokens_equal"] = res["tp1"]["tokens"] == res["tp2"]["tokens"]
    except Exception:  # recorded, so the other families still run and the test shows the traceback
        res["error"] = traceback.format_exc()
    return res


def main(job_file: str) -> None:
    import torch

    torch.set_num_threads(1)
    job = json.loads(Path(job_file).read_text())
    out = {"cases": {}}
    for name in job["cases"]:
        r = run_case(name, Path(job["ckpt_dir"]))
        out["cases"][name] = r
        secs = sum(r[k]["seconds"] for k in ("tp1", "tp2") if k in r)
        print(f"{name}: {'ERROR' if 'error' in r else r['max_logit_diff']} {secs:.1f}s", flush=True)
    Path(job["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
