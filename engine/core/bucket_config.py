"""Bucket-config files: the tuner's output, read by ``from_pretrained(bucket_config=...)`` and
``aotlm compile --config``.

A JSON object with ``n_positions`` (list of token buckets), ``context_length_estimate`` (list of
context buckets) and optionally ``batch_size``. Lists are used exactly as given (a one-element
``n_positions`` list is one bucket, not "powers of two up to it"). Arguments passed explicitly to
``from_pretrained`` win over the file, as command-line flags win over ``--config``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from aotlm.durable import atomic_write_bytes

KEYS = ("n_positions", "context_length_estimate", "batch_size")


def _ints(v: Any, key: str) -> list[int] | int:
    ok = lambda x: isinstance(x, int) and not isinstance(x, bool) and x > 0
    if ok(v) or (isinstance(v, list) and v and all(ok(x) for x in v)):
        return v
    raise ValueError(f"bucket config: {key} must be a positive int or a non-empty list of them, got {v!r}")


def load_bucket_config(source: str | os.PathLike | Mapping) -> dict:
    """Read and validate a bucket config (a path to JSON, or a dict)."""
    if isinstance(source, Mapping):
        data, where = dict(source), "bucket_config"
    else:
        where = os.fspath(source)
        try:
            data = json.loads(open(where).read())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read bucket config {where}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a bucket config is a JSON object with keys {list(KEYS)}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {list(KEYS)}")
    for k, v in data.items():
        _ints(v, k)
    if isinstance(data.get("batch_size"), list):
        raise ValueError(f"{where}: batch_size must be one positive int")
    return data


def resolve(source, **explicit) -> dict:
    """Merge a bucket config under explicit arguments (``None`` = not given)."""
    merged = load_bucket_config(source)
    merged.update({k: v for k, v in explicit.items() if v is not None})
    return merged


def write_bucket_config(path: str | os.PathLike, ctx, tg, batch_size: int | None = None) -> dict:
    data: dict = {"n_positions": sorted(int(w) for w in tg), "context_length_estimate": sorted(map(int, ctx))}
    if batch_size is not None:
        data["batch_size"] = int(batch_size)
    load_bucket_config(data)
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())  # never half-written
    return data
