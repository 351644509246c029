"""Cerebras-style autoregressive inference over an HDF5 file of token ids (``aotlm run-h5``).

``params.yaml`` (Cerebras names)::

    inference_input:
      data_processor: GptHDF5MapDataProcessor
      data_dir: ./data            # one .h5 file, dataset "data" [num_samples, max_seq_len]
      batch_size: 3
    model:
      start_token: 50256          # int or list; may lie outside the vocabulary
      stop_sequences: [[13, 13]]  # optional; a matched sequence stays in the output
      max_tokens: 64              # optional cap on generated tokens
      loop_dim: 1                 # 0: the data is stored [max_seq_len, num_samples]

Each sample's prompt ends before its first start token. Batch ``k`` (1-based global step)
covers samples ``(k-1)*batch_size ...``; the last batch is padded with dummy samples. As each
batch finishes, ``MODEL_DIR/predictions/predictions_{k}.npz`` is written atomically with
``global_step`` and ``predictions`` [batch_size, max_seq_len]: the prompt immediately
followed by the generated tokens, padded with the first start token (dummy rows: all start
token). Files already present are complete (atomic writes), so a re-run skips them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aotlm.durable import atomic_save_npz
from aotlm.generate import rows

log = logging.getLogger("aotlm.h5")
PROCESSOR = "GptHDF5MapDataProcessor"
SCAN_ROWS = 4096


@dataclass
class H5Job:
    data_file: Path
    batch_size: int
    start_tokens: list[int]
    stop_sequences: list[list[int]] = field(default_factory=list)
    max_tokens: int | None = None
    loop_dim: int = 1
    num_samples: int = 0
    max_seq_len: int = 0
    prompt_lens: np.ndarray | None = None  # per sample

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def limits(self, lens: np.ndarray) -> np.ndarray:
        """Tokens each sample may generate: up to max_seq_len, and max_tokens."""
        room = self.max_seq_len - lens
        return room if self.max_tokens is None else np.minimum(room, self.max_tokens)

    def needed_positions(self) -> int:
        """KV-cache length a batch needs: longest (left-padded) prompt + most new tokens."""
        need = 1
        for lo in range(0, self.num_samples, self.batch_size):
            lens = self.prompt_lens[lo : lo + self.batch_size]
            need = max(need, int(lens.max() + self.limits(lens).max()))
        return need


def _int_list(v, what: str) -> list[int]:
    vals = v if isinstance(v, list | tuple) else [v]
    if not vals or not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
        raise ValueError(f"params: {what} must be an int or a non-empty list of ints, got {v!r}")
    return [int(x) for x in vals]


def read_params(path: str | os.PathLike) -> H5Job:
    import yaml  # local: only for Cerebras YAML params: kept out of `import aotlm`

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read params file {path}: {str(e).splitlines()[0]}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("inference_input"), dict):
        raise ValueError(f"{path}: needs an 'inference_input' section (data_processor, data_dir, batch_size)")
    inp, model = doc["inference_input"], doc.get("model") or {}
    if inp.get("data_processor", PROCESSOR) != PROCESSOR:
        raise ValueError(
            f"{path}: data_processor {inp['data_processor']!r} is not supported; use {PROCESSOR}"
        )
    bs = inp.get("batch_size")
    if not isinstance(bs, int) or bs < 1:
        raise ValueError(f"{path}: inference_input.batch_size must be a positive int, got {bs!r}")
    if "start_token" not in model:
        raise ValueError(f"{path}: model.start_token is required (int or list of ints)")
    stops = model.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, list) and s for s in stops):
        raise ValueError(f"{path}: model.stop_sequences must be a list of non-empty lists of token ids")
    max_tokens = model.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{path}: model.max_tokens must be a positive int, got {max_tokens!r}")
    loop_dim = model.get("loop_dim", 1)
    if loop_dim not in (0, 1):
        raise ValueError(f"{path}: model.loop_dim must be 0 ([max_seq_len, samples]) or 1, got {loop_dim!r}")
    data_dir = Path(os.path.expandvars(os.path.expanduser(str(inp.get("data_dir", "")))))
    if not data_dir.is_absolute() and not data_dir.is_dir() and (path.parent / data_dir).is_dir():
        data_dir = path.parent / data_dir  # relative to the params file when not to the cwd
    files = sorted(data_dir.glob("*.h5")) if data_dir.is_dir() else []
    if len(files) != 1:
        raise ValueError(
            f"{path}: inference_input.data_dir {data_dir} must hold exactly one .h5 file, found {len(files)}"
        )
    return H5Job(
        data_file=files[0],
        batch_size=bs,
        start_tokens=_int_list(model["start_token"], "model.start_token"),
        stop_sequences=[_int_list(s, "each stop sequence") for s in stops],
        max_tokens=max_tokens,
        loop_dim=loop_dim,
    )


def _dataset(f, job: H5Job):
    if "data" not in f:
        raise ValueError(f"{job.data_file} has no dataset 'data' (found {sorted(f.keys())})")
    ds = f["data"]
    if ds.ndim != 2 or ds.dtype.kind not in "iu":
        raise ValueError(f"{job.data_file}: 'data' must be a 2-D integer array, got {ds.shape} {ds.dtype}")
    return ds


def _rows(ds, job: H5Job, lo: int, hi: int) -> np.ndarray:
    """Samples ``lo:hi`` as [n, max_seq_len] whatever the storage layout."""
    return np.asarray(ds[lo:hi] if job.loop_dim == 1 else ds[:, lo:hi].T, dtype=np.int64)


def scan(job: H5Job, vocab_size: int) -> H5Job:
    """Shapes and prompt lengths of every sample; errors name the sample (pre-flight, no weights)."""
    import h5py  # local: heavy, only for HDF5 jobs: kept out of `import aotlm`

    with h5py.File(job.data_file, "r") as f:
        ds = _dataset(f, job)
        n, length = ds.shape if job.loop_dim == 1 else ds.shape[::-1]
        job.num_samples, job.max_seq_len = int(n), int(length)
        lens = np.empty(n, np.int64)
        for lo in range(0, n, SCAN_ROWS):
            block = _rows(ds, job, lo, min(n, lo + SCAN_ROWS))
            is_start = np.isin(block, job.start_tokens)
            first = np.where(is_start.any(1), is_start.argmax(1), length)
            lens[lo : lo + len(block)] = first
            for r in range(len(block)):
                if first[r] == 0:
                    raise ValueError(
                        f"{job.data_file}: sample {lo + r} has no prompt (starts with a start token)"
                    )
                bad = (block[r, : first[r]] < 0) | (block[r, : first[r]] >= vocab_size)
                if bad.any():
                    c = int(np.argmax(bad))
                    raise ValueError(
                        f"{job.data_file}: sample {lo + r} position {c} holds {block[r, c]}, outside the "
                        f"vocabulary ({vocab_size}) and not a start token"
                    )
    if job.num_samples == 0:
        raise ValueError(f"{job.data_file}: 'data' holds no samples")
    job.prompt_lens = lens
    return job


def steps_to_run(job: H5Job, out_dir: Path, inference_steps: int | None, shard=(0, 1)) -> list[int]:
    """1-based global steps this process still has to write."""
    last = job.num_batches if inference_steps is None else min(inference_steps, job.num_batches)
    i, n = shard
    return [
        s for s in range(1, last + 1) if (s - 1) % n == i and not (out_dir / f"predictions_{s}.npz").exists()
    ]


def run_step(model, job: H5Job, ds, step: int, out_dir: Path) -> Path:
    lo = (step - 1) * job.batch_size
    hi = min(job.num_samples, lo + job.batch_size)
    data = _rows(ds, job, lo, hi)
    lens = job.prompt_lens[lo:hi]
    limits = job.limits(lens)
    pad = job.start_tokens[0]
    pred = np.full((job.batch_size, job.max_seq_len), pad, np.int64)
    todo = [r for r in range(hi - lo) if limits[r] > 0]
    results = {}
    if todo:
        gen = rows.generate(
            model,
            [data[r, : lens[r]].tolist() for r in todo],
            [int(limits[r]) for r in todo],
            stop_sequences=job.stop_sequences,
        )
        results = dict(zip(todo, gen, strict=True))
    for r in range(hi - lo):
        row = data[r, : lens[r]].tolist() + (results[r].tokens if r in results else [])
        pred[r, : len(row)] = row[: job.max_seq_len]
    dtype = (
        np.int32
        if np.iinfo(np.int32).min <= pred.min() and pred.max() <= np.iinfo(np.int32).max
        else np.int64
    )
    path = out_dir / f"predictions_{step}.npz"
    atomic_save_npz(path, global_step=np.int64(step), predictions=pred.astype(dtype))
    return path


def clean_stale(out_dir: Path, steps: list[int]) -> None:
    """Remove leftovers of a kill mid-write (never under a final name), of these steps only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for step in steps:
        for stale in out_dir.glob(f".predictions_{step}.npz.tmp-*"):
            stale.unlink(missing_ok=True)


def open_data(job: H5Job):
    """(h5py file, its checked "data" dataset) for ``run_step``; the caller closes the file."""
    import h5py  # local: heavy, only for HDF5 jobs: kept out of `import aotlm`

    f = h5py.File(job.data_file, "r")
    return f, _dataset(f, job)


def run(model, job: H5Job, out_dir: Path, steps: list[int]) -> list[Path]:
    import h5py  # local: heavy, only for HDF5 jobs: kept out of `import aotlm`

    clean_stale(out_dir, steps)
    written = []
    with h5py.File(job.data_file, "r") as f:
        ds = _dataset(f, job)
        for k, step in enumerate(steps, 1):
            written.append(run_step(model, job, ds, step, out_dir))
            log.info("[%d/%d] wrote %s", k, len(steps), written[-1])
    return written
