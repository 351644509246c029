"""Long prompts on a tiny Llama: prefill time, decode speed and peak memory per window size.

    python scripts/bench_long_context.py                         # windows 4k / 16k / 32k
    python scripts/bench_long_context.py --windows 4096 --new 16 --no-hf
    python scripts/bench_long_context.py --windows 32768 --ctx 4096      # chunks of 4096

For each window ``W`` (``n_positions=W``; default buckets: context buckets up to ``W/2``, so a
prompt of ~61% of the window is encoded in two chunks, the second a ``(W/2, W)`` graph; ``--ctx``
sets ``context_length_estimate``) a fresh subprocess loads the checkpoint, runs the prompt once
("first run s": load, compiles, one generation), then times ``forward`` (the prefill alone) and
``sample`` (prefill + ``--new`` greedy tokens, "generate s"), ``--runs`` times each: decode
tok/s = (new - 1) / (shortest sample time - shortest prefill time). Peak RSS is the child's
``VmHWM`` (the whole process: Python, jax, weights, KV cache, compiles). Another subprocess runs
transformers (sdpa attention) on the same prompt: "HF generate s" times its greedy ``generate``,
"max |dlogit|" compares the last prompt position's logits, "tokens = HF" the tokens. KV bytes per
token = 2 (k and v) x layers x kv heads x head dim x dtype bytes, per batch row (plus the cache's
int32 position table, 4 bytes). "prefill temp MB" is the largest ``memory_analysis()`` temp
size of the prefill executables (XLA's scratch for one call: activations and score blocks).
The machine is shared: read one run's rows together.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from aotlm.tiny import cpu_model

# a tiny Llama (GQA: 4 query heads over 2 kv heads) with room for a 32k window
LLAMA = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    num_hidden_layers=2,
    vocab_size=256,
    max_position_embeddings=32768,
)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--fraction", type=float, default=0.61, help="prompt length / window (rounded to 100)")
    ap.add_argument("--new", type=int, default=256, help="greedy tokens generated")
    ap.add_argument("--ctx", type=int, nargs="+", default=None, help="context_length_estimate")
    ap.add_argument("--runs", type=int, default=3, help="timed prefills and generations (the shortest)")
    ap.add_argument("--checkpoint", default="/tmp/aotlm-bench/llama-long", help="made here if missing")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--child", choices=["aotlm", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--window", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, help=argparse.SUPPRESS)
    return ap.parse_args()


def make_checkpoint(path: Path, seed: int = 0, scale: float = 2.0) -> Path:
    """A random-init ``LlamaForCausalLM`` (weight matrices times ``scale``: peaked logits)."""
    import torch  # local: only the parent (or a test) writes the checkpoint
    import transformers  # local: as above

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    model.save_pretrained(str(path))
    return path


def prompt_ids(n: int, vocab: int = LLAMA["vocab_size"], seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, n))


def peak_rss_gb() -> float:
    """This process's peak resident set (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def run_aotlm(path: str, window: int, prompt: int, new: int, runs: int, ctx: list[int] | None) -> dict:
    """Child: compile on a first run, then time the prefill and the whole greedy generation."""
    from aotlm import AutoModelForSampling  # local: the child measures its own imports too

    ids = prompt_ids(prompt)
    t0 = time.perf_counter()
    model = AutoModelForSampling.from_pretrained(
        path, n_positions=window, context_length_estimate=ctx, compile_cache=False
    )
    model.sample(ids, max_new_tokens=new)
    first = time.perf_counter() - t0
    logits = model.forward(ids)[0]
    prefill, total = [], []
    for _ in range(runs):  # the shortest of each: the machine is shared
        t0 = time.perf_counter()
        model.forward(ids)
        prefill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = model.sample(ids, max_new_tokens=new)
        total.append(time.perf_counter() - t0)
    temps = [
        exe.memory_analysis().temp_size_in_bytes for k, exe in model._executables.items() if k[0] == "prefill"
    ]
    c = model.cfg
    return {
        "tokens": out[0, prompt:].tolist(),
        "logits": logits.tolist(),
        "first_s": first,
        "prefill_s": min(prefill),
        "generate_s": min(total),
        "decode_tps": (new - 1) / max(min(total) - min(prefill), 1e-9),
        "rss_gb": peak_rss_gb(),
        "kv_bytes_per_token": 2 * c.n_layers * c.n_kv_heads * c.head_dim * np.dtype(np.float32).itemsize,
        "prefill_temp_mb": max(temps) / 1e6,
        "graphs": [list(map(str, k)) for k in model._executables],
    }


