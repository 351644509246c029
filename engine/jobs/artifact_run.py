"""The compile/run split (SambaNova ``compile --inference`` / ``run``).

``aotlm compile CKPT ... --output-artifacts DIR`` compiles once and writes ``DIR``: the
relocatable executables of ``model.save`` plus ``aotlm_args.json``, the arguments the model
was built with. ``aotlm run --artifacts DIR --checkpoint PATH`` rebuilds the model from
those arguments and loads the executables: zero tracing, lowering or compiling. The
checkpoint's architecture is compared with the one compiled in *before* any weight is read,
so a mismatched checkpoint is a one-line error, not a crash deep inside XLA.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.core import artifacts
from aotlm.core.spec import MODEL_KEYS
from aotlm.durable import atomic_write_bytes
from aotlm.models import family_for
from aotlm.models.checkpoint import load_hf_config

ARGS_FILE = "aotlm_args.json"
ARG_KEYS = MODEL_KEYS


def _quant_name(q) -> str:
    """A ``QuantizationConfig`` as the string option that rebuilds it (its dequant dtype is the amp)."""
    if q.activations and not q.int4:  # prefill activations rounded too
        return "w8a8" if q.w8a8 else "bf16a"
    return q.label  # "int8", "bf16", "f16", "fp8", "int4-g64-asym-a16" (how an int4 x is held included)


def model_args(model, quant=None) -> dict:
    """The constructor arguments that rebuild ``model``'s exact configuration."""
    named = quant if quant is None or isinstance(quant, str) else _quant_name(quant)
    return model.spec.arguments() | {"quant": named}


def save_artifacts(model, directory: str | os.PathLike, quant=None) -> Path:
    """``model.save(directory)`` plus the model arguments as JSON."""
    directory = Path(directory)
    model.save(directory)
    doc = {
        "format": 1,
        "model_kwargs": model_args(model, quant),
        "compiled_from": os.path.abspath(model.path),
    }
    atomic_write_bytes(directory / ARGS_FILE, (json.dumps(doc, indent=1) + "\n").encode())
    return directory


def read_args(directory: str | os.PathLike) -> dict:
    directory = Path(os.path.expandvars(os.path.expanduser(str(directory))))
    f = directory / ARGS_FILE
    if not f.is_file():
        raise ValueError(
            f"{directory} holds no compiled artifacts ({ARGS_FILE} is missing); "
            "make them with: aotlm compile CKPT ... --output-artifacts DIR"
        )
    try:
        doc = json.loads(f.read_text())
        kwargs = doc["model_kwargs"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{f} is unreadable ({e}); compile the artifacts again") from e
    unknown = set(kwargs) - set(ARG_KEYS)
    if unknown:
        raise ValueError(f"{f} has unknown model arguments {sorted(unknown)}; compile the artifacts again")
    return kwargs


def check_architecture(directory: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
    """Refuse a checkpoint whose architecture differs from the compiled one (reads config.json only)."""
    directory = Path(directory)
    manifest = directory / artifacts.MANIFEST
    if not manifest.is_file() and (directory / "stage-0" / artifacts.MANIFEST).is_file():
        manifest = directory / "stage-0" / artifacts.MANIFEST  # pipelined: every stage has the architecture
    try:
        saved = json.loads(manifest.read_text())["fields"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{manifest} is missing or unreadable ({e})") from e
    hf = load_hf_config(checkpoint)
    arch = json.loads(json.dumps(dataclasses.asdict(family_for(hf.model_type).arch_config(hf))))
    diffs = [
        f"{k} {saved.get('arch.' + k)!r} vs {v!r}"
        for k, v in sorted(arch.items())
        if saved.get("arch." + k) != v
    ]
    if diffs:
        shown = ", ".join(diffs[:4]) + (f" (+{len(diffs) - 4} more)" if len(diffs) > 4 else "")
        raise ValueError(
            f"checkpoint {checkpoint} does not match the architecture compiled into {directory} "
            f"(compiled vs checkpoint: {shown}); compile artifacts for this checkpoint with "
            "aotlm compile CKPT --output-artifacts DIR"
        )


def load_from_artifacts(directory: str | os.PathLike, checkpoint: str | os.PathLike):
    """A model built from the saved arguments with the saved executables loaded (no compiling)."""
    directory = Path(os.path.expandvars(os.path.expanduser(str(directory))))
    kwargs = read_args(directory)
    check_architecture(directory, checkpoint)
    model = AutoModelForSampling.from_pretrained(checkpoint, compile_cache=False, **kwargs)
    return model.load(directory)
