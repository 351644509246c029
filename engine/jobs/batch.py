"""``aotlm batch-generate``: run validated JSONL records group by group (see batch_plan.py).

One model in memory at a time: each group's model is loaded once, serves all of its records
(rows with different sampling settings share batches), then is released before the next.
Results are appended as each batch finishes (``durable.JsonlAppender``: whole lines only), in
completion order, each tagged with its ``input_line``; when every record of the run is done,
the file is rewritten in input order (atomically). ``--resume`` skips records already in the
output (by ``id`` when the record has one, else by input line). Failures that only appear
while generating (e.g. corrupt weight files) become an ``error`` field; the run goes on.
"""

from __future__ import annotations

import gc
import json
import logging
import os

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.durable import JsonlAppender, atomic_write_jsonl, read_jsonl, truncate_partial_line
from aotlm.generate import rows
from aotlm.generate.constraints import Grammars
from aotlm.jobs.model_refs import load_tokenizer
from aotlm.jobs.plan import Group, Record
from aotlm.models.checkpoint.resolve import shown
from aotlm.text.tokens import eos_ids

log = logging.getLogger("aotlm.jobs.batch")
SOFT_ERRORS = (ValueError, TypeError, RuntimeError, OSError, KeyError)


def done_keys(output: str, repair: bool = True) -> tuple[set, set]:
    """(input lines, ids) already present in ``output`` (``repair``: drop a torn last line first)."""
    lines, ids = set(), set()
    if output and os.path.isfile(output):
        if repair:
            truncate_partial_line(output)
        for rec in _whole_lines(output):
            lines.add(rec.get("input_line"))
            if "id" in rec:
                ids.add(json.dumps(rec["id"]))
    return lines, ids


def _whole_lines(path: str):
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n") and line.strip():
                yield json.loads(line)


def is_done(r: Record, lines: set, ids: set) -> bool:
    return json.dumps(r.data["id"]) in ids if "id" in r.data else r.line in lines


def _generation_block(r: Record, g: Group) -> dict:
    gen = {k: v for k, v in r.gen.items()}
    gen.update(model=shown(g.key[0]), dtype=g.key[1], tokenizer=shown(g.key[2]) if g.key[2] else g.key[2])
    return gen


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return (text[: min(ends)], True) if ends else (text, False)


def output_record(r: Record, g: Group, tok, result: rows.RowResult | None, error: str | None) -> dict:
    out = {**r.data, "input_line": r.line}
    if error is not None:
        out["error"] = error
    else:
        text = tok.decode(result.tokens, skip_special_tokens=True)
        text, stopped = _cut_at_stop(text, r.gen["stop_sequences"])
        reason = "stop_sequence" if stopped else result.finish_reason
        out["completion"] = (r.prompt + text) if r.gen["return_full_text"] else text
        out["finish_reason"] = reason
    out["generation"] = _generation_block(r, g)
    return out


def batches(records: list[Record], batch_size: int) -> list[list[Record]]:
    """Every setting is per row, so any records share a batch; sorting by prompt length keeps
    the left padding small."""
    recs = sorted(records, key=lambda r: len(r.prompt_ids))
    return [recs[i : i + batch_size] for i in range(0, len(recs), batch_size)]


def _sampling(r: Record) -> dict:
    return {k: r.gen[k] for k in rows.SAMPLING_KEYS}


_GRAMMARS: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, Grammars): built once per tokenizer


def _matcher(r: Record, model, tok, eos: list[int]):
    """A callable making ``r``'s grammar matcher (None: unconstrained); a bad schema fails the row."""
    if r.constraint is None:
        return None
    if id(tok) not in _GRAMMARS:
        _GRAMMARS[id(tok)] = (tok, Grammars(tok, model.cfg.vocab_size, eos))
    grammars = _GRAMMARS[id(tok)][1]
    return lambda: grammars.matcher(r.constraint)


