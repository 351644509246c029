"""``aotlm batch-generate`` (JSONL in, JSONL out) and ``aotlm batch-merge`` (re-join shards)."""

from __future__ import annotations

import logging
import os
import sys
import time

from aotlm.cli.common import (
    add_job_args,
    add_table_flags,
    bucket_list,
    counted,
    distinct_files,
    lora_kwargs,
    positive_int,
    setup_logging,
    table,
    table_values,
)  # fmt: skip
from aotlm.durable import atomic_write_jsonl, read_jsonl
from aotlm.jobs import batch, ray_data, ray_jobs
from aotlm.jobs import plan as batch_plan
from aotlm.jobs.dryrun import PLAN_HEADER, plan_rows
from aotlm.jobs.model_refs import amp_for

log = logging.getLogger("aotlm.jobs.batch")


def _cli_defaults(args) -> dict:
    gen = table_values(args)
    if args.max_new_tokens is not None:
        gen["max_new_tokens"] = args.max_new_tokens
    if args.return_full_text:
        gen["return_full_text"] = True
    if args.stop:
        gen["stop_sequences"] = list(args.stop)
    n_pos = args.n_positions
    return {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "dtype": args.dtype,
        "generation": gen,
        "n_positions": (n_pos if len(n_pos) > 1 else n_pos[0]) if n_pos else None,
        "adapters": sorted(_lora(args).get("lora_adapters", {})),
    }


def _lora(args) -> dict:
    """``--lora NAME=DIR`` (repeatable) and ``--max-lora-rank``: adapter slots records name."""
    given = args.lora or []
    if any("=" not in x for x in given):
        raise ValueError("batch-generate takes --lora NAME=DIR (records name the adapter in 'adapter')")
    return lora_kwargs(given, None, args.max_lora_rank)


def cmd_batch_generate(args) -> int:
    setup_logging(args.quiet)

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    distinct_files(args.input, args.output, "--input and --output")
    if os.path.exists(args.output) and os.path.getsize(args.output) and not (args.resume or args.overwrite):
        if not args.dry_run:
            raise ValueError(
                f"{args.output} exists; pass --resume to continue it or --overwrite to replace it"
            )
    check_ray_args(args)
    try:
        amp_for(args.dtype)  # the records' default: named as the flag, not as a record's
    except ValueError as e:
        raise ValueError(f"--dtype: {e}") from None
    cli = _cli_defaults(args)
    merged = batch_plan.merged_generation(cli["generation"], {}, "command-line defaults")
    cli["generation"] = {k: v for k, v in merged.items() if k in cli["generation"]}
    records = batch_plan.parse(args.input, cli)
    groups = batch_plan.group(records)
    batch_plan.prepare(groups, cli, args.input)
    mine = batch_plan.select_shard(groups, args.shard)
    lines, ids = batch.done_keys(args.output, repair=not args.dry_run) if args.resume else (set(), set())
    todo = {id(g): sum(not batch.is_done(r, lines, ids) for r in g.records) for g in mine}
    opts = {
        "batch_size": args.batch_size,
        "context_length_estimate": args.context_length_estimate,
        "tp_degree": args.tp_degree,
        "pp_degree": args.pp_degree,
        "cache_dir": args.cache_dir,
        "lora": _lora(args),
    }
    n_mine = sum(len(g.records) for g in mine)
    i, n = args.shard
    shard = f" (shard {i}/{n}: {n_mine} records in {len(mine)} of {len(groups)} groups)"
    log.info("pre-flight ok: %d records, %d model groups%s", len(records), len(groups), shard)
    if args.dry_run:
        print(table(plan_rows(mine, opts, todo), PLAN_HEADER))
        print(f"dry run: {counted(sum(todo.values()), 'record')} to generate; nothing loaded")
        return 0
    if args.overwrite and os.path.exists(args.output):
        os.remove(args.output)
    t0 = time.perf_counter()
    if args.ray:
        try:
            written, errors, _ = ray_jobs.run_batch_generate(
                mine, opts, args.output, args.resume, args.ray_workers, args.ray_address, args.quiet
            )
        except ray_jobs.RayJobError as e:
            print(f"aotlm batch-generate: error: {e}; finish it with --resume", file=sys.stderr)
            return 1
    else:
        written, errors = batch.run(mine, opts, args.output, args.resume)
    dt = time.perf_counter() - t0
    print(f"{counted(written, 'record')} written to {args.output} in {dt:.2f}s ({errors} with errors)")
    return 0


