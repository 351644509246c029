"""Persistent on-disk cache of *serialized executables*.

A hit skips tracing, lowering and XLA compilation: the entry's bytes go straight to
``jax.experimental.serialize_executable.deserialize_and_load``. Layout::

    <dir>/<key hash>/executable.bin   pickled (serialized executable, in_tree, out_tree)
    <dir>/<key hash>/manifest.json    readable key fields, sizes, sha256, timings

An entry is written to a temporary directory and renamed into place, so readers never
see half an entry and two processes compiling the same key both succeed (the second
rename loses and is discarded). Anything wrong with an entry (checksum, unpickling, a
platform refusing the executable) is a warning followed by a fresh compile.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import pickle
import shutil
import tempfile
import threading
import time
import uuid
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable
from jax.sharding import Mesh

from aotlm import kernels
from aotlm.core.backend import compiler_options
from aotlm.kernels import gpu_attention, gpu_matmul

ENGINE_VERSION = "0.1.0"
DEFAULT_DIR = "compile_cache"
DEFAULT_MAX_GB = 20.0
BIN, MANIFEST = "executable.bin", "manifest.json"


class CacheWarning(UserWarning):
    """Something in the compile cache was unusable; aotlm compiled instead."""


def _code_only(source: str) -> str:
    """A module's code without imports, docstrings, comments or layout (``ast.dump``).

    Imports go because they name *where* code lives, not what it does: moving a module into
    another subpackage (and rewriting the imports that name it) must not make every cached
    executable stale, while any change to a statement must.
    """
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list) or not all(isinstance(s, ast.stmt) for s in stmts):
                continue
            kept = [s for s in stmts if not isinstance(s, ast.Import | ast.ImportFrom)]
            docstring_owner = isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            )
            if field == "body" and docstring_owner and kept and isinstance(kept[0], ast.Expr):
                if isinstance(kept[0].value, ast.Constant) and isinstance(kept[0].value.value, str):
                    kept = kept[1:]
            setattr(node, field, kept or [ast.Pass()])
    return ast.dump(tree)


def source_hash(files: list[Path] | None = None) -> str:
    """Hash of the code that can change an executable: a code change never reuses stale ones.

    That code is ``graph_code()`` (models, kernels, the compiled model and the generation graphs);
    front ends, jobs, tuning and this cache's own bookkeeping cannot change what XLA compiles,
    so editing them keeps users' caches. Path-independent: each module's code
    (``_code_only``) is hashed without its file name, and the hashes sorted.
    """
    if files is None:
        return _package_source_hash()
    digests = sorted(
        hashlib.sha256(_code_only(f.read_text(encoding="utf-8")).encode()).hexdigest() for f in files
    )
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:16]


# subpackages whose code is traced into graphs or lowers them, less core's host-side modules
GRAPH_PACKAGES = ("aotlm.core", "aotlm.generate", "aotlm.kernels", "aotlm.models")
HOST_ONLY = (
    "artifacts",
    "bucket_config",
    "bundled",
    "compile_cache",
    "distributed",
    "inputs",
    "memory",
    "resolve",
    "backend",
    "weight_cache",
)


def graph_code() -> list[Path]:
    """The modules ``source_hash`` covers (package ``__init__`` files only re-export names)."""
    roots = [Path(str(resources.files(pkg))).resolve() for pkg in GRAPH_PACKAGES]
    return [f for root in roots for f in root.glob("*.py") if f.stem not in ("__init__", *HOST_ONLY)]


_HASH_LOCK = threading.Lock()  # ``ast.parse`` on several threads at once fails in CPython 3.11


@functools.cache
def _package_hash_once() -> str:
    return source_hash(graph_code())


def _package_source_hash() -> str:
    with _HASH_LOCK:  # compile() looks entries up on a thread per core
        return _package_hash_once()


def environment_fields(mesh) -> dict:
    """Everything about the software/hardware that makes an executable non-portable."""
    devs = list(mesh.devices.flat)
    return {
        "engine": ENGINE_VERSION,
        "source": source_hash(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "mesh": {
            "axes": list(mesh.axis_names),
            "shape": list(mesh.devices.shape),
            "ids": [d.id for d in devs],
        },
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "compiler_options": compiler_options(devs[0].platform),
        "kernels": kernels.cache_tag(),  # graphs with / without the FFI kernels, and their build
        "gpu_matmul": gpu_matmul.cache_tag(),  # GPU decode products: XLA's dots or the Pallas kernel
        "gpu_attention": gpu_attention.cache_tag(),  # GPU decode attention: XLA's or the Pallas kernel
    }


def compile_lowered(lowered, mesh):
    """``lowered.compile()`` with this backend's compile options (``aotlm.core.backend``)."""
    return lowered.compile(compiler_options(next(iter(mesh.devices.flat)).platform) or None)


