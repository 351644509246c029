"""Where a model's files are: checkpoint directories, training runs and bundled names.

Every place that accepts a model (``from_pretrained``, ``pipeline``, each CLI command)
goes through :func:`resolve`, so they all accept the same things:

* a checkpoint directory (``config.json`` + weights);
* a training run directory: its latest ``checkpoints/checkpoint-N`` (or ``checkpoint-N``,
  the HF Trainer layout), by the numeric value of ``N``, not by name;
* a bundled model name such as ``"aotlm/tiny-py"`` (package data, see ``aotlm.models.checkpoint.bundled``);
* a real model's name such as ``"smollm2"`` (a package's GGUF file, see ``aotlm.models.checkpoint.named``);
* a llama.cpp ``*.gguf`` file: converted once into a cached checkpoint directory (``gguf``);

with ``~`` and ``$VARS`` expanded. :func:`validate_checkpoint` checks that every piece is
there without reading any weight, so a typo fails in milliseconds, naming the missing file.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from aotlm.models.checkpoint import gguf, named
from aotlm.models.checkpoint.bundled import BUNDLED_MODELS, DEFAULT_MODEL, bundled_path
from aotlm.models.checkpoint.formats import (
    SAFE_INDEX,
    SAFE_SINGLE,
    TORCH_INDEX,
    TORCH_SINGLE,
    CheckpointError,
)
from aotlm.models.checkpoint.gguf_weights import source_of

_CKPT_NAME = re.compile(r"^checkpoint-(\d+)$")
_UNSET_VAR = re.compile(r"\$(\w+|\{\w+\})")
# files that make a directory a tokenizer (any one of them is enough for AutoTokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class CheckpointFiles:
    """The resolved pieces of a model: what would be read, nothing read yet."""

    checkpoint: Path  # the checkpoint directory
    config: Path  # its config.json
    weights: tuple[Path, ...]  # every weight file (all shards of an index)
    tokenizer: Path | None  # the directory holding the tokenizer files (None: not found)
    run: Path | None = None  # the training run directory, when one was given
    model_type: str = ""


def expand(path: str | os.PathLike) -> Path:
    """``~`` and ``$VARS`` expanded; an unset variable is an error naming it."""
    text = os.path.expandvars(os.path.expanduser(os.fspath(path)))
    unset = _UNSET_VAR.search(text)
    if unset and not Path(text).exists():
        name = unset.group(1).strip("{}")
        raise CheckpointError(f"the path {os.fspath(path)!r} uses ${name}, which is not set; export {name}")
    return Path(text)


def is_bundled_name(path: str | os.PathLike) -> bool:
    """``aotlm/<name>`` that is not an existing path."""
    text = os.fspath(path)
    return text.startswith("aotlm/") and not Path(text).exists()


def bundled(name: str) -> Path:
    """The directory of a bundled model, or a clear error when it is not installed."""
    found = bundled_path(name)
    if found is None:
        raise CheckpointError(
            f"bundled model {name!r} not installed; bundled models: {sorted(BUNDLED_MODELS)}, "
            "or pass a checkpoint directory"
        )
    return Path(found)


def latest_checkpoint(run: Path) -> Path | None:
    """The ``checkpoint-N`` with the largest ``N`` under ``run/checkpoints`` or ``run``."""
    for parent in (run / "checkpoints", run):
        if not parent.is_dir():
            continue
        found = [
            (int(m.group(1)), p) for p in parent.iterdir() if (m := _CKPT_NAME.match(p.name)) and p.is_dir()
        ]
        if found:
            return max(found)[1]
    return None


def run_root(checkpoint: Path) -> Path | None:
    """The training run a ``.../checkpoints/checkpoint-N`` directory belongs to, if any."""
    if not _CKPT_NAME.match(checkpoint.name):
        return None
    parent = checkpoint.parent
    return parent.parent if parent.name == "checkpoints" else parent


def resolve(path: str | os.PathLike | None) -> Path:
    """The checkpoint directory a model argument names (see the module docstring); None: the default."""
    if path is None:
        path = default_model()
    if is_bundled_name(path):
        return bundled(os.fspath(path))
    if named.is_named(os.fspath(path)):  # a real model by name: its package's GGUF file
        path = named.locate(os.fspath(path))
    p = expand(path)
    if gguf.is_gguf(p):
        return gguf.convert(p)
    if (p / "config.json").is_file():
        return p
    if not p.exists():
        raise CheckpointError(
            f"model path {p} does not exist; check the path, or give a model name: "
            f"{', '.join(sorted(named.NAMED_MODELS))} (aotlm models) or {', '.join(sorted(BUNDLED_MODELS))}"
        )
    if not p.is_dir():
        raise CheckpointError(
            f"model path {p} is a file; give the checkpoint directory that holds config.json"
        )
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"{p} is neither a checkpoint (no config.json) nor a training run (no checkpoints/checkpoint-N); "
            "give the directory that holds config.json"
        )
    if not (latest / "config.json").is_file():
        raise CheckpointError(f"the latest checkpoint of run {p}, {latest}, has no config.json (incomplete?)")
    return latest


def has_tokenizer(directory: Path) -> bool:
    return directory.is_dir() and any((directory / f).is_file() for f in TOKENIZER_FILES)


def find_tokenizer(checkpoint: Path, tokenizer: str | os.PathLike | None = None) -> Path | None:
    """An explicit tokenizer directory, else the checkpoint's, else its training run's."""
    if tokenizer is not None:
        t = bundled(os.fspath(tokenizer)) if is_bundled_name(tokenizer) else expand(tokenizer)
        if not t.is_dir():
            raise CheckpointError(f"tokenizer directory {t} does not exist")
        if not has_tokenizer(t):
            raise CheckpointError(f"no tokenizer files in {t}: expected one of {list(TOKENIZER_FILES)}")
        return t
    for d in (checkpoint, run_root(checkpoint)):
        if d is not None and has_tokenizer(d):
            return d
    return None


def weight_files(checkpoint: Path) -> tuple[Path, ...]:
    """Every weight file of a checkpoint (a GGUF model's: its .gguf file); a missing one is an error
    naming it."""
    gguf_file = source_of(checkpoint)
    if gguf_file is not None:
        return (gguf_file,)
    for index in (SAFE_INDEX, TORCH_INDEX):
        f = checkpoint / index
        if f.is_file():
            try:
                names = sorted(set(json.loads(f.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError, AttributeError) as e:
                raise CheckpointError(f"{f} is not a valid weight index ({e}); re-save the checkpoint") from e
            for n in names:
                if not (checkpoint / n).is_file():
                    raise CheckpointError(
                        f"weight file {checkpoint / n} (listed in {index}) is missing; copy every shard"
                    )
            return tuple(checkpoint / n for n in names)
    for single in (SAFE_SINGLE, TORCH_SINGLE):
        if (checkpoint / single).is_file():
            return (checkpoint / single,)
    raise CheckpointError(
        f"no weights in {checkpoint}: expected {SAFE_SINGLE}, {SAFE_INDEX}, {TORCH_SINGLE} or {TORCH_INDEX}; "
        "copy the weight files next to config.json"
    )


def validate_checkpoint(
    path: str | os.PathLike | None, tokenizer: str | os.PathLike | None = None, require_tokenizer: bool = True
) -> CheckpointFiles:
    """Resolve ``path`` and check config, weights and tokenizer exist, without loading weights.

    Raises ``CheckpointError`` naming the first missing or unreadable piece. With
    ``require_tokenizer=False`` a missing tokenizer is ``tokenizer=None`` instead of an error.
    """
    ckpt = resolve(path)
    cfg = ckpt / "config.json"
    try:
        model_type = json.loads(cfg.read_text()).get("model_type", "")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{cfg} is not valid JSON ({e}); re-save the checkpoint") from e
    if not model_type:
        raise CheckpointError(f"{cfg} has no model_type; it is not a transformers config: fix or re-save it")
    weights = weight_files(ckpt)
    tok = find_tokenizer(ckpt, tokenizer)
    if tok is None and require_tokenizer:
        root = run_root(ckpt)
        where = f"{ckpt}" + (f" or the run root {root}" if root else "")
        raise CheckpointError(f"no tokenizer found in {where}; pass --tokenizer DIR (tokenizer=DIR)")
    by_name = path is None or is_bundled_name(path) or named.is_named(os.fspath(path))
    original = None if by_name else expand(path)
    run = original if original is not None and original != ckpt and not gguf.is_gguf(original) else None
    return CheckpointFiles(ckpt, cfg, weights, tok, run, model_type)


def shown(checkpoint: str | os.PathLike) -> str:
    """How outputs and logs name a resolved checkpoint: a GGUF model by its ``.gguf`` file (not the
    cached directory it was converted into), any other by its path."""
    source = source_of(checkpoint)
    return str(source if source is not None else checkpoint)


def default_model() -> str:
    """The name every command uses when no model is given (the bundled one)."""
    return DEFAULT_MODEL
