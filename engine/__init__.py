"""aotlm: ahead-of-time compiled Hugging Face causal LMs on JAX.

The installed package ``aotlm`` is the repository's ``engine/`` folder and ``aotlm.models``
its ``models/`` folder (see ``pyproject.toml``). Public names are imported lazily, so that
``aotlm.models`` can import small runtime modules (``aotlm.models.checkpoint``) without pulling in
the whole runtime (no import cycle) and ``import aotlm`` stays cheap.
"""

from __future__ import annotations

import importlib
import os

# transformers prints advice at import ("PyTorch was not found...") that is noise for aotlm
# users, who run without torch; only a default, so TRANSFORMERS_VERBOSITY still wins.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# public name -> module (inside aotlm) that defines it
_EXPORTS = {
    "AutoModelForSampling": "api.causal_lm",
    "BUNDLED_MODELS": "models.checkpoint.bundled",
    "DEFAULT_MODEL": "models.checkpoint.bundled",
    "bundled_path": "models.checkpoint.bundled",
    "CausalLMForSampling": "api.causal_lm",
    "BloomForSampling": "api.families",
    "FalconForSampling": "api.families",
    "GemmaForSampling": "api.families",
    "Gemma2ForSampling": "api.families",
    "GPT2ForSampling": "api.families",
    "GPT2ForSamplingWithContextBroadcasting": "api.families",
    "GPTBigCodeForSampling": "api.families",
    "GPTJForSampling": "api.families",
    "GPTNeoXForSampling": "api.families",
    "LlamaForSampling": "api.families",
    "MistralForSampling": "api.families",
    "MixtralForSampling": "api.families",
    "MPTForSampling": "api.families",
    "OPTForSampling": "api.families",
    "Phi3ForSampling": "api.families",
    "Qwen2ForSampling": "api.families",
    "Qwen3ForSampling": "api.families",
    "NeuronAutoModelForCausalLM": "api.families",
    "NeuronConfig": "api.neuron_config",
    "GQA": "api.neuron_config",
    "QuantizationConfig": "models.quant",
    "StoppingCriteria": "generate.stopping",
    "StoppingCriteriaList": "generate.stopping",
    "HuggingFaceGenerationModelAdapter": "text.hf_adapter",
    "SpeculativeGenerator": "generate.speculative",
    "pipeline": "text.pipeline",
    "TextGenerationPipeline": "text.pipeline",
    "TextStreamer": "text.tokens",
    "validate_checkpoint": "models.checkpoint.resolve",
    "load_bucket_config": "core.bucket_config",
    "GenerationConfig": "generate.params",
    "GenerateOutput": "generate.generation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"aotlm.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'aotlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
