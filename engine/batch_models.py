"""Where batch jobs find checkpoints and tokenizers (the one switch point to ``aotlm.resolve``).

Pre-flight needs the resolved checkpoint and tokenizer paths *without* reading weights,
so a bad path fails on its JSONL line before any model is loaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from aotlm.checkpoint import CheckpointError

AMP_NAMES = {
    "f32": "f32",
    "fp32": "f32",
    "float32": "f32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "f16": "f16",
    "fp16": "f16",
    "float16": "f16",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def expand(path: str | os.PathLike) -> str:
    return os.path.expandvars(os.path.expanduser(str(path)))


def amp_for(dtype: str | None, default: str = "f32") -> str:
    if dtype is None:
        return default
    if str(dtype).lower() not in AMP_NAMES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(set(AMP_NAMES))}")
    return AMP_NAMES[str(dtype).lower()]


def _has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def resolve(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, need_tokenizer: bool = True):
    """(checkpoint dir, tokenizer dir or None), both absolute; reads no weights.

    A directory with ``config.json`` is a checkpoint; a training run directory resolves to
    its latest ``checkpoints/checkpoint-N`` (numeric order). The tokenizer is ``tokenizer``
    if given, else next to the checkpoint, else at the run root.
    """
    try:
        from aotlm import validate_checkpoint  # the text issue's resolver, when present
    except ImportError:
        validate_checkpoint = None
    if validate_checkpoint is not None:
        info = validate_checkpoint(expand(path), tokenizer=None if tokenizer is None else expand(tokenizer))
        ckpt = _field(info, "checkpoint", "path", "config")
        tok = _field(info, "tokenizer")
        ckpt = Path(ckpt).parent if Path(ckpt).is_file() else Path(ckpt)
        tok = None if tok is None else (Path(tok).parent if Path(tok).is_file() else Path(tok))
    else:
        ckpt, tok = _resolve_local(Path(expand(path)), tokenizer)
    if need_tokenizer and tok is None:
        raise CheckpointError(f"no tokenizer found for {path}; pass a tokenizer path (--tokenizer)")
    return str(Path(ckpt).resolve()), None if tok is None else str(Path(tok).resolve())


def _field(info, *names):
    for n in names:
        v = info.get(n) if isinstance(info, dict) else getattr(info, n, None)
        if v is not None:
            return v
    return None


def _resolve_local(p: Path, tokenizer) -> tuple[Path, Path | None]:
    root = p
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not (p / "config.json").is_file():
        runs = [
            c for c in (p / "checkpoints").glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", c.name)
        ]
        if not runs:
            raise CheckpointError(f"{p} is neither a checkpoint (no config.json) nor a run directory")
        p = max(runs, key=lambda c: int(c.name.split("-")[1]))
        if not (p / "config.json").is_file():
            raise CheckpointError(f"{p / 'config.json'} is missing")
    if tokenizer is not None:
        t = Path(expand(tokenizer))
        if not (t.is_dir() and _has_tokenizer(t)):
            raise CheckpointError(f"tokenizer {tokenizer} does not exist or holds no tokenizer files")
        return p, t
    for d in (p, root):
        if _has_tokenizer(d):
            return p, d
    return p, None


def load_tokenizer(path: str):
    """A transformers tokenizer that pads on the left (as generation needs)."""
    try:
        from aotlm.text import load_tokenizer as text_load  # the text issue's loader, when present
    except ImportError:
        text_load = None
    if text_load is not None:
        return text_load(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.padding_side = "left"
    return tok
