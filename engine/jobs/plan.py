"""Pre-flight for ``aotlm batch-generate``: every JSONL record checked before any weights load.

A record is self-describing; only ``prompt`` is required::

    {"id": "q1", "prompt": "def f(x):",
     "model": {"checkpoint": "~/ckpt", "dtype": "bf16", "tokenizer": "$TOK"},   # or "model": "PATH"
     "generation": {"max_new_tokens": 16, "temperature": 0.7, "seed": 3, "stop_sequences": ["\\n\\n"]},
     "response_format": {"type": "json_schema", "json_schema": {"schema": {...}}},   # optional
     "adapter": "sql"}   # optional: a LoRA adapter given as --lora sql=DIR

Bad JSON, a missing prompt, an unknown field, an out-of-range parameter, or a checkpoint or
tokenizer that does not resolve raise ``ValueError("<file> line N: ...")`` (exit code 2);
nothing has been loaded by then. Records sharing (checkpoint, dtype, tokenizer) form one
group: one model load serves all of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from aotlm.core import sampler_params
from aotlm.generate.constraints import Constraint, ConstraintError, from_response_format
from aotlm.generate.params import GREEDY_DEFAULTS
from aotlm.jobs.model_refs import amp_for, expand, load_tokenizer, resolve
from aotlm.models import family_for
from aotlm.models.checkpoint import load_hf_config
from aotlm.models.checkpoint.resolve import default_model
from aotlm.text.unicode import NOT_TEXT, lone_surrogate

TOP_FIELDS = {"prompt", "id", "model", "generation", "metadata", "response_format", "adapter"}
MODEL_FIELDS = {"checkpoint", "output_dir", "dtype", "tokenizer"}

GEN_DEFAULTS = {
    "max_new_tokens": 32,
    **GREEDY_DEFAULTS,
    "return_full_text": False,
    "stop_sequences": [],
}
GEN_FIELDS = set(GEN_DEFAULTS) | {"greedy"}


def _num(v, name, lo=None, hi=None, lo_open=False, integer=False, none_ok=False):
    """Check one generation parameter; returns an error string or None."""
    if v is None and none_ok:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kinds) or (not integer and not math.isfinite(v)):
        return f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}"
    if lo is not None and (v <= lo if lo_open else v < lo):
        return f"{name}={v} is out of range (must be {'>' if lo_open else '>='} {lo})"
    if hi is not None and v > hi:
        return f"{name}={v} is out of range (must be <= {hi})"
    return None


def _table_num(v, p: sampler_params.Param) -> str | None:
    r = p.range
    return _num(v, p.hf, r.lo, r.hi, r.lo_open, p.integer, none_ok=p.default is None)


def check_generation(gen: dict) -> str | None:
    """The first problem in a (merged) generation block, or None."""
    checks = [
        _num(gen["max_new_tokens"], "max_new_tokens", lo=1, integer=True),
        *(_table_num(gen[p.hf], p) for p in sampler_params.TABLE if p.hf in gen and p.range),
    ]
    if not isinstance(gen["do_sample"], bool):
        checks.append(f"do_sample must be true or false, got {gen['do_sample']!r}")
    if not isinstance(gen["return_full_text"], bool):
        checks.append(f"return_full_text must be true or false, got {gen['return_full_text']!r}")
    stops = gen["stop_sequences"]
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        checks.append(f"stop_sequences must be a list of non-empty strings, got {stops!r}")
    return next((c for c in checks if c), None)


@dataclass
class Record:
    line: int  # 1-based line number in the input file
    data: dict  # the input record as given (echoed in the output)
    prompt: str
    gen: dict  # effective generation parameters
    key: tuple  # (checkpoint dir, amp, tokenizer dir): the group
    prompt_ids: list[int] = field(default_factory=list)
    stop_ids: list[list[int]] = field(default_factory=list)
    constraint: Constraint | None = None  # OpenAI-shaped "response_format" (structured outputs)
    adapter: str | None = None  # a LoRA adapter's name (--lora NAME=DIR)


@dataclass
class Group:
    key: tuple
    records: list[Record]
    vocab_size: int = 0
    max_positions: int | None = None
    n_positions: int | list[int] | None = None

    def model_kwargs(self, opts: dict) -> dict:
        """``from_pretrained`` arguments for this group's model (checkpoint and amp from the key)."""
        return dict(
            batch_size=opts["batch_size"],
            n_positions=self.n_positions,
            context_length_estimate=opts.get("context_length_estimate"),
            tp_degree=opts.get("tp_degree") or 1,
            pp_degree=opts.get("pp_degree") or 1,
            amp=self.key[1],
            **opts.get("lora", {}),
        )


