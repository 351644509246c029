"""GGUF files (llama.cpp, Ollama) as aotlm checkpoints: the file is the weights.

:func:`convert` gives a ``model.gguf`` file a small HF-style checkpoint directory that every other
part of aotlm already reads (``aotlm.models.checkpoint.resolve`` calls it for any ``*.gguf`` path):

* ``config.json``: the config transformers' GGUF loading builds for the file (``AutoConfig.
  from_pretrained(dir, gguf_file=name)``), rebuilt without torch from its tables
  (:mod:`aotlm.models.checkpoint.gguf_meta`: aotlm itself needs no torch);
* the tokenizer files and chat template (transformers' GGUF tokenizer conversion, torch-free, saved);
* ``generation_config.json`` (bos / eos / pad ids from the metadata);
* ``aotlm_gguf.json``: the source (path, sha256, size), its tensor type counts and the default
  weight storage (:func:`default_quant`);
* ``aotlm_gguf_source.json``: the file the weights are read from (``gguf_weights``), rewritten
  whenever a path resolves to this directory.

No weights are copied: the loader reads them from the file itself, memory-mapped, one tensor at a
time, straight into their stored form (:func:`open_weights`, ``gguf_weights.GGUFWeights``).

The directory is ``$AOTLM_GGUF_CACHE/<sha256[:16]>`` (default ``~/.cache/aotlm/gguf``), written
to a temporary directory and renamed into place, so a failed or interrupted conversion leaves
nothing. A file is hashed once: ``hashes.json`` there maps (path, size, mtime) to its sha256, so
a warm load reads neither the file nor transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from aotlm.models.checkpoint import gguf_lookup
from aotlm.models.checkpoint.formats import CheckpointError
from aotlm.models.checkpoint.gguf_file import QUANT_TYPES, Plan, inspect, is_gguf, rope_factors
from aotlm.models.checkpoint.gguf_meta import build_config, build_tokenizer, read_metadata
from aotlm.models.checkpoint.gguf_weights import GGUFWeights, note_source, source_of
from aotlm.models.quant import INT4_KEEPS, Q8_BLOCK_TYPES

__all__ = ["convert", "default_quant", "is_gguf", "cache_root", "open_weights", "SOURCE_FILE", "stats"]

logger = logging.getLogger("aotlm.models.checkpoint.gguf")
SOURCE_FILE = "aotlm_gguf.json"
_MEMO = "hashes.json"
FORMAT = 6  # bump when the converted layout changes: old cache entries are then converted again
stats = {"conversions": 0, "cache_hits": 0}  # this process's counts (tests assert on them)


def cache_root() -> Path:
    """Where converted GGUF files live: ``$AOTLM_GGUF_CACHE`` or ``~/.cache/aotlm/gguf``."""
    env = os.environ.get("AOTLM_GGUF_CACHE")
    return Path(os.path.expanduser(env)) if env else Path.home() / ".cache" / "aotlm" / "gguf"


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _read_memo(root: Path) -> dict:
    try:
        memo = json.loads((root / _MEMO).read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_memo(root: Path, key: str, sha: str) -> None:
    memo = _read_memo(root)
    memo[key] = sha
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".hashes-")
    with os.fdopen(fd, "w") as f:
        json.dump(memo, f, indent=0)
    os.replace(tmp, root / _MEMO)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _entry(root: Path, sha: str) -> Path:
    return root / f"{sha[:16]}-v{FORMAT}"


def cached(path: str | os.PathLike) -> Path | None:
    """The converted directory of ``path`` if it is in the cache (no hashing: the stat memo only)."""
    path = Path(path)
    root = cache_root()
    sha = _read_memo(root).get(_stat_key(path))
    if sha is None:
        return None
    d = _entry(root, sha)
    return d if (d / SOURCE_FILE).is_file() else None


def convert(path: str | os.PathLike) -> Path:
    """The checkpoint directory of GGUF file ``path``, converting it on first use (see module doc)."""
    path = Path(path)
    hit = cached(path)
    if hit is not None:
        stats["cache_hits"] += 1
        note_source(hit, path)
        return hit
    plan, reader = inspect(path)  # every check before anything is written
    root = cache_root()
    sha = file_sha256(path)
    final = _entry(root, sha)
    if not (final / SOURCE_FILE).is_file():  # same content under another path / mtime: reuse it
        _convert_into(plan, reader, root, final, sha)
    _write_memo(root, _stat_key(path), sha)
    note_source(final, path)
    return final


def open_weights(checkpoint: str | os.PathLike) -> GGUFWeights | None:
    """The weights of a converted GGUF model, read from its file (None for any other checkpoint)."""
    src = source_of(checkpoint)
    return None if src is None else GGUFWeights(src, Path(checkpoint))


def _convert_into(plan: Plan, reader, root: Path, final: Path, sha: str) -> None:
    start = time.perf_counter()
    logger.info("converting %s (%s) once into %s", plan.path, plan.arch_name, final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{sha[:16]}-"))
    try:
        metadata = read_metadata(reader)
        config, _ = _write_config(plan, reader, metadata, tmp)
        if plan.has_tokenizer:
            _write_tokenizer(plan, metadata, config, tmp)
        _write_generation_config(metadata, tmp)
        source = {
            "format": FORMAT,
            "path": str(plan.path.resolve()),
            "sha256": sha,
            "size": plan.path.stat().st_size,
            "architecture": plan.arch_name,
            "tensor_types": plan.type_counts,
            "matrix_types": sorted(plan.matrix_types()),
            "hf_types": {t.hf: t.qtype for t in plan.tensors if len(t.shape) == 2},  # the memory plan's
            "embedding_type": next((t.qtype for t in plan.tensors if t.gguf == "token_embd.weight"), None),
            "parameters": plan.parameters(),
            "default_quant": storage_for(plan.matrix_types(), plan.parameters()),
            "seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
        try:
            os.replace(tmp, final)
        except OSError:  # another process converted the same file first: keep its copy
            if not (final / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stats["conversions"] += 1
    logger.info("converted %s in %.1f s", plan.path.name, time.perf_counter() - start)


def _write_config(plan: Plan, reader, metadata: dict, out: Path):
    """transformers' config of the file (built without torch), saved; returns it and its saved fields."""
    try:
        cfg = build_config(metadata, (t.gguf for t in plan.tensors))
    except Exception as e:  # transformers raises many types, with multi-line messages
        raise CheckpointError(f"{plan.path}: transformers cannot build its config ({_first_line(e)})") from e
    if cfg.model_type not in (plan.arch.model_type, *plan.arch.also):
        raise CheckpointError(
            f"{plan.path}: transformers reads it as {cfg.model_type!r}, expected {plan.arch.model_type!r}"
        )
    cfg.save_pretrained(str(out))
    saved = json.loads((out / "config.json").read_text())
    factors = rope_factors(reader, plan)
    if factors is not None:  # llama3 rope scaling as llama.cpp keeps it (transformers' GGUF loading drops it)
        saved["rope_freq_factors"] = factors
        (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return cfg, saved


def _write_tokenizer(plan: Plan, metadata: dict, config, out: Path) -> None:
    """transformers' tokenizer built from the metadata (vocabulary, merges, special tokens, chat template)."""
    try:
        tok = build_tokenizer(metadata, config)
    except Exception as e:  # transformers raises many types, with multi-line messages
        raise CheckpointError(
            f"{plan.path}: transformers cannot build its tokenizer ({_first_line(e)}); upgrade transformers "
            "if it is a newer tokenizer type, or convert the HF checkpoint instead"
        ) from e
    tok.save_pretrained(str(out))


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split("\n")[0].split())[:200] or type(e).__name__


