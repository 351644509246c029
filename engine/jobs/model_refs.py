"""Where batch jobs find checkpoints and tokenizers (one switch point: ``checkpoint.resolve``).

Pre-flight needs the resolved checkpoint and tokenizer paths *without* reading weights,
so a bad path fails on its JSONL line before any model is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from aotlm.models.checkpoint.resolve import validate_checkpoint
from aotlm.text.tokens import load_tokenizer as text_load

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


def expand(path: str | os.PathLike) -> str:
    return os.path.expandvars(os.path.expanduser(str(path)))


def amp_for(dtype: str | None, default: str = "f32") -> str:
    if dtype is None:
        return default
    if str(dtype).lower() not in AMP_NAMES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(set(AMP_NAMES))}")
    return AMP_NAMES[str(dtype).lower()]


def resolve(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, need_tokenizer: bool = True):
    """(checkpoint dir, tokenizer dir or None), both absolute; reads no weights.

    ``aotlm.models.checkpoint.resolve.validate_checkpoint``: a checkpoint directory, a training run directory
    (its latest ``checkpoints/checkpoint-N``) or a bundled name; the tokenizer is ``tokenizer``
    if given, else next to the checkpoint, else at the run root.
    """
    files = validate_checkpoint(path, tokenizer, require_tokenizer=need_tokenizer)
    tok = None if files.tokenizer is None else str(Path(files.tokenizer).resolve())
    return str(Path(files.checkpoint).resolve()), tok


def load_tokenizer(path: str):
    """A transformers tokenizer that pads on the left (as generation needs)."""
    return text_load(path)
