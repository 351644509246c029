"""Pipeline vs tensor parallelism on forced CPU devices: speed, memory and what crosses devices.

    python scripts/bench_pp.py [--devices 4] [--batch 1 8] [--prompt 128] [--new 64] [--runs 3]

GPT-2-small (random init) on ``--devices`` forced CPU devices as tp=N, pp=N and pp=N/2 x tp=2:
decode tokens/s, prefill ms (median of runs, configurations called round-robin), the fullest
device's weight bytes, and the bytes that leave a device per generated token and row, read from
the compiled graphs: the hidden states each stage hands the next (the lecture's 2D bytes per
boundary, here float32 so 4D, plus the sampled token sent back to the first stage), the
all-reduce payloads of tensor parallelism (two per layer, one for the embedding) and its
all-gathers (the logits, once per step, for the sampler).

All forced devices share this machine's cores and memory bandwidth, so the times say what the
host-side chaining costs here, not what separate devices would reach; the bytes and the per-device
weights are what carry over to real multi-device hosts.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint (default: random GPT-2-small)")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/tmp/aotlm-bench")
    return ap.parse_args()


def collective_bytes(hlo: str, kind: str) -> list[int]:
    """Result sizes (bytes) of every ``kind`` collective in an HLO module."""
    out = []
    for dtype, dims in re.findall(rf"= (\w+)\[([\d,]*)\][^ ]* {kind}(?:-start)?\(", hlo):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1}.get(dtype, 4))
    return out


def device_weight_bytes(model) -> int:
    import jax

    per: dict = {}
    for st in getattr(model, "stages", [model]):
        for leaf in jax.tree.leaves(st.params):
            for sh in leaf.addressable_shards:
                per[sh.device.id] = per.get(sh.device.id, 0) + sh.data.nbytes
    return max(per.values())


def tp_bytes(exe, rows: int) -> tuple[int, int]:
    """(all-reduce bytes, all-gather bytes) per row of one compiled decode step."""
    hlo = exe.as_text()
    return sum(collective_bytes(hlo, "all-reduce")) // rows, sum(collective_bytes(hlo, "all-gather")) // rows


def crossing_bytes(model, width: int) -> dict:
    """Bytes per generated token and row that leave a device, read from the compiled graphs."""
    stages = getattr(model, "stages", None)
    if not stages:
        ar, ag = tp_bytes(model.executable(("decode", width)), model.batch_size)
        return {"stage hand-offs B": 0, "tp all-reduce B": ar, "tp all-gather B": ag}
    mb, hidden, ar, ag = stages[0].batch_size, 0, 0, 0
    for st in stages:
        exe = st.executable(("pp_step", width))
        if not st.stage.is_last:
            hidden += int(exe.out_info[0].size * exe.out_info[0].dtype.itemsize) // mb
        a, g = tp_bytes(exe, mb)
        ar, ag = ar + a, ag + g
    ints = 4  # the sampled token, back to stage 0 (positions come from the host)
    return {"stage hand-offs B": hidden + ints, "tp all-reduce B": ar, "tp all-gather B": ag}


def bubble(stages: int, micro: int) -> dict:
    """Idle share of each device by the schedule: prefill runs the micro-batches through the
    stages once ((S - 1) / (M + S - 1) idle); decode is a ring (micro-batch m's next token enters
    stage 0 as its last token leaves stage S - 1), idle 1 - M / S while M < S, none once M >= S."""
    if stages == 1:
        return {"prefill bubble": "0%", "decode bubble": "0%"}
    pre = (stages - 1) / (micro + stages - 1)
    dec = max(0.0, 1 - micro / stages)
    return {"prefill bubble": f"{pre:.0%}", "decode bubble": f"{dec:.0%}"}


def main() -> int:
    args = parse()
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    )
    import numpy as np

    from aotlm import AutoModelForSampling
    from aotlm.tiny import cpu_model, make_gpt2_small

    n = args.devices
    configs = {  # name -> (pp, tp, micro-batches: None = the default, min(batch, pp))
        f"tp={n}": (1, n, None),
        f"pp={n}": (n, 1, None),
        f"pp={n}, 1 micro-batch": (n, 1, 1),
        f"pp={n // 2} x tp=2": (n // 2, 2, None),
    }
    path = args.checkpoint or make_gpt2_small(Path(args.work) / "gpt2-small")
    print(f"CPU: {cpu_model()}")
    print(f"{path}: prompt {args.prompt}, {args.new} new, greedy, {n} forced devices, median of {args.runs}")
    rows = []
    for b in args.batch:
        ids = np.random.default_rng(0).integers(0, 50000, (b, args.prompt))
        shapes = dict(batch_size=b, n_positions=args.prompt + args.new, context_length_estimate=args.prompt)
        models = {}
        for name, (pp, tp, micro) in configs.items():
            if micro is not None and b == 1:
                continue  # batch 1 has one micro-batch anyway
            extra = {} if micro is None else {"micro_batches": micro}
            m = AutoModelForSampling.from_pretrained(path, pp_degree=pp, tp_degree=tp, **shapes, **extra)
            m.compile()
            m.sample(ids, max_new_tokens=4)  # warm
            models[name] = m
        times: dict = {name: ([], []) for name in models}
        for _ in range(args.runs):
            for name, m in models.items():
                t0 = time.perf_counter()
                m.forward(ids)
                t1 = time.perf_counter()
                m.sample(ids, max_new_tokens=args.new)
                times[name][0].append(t1 - t0)
                times[name][1].append(time.perf_counter() - t1)
        for name, m in models.items():
            pre, gen = statistics.median(times[name][0]), statistics.median(times[name][1])
            rows.append(
                {
                    "config": name,
                    "batch": b,
                    "micro-batches": getattr(m, "micro_batches", 1),
                    **bubble(getattr(m, "pp_degree", 1), getattr(m, "micro_batches", 1)),
                    "decode tok/s": b * (args.new - 1) / (gen - pre),
                    "prefill ms": pre * 1e3,
                    "weights MB/device": device_weight_bytes(m) / 1e6,
                    **crossing_bytes(m, m.tg_buckets[-1]),
                }
            )
        models.clear()
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