def _write_generation_config(metadata: dict, out: Path) -> None:
    """bos / eos / pad ids of the file's tokenizer metadata."""
    ids = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    gen = {k: metadata[f"tokenizer.ggml.{g}"] for k, g in ids.items() if f"tokenizer.ggml.{g}" in metadata}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")


# A file's 4-bit blocks are kept by default. From this size up the kernels round activations to int8 per
# group of 32 (quant="int4"), as llama.cpp's q4 x q8_0 products do (logits ~1e-2 off the file's float32
# ones), for the prompt's speed (int16 costs 1.6-1.8x at 1B, scripts/README.md); below it they hold them
# as int16 (quant="int4-a16": ~1e-4), where int8 activations had changed the quick start's answer on
# SmolLM2-135M's Q4_1 file ("Paris" became another text).
AS_STORED_PARAMS = 1_000_000_000


def storage_for(matrix_types: set[str], parameters: int = 0) -> str | None:
    """The default weight storage for a file whose matrices have these GGUF types.

    With blocks that int4 storage keeps (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K): ``"int4"`` from
    ``AS_STORED_PARAMS`` parameters up, ``"int4-a16"`` below (int16 activations), which keep them and store
    the file's other types as int8 (Q8_0 as int8 groups); other block-quantized (8-bit, Q2_K / Q3_K)
    files -> ``"int8"`` (Q8_0 as int8 groups, others re-rounded per output channel);
    all F16 -> ``"f16"``, all BF16 -> ``"bf16"`` (both exact), otherwise None (float32).
    """
    if matrix_types & set(INT4_KEEPS):
        return "int4" if parameters >= AS_STORED_PARAMS else "int4-a16"
    if matrix_types & set(QUANT_TYPES):
        return "int8"
    if matrix_types in ({"F16"}, {"BF16"}):
        return next(iter(matrix_types)).lower()
    return None


