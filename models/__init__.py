"""Model families: ``model_type`` -> module with ``arch_config``, ``weight_rows``, ``PREFIXES``."""

from __future__ import annotations

import importlib
from types import ModuleType

_FAMILIES = (
    "gpt2",
    "llama",
    "mixtral",
    "qwen",
    "gemma",
    "phi3",
    "gptj",
    "gpt_neox",
    "opt",
    "bloom",
    "mpt",
    "falcon",
    "gpt_bigcode",
)


def _unsupported() -> dict[str, str]:
    """model_type -> why aotlm refuses it and what to load instead (a family's ``UNSUPPORTED``)."""
    out: dict[str, str] = {}
    for fam in _FAMILIES:
        out.update(getattr(importlib.import_module(f"aotlm.models.{fam}"), "UNSUPPORTED", {}))
    return out


def _registry() -> dict[str, ModuleType]:
    reg: dict[str, ModuleType] = {}
    for fam in _FAMILIES:
        mod = importlib.import_module(f"aotlm.models.{fam}")
        for mt in mod.MODEL_TYPES:
            reg[mt] = mod
    return reg


def supported_model_types() -> list[str]:
    return sorted(_registry())


def family_for(model_type: str) -> ModuleType:
    reg = _registry()
    why = _unsupported().get(model_type)
    if why is not None:
        raise ValueError(f"model_type={model_type!r} {why}")
    if model_type not in reg:
        raise ValueError(
            f"unknown architecture model_type={model_type!r}; aotlm supports: {', '.join(sorted(reg))}"
        )
    return reg[model_type]
