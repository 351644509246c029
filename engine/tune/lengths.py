"""Request-length distributions for bucket tuning: (prompt tokens, new tokens, weight) triples.

Buckets are chosen for the traffic a deployment expects, so the tuner reads that traffic in the
forms people have it: a histogram (JSON or CSV), a JSONL of prompts (tokenized here), a Cerebras
HDF5 file, or a synthetic ``normal:MEAN:STD[:LO:HI]`` spec. Every problem is a ``ValueError``
naming the file and the fix.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass

import numpy as np

COLUMNS = ("prompt_len", "new_tokens", "count")
# a request's output length: these keys, or batch-generate's "generation": {"max_new_tokens": N}
_NEW_KEYS = ("new_tokens", "output_len", "output_tokens", "max_new_tokens", "max_tokens")
_OUT_TEXT_KEYS = ("completion", "output", "response")


@dataclass(frozen=True)
class LengthDist:
    """Unique ``(prompt_len, new_tokens)`` pairs and their probabilities (sum 1)."""

    prompt_len: np.ndarray
    new_tokens: np.ndarray
    weight: np.ndarray

    @property
    def max_prompt(self) -> int:
        return int(self.prompt_len.max())

    @property
    def max_total(self) -> int:
        return int((self.prompt_len + self.new_tokens).max())

    def mean(self, x: np.ndarray) -> float:
        return float(np.sum(self.weight * x))

    def sample(self, n: int, seed: int = 0) -> list[tuple[int, int]]:
        """``n`` requests drawn from the distribution (for replays)."""
        idx = np.random.default_rng(seed).choice(len(self.weight), size=n, p=self.weight)
        return [(int(self.prompt_len[i]), int(self.new_tokens[i])) for i in idx]

    def prompts(self) -> np.ndarray:
        """Every prompt length once per unit of weight resolution (for histograms)."""
        return np.repeat(self.prompt_len, np.maximum(1, np.round(self.weight * 10000).astype(int)))


def from_counts(prompt_len, new_tokens, count, source: str = "the distribution") -> LengthDist:
    """Validate and merge duplicate pairs; weights are normalized counts."""
    p = np.asarray(prompt_len, dtype=np.int64).reshape(-1)
    n = np.asarray(new_tokens, dtype=np.int64).reshape(-1)
    c = np.asarray(count, dtype=np.float64).reshape(-1)
    if not (len(p) == len(n) == len(c)):
        raise ValueError(f"{source}: prompt_len, new_tokens and count have different lengths")
    keep = c > 0
    p, n, c = p[keep], n[keep], c[keep]
    if len(p) == 0:
        raise ValueError(f"{source}: the length distribution is empty; give at least one request")
    if (p < 1).any() or (n < 1).any():
        raise ValueError(f"{source}: prompt_len and new_tokens must be >= 1")
    pairs, inv = np.unique(np.stack([p, n], 1), axis=0, return_inverse=True)
    w = np.bincount(inv.reshape(-1), weights=c)
    return LengthDist(pairs[:, 0].copy(), pairs[:, 1].copy(), w / w.sum())


def with_new_tokens(dist: LengthDist, new_tokens: int) -> LengthDist:
    return from_counts(dist.prompt_len, np.full_like(dist.prompt_len, new_tokens), dist.weight)


def _histogram_json(path: str) -> tuple[LengthDist, bool]:
    data = json.loads(open(path).read())
    if not isinstance(data, dict) or "prompt_len" not in data:
        raise ValueError(f"{path}: expected a JSON object with keys {list(COLUMNS)}")
    p = data["prompt_len"]
    new = data.get("new_tokens", [1] * len(p))
    return from_counts(p, new, data.get("count", [1] * len(p)), path), "new_tokens" in data


def _histogram_csv(path: str) -> tuple[LengthDist, bool]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "prompt_len" not in rows[0]:
        raise ValueError(f"{path}: expected a CSV with the header {','.join(COLUMNS)}")
    try:
        get = lambda k, d: [float(r.get(k) or d) for r in rows]
        dist = from_counts(get("prompt_len", 0), get("new_tokens", 1), get("count", 1), path)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    return dist, "new_tokens" in rows[0]


def _jsonl(path: str, tokenizer: str | None) -> tuple[LengthDist, bool]:
    """Prompts as ``prompt``/``text`` (needs a tokenizer) or ``prompt_ids``; optional output lengths."""
    tok = None
    p, n = [], []
    has_new = True
    for i, line in enumerate(open(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from e
        if "prompt_ids" in row:
            p.append(len(row["prompt_ids"]))
        else:
            text = row.get("prompt", row.get("text"))
            if text is None:
                raise ValueError(f"{path}:{i}: expected a 'prompt', 'text' or 'prompt_ids' field")
            tok = tok or _tokenizer(tokenizer, path)
            p.append(len(tok(text)["input_ids"]))
        gen = row.get("generation")
        given = {**row, **gen} if isinstance(gen, dict) else row
        new = next((given[k] for k in _NEW_KEYS if k in given), None)
        if new is None and any(k in row for k in _OUT_TEXT_KEYS):
            tok = tok or _tokenizer(tokenizer, path)
            out = next(row[k] for k in _OUT_TEXT_KEYS if k in row)
            new = len(tok(out, add_special_tokens=False)["input_ids"])
        has_new &= new is not None
        n.append(max(1, int(new or 1)))
    return from_counts(p, n, np.ones(len(p)), path), has_new


def _tokenizer(name: str | None, path: str):
    if name is None:
        raise ValueError(f"{path} holds prompt text; pass --tokenizer DIR (a local tokenizer directory)")
    # local: slow to import (~1-2 s): kept out of `import aotlm` until text is needed
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer {name!r} from local files: {e}") from e


def _hdf5(path: str, start_token: int | None) -> LengthDist:
    """Cerebras layout: dataset ``data`` [samples, seq] (or [samples, 3, seq], row 0 = input ids).

    The prompt is everything before the first ``start_token``; rows without it are skipped.
    """
    import h5py  # local: heavy, only for HDF5 jobs: kept out of `import aotlm`

    if start_token is None:
        raise ValueError(f"{path}: an HDF5 file needs --start-token ID (the token that ends each prompt)")
    with h5py.File(path, "r") as f:
        if "data" not in f:
            raise ValueError(f"{path}: no dataset 'data' (expected the Cerebras layout [samples, seq])")
        data = np.asarray(f["data"])
    if data.ndim == 3:
        data = data[:, 0, :]
    if data.ndim != 2:
        raise ValueError(f"{path}: 'data' has shape {data.shape}; expected [samples, seq]")
    hit = data == start_token
    found = hit.any(1)
    p = hit.argmax(1)[found]
    if len(p) == 0 or (p < 1).all():
        raise ValueError(f"{path}: no row has a prompt before start_token={start_token}")
    p = p[p >= 1]
    return from_counts(p, np.ones_like(p), np.ones(len(p)), path)


def _normal(spec: str, seed: int = 0, n: int = 20000) -> LengthDist:
    try:
        parts = [float(x) for x in spec.split(":")[1:]]
        mean, std = parts[0], parts[1]
        lo, hi = (parts[2], parts[3]) if len(parts) >= 4 else (1, mean + 4 * std)
    except (IndexError, ValueError) as e:
        raise ValueError(f"bad --lengths spec {spec!r}; use normal:MEAN:STD[:LO:HI]") from e
    if not (std >= 0 and mean >= 1 and 1 <= lo <= hi):
        raise ValueError(
            f"bad --lengths spec {spec!r}: needs MEAN >= 1, STD >= 0 and 1 <= LO <= HI (prompt tokens)"
        )
    x = np.clip(np.round(np.random.default_rng(seed).normal(mean, std, n)), lo, hi).astype(int)
    v, c = np.unique(x, return_counts=True)
    return from_counts(v, np.ones_like(v), c, spec)


LISTED = re.compile(r"\s*\d+(\s*,\s*\d+)*\s*")  # "12,40,300": prompt lengths seen, once each


def _listed(spec: str) -> LengthDist:
    v = [int(x) for x in spec.split(",")]
    return from_counts(v, np.ones(len(v), np.int64), np.ones(len(v), np.int64), f"--lengths {spec}")


def load_lengths(
    source: str,
    tokenizer: str | None = None,
    new_tokens: int | None = None,
    start_token: int | None = None,
) -> LengthDist:
    """Read a length distribution; ``new_tokens`` fills in (or overrides) every output length."""
    if source.startswith("normal:"):
        dist, has_new = _normal(source), False
    elif not os.path.isfile(source) and LISTED.fullmatch(source):
        dist, has_new = _listed(source), False
    else:
        if not os.path.isfile(source):
            raise ValueError(
                f"cannot read --lengths {source}: no such file; give a histogram .json / .csv, a .jsonl of "
                "prompts, a .h5, normal:MEAN:STD or prompt lengths such as 12,40,300"
            )
        ext = os.path.splitext(source)[1].lower()
        try:
            if ext in (".h5", ".hdf5"):
                dist, has_new = _hdf5(source, start_token), False
            elif ext == ".csv":
                dist, has_new = _histogram_csv(source)
            elif ext == ".jsonl":
                dist, has_new = _jsonl(source, tokenizer)
            else:
                dist, has_new = _histogram_json(source)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"cannot read --lengths {source}: {e}") from e
    if new_tokens is not None:
        return with_new_tokens(dist, int(new_tokens))
    if not has_new:
        raise ValueError(f"--lengths {source} gives prompt lengths only; pass --new-tokens N (per request)")
    return dist