def _whole_k_blocks(source: dict, tp: int) -> bool:
    """Does every Q5_K / Q6_K matrix of the file keep whole blocks of 256 input rows (Q5_0 / Q5_1: 32) on
    each of ``tp`` shards (their codes' high bits live in the blocks: ``models.packing``)? True where the
    file is gone."""
    try:
        plan, _ = inspect(Path(source["path"]))
    except (KeyError, OSError, ValueError, CheckpointError):
        return True
    rows = {"Q5_0": 32, "Q5_1": 32, "Q5_K": 256, "Q6_K": 256}
    k_blocks = [t.shape[1] // rows[t.qtype] for t in plan.tensors if t.qtype in rows and len(t.shape) == 2]
    return all(n % tp == 0 for n in k_blocks)


def default_quant(checkpoint: str | os.PathLike, tp_degree: int = 1) -> str | None:
    """The ``quant`` a model converted from a GGUF file gets when the caller passed none (int8 where
    ``tp_degree`` shards would split the blocks the int4 storages keep).

    None for any other checkpoint. Logs one line saying what was chosen and how to keep float32.
    """
    f = Path(checkpoint) / SOURCE_FILE
    if not f.is_file():
        return None
    try:
        source = json.loads(f.read_text())
    except ValueError:
        return None
    quant = source.get("default_quant")
    if "matrix_types" in source and "parameters" in source:  # this version's choice, not the cache's
        quant = storage_for(set(source["matrix_types"]), source["parameters"])
    split = quant in ("int4", "int4-a16") and tp_degree > 1 and not _whole_k_blocks(source, tp_degree)
    quant = "int8" if split else int4_form(checkpoint, quant, log=False)  # the line below names the form
    if quant is not None:
        how = how_stored(quant, [t for t in source.get("matrix_types", []) if t != "F32"])
        why = f" (tp={tp_degree} would split 5- / 6-bit blocks)" if split else ""
        logger.warning(
            "%s: %s; stored as %s%s (quant='none' / --quant none keeps f32)",
            Path(source.get("path", "")).name, how, quant, why,
        )  # fmt: skip
    return quant


def how_stored(quant: str, types: list[str]) -> str:
    """What the default storage ``quant`` does with a file's matrix ``types`` (the log line's words)."""
    quant = quant.replace("int4-asym", "int4")  # the form holding blocks with minimums: the same words
    if quant not in ("int4", "int4-a16", "int8"):  # f16 / bf16: the values as they are
        return f"{'/'.join(types)} kept"
    kept = [t for t in types if t in INT4_KEEPS] if quant != "int8" else []
    groups = [t for t in types if t in Q8_BLOCK_TYPES and t not in kept]
    rest = [t for t in types if t not in kept and t not in groups]
    parts = [f"{'/'.join(kept)} blocks kept"] if kept else []
    parts += [f"{'/'.join(groups)} kept as int8 groups of 32"] if groups else []
    parts += [f"{'/'.join(rest)} re-rounded to int8 per channel"] if rest else []
    acts = {"int4": ", activations rounded to int8 per group", "int4-a16": ", activations held as int16"}
    return ", ".join(parts) + acts.get(quant, "")


Q4_TYPES = INT4_KEEPS  # blocks quant="int4" keeps: 4-bit ones in groups of 32, 5- and 6-bit ones' codes


def q4_types(checkpoint: str | os.PathLike) -> list[str]:
    """The block types among a converted GGUF model's matrices that ``quant="int4"`` keeps as stored
    (``Q4_TYPES``; empty for any other checkpoint)."""
    f = Path(checkpoint) / SOURCE_FILE
    try:
        types = json.loads(f.read_text()).get("matrix_types", []) if f.is_file() else []
    except ValueError:
        return []
    return [t for t in Q4_TYPES if t in types]


def hf_types(checkpoint: str | os.PathLike) -> dict[str, str] | None:
    """A converted GGUF model's block type of each 2-D tensor, by its HF name (``"Q6_K"``, ...); None for
    any other checkpoint."""
    f = Path(checkpoint) / SOURCE_FILE
    try:
        return json.loads(f.read_text()).get("hf_types") if f.is_file() else None
    except ValueError:
        return None


def lookup_bytes(checkpoint: str | os.PathLike) -> float | None:
    """Bytes per weight of a converted GGUF model's embedding where the lookup keeps its codes (int8
    codes, float32 group scales and offsets: ``aotlm.models.lookup``); None for any other checkpoint."""
    return gguf_lookup.bytes_per_weight(embedding_type(checkpoint))


def embedding_type(checkpoint: str | os.PathLike) -> str | None:
    """The block type of a converted GGUF model's token embedding (``"Q6_K"``, ...); None for any other
    checkpoint."""
    f = Path(checkpoint) / SOURCE_FILE
    try:
        return json.loads(f.read_text()).get("embedding_type") if f.is_file() else None
    except ValueError:
        return None


def int4_form(checkpoint: str | os.PathLike, quant, log: bool = True):
    """``quant="int4"`` (``"int4-a16"``, ``"int4-f32a"``) for a GGUF model with Q4_1 / Q4_K / Q5_1 / Q5_K
    blocks (a minimum per block) -> ``"int4-asym"`` (``"int4-asym-a16"``, ...), the form that holds them
    (``aotlm.models.quant4``), saying so in a log line (``log``); anything else unchanged."""
    types = q4_types(checkpoint)
    if quant not in ("int4", "int4-a16", "int4-f32a") or not {"Q4_1", "Q4_K", "Q5_1", "Q5_K"} & set(types):
        return quant
    asym = quant.replace("int4", "int4-asym")  # "-a16" / "-f32a" (how activations are held) kept
    if log:
        kinds = "/".join(types)
        logger.warning("%s blocks have a minimum each: quant=%r stores them as %r", kinds, quant, asym)
    return asym