def cmd_batch_merge(args) -> int:
    """Concatenate shard outputs back into input order (by ``input_line``), refusing duplicates."""
    for path in args.inputs:  # a shard replaced by the merge would be lost if the merge is wrong
        distinct_files(path, args.output, "an input and --output")
    recs = [r for path in args.inputs for r in read_jsonl(path)]
    seen: dict = {}
    for r in recs:
        if "input_line" not in r:
            raise ValueError("a record without 'input_line': merge only batch-generate outputs")
        if r["input_line"] in seen:
            raise ValueError(
                f"input line {r['input_line']} appears twice; were the shards run with one input?"
            )
        seen[r["input_line"]] = r
    atomic_write_jsonl(args.output, [seen[k] for k in sorted(seen)])
    print(f"{counted(len(seen), 'record')} from {counted(len(args.inputs), 'file')} written to {args.output}")
    return 0


def add_ray_args(p) -> None:
    """``--ray``: the same job on a pool of Ray actors (jobs/ray_jobs.py); shared with run-h5."""
    p.add_argument(
        "--ray", action="store_true", help="run the batches on Ray actors (pip install -e '.[ray]')"
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray)")
    p.add_argument("--ray-workers", type=int, default=None, help="Ray actors, one model each (default 2)")


def check_ray_args(args) -> None:
    """Refuse Ray flags without ``--ray`` and a bad worker count; with ``--ray``, fail fast (before
    pre-flight) when Ray is not installed, with the install hint."""
    if not args.ray:
        if args.ray_address or args.ray_workers is not None:
            raise ValueError("--ray-address / --ray-workers only apply with --ray; add --ray")
        return
    if args.ray_workers is None:
        args.ray_workers = 2
    if args.ray_workers < 1:
        raise ValueError(f"--ray-workers must be >= 1, got {args.ray_workers}")
    ray_data.import_ray()


def register(sub) -> None:
    p = sub.add_parser("batch-generate", help="JSONL of prompts -> JSONL of completions, models grouped")
    p.add_argument(
        "--input", required=True, help="JSONL: one {'prompt': ..., 'model': ..., 'generation': ...}"
    )
    p.add_argument(
        "--output", required=True, help="JSONL output (appended per batch, input order at the end)"
    )
    p.add_argument("--model", default=None, help="model for records without one (default: the bundled model)")
    p.add_argument(
        "--tokenizer", default=None, help="default tokenizer dir (default: next to the checkpoint)"
    )
    p.add_argument("--dtype", default=None, help="default dtype: float32 | bfloat16 | float16")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 32")
    add_table_flags(p)
    p.add_argument("--return-full-text", action="store_true")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument(
        "--lora", action="append", default=None, metavar="NAME=DIR",
        help="a PEFT LoRA adapter records may name in 'adapter' (repeatable; one set of graphs for all)",
    )  # fmt: skip
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank (default 16)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="compiled batch size (default 4)")
    p.add_argument(
        "--n-positions", type=bucket_list, default=None, help="KV-cache buckets (default: from the prompts)"
    )
    p.add_argument("--context-length-estimate", type=bucket_list, default=None)
    p.add_argument("--tp-degree", type=positive_int, default=1)
    p.add_argument("--pp-degree", type=positive_int, default=1, help="pipeline stages (pp x tp devices)")
    p.add_argument("--cache-dir", default=None)
    add_job_args(p, "I/N: only model groups with g %% N == I")
    add_ray_args(p)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_batch_generate)
    p = sub.add_parser("batch-merge", help="join batch-generate --shard outputs back into input order")
    p.add_argument("--output", required=True)
    p.add_argument("inputs", nargs="+")
    p.set_defaults(fn=cmd_batch_merge)
