"""One batch-generate job, 1 plain process vs ``--ray`` workers, cold and warm compile cache.

    python scripts/bench_ray.py                    # 2,000 records, bundled model, 2 Ray workers
    python scripts/bench_ray.py --records 200      # a quick look

Every configuration runs in a fresh process (``--one``), so a "cold" run really starts with an
empty compile cache directory and no in-memory executables; "warm" re-runs it on the cache the
cold run filled. Measured: the job's seconds after pre-flight (what ``batch-generate`` prints:
model load and compile included, and for Ray the local ``ray.init`` and actor start-up),
records/s over those seconds, and per worker the start-up: actor created -> first model ready
(process, imports, weights, compile or cache load). The plain process's start-up is the same
model built and compiled in a process of its own. "records/s after start-up" divides by the job
seconds less the start-up (plain: that start-up; Ray: ``ray.init`` + the slowest worker's), an
estimate of the steady rate. Outputs of all runs are checked identical.

Run it on a quiet machine, and on a source tree nobody edits meanwhile: the compile cache key
hashes the engine's code, so an edit between runs turns the "warm" runs cold.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):",
    "import os",
    "class Point:\n    def __init__(self, x, y):",
    "for i in range(10):",
    "def read_json(path):\n    with open(path) as f:",
    "# sort a list of numbers\ndef sort(xs):",
    "if __name__ == '__main__':",
    "def add(a, b):\n    return",
]


def write_input(path: Path, n: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            rec: dict = {"id": i, "prompt": rng.choice(PROMPTS)}
            if i % 3 == 1:  # a third sampled, seeded per record
                rec["generation"] = {"do_sample": True, "temperature": 0.8, "top_k": 40, "seed": i}
            f.write(json.dumps(rec) + "\n")


def one(mode: str, inp: str, out: str, cache: str, workers: int, new_tokens: int) -> dict:
    """One configuration, in this (fresh) process; prints its measurements as JSON."""
    from aotlm.jobs import batch, plan, ray_jobs

    t0 = time.perf_counter()
    cli = {"generation": {"max_new_tokens": new_tokens}}
    groups = plan.group(plan.parse(inp, cli))
    plan.prepare(groups, cli, inp)
    opts = {"batch_size": 4, "cache_dir": cache}
    t_pre = time.perf_counter() - t0
    res: dict = {"mode": mode, "preflight_s": t_pre}
    if mode == "startup":  # the plain process's start-up: build + compile the job's model
        t0 = time.perf_counter()
        model = batch.load_group_model(groups[0], opts)
        model.compile()
        res["startup_s"] = time.perf_counter() - t0
        return res
    t0 = time.perf_counter()
    if mode == "plain":
        written, _ = batch.run(groups, opts, out, resume=False)
        stats: dict = {}
    else:
        import ray

        ti = time.perf_counter()
        ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
        res["ray_init_s"] = time.perf_counter() - ti
        written, _, stats = ray_jobs.run_batch_generate(groups, opts, out, False, workers)
        ray.shutdown()
    res.update(job_s=time.perf_counter() - t0, written=written, workers=list(stats.values()))
    return res


def run_one(*args) -> dict:
    cmd = [sys.executable, __file__, "--one", *map(str, args)]
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--one", nargs=6, metavar=("MODE", "IN", "OUT", "CACHE", "WORKERS", "NEW"))
    a = ap.parse_args()
    if a.one:
        mode, inp, out, cache, workers, new = a.one
        print(json.dumps(one(mode, inp, out, cache, int(workers), int(new))))
        return 0

    from aotlm.tiny import cpu_model

    print(f"CPU: {cpu_model()}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_ray-"))
    inp = tmp / "in.jsonl"
    write_input(inp, a.records)
    rows, outputs = [], {}
    for mode in ("plain", "ray"):
        cache = tmp / f"cache-{mode}"
        for state in ("cold", "warm"):
            out = tmp / f"out-{mode}-{state}.jsonl"
            res = run_one(mode, inp, out, cache, a.workers, a.max_new_tokens)
            if mode == "plain":  # start-up of the one process, on a cache as cold/warm as the job's
                boot_cache = tmp / "cache-boot"  # cold: empty; warm: what the cold start-up filled
                res["workers"] = [run_one("startup", inp, "-", boot_cache, 1, a.max_new_tokens)]
            outputs[(mode, state)] = out.read_bytes()
            rows.append((mode, state, res))
            print(json.dumps(res), file=sys.stderr)
    same = len(set(outputs.values())) == 1
    print(f"\n{a.records} records, max_new_tokens {a.max_new_tokens}, batch_size 4, "
          f"{a.workers} Ray workers; outputs identical: {same}\n")  # fmt: skip
    print(
        "| run | compile cache | job s | records/s | rec/s after start-up | start-up per worker s (compiles)"
        " |"
    )
    print("|---|---|---:|---:|---:|---|")
    for mode, state, res in rows:
        name = "1 process (plain)" if mode == "plain" else f"Ray, {a.workers} workers"
        if mode == "plain":
            boot = f"{res['workers'][0]['startup_s']:.1f}"
            up = res["workers"][0]["startup_s"]
        else:
            up = res["ray_init_s"] + max(w.get("startup_s", 0) for w in res["workers"])
            boot = ", ".join(
                f"{w['startup_s']:.1f} ({w['compiles']})" for w in res["workers"] if "startup_s" in w
            )
            boot += f"; ray.init {res['ray_init_s']:.1f}"
        rate, steady = res["written"] / res["job_s"], res["written"] / max(res["job_s"] - up, 1e-9)
        print(f"| {name} | {state} | {res['job_s']:.1f} | {rate:.0f} | ~{steady:.0f} | {boot} |")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
