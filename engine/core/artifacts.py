"""``model.save(dir)`` / ``model.load(dir)``: compiled graphs as a relocatable directory.

The directory holds one compile-cache entry per graph plus ``aotlm_model.json``, which
records the configuration as flat readable fields. Nothing in it names a file path, so
the directory can be moved to another path or a machine of the same kind. Loading into
a model of another configuration fails with the fields that differ.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path

from aotlm.core.compile_cache import MANIFEST as MANIFEST_ENTRY
from aotlm.core.compile_cache import (
    EntryError,
    compile_lowered,
    entry_key,
    environment_fields,
    read_entry,
    write_entry,
)

MANIFEST = "aotlm_model.json"
PIPELINE_MANIFEST = "aotlm_pipeline.json"  # ``pipeline.save``'s, over its stages' directories
FORMAT = 1


def config_fields(model) -> dict:
    """Flat, JSON-able description of everything an executable depends on."""
    fields = {f"arch.{k}": v for k, v in dataclasses.asdict(model.cfg).items()}
    fields.update(
        batch_size=model.batch_size,
        n_positions=model.n_positions,
        token_buckets=list(model.tg_buckets),
        context_buckets=list(model.ctx_buckets),
        amp=model.amp,
        tp_degree=model.tp_degree,
        gqa=model.gqa,
        quant=repr(model.quant),
        fuse_qkv=model.fuse_qkv,
        kv_cache_dtype=model.kv_cache_dtype,  # None (follows amp) is also what older manifests give
    )
    fields.update({f"env.{k}": v for k, v in environment_fields(model.mesh).items()})
    return json.loads(json.dumps(fields))  # tuples -> lists, as they come back from disk


def save_target(directory: str | os.PathLike) -> Path:
    """``directory`` as an absolute path ``save`` may replace whole: absent, an empty directory or an
    earlier save (its manifest inside); a file or a directory of other files is a ``ValueError``."""
    d = Path(os.path.abspath(directory))
    if d.exists() and not d.is_dir():
        raise ValueError(f"cannot save the model to {d}: it is a file; give a directory path")
    if d.is_dir() and any(d.iterdir()) and not any((d / m).is_file() for m in (MANIFEST, PIPELINE_MANIFEST)):
        raise ValueError(
            f"cannot save the model to {d}: the directory holds other files and a save replaces its "
            "directory whole; give a new or empty directory (or one an earlier save wrote)"
        )
    if d == Path.cwd() or d == d.parent:
        raise ValueError(f"cannot save the model to {d}, the current or root directory; give a new directory")
    return d


def save(model, directory: str | os.PathLike) -> None:
    directory = save_target(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    graphs = []
    try:
        for key in model.graph_keys():
            digest, fields = entry_key(model.fingerprint(), key, model.mesh)
            _write_graph(model, key, tmp, digest, fields)
            graphs.append({"key": list(key), "entry": digest})
        manifest = {"format": FORMAT, "fields": config_fields(model), "graphs": graphs}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        swap_in(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def swap_in(tmp: Path, directory: Path) -> None:
    """Put the finished directory ``tmp`` at ``directory`` by renames: a crash leaves the old one
    (or none), never a half-written one."""
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex}")
        os.rename(directory, old)
        os.rename(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, directory)


def _write_graph(model, key: tuple, tmp: Path, digest: str, fields: dict) -> None:
    """Store one graph's executable as the entry ``tmp/digest``.

    XLA CPU cannot re-serialize an executable that was itself deserialized (the copy fails at
    run time with "Function ... not found"), so a graph that came from the compile cache (or
    from a saved directory) is copied byte for byte from its cache entry, or compiled afresh
    when the entry is gone; only executables compiled in this process are serialized.
    """
    fresh = any(
        r["graph"] == key[0] and tuple(r["bucket"]) == key[1:] and not r["hit"] for r in model.compile_report
    )
    if fresh:
        write_entry(tmp, digest, fields, model.executable(key), 0.0)
        return
    cached = model.compile_cache.dir / digest if model.compile_cache.dir is not None else None
    if cached is not None and (cached / MANIFEST_ENTRY).is_file():
        shutil.copytree(cached, tmp / digest)
        return
    write_entry(tmp, digest, fields, compile_lowered(model.lower(key), model.mesh), 0.0)


def load(model, directory: str | os.PathLike) -> dict:
    """``{graph key: executable}`` from a saved directory, after checking it fits ``model``."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError as e:
        raise ValueError(f"{directory} holds no saved aotlm model ({MANIFEST} is missing)") from e
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{directory / MANIFEST} is unreadable ({e}); save the model again") from e
    saved, mine = manifest.get("fields", {}), config_fields(model)
    diffs = [
        f"{k}: saved {saved.get(k)!r}, this model {mine.get(k)!r}"
        for k in sorted(set(saved) | set(mine))
        if saved.get(k) != mine.get(k)
    ]
    if diffs:
        raise ValueError(
            f"the compiled artifacts in {directory} were built for another configuration; differing fields: "
            + "; ".join(diffs)
        )
    out = {}
    for g in manifest["graphs"]:
        key = tuple(g["key"])
        digest, _ = entry_key(model.fingerprint(), key, model.mesh)
        if digest != g["entry"]:
            raise ValueError(f"saved graph {key} in {directory} does not match this model (key {digest})")
        try:
            out[key] = read_entry(directory / digest, model.mesh)
        except EntryError as e:
            raise ValueError(f"saved graph {key} in {directory} cannot be loaded: {e}; save it again") from e
    return out