def _generate(
    model, batch: list[Record], eos: list[int], tok=None
) -> list[tuple[rows.RowResult | None, str | None]]:
    """Results for one batch; if the batch fails, each row alone, so only bad rows get an error."""

    def call(recs):
        return rows.generate(
            model,
            [r.prompt_ids for r in recs],
            [r.gen["max_new_tokens"] for r in recs],
            [_sampling(r) for r in recs],
            row_stop_sequences=[r.stop_ids for r in recs],
            eos_token_id=eos,
            constraints=[_matcher(r, model, tok, eos) for r in recs],
            adapters=[r.adapter for r in recs],
        )

    try:
        return [(res, None) for res in call(batch)]
    except SOFT_ERRORS as e:
        if len(batch) == 1:
            return [(None, f"{type(e).__name__}: {e}")]
    return [_generate(model, [r], eos, tok)[0] for r in batch]


def load_error(g: Group, e: BaseException) -> str:
    """The soft error every record of a group gets when its model cannot be loaded."""
    return f"model {g.key[0]} could not be loaded: {type(e).__name__}: {e}"


def load_group_model(g: Group, opts: dict):
    """A group's model (graphs compiled on first use); raises one of ``SOFT_ERRORS`` when the
    weights are unusable.

    Shared by the plain run and the Ray workers (jobs/ray_jobs.py), so both build the same model.
    """
    return AutoModelForSampling.from_pretrained(
        g.key[0], compile_cache=opts.get("cache_dir"), **g.model_kwargs(opts)
    )


def batch_outputs(model, g: Group, tok, eos: list[int], batch: list[Record]) -> tuple[list[dict], int]:
    """One batch's output records (sorted by input line) and how many carry an error."""
    results = _generate(model, batch, eos, tok)
    outs = [output_record(r, g, tok, res, err) for r, (res, err) in zip(batch, results, strict=True)]
    return sorted(outs, key=lambda o: o["input_line"]), sum(err is not None for _, err in results)


def run_group(g: Group, todo: list[Record], opts: dict, sink: JsonlAppender) -> int:
    """Load the group's model once and write every record; returns the number of errors."""
    ckpt, amp, tok_dir = g.key
    tok = load_tokenizer(tok_dir)
    log.info("loading model %s (dtype %s) for %d records", ckpt, amp, len(todo))
    try:
        model = load_group_model(g, opts)
    except SOFT_ERRORS as e:
        msg = load_error(g, e)
        log.warning("%s; %d records get an error", msg, len(todo))
        sink.write([output_record(r, g, tok, None, msg) for r in sorted(todo, key=lambda r: r.line)])
        return len(todo)

    eos = eos_ids(ckpt, model.hf_config, tok)  # as transformers generate finds them
    errors = 0
    try:
        for batch in batches(todo, model.batch_size):
            outs, n_err = batch_outputs(model, g, tok, eos, batch)
            errors += n_err
            sink.write(outs)
    finally:
        del model  # one model in memory at a time
        gc.collect()
    return errors


def run(groups: list[Group], opts: dict, output: str | None, resume: bool) -> tuple[int, int]:
    """Process ``groups``; returns (records written, errors)."""
    lines, ids = done_keys(output) if resume else (set(), set())
    sink = JsonlAppender(output)
    written = errors = 0
    try:
        for g in groups:
            todo = [r for r in g.records if not is_done(r, lines, ids)]
            skipped = len(g.records) - len(todo)
            if skipped:
                log.info("resume: %d records of %s already in %s", skipped, g.key[0], output)
            if todo:
                errors += run_group(g, todo, opts, sink)
                written += len(todo)
    finally:
        sink.close()
    rewrite_in_order(output)
    return written, errors


def rewrite_in_order(output: str | None) -> list[dict]:
    """When a run is done: the output rewritten (atomically) in input order, one record per input
    line (the first; a Ray task retried after its reply was lost could deliver a batch twice).
    Returns the records written."""
    if not (output and os.path.isfile(output)):
        return []
    first: dict = {}
    for o in read_jsonl(output):
        first.setdefault(o.get("input_line", 0), o)
    recs = [first[k] for k in sorted(first)]
    atomic_write_jsonl(output, recs)
    return recs
