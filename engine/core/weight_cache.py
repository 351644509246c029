"""Weights in their stored form, cached on disk: a warm load reads them instead of converting again.

Loading a quantized model converts every tensor (a GGUF file's blocks dequantized, re-rounded to
int8 or int4, fused, packed into the kernels' panels); for a 1B model that is ~30 s on 2 cores. The
first load writes each leaf exactly as it is handed to its devices (after every host-side rewrite)
to ``$AOTLM_WEIGHT_CACHE/<key>/`` (default ``~/.cache/aotlm/weights``; one ``.npy`` per leaf and a
``manifest.json``, written to a temporary directory and renamed into place) and places it from that
file, mapped, so even the first load holds no second copy of the weights; the next load of the
same weights with the same options maps those files (``np.load(mmap_mode="r")``) and places them,
touching no checkpoint file. On one CPU device JAX's arrays then use the mapped pages themselves (no
copy is made: a warm load takes no time per byte and the weights live in the page cache, shared between
processes, as llama.cpp maps its file); the pages are read on first use. Entries are never changed in
place (written to a temporary directory, renamed), and a mapping outlives an eviction. The key hashes
the checkpoint's identity (a GGUF file's sha256; the weight files' paths, sizes and modification
times), every option that changes a stored leaf (quant, fusion, packing, tensor parallelism, the rows
loaded) and the code that makes them.

Used where the stored form is quantized (any ``quant``: a GGUF file's default, int8, int4, bf16 / f16
matrices): a float32 load is not kept (a GGUF file's would be 4x the file). ``AOTLM_WEIGHT_CACHE=0``
turns it off. Entries are evicted least recently used first beyond ``AOTLM_WEIGHT_CACHE_MAX_GB``
(default 40). A damaged entry is ignored (and removed) and the weights are converted again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from aotlm.models.checkpoint.gguf import SOURCE_FILE
from aotlm.models.checkpoint.resolve import weight_files
from aotlm.progress import bar

logger = logging.getLogger("aotlm.core.weight_cache")
ENV, MAX_ENV = "AOTLM_WEIGHT_CACHE", "AOTLM_WEIGHT_CACHE_MAX_GB"
DEFAULT_MAX_GB = 40.0
MANIFEST = "manifest.json"
stats = {"hits": 0, "writes": 0}  # this process's counts (tests assert on them)


def root() -> Path | None:
    """The cache directory, or None when ``AOTLM_WEIGHT_CACHE=0`` turns the cache off."""
    env = os.environ.get(ENV, "").strip()
    if env in ("0", "off", "false"):
        return None
    return Path(os.path.expanduser(env)) if env else Path.home() / ".cache" / "aotlm" / "weights"


def identity(checkpoint: str | os.PathLike) -> dict:
    """What the weights of ``checkpoint`` are: a GGUF file's sha256, else each weight file's path,
    size and modification time."""
    src = Path(checkpoint) / SOURCE_FILE
    if src.is_file():
        return {"gguf_sha256": json.loads(src.read_text())["sha256"]}
    files = weight_files(Path(checkpoint))
    return {"files": [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]}


def key(fields: dict) -> str:
    """The entry name of a load described by ``fields`` (JSON-serializable)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def load(name: str, place: Callable[[tuple, np.ndarray], object]) -> dict | None:
    """The params tree of entry ``name``, each leaf read and handed to ``place(path, array)``; None
    on a miss (or a damaged entry, which is removed)."""
    base = root()
    d = base / name if base is not None else None
    if d is None or not (d / MANIFEST).is_file():
        return None
    try:
        leaves = json.loads((d / MANIFEST).read_text())["leaves"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return _unusable(d, e)
    params: dict = {}
    for entry in bar(leaves, "loading cached weights", unit="tensor"):
        try:
            arr = _typed(np.load(d / entry["file"], mmap_mode="r", allow_pickle=False), entry["dtype"])
            if list(arr.shape) != entry["shape"] or str(arr.dtype) != entry["dtype"]:
                raise ValueError(f"{entry['file']} holds {arr.dtype} {arr.shape}, not the manifest's")
            path = tuple(int(p) if p.isdigit() else p for p in entry["path"])  # layer indices
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return _unusable(d, e)
        _set(params, path, place(path, arr))  # outside the try: a device error is not the entry's fault
    with contextlib.suppress(OSError):  # evicted meanwhile by another process: the leaves are read
        os.utime(d / MANIFEST)  # least recently used
    stats["hits"] += 1
    if "layers" in params:
        params["layers"] = [params["layers"][i] for i in sorted(params["layers"])]
    return params


class Writer:
    """Records the leaves of a load as they are placed, then stores them as entry ``name``. Each leaf
    is written when it is made and handed back mapped from its file (``record``), so a converting load
    holds no second copy of the weights: its pages live in the page cache, as a warm load's do, and
    only one tensor's working set is anonymous memory at a time."""

    def __init__(self, name: str, fields: dict):
        self.name, self.fields = name, fields
        base = root()
        self._dir: Path | None = None
        self._leaves: list[dict] = []
        self._failed: Exception | None = None
        if base is None:
            return
        try:
            base.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(dir=base, prefix=f".{name}-"))
        except OSError as e:
            logger.warning("weight cache %s is not writable (%s); the weights are not cached", base, e)

    def record(self, path: tuple, arr: np.ndarray) -> np.ndarray:
        """Write leaf ``path``; returns its file mapped (``arr`` itself once a write has failed: from
        then on nothing more is written and the entry is not published)."""
        if self._dir is None or self._failed is not None:
            return arr
        file = f"{len(self._leaves):05d}.npy"
        try:
            np.save(self._dir / file, np.ascontiguousarray(arr), allow_pickle=False)
            mapped = _typed(np.load(self._dir / file, mmap_mode="r", allow_pickle=False), str(arr.dtype))
        except Exception as e:  # any failure: nothing more is written, the entry is not published
            self._failed = e
            return arr
        self._leaves.append({"path": [str(p) for p in path], "file": file, "shape": list(arr.shape),
                             "dtype": str(arr.dtype)})  # fmt: skip
        return mapped

    def _finish_writes(self) -> bool:
        """Whether every file was written."""
        if self._failed is not None:
            logger.warning("cannot write the weight cache (%s); the weights are not cached", self._failed)
        return self._failed is None

    def commit(self, params: dict) -> None:
        """Keep the leaves the final tree holds (``params``), publish the entry, evict old ones."""
        if self._dir is None:
            return
        if not self._finish_writes():
            self.abandon()
            return
        kept = [e for e in self._leaves if _has(params, e["path"])]
        manifest = {"fields": self.fields, "leaves": kept, "written": time.time()}
        try:
            (self._dir / MANIFEST).write_text(json.dumps(manifest, default=repr))
            os.replace(self._dir, self._dir.parent / self.name)
            stats["writes"] += 1
        except OSError:  # another process published the same entry first: keep its copy
            pass
        self.abandon()
        evict(self._dir.parent if self._dir is not None else None)

    def abandon(self) -> None:
        self._failed = self._failed or OSError("abandoned")  # nothing more is written
        if self._dir is not None and self._dir.exists():
            shutil.rmtree(self._dir, ignore_errors=True)