def merged_generation(defaults: dict, block, where: str) -> dict:
    if block is None:
        block = {}
    if not isinstance(block, dict):
        raise ValueError(f"{where}: 'generation' must be an object, got {type(block).__name__}")
    unknown = sorted(set(block) - GEN_FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {unknown} in 'generation'; allowed: {sorted(GEN_FIELDS)}"
        )
    gen = {**GEN_DEFAULTS, **defaults, **{k: v for k, v in block.items() if k != "greedy"}}
    if "greedy" in block:
        if not isinstance(block["greedy"], bool):
            raise ValueError(f"{where}: greedy must be true or false, got {block['greedy']!r}")
        if "do_sample" in block and block["do_sample"] == block["greedy"]:
            raise ValueError(f"{where}: greedy={block['greedy']} contradicts do_sample={block['do_sample']}")
        gen["do_sample"] = not block["greedy"]
    problem = check_generation(gen)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return gen


def model_spec(rec: dict, cli: dict, where: str) -> tuple[str, str | None, str]:
    """(checkpoint or run dir, tokenizer or None, amp) named by the record or the CLI."""
    m = rec.get("model")
    path, tok, dtype = cli.get("model"), cli.get("tokenizer"), cli.get("dtype")
    if isinstance(m, str):
        path = m
    elif isinstance(m, dict):
        unknown = sorted(set(m) - MODEL_FIELDS)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown} in 'model'; allowed: {sorted(MODEL_FIELDS)}"
            )
        if "checkpoint" in m and "output_dir" in m:
            raise ValueError(f"{where}: give 'checkpoint' or 'output_dir' in 'model', not both")
        path = m.get("checkpoint", m.get("output_dir", path))
        tok, dtype = m.get("tokenizer", tok), m.get("dtype", dtype)
    elif m is not None:
        raise ValueError(f"{where}: 'model' must be a path or an object, got {type(m).__name__}")
    if not path:
        path = default_model()
    try:
        return str(path), tok, amp_for(dtype)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def json_records(path: str, fields: set | None) -> Iterator[tuple[int, str, dict]]:
    """``(line number, "PATH line N", record)`` for every non-blank line of a JSONL input; invalid
    JSON, a line that is not an object or a field outside ``fields`` (None: any field) is a
    ``ValueError`` naming it."""
    try:
        f = open(expand(path), encoding="utf-8")  # closed by the with below
    except OSError as e:  # missing, a directory, unreadable: one line naming the file
        raise ValueError(
            f"cannot read the input {path} ({e.strerror}); give a JSONL file of records"
        ) from None
    with f:
        for n, line in enumerate(_lines(f, path), 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
            bad_text = lone_surrogate(rec)
            if bad_text is not None:
                raise ValueError(f"{where}: '{bad_text}' {NOT_TEXT}; give valid Unicode")
            unknown = sorted(set(rec) - fields) if fields is not None else []
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(fields)}")
            yield n, where, rec


def _lines(f, path: str) -> Iterator[str]:
    try:
        yield from f
    except UnicodeDecodeError:
        raise ValueError(f"the input {path} is not UTF-8 text; give a JSONL file") from None


