"""``aotlm tune`` and ``aotlm explore-batch``: measured, distribution-driven buckets and batch size.

aotlm tune --model CKPT --lengths FILE [--max-graphs N] [--compile-budget-s S] [--memory-gb G]
           [--objective latency|throughput] [--out buckets.json] [--replay 40] [--plot out.png] [--batch]
aotlm explore-batch --model CKPT --lengths FILE [--bucket-config buckets.json] [--memory-gb G]
           [--max-latency-ms MS]

The same code runs as ``scripts/tune_buckets.py`` and ``scripts/explore_batch.py``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from aotlm.cli.common import table
from aotlm.core.bucket_config import load_bucket_config, write_bucket_config
from aotlm.core.buckets import context_buckets, token_buckets
from aotlm.core.memory import GIB, plan_for_checkpoint
from aotlm.models import family_for
from aotlm.models.checkpoint import load_hf_config
from aotlm.models.checkpoint.resolve import find_tokenizer, resolve
from aotlm.tiny import cpu_model
from aotlm.tune import lengths
from aotlm.tune import measure as run
from aotlm.tune import optimise as tuning


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _common(p) -> None:
    p.add_argument(
        "--model", required=True, help="checkpoint dir, .gguf file, model name (aotlm models) or bundled name"
    )
    p.add_argument(
        "--lengths",
        required=True,
        help="histogram .json/.csv (prompt_len,new_tokens,count), .jsonl prompts, Cerebras .h5, "
        "normal:MEAN:STD[:LO:HI] or prompt lengths 12,40,300",
    )
    p.add_argument("--tokenizer", default=None, help="for .jsonl prompt text (default: the model's)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (fills in/overrides)")
    p.add_argument("--start-token", type=int, default=None, help=".h5: the token id that ends each prompt")
    p.add_argument("--n-positions", type=int, default=None, help="upper limit on the largest token bucket")
    p.add_argument("--memory-gb", type=float, default=None, help="per-device memory for weights + KV cache")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--amp", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--max-latency-ms", type=float, default=None, help="batch exploration: latency limit")
    p.add_argument("--max-batch", type=int, default=32, help="batch exploration: largest batch measured")
    p.add_argument("--batches", type=int, default=3, help="batch exploration: timed batches per size")
    p.add_argument("--plot", default=None, help="write a PNG (needs matplotlib: pip install 'aotlm[plot]')")
    p.add_argument("--seed", type=int, default=0)


def register(sub) -> None:
    p = sub.add_parser("tune", help="measure graphs and choose buckets for a length distribution")
    _common(p)
    p.add_argument("--max-graphs", type=int, default=None, help="default: as many as the default buckets")
    p.add_argument("--compile-budget-s", type=float, default=None, help="modelled compile seconds, total")
    p.add_argument("--objective", choices=["latency", "throughput"], default="latency")
    p.add_argument("--granularity", type=int, default=32, help="candidate bucket edges: multiples of this")
    p.add_argument("--measure-runs", type=int, default=3, help="timed runs per measured graph (median)")
    p.add_argument("--replay", type=int, default=40, help="requests replayed with both configs (0: skip)")
    p.add_argument("--out", default="buckets.json", help="bucket-config JSON to write")
    p.add_argument("--batch", action="store_true", help="then explore batch sizes with the tuned buckets")
    p.set_defaults(fn=cmd_tune)
    p = sub.add_parser("explore-batch", help="throughput and latency at candidate batch sizes")
    _common(p)
    p.add_argument("--bucket-config", default=None, help="buckets to use (default: powers of two)")
    p.set_defaults(fn=cmd_explore_batch)


def _limit(args) -> int:
    """Largest token bucket allowed: model positions, --n-positions, and --memory-gb at this batch."""
    hf = load_hf_config(args.model)
    limit = family_for(hf.model_type).arch_config(hf).max_positions
    if args.n_positions is not None:
        limit = min(limit, args.n_positions)
    if args.memory_gb is not None:
        fits = lambda n: (
            plan_for_checkpoint(args.model, args.batch_size, n, amp=args.amp)["total_bytes_per_device"]
            <= args.memory_gb * GIB
        )
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        limit = lo
    return limit


_AT_LEAST_1 = (
    "batch_size",
    "max_batch",
    "batches",
    "max_graphs",
    "granularity",
    "measure_runs",
    "n_positions",
    "new_tokens",
)
_ABOVE_0 = ("memory_gb", "max_latency_ms", "compile_budget_s")


def check_flags(args) -> None:
    """Flags out of range (each named with its value) and output folders that do not exist, refused
    before the model loads or a graph is measured. ``tune``'s own flags are checked where present."""
    for k in _AT_LEAST_1:
        v = getattr(args, k, None)
        if v is not None and v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    for k in _ABOVE_0:
        v = getattr(args, k, None)
        if v is not None and not v > 0:
            raise ValueError(f"--{k.replace('_', '-')} must be > 0, got {v}")
    if getattr(args, "replay", 0) < 0:
        raise ValueError(f"--replay must be >= 0 (0: skip the replay), got {args.replay}")
    for flag in ("out", "plot"):
        path = getattr(args, flag, None)
        folder = os.path.dirname(os.path.abspath(os.path.expanduser(path))) if path else None
        if folder is not None and not os.path.isdir(folder):
            raise ValueError(f"--{flag} {path}: the directory {folder} does not exist; create it first")


