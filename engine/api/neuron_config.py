"""transformers-neuronx's ``NeuronConfig`` / ``GQA``, mapped onto aotlm's construction arguments.

``NeuronConfig(quant=..., group_query_attention=GQA..., on_device_generation=GenerationConfig(...),
fuse_qkv=...)`` passed as ``neuron_config=`` becomes ``quant=``, ``gqa=``, ``fuse_qkv=`` and the
model's default generation settings. A field aotlm does not implement is a ``ValueError`` naming
it, unless it holds transformers-neuronx's default (a no-op); an unknown field is a ``TypeError``.
Nothing is ignored silently.
"""

from __future__ import annotations

import enum
from typing import Any

from aotlm.generate.params import GenerationConfig
from aotlm.models.quant import QuantizationConfig


class GQA(enum.StrEnum):
    """K/V-head sharding strategies under tensor parallelism (transformers-neuronx names).

    The values are aotlm's ``gqa=`` strings, so ``gqa=GQA.SHARD_OVER_BATCH`` works too.
    """

    SHARD_OVER_HEADS = "shard-over-heads"
    SHARD_OVER_BATCH = "shard-over-batch"
    REPLICATED_HEADS = "replicated-heads"
    ALL_GATHER_HEADS = "all-gather-heads"


# fields aotlm implements -> the from_pretrained argument they become
_MAPPED = {"quant": "quant", "group_query_attention": "gqa", "fuse_qkv": "fuse_qkv"}
# transformers-neuronx fields aotlm does not implement -> the values that mean "off" there
_NO_OP = {
    "all_reduce_dtype": (None,),
    "sparse_attn": (None,),
    "cast_logits_dtype": ("float32", None),
    "continuous_batching": (None,),
    "use_2d_cache_ids": (False,),
    "attention_layout": ("HSB", None),
    "collectives_layout": ("HSB", None),
    "padding_side": ("left", None),
    "shard_over_sequence": (False,),
    "duplicate_q_weight_sbh": (False,),
    "weight_tiling": (False,),
    "log_softmax_scores": (False,),
    "is_eagle_target": (False,),
    "is_eagle_draft": (False,),
    "bf16_rms_norm": (False,),
    "qkv_tiling": (False,),
    "mlp_out_weight_transpose": (False,),
    "on_device_embedding": (False,),
    "lhs_aligned": (False,),
}
_WHY = {
    "continuous_batching": "serve with `aotlm serve` (aotlm.serve.Engine) instead",
    "all_reduce_dtype": "collectives run in the activation dtype",
    "cast_logits_dtype": "logits are always float32",
}


class NeuronConfig:
    """transformers-neuronx's model options: ``quant``, ``group_query_attention``,
    ``on_device_generation`` and ``fuse_qkv`` map onto aotlm; see the module docstring."""

    def __init__(self, **fields: Any):
        known = set(_MAPPED) | set(_NO_OP) | {"on_device_generation"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(
                f"NeuronConfig got unknown field(s) {unknown}; aotlm implements {sorted(_MAPPED)} and "
                "on_device_generation"
            )
        for name, value in fields.items():
            if name in _NO_OP and value not in _NO_OP[name]:
                why = f" ({_WHY[name]})" if name in _WHY else ""
                raise ValueError(
                    f"NeuronConfig({name}={value!r}) is not supported by aotlm{why}; leave it out"
                )
        quant = fields.get("quant")
        if quant is not None and not isinstance(quant, QuantizationConfig):
            raise TypeError(f"NeuronConfig(quant=...) takes a QuantizationConfig, got {quant!r}")
        gqa = fields.get("group_query_attention")
        if gqa is not None:
            try:
                gqa = GQA(gqa)
            except ValueError:
                raise ValueError(
                    f"group_query_attention={gqa!r} is unknown; use one of {[g.name for g in GQA]}"
                ) from None
            if gqa is GQA.ALL_GATHER_HEADS:
                raise ValueError(
                    "GQA.ALL_GATHER_HEADS is not implemented in aotlm; use GQA.SHARD_OVER_HEADS, "
                    "GQA.SHARD_OVER_BATCH or GQA.REPLICATED_HEADS (engine/core/README.md: tensor parallelism)"
                )
        gen = fields.get("on_device_generation")
        if gen is not None and not isinstance(gen, GenerationConfig):
            raise TypeError(
                f"on_device_generation takes aotlm.config.GenerationConfig(...), got {type(gen).__name__}"
            )
        self.quant: QuantizationConfig | None = quant
        self.group_query_attention: GQA | None = gqa
        self.fuse_qkv = bool(fields.get("fuse_qkv", False))
        self.on_device_generation: GenerationConfig | None = gen

    def model_kwargs(self) -> dict:
        """The ``from_pretrained`` arguments this config sets (only those it sets)."""
        out: dict[str, Any] = {}
        if self.quant is not None:
            out["quant"] = self.quant
        if self.group_query_attention is not None:
            out["gqa"] = self.group_query_attention.value
        if self.fuse_qkv:
            out["fuse_qkv"] = True
        return out

    def __repr__(self) -> str:
        return (
            f"NeuronConfig(quant={self.quant!r}, group_query_attention={self.group_query_attention}, "
            f"fuse_qkv={self.fuse_qkv}, on_device_generation={self.on_device_generation!r})"
        )


def apply(neuron_config: NeuronConfig | None, kwargs: dict) -> GenerationConfig | None:
    """Merge ``neuron_config`` into ``kwargs`` (in place); returns its generation defaults.

    An argument given both ways with different values is an error naming it.
    """
    if neuron_config is None:
        return None
    if not isinstance(neuron_config, NeuronConfig):
        raise TypeError(f"neuron_config takes aotlm.NeuronConfig(...), got {type(neuron_config).__name__}")
    for name, value in neuron_config.model_kwargs().items():
        given = kwargs.get(name)
        if given is not None and given is not False and given != value:
            raise ValueError(f"{name}={given!r} was passed and neuron_config sets {value!r}; give it one way")
        kwargs[name] = value
    return neuron_config.on_device_generation
