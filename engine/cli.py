"""``aotlm <command>``: the single command-line entry point.

aotlm demo                      make a tiny checkpoint, compile it, sample from it
aotlm make-tiny DIR             write the tiny random GPT-2 checkpoint
aotlm compile CHECKPOINT ...    compile every bucket ahead of time into the cache
aotlm sample CHECKPOINT ...     greedy generation from token ids
aotlm cache list|verify|clear   inspect and maintain the compile cache
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence

import numpy as np

from aotlm.model import MODEL_KEYS


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = float("nan")
    if not 0 <= days < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of days >= 0, got {text!r}")
    return days


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the problem and where the fix is, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


# value types a --config file may hold (flags are typed by argparse)
_CONFIG_TYPES = {
    "batch_size": "int",
    "n_positions": "ints",
    "context_length_estimate": "ints",
    "tp_degree": "int",
    "gqa": "str",
    "amp": "str",
    "quant": "str",
    "fuse_qkv": "bool",
}


def _config_value_ok(kind: str, v) -> bool:
    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
    if kind == "int":
        return is_int(v)
    if kind == "ints":
        return is_int(v) or (isinstance(v, list) and all(map(is_int, v)))
    return v is None or isinstance(v, {"str": str, "bool": bool}[kind])


def add_model_args(p: argparse.ArgumentParser, checkpoint: bool = True) -> None:
    """The shape options of ``compile``; ``checkpoint=False`` leaves out the positional model path."""
    if checkpoint:
        p.add_argument(
            "checkpoint",
            nargs="?",
            default=None,
            help="checkpoint dir, training run dir or bundled name (default: the bundled model)",
        )
    p.add_argument("--batch-size", type=int, default=None, help="compiled batch size (default 1)")
    p.add_argument(
        "--n-positions", type=_int_list, default=None, help="token-generation buckets, e.g. 64,128"
    )
    p.add_argument(
        "--context-length-estimate", type=_int_list, default=None, help="context buckets, e.g. 16,32"
    )
    p.add_argument("--tp-degree", type=int, default=None, help="tensor-parallel degree (default 1)")
    p.add_argument("--gqa", default=None, help="shard-over-heads | replicated-heads | shard-over-batch")
    p.add_argument("--amp", default=None, choices=["f32", "bf16", "f16"], help="compute dtype (default f32)")
    p.add_argument(
        "--quant",
        default=None,
        choices=["int8", "bf16"],
        help="int8 (per-channel scales) or bf16 weight storage",
    )
    p.add_argument("--fuse-qkv", action="store_true", default=None, help="one q/k/v and one gate/up matmul")
    p.add_argument(
        "--cache-dir", default=None, help="compile cache dir (default $AOTLM_CACHE_DIR or ./compile_cache)"
    )
    p.add_argument("--config", default=None, help="JSON file with any of the options above (flags win)")
    p.add_argument("--coordinator", default=None, help="multi-host: host:port of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: process count")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's rank")


def model_kwargs(args) -> dict:
    from aotlm import distributed

    # joins a multi-host run when flags or $AOTLM_* say so; a no-op for one process
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if hasattr(args, "checkpoint"):  # a run dir, a bundled name, ~ or $VARS; none: the bundled model
        from aotlm.resolve import resolve

        args.checkpoint = str(resolve(args.checkpoint))
    keys = MODEL_KEYS
    kw: dict = {}
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read --config {args.config} ({e}); give a readable JSON file") from e
        if not isinstance(loaded, dict):
            raise ValueError(f'--config {args.config} must hold a JSON object, e.g. {{"batch_size": 2}}')
        unknown = set(loaded) - set(keys)
        if unknown:
            raise ValueError(f"unknown keys in {args.config}: {sorted(unknown)}; allowed: {list(keys)}")
        for k, v in loaded.items():
            if not _config_value_ok(_CONFIG_TYPES[k], v):
                raise ValueError(f"{args.config}: {k}={v!r} has the wrong type; expected {_CONFIG_TYPES[k]}")
        kw.update(loaded)
    for k in keys:
        v = getattr(args, k)
        if v is not None:
            # a single --n-positions N means "powers of two up to N"; a list in --config is exact
            kw[k] = v[0] if k == "n_positions" and isinstance(v, list) and len(v) == 1 else v
    kw["compile_cache"] = args.cache_dir
    return kw


def table(rows: Sequence[Sequence], header: Sequence[str]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def _gb(n: float) -> str:
    return f"{n / 2**30:.3f} GB"


def cmd_compile(args) -> int:
    from aotlm import AutoModelForSampling

    kw = model_kwargs(args)
    if args.dry_run or args.device_memory_gb is not None:
        from aotlm.memory import check_fits, format_plan, plan_for_checkpoint

        skip = ("compile_cache", "quant", "fuse_qkv")  # the plan counts weights at the amp dtype
        plan = plan_for_checkpoint(args.checkpoint, **{k: v for k, v in kw.items() if k not in skip})
        print(format_plan(plan))
        if args.device_memory_gb is not None:
            check_fits(plan, args.device_memory_gb)
        if args.dry_run:
            rows = [(g[0], "x".join(map(str, g[1:])), plan["batch_size"]) for g in plan["graphs"]]
            print(table(rows, ("graph", "bucket", "batch")))
            print(f"{len(plan['graphs'])} graphs would be compiled (dry run: nothing compiled)")
            return 0
    t0 = time.perf_counter()
    model = AutoModelForSampling.from_pretrained(args.checkpoint, **kw)
    t_load = time.perf_counter() - t0
    keys = model.graph_keys()
    for i, key in enumerate(keys, 1):
        t = time.perf_counter()
        model.compile_graph(key)
        info = model.compile_report[-1]
        print(
            f"[{i}/{len(keys)}] {key[0]} {'x'.join(map(str, key[1:]))}: "
            f"{'hit' if info['hit'] else 'compiled'} in {time.perf_counter() - t:.2f}s",
            file=sys.stderr,
        )
    rows = [
        (
            r["graph"],
            "x".join(map(str, r["bucket"])),
            model.batch_size,
            f"{r['seconds']:.2f}",
            "hit" if r["hit"] else "miss",
            f"{r['bytes'] / 1024:.0f} KB",
        )
        for r in model.compile_report
    ]
    print(table(rows, ("graph", "bucket", "batch", "compile s", "cache", "size")))
    total = sum(r["seconds"] for r in model.compile_report)
    hits = sum(r["hit"] for r in model.compile_report)
    where = model.compile_cache.dir or "memory only"
    print(
        f"total: {len(rows)} graphs ({hits} from cache) in {total:.2f}s; weights loaded in {t_load:.2f}s; "
        f"cache: {where}"
    )
    if args.output_artifacts:
        from aotlm.artifact_run import save_artifacts

        print(f"artifacts: {save_artifacts(model, args.output_artifacts, kw.get('quant'))}")
    return 0


def cmd_sample(args) -> int:
    from aotlm import AutoModelForSampling

    model = AutoModelForSampling.from_pretrained(args.checkpoint, **model_kwargs(args))
    ids = args.prompt_ids  # lists of ints; ragged or empty prompts get the engine's clear error
    t0 = time.perf_counter()
    out = model.sample(ids, max_new_tokens=args.max_new_tokens, eos_token_id=args.eos_token_id)
    dt = time.perf_counter() - t0
    for row in out:
        print(",".join(map(str, row.tolist())))
    print(
        f"{out.shape[0]} x {out.shape[1] - len(ids[0])} new tokens in {dt:.2f}s (incl. any compile)",
        file=sys.stderr,
    )
    return 0


def cmd_demo(args) -> int:
    from aotlm import AutoModelForSampling
    from aotlm.tiny import make_tiny_gpt2

    path = make_tiny_gpt2(args.dir)
    print(f"checkpoint: {path} (tiny random-init GPT-2, made by aotlm)")
    t0 = time.perf_counter()
    model = AutoModelForSampling.from_pretrained(
        path,
        batch_size=2,
        n_positions=[64, 128],
        context_length_estimate=[16, 32],
        compile_cache=args.cache_dir,
    )
    t_load, t0 = time.perf_counter() - t0, time.perf_counter()
    model.compile()
    hits = sum(r["hit"] for r in model.compile_report)
    n, dt = len(model.compile_report), time.perf_counter() - t0
    print(f"weights loaded in {t_load:.2f}s; {n} graphs ready in {dt:.2f}s ({hits} from the cache)")
    prompts = np.asarray([[5, 17, 42, 99, 7, 3, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8]])
    t0 = time.perf_counter()
    out = model.sample(prompts, max_new_tokens=48)
    dt = time.perf_counter() - t0
    for row in out:
        print("tokens:", " ".join(map(str, row.tolist())))
    print(f"generated 2 x 48 tokens in {dt * 1000:.0f} ms ({2 * 48 / dt:.0f} tok/s)")
    return 0


def cmd_make_tiny(args) -> int:
    from aotlm.tiny import make_tiny_gpt2

    print(make_tiny_gpt2(args.dir))
    return 0


def cmd_cache(args) -> int:
    from aotlm.compile_cache import CompileCache

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = CompileCache.create(args.cache_dir)
    if cache.dir is None:
        why = caught[-1].message if caught else "no directory"
        raise ValueError(f"{why}; pass --cache-dir with a writable directory")
    if args.action == "list":
        entries = cache.entries()
        rows = []
        for e in entries:
            f = e.get("fields", {})
            arch = f.get("model", {}).get("arch", "")
            mt = arch.split("model_type='")[1].split("'")[0] if "model_type='" in arch else "?"
            rows.append(
                (
                    e["key"][:12],
                    mt,
                    " ".join(map(str, f.get("graph", []))),
                    f.get("model", {}).get("batch_size", "?"),
                    f.get("model", {}).get("amp", "?"),
                    f.get("model", {}).get("tp_degree", "?"),
                    f"{e.get('bytes', 0) / 1024:.0f} KB",
                    time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"])),
                )
            )
        print(table(rows, ("key", "model", "graph", "batch", "amp", "tp", "size", "last used")))
        print(
            f"{len(entries)} entries, {sum(e.get('bytes', 0) for e in entries) / 2**20:.1f} MB in {cache.dir}"
        )
    elif args.action == "verify":
        bad = cache.verify()
        for key, why in bad:
            print(f"CORRUPT {key}: {why}")
        print(f"{len(cache.entries())} entries checked, {len(bad)} corrupt")
        return 1 if bad else 0
    elif args.action == "clear":
        n = cache.clear(args.older_than)
        print(f"removed {n} entries from {cache.dir}")
    return 0


# Front-end commands live in their own modules, each with ``register(subparsers)``.
COMMAND_MODULES: tuple[str, ...] = (
    "aotlm.cli_text",
    "aotlm.cli_tune",
    "aotlm.cli_batch",
    "aotlm.cli_h5",
    "aotlm.cli_jsonl",
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    ap = _Parser(prog="aotlm", description="ahead-of-time compiled HF causal LMs on JAX")
    sub = ap.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    p = sub.add_parser("demo", help="make a tiny checkpoint, compile and sample from it")
    p.add_argument("--dir", default="tiny-gpt2")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("make-tiny", help="write the tiny random-init GPT-2 checkpoint")
    p.add_argument("dir")
    p.set_defaults(fn=cmd_make_tiny)
    p = sub.add_parser("compile", help="compile every bucket graph into the compile cache")
    add_model_args(p)
    p.add_argument("--dry-run", action="store_true", help="print graphs and memory plan, compile nothing")
    p.add_argument(
        "--device-memory-gb", type=float, default=None, help="fail if weights + KV cache do not fit"
    )
    p.add_argument(
        "--output-artifacts",
        default=None,
        metavar="DIR",
        help="also write relocatable artifacts for aotlm run",
    )
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("sample", help="greedy generation from comma-separated token ids")
    add_model_args(p)
    p.add_argument(
        "--prompt-ids", type=_int_list, action="append", required=True, help="e.g. 1,2,3 (repeat for a batch)"
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.set_defaults(fn=cmd_sample)
    p = sub.add_parser("cache", help="inspect or maintain the compile cache")
    p.add_argument("action", choices=["list", "verify", "clear"])
    p.add_argument("--cache-dir", default=None)
    p.add_argument(
        "--older-than", type=_days, default=None, metavar="DAYS", help="clear: only entries unused this long"
    )
    p.set_defaults(fn=cmd_cache)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    from aotlm.models.checkpoint import CheckpointError

    # warnings (e.g. an unusable compile cache) as one line each, not file:line + source
    old_format = warnings.formatwarning
    warnings.formatwarning = lambda msg, cat, *a, **k: f"aotlm {args.command}: warning: {msg}\n"
    try:
        return args.fn(args)
    except (ValueError, TypeError, CheckpointError, OSError) as e:  # includes MemoryPlanError
        msg = " ".join(str(e).split())  # one line, whatever the source's formatting
        print(f"aotlm {args.command}: error: {msg}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = old_format


if __name__ == "__main__":
    sys.exit(main())