def load_dist(args) -> lengths.LengthDist:
    """The length distribution; first ``args.model`` resolved as every command resolves a model (a name,
    a .gguf file, a run dir) and ``args.tokenizer`` defaulted to the model's."""
    ckpt = resolve(args.model)
    args.model = str(ckpt)
    if args.tokenizer is None:
        found = find_tokenizer(ckpt)
        args.tokenizer = None if found is None else str(found)
    return lengths.load_lengths(args.lengths, args.tokenizer, args.new_tokens, args.start_token)


def default_config(dist: lengths.LengthDist, limit: int):
    n = 1 << (dist.max_total - 1).bit_length()
    return tuning.default_buckets(min(max(n, dist.max_total), limit))


def _kv_gb(args, tg) -> float:
    return (
        plan_for_checkpoint(args.model, args.batch_size, max(tg), amp=args.amp)["kv_cache_bytes_per_device"]
        / GIB
    )


def cmd_tune(args) -> int:
    check_flags(args)
    dist = load_dist(args)
    limit = _limit(args)
    if dist.max_total > limit:
        raise ValueError(
            f"the longest request needs {dist.max_total} positions (prompt {dist.max_prompt} + new tokens) "
            f"but n_positions is limited to {limit} (model / --n-positions / --memory-gb); "
            "shorten the requests or raise the limit"
        )
    opt = tuning.batch_dist(dist, args.batch_size) if args.objective == "throughput" else dist
    c_cands, w_cands = tuning.candidate_edges(opt, args.granularity, limit)
    d_ctx, d_tg = default_config(dist, limit)
    print(f"CPU: {cpu_model()}; model {args.model}; batch {args.batch_size}; objective {args.objective}")
    print(
        f"distribution: {len(dist.weight)} (prompt, new) pairs; "
        f"mean prompt {dist.mean(dist.prompt_len):.1f}, "
        f"longest prompt {dist.max_prompt}, mean new {dist.mean(dist.new_tokens):.1f}, "
        f"longest request {dist.max_total}; {len(c_cands)} context / {len(w_cands)} token candidates"
    )
    _log("measuring graphs (compiled in memory, not cached):")
    cm, rows = run.measure(
        args.model, c_cands, w_cands, args.batch_size, args.amp, args.measure_runs,
        min_prompt=int(opt.prompt_len.min()), log=_log,
    )  # fmt: skip
    print(
        f"cost model: prefill ms = {cm.p0 * 1e3:.2f} + {cm.p1 * 1e3:.4f}*C + {cm.p2 * 1e3:.2e}*C^2; "
        f"decode ms/token = {cm.d0 * 1e3:.3f} + {cm.d1 * 1e3:.2e}*W; {cm.call * 1e3:.2f} ms/call"
    )
    max_graphs = args.max_graphs if args.max_graphs is not None else len(tuning.graph_keys(d_ctx, d_tg))
    choice = tuning.optimise(cm, opt, c_cands, w_cands, max_graphs, args.compile_budget_s, limit)
    configs = {"default": (d_ctx, d_tg), "tuned": (choice.ctx, choice.tg)}
    # generated tokens per call: a batch call yields every row's own new tokens
    mean_new = dist.mean(dist.new_tokens) * (args.batch_size if args.objective == "throughput" else 1)
    out_rows = []
    for name, (ctx, tg) in configs.items():
        keys = tuning.graph_keys(ctx, tg)
        e = tuning.expected_s(cm, ctx, tg, opt)
        out_rows.append(
            (name, ",".join(map(str, ctx)), ",".join(map(str, tg)), len(keys),
             f"{sum(cm.compile_s(k) for k in keys):.0f}", f"{_kv_gb(args, tg):.3f}",
             f"{e * 1e3:.1f}", f"{mean_new / e:.1f}")
        )  # fmt: skip
    print(
        table(out_rows, ("config", "context buckets", "token buckets", "graphs", "est. compile s", "KV GiB",
                         "expected ms/request", "expected tok/s"))
    )  # fmt: skip
    budget = "none" if args.compile_budget_s is None else f"{args.compile_budget_s} s"
    print(f"limits: max graphs {max_graphs}, compile budget {budget}, n_positions <= {limit}")
    data = write_bucket_config(
        args.out, choice.ctx, choice.tg, args.batch_size if args.batch_size > 1 else None
    )
    print(f"wrote {args.out}: {data}")
    if args.replay > 0:
        _replay(args, dist, configs)
    if args.plot:
        plot(args.plot, dist, configs, rows, cm)
    if args.batch:
        _explore(args, dist, choice.ctx, choice.tg)
    return 0


