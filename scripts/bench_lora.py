"""Multi-LoRA decode throughput: per-row adapters against the base model, one run, one table.

    python scripts/bench_lora.py                       # SmolLM2-135M (the bundled GGUF), 16 rows, 8 adapters
    python scripts/bench_lora.py --checkpoint DIR --rows 16 --adapters 8 --rank 16 --new 64

Writes ``--adapters`` random rank-``--rank`` PEFT adapters (every projection: q/k/v/o, gate/up/down;
``adapter_config.json`` + ``adapter_model.safetensors``, as PEFT saves them) for the checkpoint, then
times greedy decode (``sample()``, the same forward the serving slots run) on:

* the base model (no adapter tables) with ``--rows`` rows and with one row;
* the same checkpoint with ``--adapters`` slots: every row the base model (the tables' cost when
  no row uses them), the rows spread over all adapters (row ``i``: adapter ``i % adapters``), and
  one row with one adapter.

Decode tokens/s = rows x (new - 1) / (total - time to first token), median of ``--runs`` with the
cases taking turns; ratios against the base model of the same row count.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from aotlm import AutoModelForSampling
from aotlm.models.checkpoint import load_hf_config
from aotlm.models.checkpoint.resolve import resolve
from aotlm.tiny import cpu_model

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def write_adapter(out: Path, hf, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter on every projection of a Llama-style checkpoint."""
    d, f = hf.hidden_size, hf.intermediate_size
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    dh = getattr(hf, "head_dim", None) or d // heads
    q, k = heads * dh, kv * dh
    dims = {"q_proj": (d, q), "k_proj": (d, k), "v_proj": (d, k), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(hf.num_hidden_layers):
        for m, (n_in, n_out) in dims.items():
            stem = f"base_model.model.model.layers.{i}.{MODULES[m]}.{m}"
            tensors[f"{stem}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(
                np.float32
            )
            tensors[f"{stem}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(MODULES),
        "bias": "none",
    }
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def timed(model, rows: int, prompt: int, new: int, adapter=None):
    """A callable running one greedy call and returning its decode tokens/s (warmed up once here)."""
    ids = np.random.default_rng(0).integers(10, 1000, (rows, prompt))
    names = None if adapter is None else [adapter(i) for i in range(rows)]
    kw = dict(max_new_tokens=new, min_new_tokens=new, return_dict=True, adapter=names)
    model.sample(ids, **kw)

    def once() -> float:
        t0 = time.perf_counter()
        out = model.sample(ids, **kw)
        return rows * (new - 1) / (time.perf_counter() - t0 - out.time_to_first_token)

    return once


def interleaved(cases: dict, runs: int) -> dict:
    """Median tokens/s of each case, the cases taking turns run after run (drift hits all alike)."""
    rates: dict = {k: [] for k in cases}
    for _ in range(runs):
        for k, once in cases.items():
            rates[k].append(once())
    return {k: statistics.median(v) for k, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--quant", default=None, help="weight storage of both models (default: the checkpoint's)")
    args = ap.parse_args()
    path = str(resolve(args.checkpoint))
    hf = load_hf_config(path)
    tmp = Path(tempfile.mkdtemp(prefix="aotlm-lora-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # the adapters written for the run
    adapters = {f"a{i}": str(write_adapter(tmp / f"a{i}", hf, args.rank, i)) for i in range(args.adapters)}
    n_pos = 1 << (args.prompt + args.new).bit_length()
    shapes = dict(n_positions=n_pos, context_length_estimate=args.prompt, quant=args.quant)
    print(cpu_model())
    print(f"{args.checkpoint}: {args.rows} rows, prompt {args.prompt}, {args.new} new tokens, "
          f"{args.adapters} adapters of rank {args.rank} on q/k/v/o/gate/up/down")  # fmt: skip
    rows = []
    for batch in (args.rows, 1):
        base = AutoModelForSampling.from_pretrained(path, batch_size=batch, **shapes)
        lora = AutoModelForSampling.from_pretrained(
            path, batch_size=batch, lora_adapters=adapters, max_lora_rank=args.rank, **shapes
        )
        spread = (lambda i: f"a{i % args.adapters}") if batch > 1 else (lambda i: "a0")
        label = f"rows over {args.adapters} adapters" if batch > 1 else "one adapter"
        cases = {
            "base": timed(base, batch, args.prompt, args.new),
            "adapter slots, every row base": timed(lora, batch, args.prompt, args.new),
            label: timed(lora, batch, args.prompt, args.new, spread),
        }
        tps = interleaved(cases, args.runs)
        unit = f"{batch} row{'s' * (batch > 1)}"
        rows += [(f"{k}, {unit}", v, v / tps["base"]) for k, v in tps.items()]
        del base, lora
    print(f"| {'case':44s} | decode tok/s | vs base |")
    print(f"|{'-' * 46}|-------------:|--------:|")
    for label, tps, ratio in rows:
        print(f"| {label:44s} | {tps:12.1f} | {ratio:6.2f}x |")


if __name__ == "__main__":
    main()
