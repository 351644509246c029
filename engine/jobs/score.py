"""``aotlm score``: JSONL texts (or context/continuation pairs) in, log-likelihoods out.

Record kinds (one per line; ``id`` and ``meta`` pass through, other fields are an error):

* ``{"text": str}`` / ``{"input_ids": [int, ...]}``: the whole text's log-likelihood. A text is
  tokenized without special tokens and its first token conditioned on the tokenizer's bos (else
  eos), as lm-eval's ``loglikelihood_rolling``; token ids score every id after the first (the
  first is context only, like transformers' ``labels=input_ids`` loss). Longer than the model's
  window: rolling windows (``--max-length``, ``--stride``; ``aotlm.text.scoring``).
* ``{"context": str, "continuation": str}`` / ``{"context_ids": [...], "continuation_ids": [...]}``:
  the continuation's log-likelihood and whether greedy decoding would produce it (lm-eval's
  ``loglikelihood``).

Conventions of the batch front ends: every line is validated before the model loads (a malformed
line stops the run, exit 2), per-record problems found later (an empty text, a continuation
too long) become an ``error`` field, results are appended whole-line and synced per chunk, and
the finished file is rewritten in input order atomically; ``--resume`` skips records already
written (by ``id``, else by input line); ``--shard I/N`` takes records ``k % N == I``.
"""

from __future__ import annotations

import dataclasses
import logging

from aotlm.durable import JsonlAppender
from aotlm.jobs.batch import done_keys, is_done, rewrite_in_order
from aotlm.jobs.plan import json_records
from aotlm.text import scoring

log = logging.getLogger("aotlm.jobs.score")
KINDS = {  # record kind -> its fields
    "text": ("text",),
    "ids": ("input_ids",),
    "pair": ("context", "continuation"),
    "pair_ids": ("context_ids", "continuation_ids"),
}
PASS_THROUGH = {"id", "meta"}
FIELDS = PASS_THROUGH | {f for fs in KINDS.values() for f in fs}
CHUNK = 64  # records per scoring call: results are written (and synced) per chunk


@dataclasses.dataclass
class ScoreRecord:
    line: int
    data: dict
    kind: str


def _ids(value, where: str, name: str, vocab: int) -> list[int]:
    ok = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    if not ok:
        raise ValueError(f"{where}: {name!r} must be a list of token ids (integers)")
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{where}: {name!r} holds {bad[0]}, outside the vocabulary [0, {vocab})")
    return value


def parse(path: str, vocab: int) -> list[ScoreRecord]:
    """Every record, validated (JSON, fields, types, id ranges); nothing tokenized or loaded."""
    records = []
    for n, where, rec in json_records(path, FIELDS):
        kinds = [k for k, fs in KINDS.items() if any(f in rec for f in fs)]
        if len(kinds) != 1 or not all(f in rec for f in KINDS[kinds[0]]):
            raise ValueError(
                f"{where}: give exactly one of 'text', 'input_ids', 'context' + 'continuation' or "
                "'context_ids' + 'continuation_ids'"
            )
        kind = kinds[0]
        for name in KINDS[kind]:
            if kind in ("text", "pair") and not isinstance(rec[name], str):
                raise ValueError(f"{where}: {name!r} must be a string")
            if kind in ("ids", "pair_ids"):
                _ids(rec[name], where, name, vocab)
        records.append(ScoreRecord(n, rec, kind))
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def select_shard(records: list[ScoreRecord], shard: tuple[int, int]) -> list[ScoreRecord]:
    i, n = shard
    return [r for k, r in enumerate(records) if k % n == i]


def _request(r: ScoreRecord, tok, prefix: int | None, n_positions: int):
    """(kind, token ids) for the scorer, or raise ValueError for a soft per-record error."""
    d = r.data
    if r.kind == "text":
        if tok is None:
            raise ValueError("text records need a tokenizer; pass --tokenizer")
        ids = tok(d["text"], add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError("empty text: nothing to score")
        return "rolling", (ids, prefix)
    if r.kind == "ids":
        if len(d["input_ids"]) < 2:
            raise ValueError("'input_ids' needs at least 2 ids (the first is context only)")
        return "rolling", (d["input_ids"][1:], d["input_ids"][0])
    if r.kind == "pair":
        if tok is None:
            raise ValueError("context/continuation records need a tokenizer; pass --tokenizer")
        ctx, cont = scoring.encode_pair(tok, d["context"], d["continuation"], prefix)
    else:
        ctx, cont = d["context_ids"], d["continuation_ids"]
    if not cont:
        raise ValueError("empty continuation: nothing to score")
    if not ctx:
        raise ValueError("empty 'context_ids': give at least one token (e.g. the eos id)")
    if len(cont) > n_positions:
        raise ValueError(f"a continuation of {len(cont)} tokens does not fit n_positions={n_positions}")
    return "pair", (ctx, cont)


def _score_chunk(model, chunk, tok, prefix, opts) -> list[dict]:
    """Score a chunk of records in one ``loglikelihood`` call (text windows and pairs share batches)."""
    outs, owners, pairs = {}, [], []
    for r in chunk:
        try:
            kind, (a, b) = _request(r, tok, prefix, model.n_positions)
        except ValueError as e:
            outs[r.line] = {"error": f"ValueError: {e}"}
            continue
        new = (
            [(a, b)] if kind == "pair" else scoring.rolling_windows(a, b, opts["max_length"], opts["stride"])
        )
        owners += [(r, kind, len(a) if kind == "rolling" else len(b))] * len(new)
        pairs += new
    sums: dict = {}
    for (r, kind, n), (lp, greedy) in zip(owners, scoring.loglikelihood(model, pairs), strict=True):
        lp0, g0 = sums.get(r.line, (0.0, True))
        sums[r.line] = (lp0 + lp, g0 and greedy)
        if kind == "pair":
            outs[r.line] = {"tokens": n, "logprob": lp, "is_greedy": greedy}
        else:
            s = scoring.TextScore.of(n, sums[r.line][0])
            outs[r.line] = {"tokens": n, "logprob": s.logprob, "nats_per_token": s.nats_per_token,
                            "perplexity": s.perplexity}  # fmt: skip
    block = {"model": opts["model"], "dtype": opts["amp"], "max_length": opts["max_length"],
             "stride": opts["stride"]}  # fmt: skip
    return [{**r.data, "input_line": r.line, **outs[r.line], "scoring": block} for r in chunk]


def run(
    model, tok, records: list[ScoreRecord], output: str, resume: bool, opts: dict
) -> tuple[int, int, dict]:
    """Score ``records`` into ``output``; returns (written, errors, totals over text records)."""
    prefix = scoring.prefix_token(tok) if tok is not None else None
    lines, ids = done_keys(output) if resume else (set(), set())
    todo = [r for r in records if not is_done(r, lines, ids)]
    if len(todo) < len(records):
        log.info("resume: %d records already in %s", len(records) - len(todo), output)
    sink = JsonlAppender(output)
    written = errors = 0
    try:
        for lo in range(0, len(todo), CHUNK):
            outs = _score_chunk(model, todo[lo : lo + CHUNK], tok, prefix, opts)
            sink.write(outs)
            written += len(outs)
            errors += sum("error" in o for o in outs)
            log.info("scored %d / %d records", lo + len(outs), len(todo))
    finally:
        sink.close()
    recs = rewrite_in_order(output)
    texts = [o for o in recs if "nats_per_token" in o]
    n_tok = sum(o["tokens"] for o in texts)
    total = {"records": len(texts), "tokens": n_tok, "logprob": sum(o["logprob"] for o in texts)}
    return written, errors, total