def _replay(args, dist, configs) -> None:
    b = args.batch_size
    reqs = dist.sample(args.replay, args.seed + 1)
    _log(f"replaying {len(reqs)} requests (batch {b}), configs interleaved round-robin:")
    res = run.replay(args.model, configs, reqs, args.amp, args.seed, b, log=_log)
    s = {k: run.summary(v["latencies"]) for k, v in res.items()}
    rows = [
        (k, res[k]["graphs"], f"{res[k]['compile_s']:.1f}", f"{s[k]['mean']:.1f}", f"{s[k]['p50']:.1f}",
         f"{s[k]['p99']:.1f}")
        for k in res
    ]  # fmt: skip
    ratio = [s["tuned"][m] / s["default"][m] for m in ("mean", "p50", "p99")]
    rows.append(("tuned/default", "", "", *(f"{r:.3f}" for r in ratio)))
    paired = [t / d for t, d in zip(res["tuned"]["latencies"], res["default"]["latencies"], strict=True)]
    what = "per request" if b == 1 else f"per call of {b} requests"
    print(f"replay: {len(reqs)} requests from the distribution, measured end-to-end latency {what} (ms):")
    print(table(rows, ("config", "graphs", "compile s", "mean ms", "p50 ms", "p99 ms")))
    print(f"median paired ratio tuned/default (same requests): {sorted(paired)[len(paired) // 2]:.3f}")


