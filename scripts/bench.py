"""Side-by-side decode/prefill speed: aotlm vs transformers PyTorch eager, same checkpoint.

    python scripts/bench.py                      # GPT-2-small (124M, random init), batch 1 and 8
    python scripts/bench.py --batch 1 --runs 5 --amp bf16
    python scripts/bench.py --tp 2               # 2 forced CPU devices (set before jax import)

Decode tokens/s = batch * (new - 1) / (generate time - prefill time), medians over runs; aotlm
and transformers calls are interleaved round-robin so machine noise hits both alike.
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


def interleaved(fns: dict, runs: int) -> dict:
    """Median seconds of each callable, run round-robin so machine noise hits all alike."""
    times: dict = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def load_aotlm(path, b, args):
    from aotlm import AutoModelForSampling

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
    return model, {"load s": t_load, "compile s": time.perf_counter() - t0}


def hf_callables(path, args, ids):
    import torch
    import transformers

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.amp]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    x = torch.tensor(ids)
    mask = torch.ones_like(x)
    kw = dict(
        max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, attention_mask=mask, pad_token_id=0
    )

    def prefill():
        with torch.inference_mode():
            model(x, attention_mask=mask)

    def generate():
        with torch.inference_mode():
            return model.generate(x, **kw).numpy()

    return prefill, generate


def bench_batch(path, b: int, args, ids) -> dict:
    model, extra = load_aotlm(path, b, args)
    fns = {
        "a_pre": lambda: model.forward(ids),
        "a_tot": lambda: model.sample(ids, max_new_tokens=args.new),
    }
    if not args.no_hf:
        h_prefill, h_generate = hf_callables(path, args, ids)
        fns |= {"h_pre": h_prefill, "h_tot": h_generate}
    for fn in fns.values():  # warm-up
        fn()
    t = interleaved(fns, args.runs)
    a_dec = b * (args.new - 1) / (t["a_tot"] - t["a_pre"])
    row = {"batch": b, "aotlm prefill ms": t["a_pre"] * 1e3, "aotlm decode tok/s": a_dec, **extra}
    if not args.no_hf:
        h_dec = b * (args.new - 1) / (t["h_tot"] - t["h_pre"])
        a_out, h_out = model.sample(ids, max_new_tokens=args.new), h_generate()
        same = float((a_out == h_out).all(axis=1).mean()) if a_out.shape == h_out.shape else 0.0
        row |= {
            "hf prefill ms": t["h_pre"] * 1e3,
            "hf decode tok/s": h_dec,
            "decode ratio": a_dec / h_dec,
            "prefill ratio": t["h_pre"] / t["a_pre"],
            "rows equal": same,
        }
    return row


def main() -> int:
    args = parse()
    if args.tp > 1:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.tp}"
        )
    import numpy as np

    from aotlm.tiny import make_gpt2_small

    path = args.checkpoint or make_gpt2_small()
    print(
        f"checkpoint {path}; prompt {args.prompt}, {args.new} new tokens, {args.amp}, tp={args.tp}, "
        f"median of {args.runs}",
        flush=True,
    )
    rows = []
    rng = np.random.default_rng(0)
    for b in args.batch:
        rows.append(bench_batch(path, b, args, rng.integers(0, 50000, (b, args.prompt))))
        print(rows[-1], file=sys.stderr, flush=True)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
