"""``aotlm <command>``: the single command-line entry point.

aotlm demo                      make a tiny checkpoint, compile it, sample from it
aotlm make-tiny DIR             write the tiny random GPT-2 checkpoint
aotlm compile CHECKPOINT ...    compile every bucket ahead of time into the cache
aotlm sample CHECKPOINT ...     greedy generation from token ids
aotlm cache list|verify|clear   inspect and maintain the compile cache
aotlm models                    the real models runnable by name
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings
from collections.abc import Sequence

import numpy as np

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.cli import batch, chat, h5, jsonl, run_batch, score, serve, text, tune
from aotlm.cli.common import (
    _days,
    _Parser,
    add_model_args,
    int_list,
    model_kwargs,
    serve_kwargs,
    table,
)
from aotlm.core.artifacts import save_target
from aotlm.core.compile_cache import CompileCache
from aotlm.core.memory import check_fits, format_plan, plan_for_checkpoint
from aotlm.jobs.artifact_run import save_artifacts
from aotlm.models.checkpoint import CheckpointError, named
from aotlm.tiny import make_tiny_gpt2


def _graph_name(key: tuple) -> tuple[str, str]:
    """(graph, bucket) for tables: ``("prefill", 16, 64)`` -> prefill 16x64; a pipeline stage's
    ``("stage", 1, "pp_step", 64)`` -> stage1:pp_step 64."""
    name, bucket = (f"stage{key[1]}:{key[2]}", key[3:]) if key[0] == "stage" else (key[0], key[1:])
    return name, "x".join(map(str, bucket))


def cmd_compile(args) -> int:
    kw = model_kwargs(args)
    for flag, on in (("--prompt-logprobs", args.prompt_logprobs), ("--embeddings", args.embeddings)):
        if on and not args.serve:
            raise ValueError(f"{flag} adds serving graphs: give --serve too")
    if args.serve:  # the slot graphs `aotlm serve` uses with the same flags
        kw = serve_kwargs(kw, args.checkpoint, args.prompt_logprobs, args.embeddings)
    if args.dry_run or args.device_memory_gb is not None:
        # the plan counts weights as stored (amp, quant); the slot graphs have the plain graphs' shapes
        skip = ("compile_cache", "fuse_qkv", "continuous_batching", "prompt_logprobs", "embeddings")
        plan = plan_for_checkpoint(args.checkpoint, **{k: v for k, v in kw.items() if k not in skip})
        print(format_plan(plan))
        if args.device_memory_gb is not None:
            check_fits(plan, args.device_memory_gb)
        if args.dry_run:
            rows = [(*_graph_name(g), plan["batch_size"]) for g in plan["graphs"]]
            print(table(rows, ("graph", "bucket", "batch")))
            print(f"{len(plan['graphs'])} graphs would be compiled (dry run: nothing compiled)")
            return 0
    if args.output_artifacts:
        save_target(args.output_artifacts)  # a file or a folder of other files: before any load
    t0 = time.perf_counter()
    model = AutoModelForSampling.from_pretrained(args.checkpoint, **kw)
    t_load = time.perf_counter() - t0
    keys = model.graph_keys()
    for i, key in enumerate(keys, 1):
        t = time.perf_counter()
        model.compile_graph(key)
        info = model.compile_report[-1]
        print(
            f"[{i}/{len(keys)}] {' '.join(_graph_name(key))}: "
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
        print(f"artifacts: {save_artifacts(model, args.output_artifacts, kw.get('quant'))}")
    return 0


def cmd_sample(args) -> int:
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
    print(make_tiny_gpt2(args.dir))
    return 0


def cmd_models(args) -> int:
    rows = [
        (r["name"], r["model"], r["license"], f"{r['download_mb']} MB", r["installed"] or "-", r["where"])
        for r in named.listing()
    ]
    print(table(rows, ("name", "model", "license", "download", "installed", "file")))
    print("a name works wherever a model path does: aotlm chat --model NAME, from_pretrained(NAME)")
    return 0


def cmd_cache(args) -> int:
    where = os.path.abspath(args.cache_dir or CompileCache.default_dir())  # as CompileCache reads it
    if not os.path.exists(where):  # looking must not create it (a mistyped --cache-dir)
        if args.action == "clear":
            print(f"nothing to clear: {where} does not exist")
            return 0
        raise ValueError(
            f"no compile cache at {where}: the directory does not exist; give --cache-dir (or "
            "$AOTLM_CACHE_DIR) of the cache the commands wrote"
        )
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
COMMAND_MODULES = (text, chat, tune, batch, h5, jsonl, score, serve, run_batch)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="aotlm", description="ahead-of-time compiled HF causal LMs on JAX")
    sub = ap.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(sub)
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
    p.add_argument(
        "--serve",
        action="store_true",
        help="compile the continuous-batching graphs `aotlm serve` uses with the same flags",
    )
    p.add_argument(
        "--prompt-logprobs", action="store_true", help="with --serve: as `aotlm serve --prompt-logprobs`"
    )
    p.add_argument("--embeddings", action="store_true", help="with --serve: as `aotlm serve --embeddings`")
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("sample", help="greedy generation from comma-separated token ids")
    add_model_args(p)
    p.add_argument(
        "--prompt-ids", type=int_list, action="append", required=True, help="e.g. 1,2,3 (repeat for a batch)"
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.set_defaults(fn=cmd_sample)
    p = sub.add_parser("models", help="list the real models aotlm runs by name (GGUF files from packages)")
    p.set_defaults(fn=cmd_models)
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
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra:  # named by the command they were given to, as its own usage errors are
        sub = f"aotlm {args.command}"
        words = [w for w in extra if not w.startswith("-")]
        hint = (
            f"give a prompt as --prompt {shlex.quote(words[0])}; " if words and "prompt" in vars(args) else ""
        )
        ap.exit(2, f"{sub}: error: unrecognized arguments: {' '.join(extra)}; {hint}see '{sub} --help'\n")

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