def entry_key(fingerprint: dict, graph_key: tuple, mesh) -> tuple[str, dict]:
    """(hash, readable fields) for one graph of one model configuration."""
    fields = {
        "graph": list(graph_key),
        "model": {k: repr(v) for k, v in sorted(fingerprint.items())},
        "env": environment_fields(mesh),
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    return digest, fields


class EntryError(RuntimeError):
    """An entry that cannot be read, verified, loaded or written."""


def read_entry(entry: Path, mesh):
    """Load one entry's executable onto ``mesh``'s devices; ``EntryError`` on any problem."""
    kernels.ensure_registered()  # the executable may call the kernels' FFI targets
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        blob = (entry / BIN).read_bytes()
        if hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
            raise ValueError("checksum mismatch (truncated or corrupt file)")
        payload, in_tree, out_tree = pickle.loads(blob)
    except Exception as e:
        raise EntryError(f"corrupt entry ({type(e).__name__}: {e})") from e
    try:
        devices = list(mesh.devices.flat)
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=devices
        )
    except Exception as e:  # e.g. jax#38445: XLA CPU refusing its own cached executable
        raise EntryError(f"the platform refused the cached executable ({type(e).__name__}: {e})") from e


def write_entry(directory: Path, digest: str, fields: dict, compiled, seconds: float) -> int:
    """Serialize ``compiled`` as ``directory/digest`` atomically; returns its size in bytes."""
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        blob = pickle.dumps((payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise EntryError(f"the executable could not be serialized ({e})") from e
    manifest = {
        "key": digest,
        "fields": fields,
        "created": time.time(),
        "compile_seconds": round(seconds, 3),
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest}-", dir=directory))
        (tmp / BIN).write_bytes(blob)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, directory / digest)
        except OSError:  # another process stored the same key first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise EntryError(f"could not write compile cache entry in {directory}: {e}") from e
    return len(blob)


class CompileCache:
    """Executables by key; ``directory=None`` means in-memory compilation only."""

    def __init__(self, directory: str | os.PathLike | None, max_bytes: int | None = None):
        self.dir = Path(directory) if directory is not None else None
        gb = float(os.environ.get("AOTLM_CACHE_MAX_GB", DEFAULT_MAX_GB))
        self.max_bytes = max_bytes if max_bytes is not None else int(gb * 2**30)
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                probe = self.dir / f".probe-{uuid.uuid4().hex}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                warnings.warn(
                    f"compile cache directory {self.dir} is not writable ({e}); compiling in memory only",
                    CacheWarning,
                    stacklevel=3,
                )
                self.dir = None

    @classmethod
    def create(cls, spec: str | os.PathLike | None | bool) -> CompileCache:
        """``None``: ``$AOTLM_CACHE_DIR`` or ``./compile_cache``; ``False``: no disk cache."""
        if spec is False:
            return cls(None)
        if spec is None or spec is True:
            spec = cls.default_dir()
        if not isinstance(spec, str | os.PathLike):
            raise TypeError(
                f"compile_cache takes a directory path, None (the default directory) or False (memory only), "
                f"got {spec!r} ({type(spec).__name__})"
            )
        return cls(spec)

    @staticmethod
    def default_dir() -> str:
        """Where a cache goes when none is named: ``$AOTLM_CACHE_DIR`` or ``./compile_cache``."""
        return os.environ.get("AOTLM_CACHE_DIR", DEFAULT_DIR)

    # ----------------------------------------------------------------- core
    def lookup(self, fingerprint: dict, graph_key: tuple, mesh) -> tuple[Any, dict] | None:
        """The cached executable for ``graph_key`` and its info, or ``None`` on a miss."""
        if self.dir is None:
            return None
        digest, _ = entry_key(fingerprint, graph_key, mesh)
        exe = self._load(digest, mesh)
        return None if exe is None else (exe, {"hit": True, "entry": digest, "bytes": self._size(digest)})

    def get_or_compile(self, fingerprint: dict, graph_key: tuple, lower, mesh) -> tuple[Any, dict]:
        """The executable for ``graph_key``: loaded from disk, or ``lower().compile()``d and stored."""
        found = self.lookup(fingerprint, graph_key, mesh)
        if found is not None:
            return found
        digest, fields = entry_key(fingerprint, graph_key, mesh)
        t0 = time.perf_counter()
        compiled = compile_lowered(lower(), mesh)
        seconds = time.perf_counter() - t0
        size = self._store(digest, fields, compiled, seconds) if self.dir is not None else 0
        return compiled, {"hit": False, "entry": digest, "bytes": size}

    def _load(self, digest: str, mesh):
        if not (self.dir / digest / MANIFEST).is_file():
            if (self.dir / digest).exists():  # entries appear by rename, complete: this one was damaged
                self._discard(digest, "manifest.json is missing")
            return None
        try:
            exe = read_entry(self.dir / digest, mesh)
        except EntryError as e:
            self._discard(digest, str(e))
            return None
        try:
            os.utime(self.dir / digest / MANIFEST)  # least-recently-used bookkeeping
        except OSError:
            pass
        return exe

    def _store(self, digest: str, fields: dict, compiled, seconds: float) -> int:
        try:
            size = write_entry(self.dir, digest, fields, compiled, seconds)
        except EntryError as e:
            warnings.warn(f"not cached: {e}", CacheWarning, stacklevel=3)
            return 0
        self.evict()
        return size

    def _discard(self, digest: str, why: str) -> None:
        warnings.warn(
            f"compile cache entry {self.dir / digest}: {why}; recompiling", CacheWarning, stacklevel=4
        )
        self._remove(digest)

    def _remove(self, digest: str) -> None:
        trash = self.dir / f".trash-{digest}-{uuid.uuid4().hex}"
        try:
            os.rename(self.dir / digest, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _size(self, digest: str) -> int:
        try:
            return (self.dir / digest / BIN).stat().st_size
        except OSError:
            return 0

    # ----------------------------------------------------------------- maintenance
    def entries(self) -> list[dict]:
        """Manifests of every complete entry, most recently used first."""
        if self.dir is None or not self.dir.is_dir():
            return []
        out = []
        for entry in self.dir.iterdir():
            m = entry / MANIFEST
            if entry.name.startswith(".") or not m.is_file():
                continue
            try:
                manifest = json.loads(m.read_text())
            except (OSError, ValueError):  # not JSON, not UTF-8 (a flipped byte)
                manifest = {"key": entry.name, "bytes": 0, "corrupt": True}
            manifest["last_used"] = m.stat().st_mtime
            out.append(manifest)
        return sorted(out, key=lambda e: -e["last_used"])

    def verify(self) -> list[tuple[str, str]]:
        """(key, problem) for every entry that does not load; empty when all are sound."""
        devices = {d.id: d for d in jax.devices()}
        bad = []
        for e in self.entries():
            try:
                ids = e["fields"]["env"]["mesh"]["ids"]
                if not all(i in devices for i in ids):
                    continue  # built for devices this process does not have
                read_entry(self.dir / e["key"], Mesh([devices[i] for i in ids], ("tp",)))
            except (EntryError, KeyError) as ex:
                bad.append((e["key"], str(ex)))
        return bad

    def clear(self, older_than_days: float | None = None) -> int:
        """Remove entries (all, or those unused for ``older_than_days``); returns the count.

        Also removes what killed processes left behind (``.tmp-*`` / ``.trash-*`` directories
        untouched for an hour: younger ones may belong to a process writing right now).
        """
        if older_than_days is not None and not 0 <= older_than_days < float("inf"):
            raise ValueError(f"older_than_days must be a number >= 0, got {older_than_days!r}")
        cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
        for d in self.dir.glob(".t*-*") if self.dir is not None else ():
            try:
                if d.name.startswith((".tmp-", ".trash-")) and time.time() - d.stat().st_mtime > 3600:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass
        n = 0
        for e in self.entries():
            if cutoff is None or e["last_used"] < cutoff:
                self._remove(e["key"])
                n += 1
        return n

    def evict(self) -> int:
        """Drop least-recently-used entries until the cache is under ``max_bytes``."""
        entries = self.entries()
        total, n = sum(e.get("bytes", 0) for e in entries), 0
        for e in reversed(entries):
            if total <= self.max_bytes:
                break
            self._remove(e["key"])
            total -= e.get("bytes", 0)
            n += 1
        return n


class CompileCounter:
    """Counts tracing / lowering / XLA compiles in this process (``jax.monitoring`` events)."""

    EVENTS = {
        "/jax/core/compile/backend_compile_duration": "compiles",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowerings",
        "/jax/core/compile/jaxpr_trace_duration": "traces",
    }

    def __init__(self):
        self.counts = dict.fromkeys(self.EVENTS.values(), 0)
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **kw) -> None:
        if event in self.EVENTS:
            self.counts[self.EVENTS[event]] += 1

    def __str__(self) -> str:
        return ", ".join(f"{v} {k}" for k, v in self.counts.items())