def parse(path: str, cli: dict) -> list[Record]:
    """Every record of the input, validated and resolved (no weights, no tokenizer loaded)."""
    resolved: dict = {}
    records = []
    for n, where, rec in json_records(path, TOP_FIELDS):
        prompt = rec.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: missing or empty 'prompt' (a non-empty string is required)")
        gen = merged_generation(cli.get("generation", {}), rec.get("generation"), where)
        spec = model_spec(rec, cli, where)
        if spec[:2] not in resolved:
            try:
                resolved[spec[:2]] = resolve(spec[0], spec[1])
            except ValueError as e:  # CheckpointError too
                raise ValueError(f"{where}: {e}") from e
        ckpt, tok = resolved[spec[:2]]
        try:
            constraint = from_response_format(rec.get("response_format"))
        except ConstraintError as e:
            raise ValueError(f"{where}: {e}") from None
        adapter = rec.get("adapter")
        if adapter is not None and adapter not in cli.get("adapters", ()):
            raise ValueError(f"{where}: adapter {adapter!r} is not given; add --lora {adapter}=DIR")
        records.append(
            Record(n, rec, prompt, gen, (ckpt, spec[2], tok), constraint=constraint, adapter=adapter)
        )
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def group(records: list[Record]) -> list[Group]:
    """Groups in order of first appearance; records keep input order inside a group."""
    groups: dict[tuple, Group] = {}
    for r in records:
        groups.setdefault(r.key, Group(r.key, [])).records.append(r)
    return list(groups.values())


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tokenize(r: Record, tok, vocab_size: int, where: str) -> None:
    """Fill ``r.prompt_ids`` / ``r.stop_ids``; a prompt the model cannot take is a ValueError."""
    r.prompt_ids = list(tok(r.prompt, add_special_tokens=False)["input_ids"]) or []
    if not r.prompt_ids:
        raise ValueError(f"{where}: the prompt tokenizes to no tokens")
    bad = [t for t in r.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} is outside the model's vocabulary ({vocab_size})")
    r.stop_ids = [list(tok(s, add_special_tokens=False)["input_ids"]) for s in r.gen["stop_sequences"]]


def prepare(groups: list[Group], cli: dict, path: str) -> None:
    """Tokenize every prompt and stop string, pick each group's KV-cache length, check limits.

    Loads tokenizers and reads config.json only (no weights). A prompt that cannot fit, or a
    token id the model does not have, is a pre-flight error naming its line.
    """
    tokenizers: dict = {}
    for g in groups:
        ckpt, _, tok_dir = g.key
        hf = load_hf_config(ckpt)
        arch = family_for(hf.model_type).arch_config(hf)
        g.vocab_size = arch.vocab_size
        g.max_positions = arch.max_positions if arch.position == "learned" else None
        if tok_dir not in tokenizers:
            tokenizers[tok_dir] = load_tokenizer(tok_dir)
        tok = tokenizers[tok_dir]
        need, need_line = 0, 0
        for r in g.records:
            tokenize(r, tok, g.vocab_size, f"{path} line {r.line}")
            total = len(r.prompt_ids) + r.gen["max_new_tokens"]
            if total > need:
                need, need_line = total, r.line
        if cli.get("n_positions"):
            g.n_positions = cli["n_positions"]
            cap = max(g.n_positions) if isinstance(g.n_positions, list) else g.n_positions
        else:
            cap = max(32, _pow2_at_least(need))
            if g.max_positions is not None:
                cap = min(cap, g.max_positions)
            g.n_positions = cap
        if need > cap:
            fix = f"raise --n-positions to {need}" if cli.get("n_positions") else "shorten it"
            raise ValueError(
                f"{path} line {need_line}: prompt + max_new_tokens = {need} tokens exceeds the "
                f"{'--n-positions' if cli.get('n_positions') else 'model limit'} of {cap}; "
                f"{fix} or lower max_new_tokens"
            )


def select_shard(groups: list[Group], shard: tuple[int, int]) -> list[Group]:
    """Shard ``I`` of ``N``'s share, each shard loading as few checkpoints as it can.

    With at least ``N`` groups: whole groups (``g % N == I``), so no checkpoint is loaded by two
    shards. With fewer (a one-model job, the usual case): shard ``I`` serves group ``I % G`` only,
    whose records are dealt out among that group's shards (``I``, ``I + G``, ... below ``N``), so
    every shard has work and loads one checkpoint.
    """
    i, n = shard
    if len(groups) >= n or not groups:
        return [g for k, g in enumerate(groups) if k % n == i]
    g = groups[i % len(groups)]
    mine = range(i % len(groups), n, len(groups))  # this group's shards
    part = [r for k, r in enumerate(g.records) if k % len(mine) == mine.index(i)]
    return [dataclasses.replace(g, records=part)] if part else []
