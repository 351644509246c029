"""``CausalLMForSampling``: the compiled model plus generation (``sample()`` and its strategies).

``aotlm.core.model.CompiledModel`` owns weights, KV cache and graphs; this subclass adds what a
request needs on top: generation parameters, the decode loop (``generation.run``), and the
strategies that add graph kinds (``extensions``: beam search, speculative decoding, context
broadcasting), plugged in through the base class's ``_extra_graph_keys`` / ``_lower_extra``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from aotlm.api import arguments, extensions
from aotlm.api import neuron_config as nc
from aotlm.api.pipelined import PipelineForSampling
from aotlm.batching import slot_graphs
from aotlm.core.model import CompiledModel
from aotlm.generate import broadcast, generation, params, speculative
from aotlm.generate.sampler import Sampler
from aotlm.generate.strategies import Strategies, speculation_lengths


class CausalLMForSampling(CompiledModel, Sampler):
    """A causal LM compiled per bucket, with ``sample()``. Use ``AutoModelForSampling.from_pretrained``.

    ``prompt_batch_size``, ``num_beams`` and ``speculation_length`` add the graphs of those
    strategies (``extensions``). ``continuous_batching=True`` makes the model a server's: its
    graphs are the slot graphs (``slot_graphs``: each batch row a slot that requests enter and
    leave, driven by ``slots.SlotBatch``); ``sample()`` still works, compiling its graphs on first
    use; ``prompt_logprobs=True`` adds the graphs that score a request's prompt while encoding it,
    ``embeddings=True`` those that return its last token's hidden state (``/v1/embeddings``).
    ``neuron_config`` (``aotlm.config.NeuronConfig``, transformers-neuronx's) sets ``quant``,
    ``gqa``, ``fuse_qkv`` and, from ``on_device_generation``, the defaults of ``sample()``. Every
    other argument is ``CompiledModel``'s.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *args,
        prompt_batch_size: int | None = None,
        num_beams: int = 1,
        speculation_length: int | Sequence[int] | None = None,
        continuous_batching: bool = False,
        prompt_logprobs: bool = False,
        embeddings: bool = False,
        neuron_config: nc.NeuronConfig | None = None,
        **kwargs,
    ):
        self.default_generation = nc.apply(neuron_config, kwargs) or params.GenerationConfig()
        super().__init__(path, *args, **kwargs)
        self.strategies = Strategies.build(self.batch_size, prompt_batch_size, num_beams, speculation_length)
        if not isinstance(continuous_batching, bool):
            raise TypeError(f"continuous_batching must be True or False, got {continuous_batching!r}")
        self.continuous_batching = continuous_batching
        for name, on in (("prompt_logprobs", prompt_logprobs), ("embeddings", embeddings)):
            if not isinstance(on, bool):
                raise TypeError(f"{name} must be True or False, got {on!r}")
            if on and not continuous_batching:
                raise ValueError(
                    f"{name}=True adds prefill graphs to the slot graphs: build the model with "
                    "continuous_batching=True too (offline, model.score() gives prompt log-probabilities)"
                )
        self.prompt_logprobs, self.embeddings = prompt_logprobs, embeddings

    def graph_keys(self) -> list[tuple]:
        if self.continuous_batching:
            return slot_graphs.graph_keys(
                self.ctx_buckets, self.tg_buckets, self.batch_size, self.prompt_logprobs, self.embeddings
            )
        return super().graph_keys()

    def _extra_graph_keys(self) -> list[tuple]:
        return extensions.graph_keys(self)

    def _lower_extra(self, key: tuple):
        if key[0].startswith("slot_"):
            return slot_graphs.lower(self, key)
        return extensions.lower(self, key)

    encode = broadcast.encoder(CompiledModel.encode)

    def to_neuron(self) -> CausalLMForSampling:
        """transformers-neuronx's name for ``compile()``: compile (or load from the compile cache
        or from ``load()``'s artifacts) every graph of ``graph_keys()``; with
        ``enable_speculative_decoder(k)`` also the speculative graphs of drafts already paired
        with this model by ``SpeculativeGenerator`` (later pairs compile theirs when created)."""
        self.compile()
        for draft in list(self.strategies.drafts.values()):
            for k in self.strategies.speculation_length or ():
                speculative.SpeculativeGenerator(draft, self, k).compile()
        return self

    def enable_speculative_decoder(self, speculation_length: int | Sequence[int]) -> None:
        """Make this model a speculative target for ``k`` draft tokens per round (transformers-
        neuronx). aotlm runs draft and target in one graph per pair of bucket widths, so those
        graphs depend on the draft: ``SpeculativeGenerator(draft, self, k)`` compiles them."""
        self.strategies.speculation_length = speculation_lengths(speculation_length)

    sample = extensions.routed(Sampler.sample)
    constrained_decoding = True  # sample(constraints=...): generation.run fills the masks
    step_scores = True  # sample(output_scores=True): generation.run reads each step's scores

    def _run(self, *args, **kw) -> np.ndarray | generation.GenerateOutput:
        return generation.run(self, *args, **kw)

    adapter_rows = CompiledModel.adapter_rows  # the slots' (Sampler's refuses every adapter)


class AutoModelForSampling(CausalLMForSampling):
    """Picks the family from ``config.model_type`` (``aotlm.api.families``: one class per family);
    ``pp_degree > 1`` gives a ``PipelineForSampling``."""

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, pp_degree: int = 1, **kwargs
    ) -> CausalLMForSampling | PipelineForSampling:
        arguments.check_names(kwargs, cls.model_arguments(), "from_pretrained()")
        if pp_degree != 1:
            return PipelineForSampling(path, pp_degree=pp_degree, model_types=cls.model_types, **kwargs)
        return cls(path, **kwargs)

    @classmethod
    def model_arguments(cls) -> set[str]:
        """The keyword arguments ``from_pretrained`` takes (besides the path)."""
        inits = [c.__init__ for c in cls.__mro__ if "__init__" in vars(c)]
        return arguments.accepted([*inits, PipelineForSampling.__init__]) - {"model_types"}
