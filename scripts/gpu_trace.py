"""Summarize a ``jax.profiler`` Perfetto trace (``perfetto_trace.json.gz``): where device time went.

    python scripts/gpu_trace.py TRACE.json.gz [--steps N] [--top 25]

Prints, for the device (GPU) timelines: kernels and copies by total time (count, total ms, mean us),
busy time against the traced span (the rest is the device waiting for the host), and the host
thread's longest-running event names (launches, synchronizations, thunks). ``--steps``: divide
counts and times by the decode steps traced, to read them per step.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> tuple[list[dict], dict[int, str]]:
    with gzip.open(path, "rt") as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return [e for e in events if e.get("ph") == "X"], names


def busy_union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def by_name(events: list[dict]) -> list[tuple[str, int, float]]:
    acc: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        acc[e["name"]][0] += 1
        acc[e["name"]][1] += float(e.get("dur", 0.0))
    return sorted(((n, c, t) for n, (c, t) in acc.items()), key=lambda x: -x[2])


def summarize(path: Path, steps: int = 0, top: int = 25) -> str:
    events, names = load(Path(path))
    device = [e for e in events if any(k in names.get(e["pid"], "") for k in ("GPU", "gpu", "TPU", "device"))]
    host = [e for e in events if e not in device]
    per = max(steps, 1)
    lines = [f"trace {path}: {len(events)} events, device timelines: "
             f"{sorted({names[e['pid']] for e in device})}"]  # fmt: skip
    if device:
        t0 = min(e["ts"] for e in device)
        t1 = max(e["ts"] + e.get("dur", 0.0) for e in device)
        busy = busy_union([(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in device])
        lines.append(
            f"device span {(t1 - t0) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
            f"({100 * busy / (t1 - t0):.0f}%), "
            f"{len(device)} device events" + (f", {len(device) / per:.0f} per step" if steps else "")
        )
        lines.append("| device op | count | total ms | mean us |" + (" per step us |" if steps else ""))
        for n, c, t in by_name(device)[:top]:
            tail = f" {t / per:.1f} |" if steps else ""
            lines.append(f"| {n[:90]} | {c} | {t / 1e3:.3f} | {t / c:.1f} |{tail}")
    lines.append("| host event | count | total ms |")
    for n, c, t in by_name(host)[:top]:
        lines.append(f"| {n[:90]} | {c} | {t / 1e3:.3f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print(summarize(Path(args.trace), args.steps, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
