"""Batch-job commands: ``run`` here, ``run-h5`` in cli_h5.py, ``batch-generate`` in cli_jsonl.py.

aotlm run --artifacts DIR --checkpoint CKPT (--prompt-ids 1,2 | --prompt TEXT | --prompts-file F)
aotlm run-h5 --params params.yaml --checkpoint CKPT --model-dir DIR [--compile-only] [--inference-steps N]
aotlm batch-generate --input setup.jsonl --output out.jsonl [--model CKPT] [--dry-run] [--resume]
aotlm batch-merge --output out.jsonl out.0.jsonl out.1.jsonl ...   (re-join --shard outputs)
"""

from __future__ import annotations

import json
import logging
import time

from aotlm.cli.common import add_table_flags, check_room, counted, int_list, setup_logging, table_values
from aotlm.core.compile_cache import CompileCounter
from aotlm.generate import rows
from aotlm.jobs.artifact_run import load_from_artifacts
from aotlm.jobs.model_refs import load_tokenizer, resolve
from aotlm.jobs.plan import json_records
from aotlm.text.tokens import eos_ids

log = logging.getLogger("aotlm.jobs.batch")


# ---------------------------------------------------------------------------- run
def _run_prompts(args, tokenizer_dir):
    """[(record to echo, token ids)] from --prompt-ids / --prompt / --prompts-file (checked before the
    executables load; a record's other fields are echoed)."""
    items = [({"prompt_ids": ids}, ids) for ids in args.prompt_ids or []]
    texts = [{"prompt": t} for t in args.prompt or []]
    for i, t in enumerate(args.prompt or [], 1):
        if not t:
            raise ValueError(f"--prompt number {i} is empty; give at least one character")
    for _, where, rec in json_records(args.prompts_file, None) if args.prompts_file else ():
        if "prompt_ids" in rec:
            ids = rec["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of token ids (ints)")
            items.append((rec, ids))
        elif isinstance(rec.get("prompt"), str) and rec["prompt"]:
            texts.append(rec)
        else:
            raise ValueError(f"{where}: needs a non-empty 'prompt' string or a 'prompt_ids' list")
    tok = None
    if texts:
        if tokenizer_dir is None:
            raise ValueError(
                "text prompts need a tokenizer: none found next to the checkpoint; pass --tokenizer"
            )
        tok = load_tokenizer(tokenizer_dir)
        items += [(rec, tok(rec["prompt"])["input_ids"]) for rec in texts]
    if not items:
        raise ValueError("no prompts: give --prompt-ids, --prompt or --prompts-file")
    return items, tok


def cmd_run(args) -> int:
    setup_logging(args.quiet)
    counter = CompileCounter()

    ckpt, tok_dir = resolve(args.checkpoint, args.tokenizer, need_tokenizer=False)
    t0 = time.perf_counter()
    items, tok = _run_prompts(args, tok_dir)
    log.info("loading model %s with the executables in %s", ckpt, args.artifacts)
    model = load_from_artifacts(args.artifacts, ckpt)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    fix = "lower --max-new-tokens or recompile with aotlm compile --n-positions {need} --output-artifacts DIR"
    check_room([len(ids) for _, ids in items], args.max_new_tokens, model.n_positions, fix)
    t1 = time.perf_counter()
    eos = [args.eos_token_id] if args.eos_token_id is not None else []
    if not eos and tok is not None:  # text prompts stop where aotlm generate stops
        eos = eos_ids(ckpt, model.hf_config, tok)
    sampling = table_values(args)
    n = len(items)
    prompts = [ids for _, ids in items]
    results = rows.generate(model, prompts, [args.max_new_tokens] * n, [sampling] * n, eos_token_id=eos)
    for (rec, _), res in zip(items, results, strict=True):
        if "prompt" in rec and tok is not None:
            out = {**rec, "completion": tok.decode(res.tokens, skip_special_tokens=True)}
            print(json.dumps({**out, "finish_reason": res.finish_reason}, ensure_ascii=False))
        elif args.prompts_file:
            print(json.dumps({**rec, "completion_ids": res.tokens, "finish_reason": res.finish_reason}))
        else:
            print(",".join(map(str, rec["prompt_ids"] + res.tokens)))
    log.info(
        "%s in %.2fs (load %.2fs); %d graphs from %s; this process: %s",
        counted(len(items), "prompt"),
        time.perf_counter() - t1,
        t1 - t0,
        len(model.graph_keys()),
        args.artifacts,
        counter,
    )
    return 0


def register(sub) -> None:
    p = sub.add_parser("run", help="generate from compiled artifacts (aotlm compile --output-artifacts)")
    p.add_argument("--artifacts", required=True, help="directory written by aotlm compile --output-artifacts")
    p.add_argument("--checkpoint", required=True, help="checkpoint with the architecture compiled in")
    p.add_argument("--prompt-ids", type=int_list, action="append", help="e.g. 1,2,3 (repeatable)")
    p.add_argument("--prompt", action="append", help="text prompt (repeatable; needs a tokenizer)")
    p.add_argument("--prompts-file", help="JSONL, one {'prompt': text} or {'prompt_ids': [...]} per line")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: next to the checkpoint)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--eos-token-id", type=int, default=None, help="default: the checkpoint's for text prompts"
    )
    add_table_flags(p)  # --do-sample, --temperature, ...: sampling needs no extra graphs
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_run)
