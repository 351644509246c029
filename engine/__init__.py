"""aotlm runtime: buckets, KV cache, compile + cache, sharding, sampling, generation, CLI.

The public classes are imported lazily so that ``models`` can import small engine
modules (``engine.checkpoint``) without pulling in the whole runtime (no import cycle).
"""

__all__ = ["AutoModelForSampling", "CausalLMForSampling", "GPT2ForSampling", "LlamaForSampling"]


def __getattr__(name: str):
    if name in __all__:
        from engine import model

        return getattr(model, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