def evict(base: Path | None = None) -> None:
    """Remove least recently used entries until the cache fits ``AOTLM_WEIGHT_CACHE_MAX_GB``.

    Best effort, and safe beside other processes: entries still being written (hidden temporary
    directories) are left alone, and one that is renamed, evicted or rebuilt by another process while
    this one scans is skipped, never an error."""
    base = base or root()
    if base is None or not base.is_dir():
        return
    cap = float(os.environ.get(MAX_ENV, DEFAULT_MAX_GB)) * 1e9
    entries = []  # (last use, dir, bytes)
    for d in base.iterdir():
        if d.name.startswith("."):
            continue
        try:
            used = (d / MANIFEST).stat().st_mtime
            entries.append((used, d, sum(f.stat().st_size for f in d.iterdir())))
        except OSError:  # not an entry, or one another process changed while this one looked
            continue
    total = sum(size for _, _, size in entries)
    for _, d, size in sorted(entries, key=lambda e: e[0]):
        if total <= cap:
            break
        shutil.rmtree(d, ignore_errors=True)
        total -= size


def _typed(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A mapped ``.npy`` array as ``dtype``: numpy writes bfloat16 as raw 2-byte records
    (``|V2``), read back as that view of the same bytes; any other mismatch is left for the caller."""
    if str(arr.dtype) == dtype or arr.dtype.kind != "V":
        return arr
    want = np.dtype(jnp.dtype(dtype))
    return arr.view(want) if want.itemsize == arr.dtype.itemsize else arr


def _unusable(d: Path, e: Exception) -> None:
    """A damaged entry: removed, so the weights are converted (and stored) again."""
    logger.warning("weight cache entry %s is unusable (%s); converting the weights again", d, e)
    shutil.rmtree(d, ignore_errors=True)


def _set(tree: dict, path: tuple, value) -> None:
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value


def _has(tree, path: list) -> bool:
    node = tree
    for k in path:
        if isinstance(node, list):
            k = int(k)
            if k >= len(node):
                return False
        elif k not in node:
            return False
        node = node[k]
    return True
