"""Scoring speed: tokens scored per second, aotlm's score graphs against transformers.

    python scripts/bench_score.py                          # GPT-2-small (124M, random init)
    python scripts/bench_score.py --batch 1 4 --length 512 --runs 5 --modes f32 int8

Scoring a text means the log-probability of every token given the ones before it (what
lm-eval's ``loglikelihood`` and perplexity need). Each row scores ``batch`` texts of ``length``
tokens (``length + 1`` ids: the first is only context). aotlm: ``model.score(ids)`` (log-softmax,
gather and argmax inside the compiled graph; only ``[batch, length]`` floats reach the host).
transformers: eager fp32 forward, ``log_softmax`` over the vocabulary and ``gather`` of the next
tokens. Medians over runs, engines called round-robin so machine noise hits them alike; "abs dlogp"
is each aotlm mode's largest and mean per-token difference from transformers on the same ids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from aotlm.tiny import cpu_model, make_gpt2_small

MODES = {"f32": {}, "bf16": {"amp": "bf16"}, "int8": {"quant": "int8"}}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint dir (default: random GPT-2-small)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--length", type=int, default=512, help="tokens scored per text")
    ap.add_argument("--modes", nargs="+", default=["f32", "int8"], choices=list(MODES))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/tmp/aotlm-bench", help="checkpoint and compile cache")
    return ap.parse_args()


def aotlm_engine(path: str, b: int, mode: str, args):
    """A scorer returning ``[b, length]`` log-probs: the model is built with ``scoring=True`` and
    compiled (or loaded from the compile cache) before timing starts."""
    from aotlm import AutoModelForSampling

    model = AutoModelForSampling.from_pretrained(
        path,
        batch_size=b,
        n_positions=args.length,
        context_length_estimate=args.length,
        compile_cache=str(Path(args.work) / "compile_cache"),
        scoring=True,
        **MODES[mode],
    ).compile()

    def run(ids: np.ndarray) -> np.ndarray:
        return np.asarray(model.score(ids).logprobs)[:, 1:]

    return run


def hf_engine(path: str):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run(ids: np.ndarray) -> np.ndarray:
        x = torch.tensor(ids)
        with torch.inference_mode():
            logp = torch.log_softmax(model(x).logits[:, :-1].float(), -1)
            return logp.gather(-1, x[:, 1:, None])[..., 0].numpy()

    return run


def bench_batch(path: str, b: int, args, ids: np.ndarray) -> list[dict]:
    engines = {f"aotlm {m}": aotlm_engine(path, b, m, args) for m in args.modes}
    engines["transformers eager fp32"] = hf_engine(path)
    ref = engines["transformers eager fp32"](ids)  # also the warm-up of every engine
    diffs = {k: np.abs(run(ids) - ref) for k, run in engines.items()}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.runs):
        for k, run in engines.items():
            t = time.perf_counter()
            run(ids)
            times[k].append(time.perf_counter() - t)
    scored = b * args.length
    hf_rate = scored / statistics.median(times["transformers eager fp32"])
    rows = []
    for k, ts in times.items():
        rate = scored / statistics.median(ts)
        d = diffs[k]
        diff = "-" if k.startswith("transformers") else f"{d.max():.1e} / {d.mean():.1e}"
        row = {"batch": b, "engine": k, "tok/s": rate, "vs transformers": rate / hf_rate}
        rows.append({**row, "abs dlogp max / mean": diff})
    return rows


def table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [
            f"{v:.0f}" if k == "tok/s" else f"{v:.2f}x" if isinstance(v, float) else str(v)
            for k, v in r.items()
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    args = parse()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    path = str(args.checkpoint or make_gpt2_small(Path(args.work) / "gpt2-small"))
    print(f"CPU: {cpu_model()}")
    print(f"checkpoint {path}; {args.length} tokens scored per text, median of {args.runs}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch:
        new = bench_batch(path, b, args, rng.integers(0, 50000, (b, args.length + 1)))
        for r in new:
            print(r, file=sys.stderr, flush=True)
        rows += new
    table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
