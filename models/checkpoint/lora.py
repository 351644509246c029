"""PEFT LoRA adapters: an ``adapter_config.json`` with ``adapter_model.safetensors`` (or
``adapter_model.bin``), read and checked, and merged into a checkpoint's weights as they are read.

A LoRA module adds ``scale * B @ A`` to its base weight (``A [r, in]``, ``B [out, r]``, ``scale =
lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; transposed for ``fan_in_fan_out``
modules such as GPT-2's ``Conv1D``): PEFT's ``merge_and_unload``. ``MergedReader`` does it per tensor
as the loader asks for it, so a merged model costs nothing at run time and loads like its base.
What PEFT can save but this does not apply (DoRA, trained biases, ``modules_to_save``, embedding
adapters, per-module alphas) is refused by name rather than dropped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aotlm.models.checkpoint.formats import CheckpointError, SafetensorsFile

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFE = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
_A, _B = ".lora_A.weight", ".lora_B.weight"
_PREFIX = "base_model.model."  # PEFT's wrapper in front of the base model's module names


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: ``modules`` maps each base weight it changes (the checkpoint's tensor
    name) to ``(A name, B name, scale)`` in ``tensors`` (name -> float32 array)."""

    path: Path
    modules: dict[str, tuple[str, str, float]]
    tensors: dict[str, np.ndarray]
    fan_in_fan_out: bool
    digest: str  # content hash: part of the converted-weights cache key

    def delta(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """``scale * B @ A`` for base weight ``name`` in the base weight's layout ``shape``."""
        a_name, b_name, scale = self.modules[name]
        d = scale * (self.tensors[b_name] @ self.tensors[a_name])
        d = d.T if self.fan_in_fan_out else d
        if d.shape != tuple(shape):
            raise CheckpointError(
                f"LoRA adapter {self.path}: module {name!r} makes a {d.shape} update for a {tuple(shape)} "
                "weight; the adapter was trained on another base model"
            )
        return d


def _config(path: Path) -> dict:
    f = path / ADAPTER_CONFIG
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        why = f"no {ADAPTER_CONFIG}" if path.is_dir() else "the directory does not exist"
        raise CheckpointError(
            f"{path} is not a PEFT adapter: {why}; give the directory save_pretrained wrote"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f} is unreadable ({e}); re-save the adapter") from e
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise CheckpointError(f"{f}: peft_type {kind!r} is not supported; only LoRA adapters (LORA)")
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "modules_to_save (fully trained copies of modules)",
        "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
        "trainable_token_indices": "trainable tokens",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise CheckpointError(f"{f}: {what} are not supported; train the adapter without {key}")
    if cfg.get("bias", "none") != "none":
        raise CheckpointError(f"{f}: trained biases (bias={cfg['bias']!r}) are not supported; use 'none'")
    return cfg


def _tensors(path: Path) -> dict[str, np.ndarray]:
    safe, binary = path / ADAPTER_SAFE, path / ADAPTER_BIN
    if safe.is_file():
        handle = SafetensorsFile(safe)
        try:
            return {k: np.asarray(handle.get_tensor(k), np.float32) for k in handle.keys()}
        finally:
            handle.close()
    if binary.is_file():
        import torch  # local: optional (PEFT's older .bin adapters only)

        sd = torch.load(str(binary), map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in sd.items()}
    raise CheckpointError(f"no adapter weights in {path}: expected {ADAPTER_SAFE} or {ADAPTER_BIN}")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_SAFE, ADAPTER_BIN):
        f = path / name
        if f.is_file():
            h.update(name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def read_adapter(path: str | os.PathLike) -> LoraAdapter:
    """Read and check the PEFT LoRA adapter in directory ``path``."""
    path = Path(path).expanduser()
    cfg = _config(path)
    tensors = _tensors(path)
    odd = sorted(k for k in tensors if not (k.endswith(_A) or k.endswith(_B)))
    if odd:
        raise CheckpointError(
            f"LoRA adapter {path}: tensor {odd[0]!r} is not a LoRA A/B matrix (embedding adapters, "
            "biases and saved modules are not supported)"
        )
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))
    modules = {}
    for a_name in sorted(k for k in tensors if k.endswith(_A)):
        module = a_name[: -len(_A)]
        b_name = module + _B
        if b_name not in tensors:
            raise CheckpointError(f"LoRA adapter {path}: {a_name!r} has no {b_name!r}; re-save the adapter")
        r = tensors[a_name].shape[0]
        scale = alpha / (math.sqrt(r) if rslora else r)
        modules[module.removeprefix(_PREFIX) + ".weight"] = (a_name, b_name, scale)
    if not modules:
        raise CheckpointError(f"LoRA adapter {path} holds no LoRA matrices")
    return LoraAdapter(path, modules, tensors, bool(cfg.get("fan_in_fan_out", False)), _digest(path))


