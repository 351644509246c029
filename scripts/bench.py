"""Side-by-side decode/prefill speed: aotlm vs transformers PyTorch eager, same checkpoint.

    python scripts/bench.py                      # GPT-2-small (124M, random init), batch 1 and 8
    python scripts/bench.py --batch 1 --runs 5 --amp bf16
    python scripts/bench.py --tp 2               # 2 forced CPU devices (set before jax import)

Decode tokens/s = batch * (new - 1) / (generate time - prefill time), medians over runs.
The machine is shared and noisy: read the ratio column, not the absolute figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint dir (default: random GPT-2-small)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--amp", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    return ap.parse_args()


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_aotlm(path, b, args, ids):
    from engine import AutoModelForSampling

    t0 = time.perf_counter()
    model = AutoModelForSampling.from_pretrained(
        path,
        batch_size=b,
        n_positions=args.prompt + args.new,
        context_length_estimate=args.prompt,
        amp=args.amp,
        tp_degree=args.tp,
        compile_cache=False,
    )
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.compile()
    t_compile = time.perf_counter() - t0
    model.sample(ids, max_new_tokens=args.new)  # warm-up
    prefill = timed(lambda: model.forward(ids), args.runs)
    total = timed(lambda: model.sample(ids, max_new_tokens=args.new), args.runs)
    out = model.sample(ids, max_new_tokens=args.new)
    return prefill, total, {"load s": t_load, "compile s": t_compile}, out


def bench_hf(path, b, args, ids):
    import torch
    import transformers

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.amp]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    x = torch.tensor(ids)
    mask = torch.ones_like(x)
    kw = dict(
        max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, attention_mask=mask, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(x, **kw)  # warm-up
        prefill = timed(lambda: model(x, attention_mask=mask), args.runs)
        total = timed(lambda: model.generate(x, **kw), args.runs)
        out = model.generate(x, **kw).numpy()
    return prefill, total, out


def main() -> int:
    args = parse()
    if args.tp > 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.tp}"
        )
    import numpy as np

    from engine.tiny import make_tiny_gpt2

    path = args.checkpoint or make_tiny_gpt2(
        "/tmp/aotlm-bench/gpt2-small", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12
    )
    print(
        f"checkpoint {path}; prompt {args.prompt}, {args.new} new tokens, {args.amp}, tp={args.tp}, "
        f"median of {args.runs}",
        flush=True,
    )
    rows = []
    rng = np.random.default_rng(0)
    for b in args.batch:
        ids = rng.integers(0, 50000, (b, args.prompt))
        a_pre, a_tot, extra, a_out = bench_aotlm(path, b, args, ids)
        a_dec = b * (args.new - 1) / (a_tot - a_pre)
        row = {"batch": b, "aotlm prefill ms": a_pre * 1e3, "aotlm decode tok/s": a_dec, **extra}
        if not args.no_hf:
            h_pre, h_tot, h_out = bench_hf(path, b, args, ids)
            h_dec = b * (args.new - 1) / (h_tot - h_pre)
            same = float((a_out == h_out).all(axis=1).mean()) if a_out.shape == h_out.shape else 0.0
            row |= {
                "hf prefill ms": h_pre * 1e3,
                "hf decode tok/s": h_dec,
                "decode ratio": a_dec / h_dec,
                "prefill ratio": h_pre / a_pre,
                "rows equal": same,
            }
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
