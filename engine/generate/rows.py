"""Variable-length prompts through a fixed-batch model: one place that calls ``model.sample``.

Batch jobs hand over lists of prompts of any lengths, each with its own ``max_new_tokens``
and sampling settings. This module packs them into the compiled batch size (left padding
+ attention mask), passes per-row settings to the sampler, and returns, per prompt, exactly
its generated tokens and why it ended (the sampler's ``num_generated`` / ``finish_reason``).
Stop sequences the in-graph check cannot take (outside the vocabulary, longer or more than its
static limits) are applied to the returned tokens on the host, with the same semantics.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aotlm.core import graphs
from aotlm.generate.params import GREEDY_DEFAULTS
from aotlm.generate.params import SAMPLING_FIELDS as SAMPLING_KEYS


@dataclass
class RowResult:
    tokens: list[int]  # the generated tokens only (a stop sequence / eos included)
    finish_reason: str  # "stop_sequence" | "eos" | "length"


def left_pad(prompts: Sequence[Sequence[int]], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    n = max(len(p) for p in prompts)
    ids = np.full((len(prompts), n), pad, np.int32)
    mask = np.zeros((len(prompts), n), np.int32)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, n - len(p) :] = p
            mask[i, n - len(p) :] = 1
    return ids, mask


def row_end(
    gen: Sequence[int], limit: int, stop_sequences: Sequence[Sequence[int]] = (), eos: Sequence[int] = ()
) -> tuple[int, str]:
    """(length, reason): where a row's generation ends inside ``gen`` (Cerebras/HF semantics)."""
    eos_set = set(eos)
    for t in range(min(limit, len(gen))):
        for s in stop_sequences:
            if len(s) and t + 1 >= len(s) and list(gen[t + 1 - len(s) : t + 1]) == list(s):
                return t + 1, "stop_sequence"
        if gen[t] in eos_set:
            return t + 1, "eos"
    return min(limit, len(gen)), "length"


def _per_row(values: Sequence, name: str, n: int):
    """A scalar when all rows agree (the cheap path), else the per-row list."""
    vals = list(values)
    if len(vals) != n:
        raise ValueError(f"{name}: {len(vals)} values for {n} prompts")
    return vals[0] if all(v == vals[0] for v in vals) else vals


def _device_stops(stops: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    """The stop sequences the in-graph check can take (in the vocabulary, within its static
    limits); the others are still applied on the host (a sequence outside the vocabulary can
    never be generated anyway)."""
    ok = [list(s) for s in stops if 0 < len(s) <= graphs.MAX_STOP_LEN and all(0 <= t < vocab for t in s)]
    return ok[: graphs.MAX_STOPS]


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    sampling: Sequence[dict] | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    eos_token_id: Sequence[int] = (),
    row_stop_sequences: Sequence[Sequence[Sequence[int]]] | None = None,
    constraints: Sequence | None = None,
    adapters: Sequence[str | None] | None = None,
) -> list[RowResult]:
    """Generate for every prompt, ``model.batch_size`` rows per call, in input order.

    ``sampling[i]`` holds row ``i``'s settings (keys of ``SAMPLING_KEYS``) and
    ``row_stop_sequences[i]`` its stop sequences (default: ``stop_sequences`` for every row);
    one batch mixes rows with different settings. ``eos_token_id`` applies to every row.
    ``constraints[i]``: a callable making row ``i``'s ``constraints.Matcher`` (structured
    outputs; called when its batch runs), or None. ``adapters[i]``: row ``i``'s LoRA adapter name.
    """
    n = len(prompts)
    sampling = list(sampling) if sampling is not None else [{} for _ in prompts]
    stops = list(row_stop_sequences) if row_stop_sequences is not None else [stop_sequences] * n
    out: list[RowResult] = []
    for lo in range(0, n, model.batch_size):
        rows = range(lo, min(lo + model.batch_size, n))
        out += _generate_batch(
            model,
            [prompts[i] for i in rows],
            [int(max_new_tokens[i]) for i in rows],
            [sampling[i] for i in rows],
            [stops[i] for i in rows],
            eos_token_id,
            None if constraints is None else [constraints[i] for i in rows],
            None if adapters is None else [adapters[i] for i in rows],
        )
    return out


def _generate_batch(
    model, prompts, limits, sampling, stops, eos, constraints=None, adapters=None
) -> list[RowResult]:
    ids, mask = left_pad(prompts)
    n = len(prompts)
    kw: dict = {"attention_mask": mask, "max_new_tokens": _per_row(limits, "max_new_tokens", n)}
    if eos:
        kw["eos_token_id"] = list(eos)
    device_stops = [_device_stops(s, model.cfg.vocab_size) for s in stops]
    if any(device_stops):  # one list for every row, or one list per row
        same = all(s == device_stops[0] for s in device_stops)
        kw["stop_sequences"] = device_stops[0] if same else device_stops
    for key in SAMPLING_KEYS:
        vals = [s.get(key, GREEDY_DEFAULTS[key]) for s in sampling]
        if all(v == GREEDY_DEFAULTS[key] for v in vals):
            continue
        if key == "seed":  # rows without a seed get a fresh one when their companions have one
            vals = [random.randrange(2**32) if v is None else int(v) for v in vals]
        kw[key] = _per_row(vals, key, n)
    if constraints is not None and any(c is not None for c in constraints):
        kw["constraints"] = [None if c is None else c() for c in constraints]
    if adapters is not None and any(a is not None for a in adapters):
        kw["adapter"] = list(adapters)
    out = model.sample(ids, return_dict=True, **kw)
    p_len = ids.shape[1]
    results = []
    for i in range(n):
        tokens = [int(t) for t in out.sequences[i, p_len : p_len + int(out.num_generated[i])]]
        length, reason = row_end(tokens, len(tokens), stops[i], eos)  # host-only stop sequences
        results.append(RowResult(tokens[:length], out.finish_reason[i] if reason == "length" else reason))
    return results
