"""Decode speed of greedy vs sampling rows (and greedy vs an older revision), in one run.

    python scripts/bench_sampling.py [--baseline REV] [--batch 1 8] [--reps 5]

GPT-2-small (random init, fp32), prompt 128, 128 new tokens. Each configuration runs in its
own subprocess (so the baseline revision imports its own code), round-robin over ``--rounds``
rounds, and the table shows medians: this machine is shared and noisy, compare ratios.
``--baseline REV`` checks out REV's engine/ and models/ with ``git worktree`` into a temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aotlm.tiny import cpu_model

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "greedy": {},
    "top_p=0.9": {"do_sample": True, "top_p": 0.9, "top_k": 0, "seed": 1},
    "top_k=50": {"do_sample": True, "top_k": 50, "seed": 1},
}


def worker(args) -> None:
    """Runs inside the subprocess: prints one JSON line of decode tok/s samples per mode."""
    import numpy as np

    from aotlm import AutoModelForSampling

    cache = os.path.join(args.cache_dir, args.tag)
    model = AutoModelForSampling.from_pretrained(
        args.checkpoint,
        batch_size=args.batch[0],
        n_positions=256,
        context_length_estimate=128,
        compile_cache=cache,
    )
    model.compile()
    b = args.batch[0]
    ids = np.random.default_rng(0).integers(0, 50257, (b, 128))
    res = {}
    for mode in args.modes:
        kw = MODES[mode]
        model.sample(ids, max_new_tokens=4, **kw)  # warm
        rates = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            model.forward(ids)
            t_pre = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.sample(ids, max_new_tokens=128, **kw)
            rates.append(b * 127 / max(time.perf_counter() - t0 - t_pre, 1e-9))
        res[mode] = rates
    print(json.dumps(res))


def baseline_tree(rev: str, tmp: str) -> str:
    """A folder where ``import aotlm`` gives revision ``rev``'s code."""
    wt = os.path.join(tmp, "wt")
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", wt, rev], check=True, capture_output=True
    )
    pkg = Path(tmp, "path", "aotlm")
    pkg.mkdir(parents=True)
    for f in Path(wt, "engine").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    (pkg / "models").symlink_to(Path(wt, "models"))
    return str(pkg.parent)


def run(tag: str, path: str | None, batch: int, modes, args) -> dict:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--tag",
        tag,
        "--batch",
        str(batch),
        "--reps",
        str(args.reps),
    ]
    cmd += ["--checkpoint", args.checkpoint, "--cache-dir", args.cache_dir, "--modes", *modes]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=path or None)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None, help="git revision to compare greedy decode with")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--tag", default="new")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from aotlm.tiny import make_gpt2_small

    args.checkpoint = args.checkpoint or str(make_gpt2_small())
    print(f"CPU: {cpu_model()}; GPT-2-small fp32, prompt 128, 128 new tokens")
    with tempfile.TemporaryDirectory() as tmp:
        args.cache_dir = args.cache_dir or os.path.join(tmp, "cache")
        base = baseline_tree(args.baseline, tmp) if args.baseline else None
        rows = []
        for b in args.batch:
            samples: dict[str, list[float]] = {}
            for _ in range(args.rounds):  # round-robin: new code, baseline, new code, ...
                for mode, rates in run("new", None, b, list(MODES), args).items():
                    samples.setdefault(mode, []).extend(rates)
                if base:
                    rates = run("base", base, b, ["greedy"], args)["greedy"]
                    samples.setdefault("greedy @ baseline", []).extend(rates)
            med = {k: statistics.median(v) for k, v in samples.items()}
            for k, v in med.items():
                rows.append((b, k, f"{v:.1f}", f"{v / med['greedy']:.3f}"))
        if base:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", os.path.join(tmp, "wt")])
    print("| batch | mode | decode tok/s (median) | ratio to greedy |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
