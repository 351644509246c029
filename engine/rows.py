"""Variable-length prompts through a fixed-batch model: one place that calls ``model.sample``.

Batch jobs hand over lists of prompts of any lengths, each with its own ``max_new_tokens``
and sampling settings. This module packs them into the compiled batch size (left padding
+ attention mask), passes per-row settings to the sampler, and returns, per prompt, exactly
its generated tokens and why it ended. Row ends are read back from the output on the host
(the first completed stop sequence or eos, else the row's limit), so the result is the same
whether the device loop stopped the row early or ran on.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# per-row sampling settings understood by model.sample (issue 10); None = the sampler's default
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
GREEDY_DEFAULTS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "seed": None,
}


@dataclass
class RowResult:
    tokens: list[int]  # the generated tokens only (a stop sequence / eos included)
    finish_reason: str  # "stop_sequence" | "eos" | "length"


def sampler_accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.sample).parameters
    except (TypeError, ValueError):
        return False


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


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    sampling: Sequence[dict] | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    eos_token_id: Sequence[int] = (),
) -> list[RowResult]:
    """Generate for every prompt, ``model.batch_size`` rows per call, in input order.

    ``sampling[i]`` holds row ``i``'s settings (keys of ``SAMPLING_KEYS``); one batch mixes
    rows with different settings. ``stop_sequences`` and ``eos_token_id`` apply to every row.
    """
    sampling = list(sampling) if sampling is not None else [{} for _ in prompts]
    out: list[RowResult] = []
    bs = model.batch_size
    for lo in range(0, len(prompts), bs):
        chunk = list(range(lo, min(lo + bs, len(prompts))))
        out += _generate_batch(
            model,
            [prompts[i] for i in chunk],
            [int(max_new_tokens[i]) for i in chunk],
            [sampling[i] for i in chunk],
            stop_sequences,
            eos_token_id,
        )
    return out


def _generate_batch(model, prompts, limits, sampling, stop_sequences, eos) -> list[RowResult]:
    ids, mask = left_pad(prompts)
    n = len(prompts)
    kw: dict = {"attention_mask": mask}
    per_row_limits = sampler_accepts(model, "stop_sequences")  # the issue-10 sampler takes lists
    kw["max_new_tokens"] = _per_row(limits, "max_new_tokens", n) if per_row_limits else max(limits)
    if eos:
        kw["eos_token_id"] = list(eos)
    if stop_sequences and sampler_accepts(model, "stop_sequences"):
        kw["stop_sequences"] = [list(s) for s in stop_sequences]
    for key in SAMPLING_KEYS:
        vals = [s.get(key, GREEDY_DEFAULTS[key]) for s in sampling]
        if all(v == GREEDY_DEFAULTS[key] for v in vals):
            continue
        if key == "seed":  # rows without a seed get a fresh one when their companions have one
            vals = [random.randrange(2**31) if v is None else int(v) for v in vals]
        if not sampler_accepts(model, key):
            raise ValueError(f"{key} is not supported by this aotlm version's sampler (greedy only)")
        kw[key] = _per_row(vals, key, n)
    seqs = np.asarray(model.sample(ids, **kw))
    gen = seqs[:, ids.shape[1] :]
    results = []
    for i in range(n):
        length, reason = row_end(gen[i].tolist(), limits[i], stop_sequences, eos)
        results.append(RowResult([int(t) for t in gen[i, :length]], reason))
    return results
