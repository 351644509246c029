"""``aotlm run-batch``: an OpenAI batch file run on the serving engine (vLLM's ``run-batch``).

aotlm run-batch -i requests.jsonl -o results.jsonl [CHECKPOINT | --model M] [aotlm serve's engine flags]

Every line of the input is a Batch API request (``aotlm.serve.batch_file``: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``, ``/v1/embeddings``); the output gets one Batch API record
per request, in input order, each written whole and synced. Run again on the same output, it answers
only the requests it does not hold yet. Up to ``--concurrency`` requests are in flight (default: twice
the slots), so the engine's continuous batching keeps every slot busy. A bad input file is one line
naming the line (exit code 2) before the model loads; a request the server refuses is that record's
error (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from aotlm.cli.common import SERVE_BATCH
from aotlm.cli.serve import add_engine_args, lacks_extra, prepare, start_engine
from aotlm.durable import JsonlAppender
from aotlm.jobs.plan import json_records
from aotlm.serve import batch_file
from aotlm.serve.adapters import Adapters
from aotlm.serve.app import build_served

log = logging.getLogger("aotlm.serve")
FIELDS = {"custom_id", "method", "url", "body"}  # a Batch API request line's


def register(sub) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL requests) on the serving engine")
    p.add_argument("-i", "--input-file", required=True, help="the Batch API requests, one JSON object a line")
    p.add_argument("-o", "--output-file", required=True, help="the records (appended; a rerun resumes)")
    p.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight (default: twice the slots)"
    )
    add_engine_args(p)
    p.set_defaults(fn=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    if lacks_extra("run-batch"):
        return 2
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if Path(args.input_file).resolve() == Path(args.output_file).resolve():
        raise ValueError("--output-file is the input file; give another path")
    records = json_records(args.input_file, FIELDS)
    lines = batch_file.read_requests(records)  # checked whole before the model loads
    done = batch_file.done_ids(args.output_file)
    todo = [line for line in lines if line.custom_id not in done]
    if done:
        log.info("%s holds %d of the %d requests: running the other %d", args.output_file,
                 len(lines) - len(todo), len(lines), len(todo))  # fmt: skip
    if not todo:
        print(f"aotlm run-batch: all {len(lines)} requests are in {args.output_file}", file=sys.stderr)
        return 0
    variables = prepare(args)
    slots = args.batch_size or SERVE_BATCH
    concurrency = args.concurrency or 2 * slots
    up = start_engine(args, variables, max_queue=concurrency + slots)
    adapters = Adapters(up.model, up.engine, up.name) if up.model.adapter_slots is not None else None
    served = build_served(up.engine, up.tokenizer, up.name, chat_template_kwargs=variables, adapters=adapters,
                          request_defaults=up.defaults, lenient_schemas=args.lenient_schemas)  # fmt: skip
    out = JsonlAppender(args.output_file)
    counts = {"ok": 0, "errors": 0}

    def noted(rec: dict) -> None:
        counts["ok" if rec["response"]["status_code"] == 200 else "errors"] += 1

    t0 = time.perf_counter()
    try:
        asyncio.run(batch_file.run(served, todo, out, concurrency, noted))
    finally:
        out.close()
        up.engine.shutdown(timeout=5.0)
    print(
        f"aotlm run-batch: {len(todo)} requests in {time.perf_counter() - t0:.1f}s: {counts['ok']} answered, "
        f"{counts['errors']} refused (their records hold the error) -> {args.output_file}",
        file=sys.stderr,
    )
    return 0