class MergedReader:
    """A checkpoint reader whose weights an adapter changes come back merged (``W + scale * B @ A``,
    in float32); every other tensor as the base reader gives it. ``unused()`` lists the adapter's
    modules the loader never asked for (the family does not read them: refused by the caller)."""

    def __init__(self, reader, adapter: LoraAdapter):
        self._reader, self.adapter, self._done = reader, adapter, set()
        self.path = reader.path
        missing = sorted(n for n in adapter.modules if n not in reader)
        if missing:
            raise CheckpointError(
                f"LoRA adapter {adapter.path} changes {missing[0]!r}, which the checkpoint in {reader.path} "
                "does not hold: the adapter was trained on another base model"
            )

    def names(self) -> list[str]:
        return self._reader.names()

    def __contains__(self, name: str) -> bool:
        return name in self._reader

    def get(self, name: str) -> np.ndarray:
        w = self._reader.get(name)
        if name not in self.adapter.modules:
            return w
        self._done.add(name)
        return (np.asarray(w, np.float32) + self.adapter.delta(name, w.shape)).astype(np.float32)

    def stored_type(self, name: str) -> str | None:
        """The base file's block type, None for a merged weight (its stored codes no longer hold)."""
        if name in self.adapter.modules or not hasattr(self._reader, "stored_type"):
            return None
        return self._reader.stored_type(name)

    def _stored(self, method: str, name: str, *args):
        """The base reader's ``method(name)`` (a file's stored form), None for a merged weight."""
        if name in self.adapter.modules or not hasattr(self._reader, method):
            return None
        return getattr(self._reader, method)(name, *args)

    def codes(self, name: str):
        """The base file's 4-bit codes, None for a merged weight (its stored codes no longer hold)."""
        return self._stored("codes", name)

    def groups4(self, name: str, fn):
        """The base file's 4-bit groups (``GGUFWeights.groups4``), None for a merged weight."""
        return self._stored("groups4", name, fn)

    def lookup(self, name: str):
        """The base file's embedding codes (``GGUFWeights.lookup``), None for a merged weight."""
        return self._stored("lookup", name)

    def row_chunks(self, name: str, rows: int = 1024):
        """The base file's rows a few at a time (``GGUFWeights.row_chunks``), None for a merged weight."""
        return self._stored("row_chunks", name, rows)

    def q8_blocks(self, name: str):
        """The base file's Q8_0 codes and scales (``GGUFWeights.q8_blocks``), None for a merged weight."""
        return self._stored("q8_blocks", name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(name)

    def unused(self) -> list[str]:
        return sorted(set(self.adapter.modules) - self._done)

    def items(self):
        for n in self.names():
            yield n, self.get(n)

    def close(self) -> None:
        self._reader.close()


def merged_adapter(lora_adapters: dict | None, merge_lora: bool) -> LoraAdapter | None:
    """The adapter ``from_pretrained(lora_adapters={name: path}, merge_lora=True)`` merges, or None."""
    if not lora_adapters:
        if merge_lora:
            raise ValueError("merge_lora=True needs an adapter: lora_adapters={'name': 'path/to/adapter'}")
        return None
    if not isinstance(lora_adapters, dict) or not all(isinstance(k, str) for k in lora_adapters):
        raise TypeError(f"lora_adapters must be a dict {{name: adapter dir}}, got {lora_adapters!r}")
    if not merge_lora:
        return None  # served per row from adapter slots (aotlm.core.lora_slots)
    if len(lora_adapters) != 1:
        names = sorted(lora_adapters)
        raise ValueError(f"merge_lora=True merges one adapter, got {len(names)}: {names}")
    return read_adapter(next(iter(lora_adapters.values())))
