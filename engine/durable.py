"""Output files that survive a kill: whole JSONL lines and atomically written files.

Batch jobs run for hours and get killed (time limits, pre-emption). Their outputs must
never hold half a record, so a re-run can trust every line / file it finds:

* JSONL: each record is written with a single ``os.write`` of its complete bytes (newline
  included) on an ``O_APPEND`` descriptor, then flushed to disk; a reader sees whole lines
  only. A line cut short by a crash inside that one write (power loss) is removed by
  ``truncate_partial_line`` before a resumed run appends.
* Other files (``.npz``, manifests): written to a temporary name in the same directory,
  fsynced, then ``os.replace``d into place, so the final name exists only when complete.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def truncate_partial_line(path: str | os.PathLike) -> int:
    """Drop a trailing line without its newline (a write cut short); returns bytes removed."""
    path = Path(path)
    if not path.is_file():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        # scan back in blocks for the last newline
        pos, block = size, 1 << 16
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return size - keep


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a JSONL file written by ``JsonlAppender`` (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


class JsonlAppender:
    """Appends whole JSON lines to a file, one ``os.write`` per record, synced per batch."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = None if path is None else Path(path)
        if self.path is None:  # stdout
            self.fd = 1
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            truncate_partial_line(self.path)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, records: list[dict]) -> None:
        for rec in records:
            data = (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
            n = os.write(self.fd, data)
            if n != len(data):  # only on a full disk or a signal mid-write
                raise OSError(f"short write to {self.path or 'stdout'} ({n} of {len(data)} bytes)")
        if self.path is not None:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.path is not None and self.fd is not None:
            os.close(self.fd)
            self.fd = None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either absent, the old file, or complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def atomic_write_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    atomic_write_bytes(path, data)
