"""``aotlm generate``: text in, JSON lines out (gpt-simple semantics).

Prompts come from ``--prompt`` (repeatable) or ``--prompts-file`` (JSONL, one
``{"prompt": ...}`` per line; other fields are echoed). Each output line is the input record
plus ``completion``, ``finish_reason``, a ``generation`` block (the parameters used, model
path, dtype) and ``timing``, so ``aotlm generate ... | jq -r .completion`` works. Everything
that can be wrong with the input is checked before the model is loaded.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from aotlm import progress
from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.cli.common import (
    add_model_args,
    add_sampling_args,
    check_room,
    distinct_files,
    generation_settings,
    graphs_ready,
    model_kwargs,
    setup_logging,
)
from aotlm.core import buckets as bk
from aotlm.generate import lookup
from aotlm.generate.constraints import Constraint, ConstraintError, from_response_format
from aotlm.generate.constraints import check as check_constraint
from aotlm.models.checkpoint.resolve import default_model, expand, shown, validate_checkpoint
from aotlm.text import tokens as text
from aotlm.text.pipeline import TextGenerationPipeline

log = logging.getLogger("aotlm")


DEFAULT_MAX_NEW_TOKENS = 64


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from prompts (JSON lines out)")
    p.add_argument(
        "--model", default=default_model(), help="checkpoint dir, training run dir or bundled name"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: next to the checkpoint or run)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeat for several)")
    p.add_argument("--prompts-file", default=None, help='JSONL, one {"prompt": ...} per line ("-": stdin)')
    p.add_argument("--output", default=None, help="write JSON lines to this file (default stdout)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default: the checkpoint's generation_config.json, else {DEFAULT_MAX_NEW_TOKENS}",
    )
    p.add_argument("--return-full-text", action="store_true", help="completion = prompt + generated text")
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="constrain every answer to this JSON schema (structured outputs; a prompts-file record's "
        '"response_format", OpenAI-shaped, constrains that record)',
    )
    add_sampling_args(p)
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
    add_model_args(p, checkpoint=False)
    p.set_defaults(fn=cmd_generate)


# ---------------------------------------------------------------------- reading prompts
def readable(path: Path, what: str) -> Path:
    """``path`` if it can be read as a file (a pipe such as ``<(...)`` too); else a one-line error."""
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist")
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a file")
    return path


def read_prompts(args) -> list[dict]:
    """Input records, each with a non-empty ``prompt`` string; errors name the line."""
    if args.prompt is not None and args.prompts_file is not None:
        raise ValueError("give --prompt or --prompts-file, not both")
    if args.prompt is not None:
        for i, text in enumerate(args.prompt, 1):
            if not text:
                raise ValueError(f"--prompt number {i} is empty; give at least one character")
        return [{"prompt": t} for t in args.prompt]
    if args.prompts_file is None:
        raise ValueError('give --prompt TEXT or --prompts-file FILE.jsonl (one {"prompt": ...} per line)')
    name = args.prompts_file
    if name == "-":
        lines = sys.stdin.read().splitlines()
    else:
        path = readable(expand(name), "prompts file")
        lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} line {n}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict):
            raise ValueError(f'{name} line {n}: expected a JSON object like {{"prompt": "..."}}')
        if "prompt" not in rec:
            raise ValueError(f'{name} line {n}: no "prompt" field')
        if not isinstance(rec["prompt"], str):
            raise ValueError(f'{name} line {n}: "prompt" must be a string')
        if not rec["prompt"]:
            raise ValueError(f"{name} line {n}: the prompt is empty")
        records.append(rec)
    if not records:
        raise ValueError(f"{name} holds no prompts")
    return records


# ---------------------------------------------------------------------- shapes
def default_shapes(kw: dict, lengths: list[int], max_new: int, max_positions: int | None) -> dict:
    """Shapes the user did not set: batch 1 (one prompt) or 4; the smallest n_positions of the
    ladder 128, 256, 512... that holds the longest request, so repeated runs hit the cache."""
    out = dict(kw)
    if "batch_size" not in out:
        out["batch_size"] = 1 if len(lengths) == 1 else 4
    if "n_positions" not in out:
        need, n = max(lengths) + max_new, 128
        while n < need:
            n *= 2
        if max_positions is not None and n > max_positions >= need:
            n = max_positions
        out["n_positions"] = n
    return out


def _max_positions(config_file: Path) -> int | None:
    cfg = json.loads(config_file.read_text())
    for k in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"):
        if isinstance(cfg.get(k), int):
            return cfg[k]
    return None


# ---------------------------------------------------------------------- output
class _Output:
    """JSON lines to stdout, or to a temp file renamed onto ``--output`` at the end (never half-written)."""

    def __init__(self, target: str | None):
        self.target = target
        self.tmp = None
        if target is not None:
            path = expand(target)
            if not path.parent.is_dir():
                raise ValueError(f"--output directory {path.parent} does not exist")
            self.path = path
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            self.tmp, self.f = tmp, os.fdopen(fd, "w", encoding="utf-8")
        else:
            self.f = sys.stdout

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.f.flush()

    def close(self, ok: bool) -> None:
        if self.tmp is None:
            return
        self.f.close()
        if ok:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)


# ---------------------------------------------------------------------- the command
def cmd_generate(args) -> int:
    if args.quiet:
        progress.set_enabled(False)
    setup_logging(args.quiet)
    distinct_files(args.prompts_file, args.output, "--prompts-file and --output")
    records = read_prompts(args)
    specs = record_constraints(args, records)
    if args.stream and len(records) != 1:
        raise ValueError(f"--stream prints one prompt as it is generated; got {len(records)} prompts")
    files = validate_checkpoint(args.model, args.tokenizer)
    tok = text.load_tokenizer(files.tokenizer)
    lengths = [len(r) for r in text.encode(tok, [r["prompt"] for r in records])]
    generation_settings(args, files.checkpoint, lengths, DEFAULT_MAX_NEW_TOKENS, tok)
    kw = default_shapes(model_kwargs(args), lengths, args.max_new_tokens, _max_positions(files.config))
    check_room(
        lengths,
        args.max_new_tokens,
        kw["n_positions"],
        "raise --n-positions to {need} or lower --max-new-tokens",
    )
    output = _Output(args.output)
    ok = False
    try:
        gens, model = _generate(args, files, tok, kw, [r["prompt"] for r in records], specs)
        if not (args.stream and args.output is None):  # streamed to stdout: the record only to --output
            for rec, g in zip(records, gens, strict=True):
                output.write(_record(rec, g, args, files, model))
        ok = True
    finally:
        output.close(ok)
    return 0


def needed_graphs(model, lengths: list[int], max_new: int, gen: dict | None = None) -> list[tuple]:
    """The graphs these prompts use (of ``model.graph_keys()``, and prompt lookup's rounds when
    ``gen`` asks for them), compiled ahead of generation (``model.executable``).

    Not every bucket: a short prompt needs neither the larger context buckets nor the chunked
    prefill graphs, and skipping them makes a cold first run (the README's first command) faster.
    """
    rounds = []
    k = (gen or {}).get("prompt_lookup_num_tokens")
    if k is not None and getattr(model, "strategies", None) is not None:  # pp models refuse lookup later
        last = min(max(lengths) + max_new, model.n_positions)
        rounds = lookup.graph_keys(model, k, gen.get("max_matching_ngram_size"), min(lengths), last)
    keys = {("select",)}
    for n in set(lengths):  # a batch is padded to the length of one of its prompts
        keys |= {
            ("prefill", s.bucket, s.width) for s in bk.prefill_plan(n, model.ctx_buckets, model.tg_buckets)
        }
    for slot in range(min(lengths), min(max(lengths) + max_new, model.n_positions)):
        keys.add(("decode", bk.decode_bucket(model.tg_buckets, slot)))
    staged = {"prefill": "pp_prefill", "decode": "pp_step"}  # pipeline stages: ("stage", s, *key)
    keys |= {(staged.get(k[0], k[0]), *k[1:]) for k in keys}
    return [k for k in model.graph_keys() if k in keys or k[2:] in keys] + rounds


def prepare_graph(model, key: tuple) -> None:
    """Compile (or load) one of ``needed_graphs``: a bucket graph, or a prompt-lookup round's graph
    (compiled on first use otherwise: not one of ``graph_keys()``)."""
    if key[0] == "lookup":
        model.executable(key)
    else:
        model.compile_graph(key)


def record_constraints(args, records: list[dict]) -> list | None:
    """One ``Constraint`` or None per record: ``--json-schema FILE``, or a record's own
    ``response_format``; None when nothing is constrained. Errors name the file or record."""
    default = None
    if args.json_schema is not None:
        path = readable(expand(args.json_schema), "--json-schema:")
        try:
            default = Constraint.json_schema(path.read_text(encoding="utf-8"))
            check_constraint(default)  # before the model loads
        except ConstraintError as e:
            raise ValueError(f"--json-schema {path}: {e}") from None
    out = []
    for i, rec in enumerate(records, 1):
        try:
            own = from_response_format(rec.get("response_format"))
            if own is not None:
                check_constraint(own)
        except ConstraintError as e:
            raise ValueError(f"record {i}: {e}") from None
        out.append(own or default)
    return out if any(c is not None for c in out) else None


def _generate(args, files, tok, kw: dict, prompts: list[str], constraints=None):
    t0 = time.perf_counter()
    model = AutoModelForSampling.from_pretrained(files.checkpoint, **kw)
    t_load, t0 = time.perf_counter() - t0, time.perf_counter()
    lengths = [len(r) for r in text.encode(tok, prompts)]
    for key in progress.bar(
        needed_graphs(model, lengths, args.max_new_tokens, args.gen), "compiling buckets", unit="graph"
    ):
        prepare_graph(model, key)
    ready = graphs_ready(model, time.perf_counter() - t0)
    log.info("%s: weights loaded in %.2fs; %s", shown(files.checkpoint), t_load, ready)
    pipe = TextGenerationPipeline(model, tok, progress_bars=not args.quiet)
    gen_kw = dict(args.gen)
    streamer = None
    if args.stream:
        streamer = text.TextStreamer(tok)
        if args.return_full_text:
            sys.stdout.write(prompts[0])
            sys.stdout.flush()
    gens = pipe.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        streamer=streamer,
        constraint=constraints,
        **gen_kw,
    )
    if streamer is not None:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return gens, model


def _record(rec: dict, g, args, files, model) -> dict:
    gen = {
        "model": shown(files.checkpoint),
        "tokenizer": shown(files.tokenizer),
        "dtype": model.amp,
        "batch_size": model.batch_size,
        "n_positions": model.n_positions,
        "max_new_tokens": args.max_new_tokens,
        "return_full_text": bool(args.return_full_text),
        "do_sample": bool(args.gen.get("do_sample", False)),
    }
    gen.update({k: v for k, v in args.gen.items() if k != "do_sample"})
    if args.stop:
        gen["stop"] = list(args.stop)
    new = len(g.tokens)
    timing = {
        "prompt_tokens": g.prompt_tokens,
        "new_tokens": new,
        "time_to_first_token_s": None if g.time_to_first_token is None else round(g.time_to_first_token, 4),
        "batch_seconds": round(g.seconds, 4),
        "tokens_per_s": round(new / g.seconds, 2) if g.seconds > 0 else None,
    }
    out = dict(rec)
    out["completion"] = (g.prompt + g.text) if args.return_full_text else g.text
    out["finish_reason"] = g.finish_reason
    out["generation"] = gen
    out["timing"] = timing
    return out
