"""Cold compile vs warm start from the on-disk compile cache, each in a fresh process.

    python scripts/bench_compile.py          # GPT-2-small, 4 context + 3 token-generation buckets

cold: ``aotlm compile`` into an empty cache directory (every graph traced, lowered, compiled).
warm: a new process runs ``from_pretrained`` (weight loading, timed separately and excluded),
then ``compile()`` from the cache and ``sample()`` of one token: the time to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

WARM = r"""
import json, sys, time
import numpy as np
t0 = time.perf_counter()
from aotlm import AutoModelForSampling
path, cache, npos, ctx = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
m = AutoModelForSampling.from_pretrained(path, batch_size=1, n_positions=[int(x) for x in npos.split(",")],
        context_length_estimate=[int(x) for x in ctx.split(",")], compile_cache=cache)
t_load = time.perf_counter() - t0
t0 = time.perf_counter()
m.compile()
out = m.sample(np.arange(1, 17)[None], max_new_tokens=1)
t_first = time.perf_counter() - t0
print(json.dumps({"import": t_import, "load": t_load, "first_token": t_first,
                  "hits": sum(r["hit"] for r in m.compile_report), "graphs": len(m.compile_report)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--n-positions", default="256,512,1024")
    ap.add_argument("--context-length-estimate", default="32,64,128,256")
    args = ap.parse_args()
    from aotlm.tiny import make_gpt2_small

    path = args.checkpoint or str(make_gpt2_small())
    cache = tempfile.mkdtemp(prefix="aotlm-bench-cache-")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "aotlm.cli", "compile", path, "--batch-size", "1"]
    cmd += ["--n-positions", args.n_positions, "--context-length-estimate", args.context_length_estimate]
    t0 = time.perf_counter()
    cold = subprocess.run(cmd + ["--cache-dir", cache], capture_output=True, text=True, env=env)
    t_cold_total = time.perf_counter() - t0
    if cold.returncode:
        print(cold.stderr, file=sys.stderr)
        return 1
    print(cold.stdout)
    total_line = [ln for ln in cold.stdout.splitlines() if ln.startswith("total:")][0]
    cold_compile = float(total_line.split(" in ")[1].split("s")[0])
    warm_runs = []
    for _ in range(3):
        p = subprocess.run(
            [sys.executable, "-c", WARM, path, cache, args.n_positions, args.context_length_estimate],
            capture_output=True,
            text=True,
            env=env,
        )
        if p.returncode:
            print(p.stderr, file=sys.stderr)
            return 1
        warm_runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    warm = sorted(warm_runs, key=lambda r: r["first_token"])[1]  # median of 3
    print("| measure | seconds |")
    print("|---|---|")
    print(f"| cold `aotlm compile` ({warm['graphs']} graphs, compile only) | {cold_compile:.2f} |")
    print(f"| cold `aotlm compile` process, wall | {t_cold_total:.2f} |")
    print(f"| warm: compile() from cache + first token (median of 3) | {warm['first_token']:.2f} |")
    print(f"| warm: weight loading (excluded) | {warm['load']:.2f} |")
    print(f"| warm: cache hits | {warm['hits']}/{warm['graphs']} |")
    print(f"| speed-up cold compile / warm start | {cold_compile / warm['first_token']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
