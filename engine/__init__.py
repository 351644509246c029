"""aotlm runtime: buckets, KV cache, compile + cache, sharding, sampling, generation, CLI."""

from engine.model import (
    AutoModelForSampling,
    CausalLMForSampling,
    GPT2ForSampling,
    LlamaForSampling,
)

__all__ = ["AutoModelForSampling", "CausalLMForSampling", "GPT2ForSampling", "LlamaForSampling"]
