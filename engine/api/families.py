"""Per-family model classes with transformers-neuronx's names.

Each is ``AutoModelForSampling`` restricted to its ``config.model_type``: loading another family's
checkpoint is an error naming both (use ``NeuronAutoModelForCausalLM`` to pick by config). Nothing
here adds behaviour: a family is a row of the weight-name table in ``aotlm.models``, not a class
with its own code.
"""

from __future__ import annotations

from aotlm.api.causal_lm import AutoModelForSampling

NeuronAutoModelForCausalLM = AutoModelForSampling  # transformers-neuronx's name for the same thing


class BloomForSampling(AutoModelForSampling):
    model_types = ("bloom",)


class FalconForSampling(AutoModelForSampling):
    model_types = ("falcon",)


class GemmaForSampling(AutoModelForSampling):
    model_types = ("gemma",)


class Gemma2ForSampling(AutoModelForSampling):
    model_types = ("gemma2",)


class GPT2ForSampling(AutoModelForSampling):
    model_types = ("gpt2",)


class GPT2ForSamplingWithContextBroadcasting(GPT2ForSampling):
    """GPT-2 with ``prompt_batch_size`` (transformers-neuronx's broadcasting class). Every aotlm
    model takes ``prompt_batch_size``; this name exists so that the guide's scripts run."""


class GPTBigCodeForSampling(AutoModelForSampling):
    model_types = ("gpt_bigcode",)


class GPTJForSampling(AutoModelForSampling):
    model_types = ("gptj",)


class GPTNeoXForSampling(AutoModelForSampling):
    model_types = ("gpt_neox",)


class LlamaForSampling(AutoModelForSampling):
    model_types = ("llama",)


class MistralForSampling(AutoModelForSampling):
    model_types = ("mistral",)


class MixtralForSampling(AutoModelForSampling):
    model_types = ("mixtral",)


class MPTForSampling(AutoModelForSampling):
    model_types = ("mpt",)


class OPTForSampling(AutoModelForSampling):
    model_types = ("opt",)


class Phi3ForSampling(AutoModelForSampling):
    model_types = ("phi3",)


class Qwen2ForSampling(AutoModelForSampling):
    model_types = ("qwen2",)


class Qwen3ForSampling(AutoModelForSampling):
    model_types = ("qwen3",)