def run_hf(path: str, prompt: int, new: int) -> dict:
    """Child: transformers' greedy generate (sdpa attention, fp32) on the same prompt."""
    import torch  # local: the transformers reference runs only in its own child
    import transformers  # local: as above

    ids = torch.tensor(prompt_ids(prompt))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        logits = model(ids, logits_to_keep=1).logits[0, -1].float().numpy()
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,  # aotlm's sample() stops only at eos ids it is given
            pad_token_id=0,
        )
    seconds, tokens = time.perf_counter() - t0, out[0, prompt:].tolist()
    return {"tokens": tokens, "logits": logits.tolist(), "seconds": seconds, "rss_gb": peak_rss_gb()}


def child(engine: str, args: argparse.Namespace, window: int, prompt: int) -> dict:
    """Run ``engine`` in a fresh process; its last stdout line is the JSON result."""
    cmd = [sys.executable, __file__, "--child", engine, "--window", str(window), "--prompt", str(prompt)]
    cmd += ["--new", str(args.new), "--runs", str(args.runs), "--checkpoint", args.checkpoint]
    cmd += ["--ctx", *map(str, args.ctx)] if args.ctx else []
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def table_row(window: int, prompt: int, a: dict, h: dict) -> list[str]:
    """One table row from the aotlm child's result ``a`` and transformers' ``h`` (may be empty)."""
    if "error" in a:
        return [str(window), str(prompt), f"aotlm failed: {a['error']}"]
    row = [
        str(window),
        str(prompt),
        f"{a['prefill_s']:.2f}",
        f"{a['generate_s']:.2f}",
        f"{a['decode_tps']:.0f}",
    ]
    row += [f"{a['rss_gb']:.2f}"]
    row += [str(a["kv_bytes_per_token"]), f"{a['prefill_temp_mb']:.1f}", f"{a['first_s']:.1f}"]
    if "tokens" not in h:
        return row + ["-", "-", "-", h.get("error", "-")]
    diff = np.abs(np.asarray(a["logits"]) - np.asarray(h["logits"])).max()
    same = str(a["tokens"] == h["tokens"]).lower()
    return row + [f"{h['seconds']:.2f}", f"{h['rss_gb']:.2f}", f"{diff:.1e}", same]


def main() -> int:
    args = parse()
    if args.child == "aotlm":
        print(json.dumps(run_aotlm(args.checkpoint, args.window, args.prompt, args.new, args.runs, args.ctx)))
        return 0
    if args.child == "hf":
        print(json.dumps(run_hf(args.checkpoint, args.prompt, args.new)))
        return 0
    print(f"CPU: {cpu_model()}")
    make_checkpoint(Path(args.checkpoint))
    print(f"model: tiny Llama {LLAMA} (random init), fp32, batch 1, {args.new} new greedy tokens")
    print(f"context buckets: {args.ctx or 'default (half of each token bucket)'}", flush=True)
    head = ["window", "prompt", "prefill s", "generate s", "decode tok/s", "peak RSS GB", "KV B/token"]
    head += ["prefill temp MB", "first run s", "HF generate s", "HF RSS GB", "max |dlogit|", "tokens = HF"]
    rows = []
    for w in args.windows:
        prompt = int(round(w * args.fraction / 100) * 100)
        a = child("aotlm", args, w, prompt)
        h = {} if args.no_hf else child("hf", args, w, prompt)
        rows.append(table_row(w, prompt, a, h))
        print(f"  done: window {w}: {rows[-1]}", flush=True)
    widths = [max(len(r[i]) if i < len(r) else 0 for r in [head, *rows]) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(n) for h, n in zip(head, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (n + 2) for n in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(n) for c, n in zip(r, widths, strict=False)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
