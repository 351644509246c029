"""``aotlm score``: log-likelihoods of JSONL texts or context/continuation pairs (``aotlm.jobs.score``).

aotlm score --input texts.jsonl --output scores.jsonl [--model M] [--stride S] [--max-length L]
            [--dry-run] [--resume | --overwrite] [--shard I/N] [model shape flags]
"""

from __future__ import annotations

import logging
import math
import os
import time

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.cli.common import (
    add_job_args,
    add_model_args,
    counted,
    distinct_files,
    model_kwargs,
    setup_logging,
    table,
)
from aotlm.jobs import score as job
from aotlm.jobs.batch import done_keys, is_done
from aotlm.jobs.dryrun import model_graph_status
from aotlm.jobs.model_refs import load_tokenizer, resolve
from aotlm.models.checkpoint import load_hf_config
from aotlm.models.checkpoint.resolve import default_model, shown

log = logging.getLogger("aotlm.jobs.score")
DEFAULT_BATCH = 4


def _window(args, n_positions: int) -> tuple[int, int]:
    """(max input tokens per window, stride), checked against the model's n_positions."""
    max_len = n_positions if args.max_length is None else args.max_length
    if not 1 <= max_len <= n_positions:
        raise ValueError(f"--max-length must be in [1, n_positions={n_positions}], got {max_len}")
    stride = max_len if args.stride is None else args.stride
    if not 1 <= stride <= max_len:
        raise ValueError(f"--stride must be in [1, --max-length={max_len}], got {stride}")
    return max_len, stride


def cmd_score(args) -> int:
    setup_logging(args.quiet)
    for flag, v in (("--max-length", args.max_length), ("--stride", args.stride)):
        if v is not None and v < 1:  # before the model loads (the upper bounds need its n_positions)
            raise ValueError(f"{flag} must be >= 1, got {v}")
    distinct_files(args.input, args.output, "--input and --output")
    if os.path.exists(args.output) and os.path.getsize(args.output) and not (args.resume or args.overwrite):
        if not args.dry_run:
            raise ValueError(
                f"{args.output} exists; pass --resume to continue it or --overwrite to replace it"
            )
    kw = model_kwargs(args)
    if (kw.get("pp_degree") or 1) > 1:
        raise ValueError(
            "aotlm score runs on one pipeline stage; drop --pp-degree (tp_degree spreads the model)"
        )
    kw.setdefault("batch_size", DEFAULT_BATCH)
    if kw["batch_size"] < 1:
        raise ValueError(f"--batch-size must be >= 1, got {kw['batch_size']}")
    ckpt, tok_dir = resolve(args.model or default_model(), args.tokenizer, need_tokenizer=False)
    records = job.select_shard(job.parse(args.input, load_hf_config(ckpt).vocab_size), args.shard)
    needs_tok = any(r.kind in ("text", "pair") for r in records)
    if needs_tok and tok_dir is None:
        raise ValueError("text records need a tokenizer: none found next to the checkpoint; pass --tokenizer")
    lines, ids = done_keys(args.output, repair=not args.dry_run) if args.resume else (set(), set())
    todo = sum(not is_done(r, lines, ids) for r in records)
    log.info("pre-flight ok: %d records (shard %d/%d), %d to score", len(records), *args.shard, todo)
    kw["scoring"] = True
    if args.dry_run:
        status = [(k, c) for k, c in model_graph_status(ckpt, kw, args.cache_dir) if k[0] == "score"]
        cached = sum(c for _, c in status)
        buckets = ",".join("x".join(map(str, k[1:])) for k, _ in status)
        rows = [(ckpt, f"{todo}/{len(records)}", buckets, f"{len(status) - cached} compile, {cached} cached")]
        print(table(rows, ("model", "records", "score graphs (CxW)", "graphs")))
        print(f"dry run: {counted(todo, 'record')} to score; nothing loaded")
        return 0
    if args.overwrite and os.path.exists(args.output):
        os.remove(args.output)
    t0 = time.perf_counter()
    model = AutoModelForSampling.from_pretrained(ckpt, **kw)
    max_len, stride = _window(args, model.n_positions)
    for key in model.graph_keys():  # only the score graphs: nothing here generates
        if key[0] == "score":
            model.compile_graph(key)
    tok = load_tokenizer(tok_dir) if tok_dir is not None else None
    t1 = time.perf_counter()
    opts = {"model": shown(ckpt), "amp": model.amp, "max_length": max_len, "stride": stride}
    written, errors, total = job.run(model, tok, records, args.output, args.resume, opts)
    dt = time.perf_counter() - t1
    done = counted(written, "record")
    print(
        f"{done} scored into {args.output} in {dt:.2f}s (load + compile {t1 - t0:.2f}s, {errors} with errors)"
    )
    if total["tokens"]:
        nats = -total["logprob"] / total["tokens"]
        texts = f"{counted(total['records'], 'record')}, {counted(total['tokens'], 'token')}"
        print(f"texts: {texts}, {nats:.4f} nats/token, perplexity {math.exp(nats):.2f}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "score", help="log-likelihood / perplexity of JSONL texts or context+continuation pairs"
    )
    p.add_argument(
        "--input", required=True, help="JSONL: {'text'} | {'input_ids'} | {'context','continuation'}"
    )
    p.add_argument("--output", required=True, help="JSONL of scores (input order)")
    p.add_argument(
        "--model", default=None, help="checkpoint dir, run dir or bundled name (default: the bundled model)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: next to the checkpoint)")
    p.add_argument(
        "--max-length", type=int, default=None, help="input tokens per window (default n_positions)"
    )
    p.add_argument(
        "--stride", type=int, default=None, help="new tokens per later window (default --max-length)"
    )
    add_model_args(p, checkpoint=False)
    add_job_args(p, "I/N: only records with k %% N == I")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_score)