def _explore(args, dist, ctx, tg) -> None:
    max_fit = (
        run.fitting_batch(args.model, max(tg), args.memory_gb, args.amp) if args.memory_gb else args.max_batch
    )
    if args.memory_gb and max_fit < 1:
        raise ValueError(f"not even batch 1 fits --memory-gb {args.memory_gb} with n_positions={max(tg)}")
    sizes = run.batch_candidates(max_fit, args.max_batch)
    note = f"largest fitting per aotlm.core.memory: {max_fit}" if args.memory_gb else "no --memory-gb given"
    _log(f"exploring batch sizes {sizes} ({note}):")
    rows = run.explore_batch(args.model, dist, ctx, tg, sizes, args.batches, args.amp, args.seed, log=_log)
    print(f"batch exploration: buckets ctx={list(ctx)} tg={list(tg)}; {note}; {args.batches} batches each")
    print(
        table(
            [(r["batch"], f"{r['tok_s']:.1f}", f"{r['mean']:.0f}", f"{r['p50']:.0f}", f"{r['p99']:.0f}",
              f"{_kv_gb(args, tg) * r['batch'] / args.batch_size:.3f}") for r in rows],
            ("batch", "generated tok/s", "mean batch ms", "p50 ms", "p99 ms", "KV GiB"),
        )
    )  # fmt: skip
    best = run.recommend(rows, args.max_latency_ms)
    lim = f"p50 latency <= {args.max_latency_ms} ms" if args.max_latency_ms else "no latency limit"
    if best is None:
        print(f"recommendation: no batch size meets {lim}; raise --max-latency-ms")
    else:
        print(f"recommendation ({lim}): batch_size={best['batch']} ({best['tok_s']:.1f} tok/s)")
    if args.plot and args.command == "explore-batch":
        plot(args.plot, dist, {"buckets": (ctx, tg)}, [], None, rows)


def cmd_explore_batch(args) -> int:
    check_flags(args)
    dist = load_dist(args)
    if args.bucket_config:
        bc = load_bucket_config(args.bucket_config)
        tg = token_buckets(bc["n_positions"])
        ctx = context_buckets(bc.get("context_length_estimate"), tg)
    else:
        ctx, tg = default_config(dist, _limit(args))
    if dist.max_total > max(tg):
        raise ValueError(f"the longest request needs {dist.max_total} positions but n_positions={max(tg)}")
    print(f"CPU: {cpu_model()}; model {args.model}")
    _explore(args, dist, ctx, tg)
    return 0


def plot(path: str, dist, configs: dict, rows: list[dict], cm, batch_rows: list[dict] | None = None) -> None:
    """Length histogram with bucket edges, and the measured (and fitted) per-bucket latency."""
    try:
        import matplotlib  # local: optional [plot] extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # local: optional [plot] extra
    except ImportError:
        print(f"--plot {path}: skipped, matplotlib is not installed (pip install 'aotlm[plot]')")
        return

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.hist(dist.prompts(), bins=60, color="0.7")
    for (name, (ctx, _)), style in zip(configs.items(), ("--", "-"), strict=False):
        for i, c in enumerate(ctx):
            a.axvline(c, ls=style, color="C0" if name == "default" else "C3", label=name if i == 0 else None)
    a.set(xlabel="prompt tokens", ylabel="requests", title="prompt lengths and context buckets")
    a.legend()
    if batch_rows:
        b.plot([r["batch"] for r in batch_rows], [r["tok_s"] for r in batch_rows], "o-")
        b.set(xlabel="batch size", ylabel="generated tok/s", title="batch exploration")
        b.set_ylim(bottom=0)
    else:
        pre = [r for r in rows if r["graph"] == "prefill" and r["c"] == r["w"]]
        xs = np.linspace(1, max(r["c"] for r in pre), 100)
        b.plot([r["c"] for r in pre], [r["seconds"] * 1e3 for r in pre], "o", label="prefill CxC measured")
        b.plot(xs, [cm.prefill_s(int(x)) * 1e3 for x in xs], "-", label="prefill fit")
        dec = [r for r in rows if r["graph"] == "decode"]
        b.plot(
            [r["w"] for r in dec], [r["token_s"] * 1e3 * 10 for r in dec], "s", label="decode ms/token x10"
        )
        b.set(xlabel="bucket tokens (C or W)", ylabel="ms", title="measured per-bucket latency")
        b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote plot {path}")
