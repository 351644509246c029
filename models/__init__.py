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


def _registry() -> tuple[dict[str, ModuleType], dict[str, str]]:
    """``(model_type -> family module, model_type -> why aotlm refuses it)`` (a family's ``UNSUPPORTED``)."""
    reg: dict[str, ModuleType] = {}
    refused: dict[str, str] = {}
    for fam in _FAMILIES:
        mod = importlib.import_module(f"aotlm.models.{fam}")
        reg.update(dict.fromkeys(mod.MODEL_TYPES, mod))
        refused.update(getattr(mod, "UNSUPPORTED", {}))
    return reg, refused


def supported_model_types() -> list[str]:
    return sorted(_registry()[0])


def family_for(model_type: str) -> ModuleType:
    reg, refused = _registry()
    why = refused.get(model_type)
    if why is not None:
        raise ValueError(f"model_type={model_type!r} {why}")
    if model_type not in reg:
        raise ValueError(
            f"unknown architecture model_type={model_type!r}; aotlm supports: {', '.join(sorted(reg))}"
        )
    return reg[model_type]
