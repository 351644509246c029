"""``PipelineForSampling``: ``pp_degree`` pipeline stages behind ``sample()`` / ``forward()``.

A composition, not a compiled model: it owns its stages (``aotlm.core.pipeline.StageModel``, each
a ``CompiledModel`` on its own devices), forwards compiling, saving and loading to them, and
chains them per request (``aotlm.generate.pp_run``). ``sample()`` comes from the shared
``Sampler`` base, as ``CausalLMForSampling``'s does.
"""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from aotlm.api import neuron_config as nc
from aotlm.core import artifacts, inputs, pipeline, sharding
from aotlm.core.model import locked
from aotlm.generate import generation, params, pp_run
from aotlm.generate.sampler import Sampler

UNSUPPORTED_PP = {  # construction options pipelined models refuse (each needs graphs of its own)
    "prompt_batch_size": None,
    "num_beams": 1,
    "speculation_length": None,
    "continuous_batching": False,
    "prompt_logprobs": False,
    "embeddings": False,
    "scoring": False,
    "max_loras": None,  # per-row LoRA adapters (merge_lora=True merges one: supported)
    "max_lora_rank": None,
}


class PipelineForSampling(Sampler):
    """``pp_degree`` stages chained by the host (``aotlm.core.pipeline``, ``aotlm.generate.pp_run``).

    ``sample()``, ``forward()``, ``compile()`` / ``to_neuron()``, ``save()`` / ``load()`` and
    ``graph_keys()`` work as on one-stage models; each stage compiles and caches its own graphs.
    Beam search, ``num_return_sequences``, speculative decoding, continuous batching and the
    score graphs are refused with a clear error (each needs graphs the stages do not have).
    ``micro_batches`` (default: the largest divisor of ``batch_size`` up to ``pp_degree``) splits
    the batch so that stages work concurrently. The stages are its parts (``stages``: each a
    ``StageModel``, a compiled model of its own); ``params`` lists their weights.
    """

    continuous_batching = False  # no slot graphs: a pipelined model does not serve
    prompt_logprobs = False
    embeddings = False
    scoring = False  # no score graphs

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        pp_degree: int,
        tp_degree: int = 1,
        batch_size: int | None = None,
        micro_batches: int | None = None,
        model_types: tuple[str, ...] | None = None,
        neuron_config: nc.NeuronConfig | None = None,
        **kwargs,
    ):
        for name, default in UNSUPPORTED_PP.items():
            if kwargs.pop(name, default) != default:
                raise ValueError(f"{name} is not supported with pp_degree > 1 yet; load with pp_degree=1")
        if kwargs.get("lora_adapters") and not kwargs.get("merge_lora"):
            raise ValueError("per-row LoRA adapters need pp_degree=1; merge one with merge_lora=True")
        self.default_generation = nc.apply(neuron_config, kwargs) or params.GenerationConfig()
        self.lock = threading.RLock()
        stages = pipeline.split_layers(pipeline.n_layers(path), pp_degree)
        batch = 1 if batch_size is None else inputs.count(batch_size, "batch_size")
        if batch < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch}")
        self.micro_batches = pipeline.micro_batches(batch, pp_degree, micro_batches)
        meshes = pipeline.stage_meshes(pp_degree, int(tp_degree))
        mb = batch // self.micro_batches
        kw = dict(kwargs, batch_size=mb, tp_degree=tp_degree, model_types=model_types)
        self.stages = [  # another process's stages (multi-host): their layout only
            pipeline.StageModel(path, st, mesh, self.micro_batches, **kw)
            if pipeline.is_local(mesh)
            else pipeline.RemoteStage(st, mesh, mb)
            for st, mesh in zip(stages, meshes, strict=True)
        ]
        head = next(st for st in self.stages if st.local)
        self.spec = head.spec.replace(batch_size=batch, pp_degree=pp_degree)  # the stages' shapes
        self.path, self.hf_config, self.compile_cache = head.path, head.hf_config, head.compile_cache
        self.mesh = None  # each stage has its own: self.stages[s].mesh

    @property
    def params(self) -> list:
        """The weights: one pytree per stage, in stage order (None for another process's stage)."""
        return [st.params if st.local else None for st in self.stages]

    @property
    def compile_report(self) -> list[dict]:
        return [
            dict(info, stage=s, graph=f"stage{s}:{info['graph']}")
            for s, st in enumerate(self.stages)
            for info in st.compile_report
        ]

    def graph_keys(self) -> list[tuple]:
        """``("stage", s, *key)`` for every graph of every stage."""
        return [("stage", s, *k) for s, st in enumerate(self.stages) for k in st.graph_keys()]

    def is_compiled(self, key: tuple) -> bool:
        """Whether graph ``("stage", s, *stage_key)`` is ready in memory."""
        return self.stages[key[1]].is_compiled(tuple(key[2:]))

    @locked
    def compile_graph(self, key: tuple):
        """Compile (or load) one graph of ``graph_keys()``: ``("stage", s, *stage_key)``."""
        if key not in self.graph_keys():
            raise ValueError(f"{key} is not one of this model's graphs: {self.graph_keys()}")
        return self.stages[key[1]].compile_graph(tuple(key[2:]))

    @locked
    def compile(self) -> PipelineForSampling:
        for st in self.stages:
            st.compile()
        return self

    def to_neuron(self) -> PipelineForSampling:
        return self.compile()

    @locked
    def save(self, directory: str | os.PathLike) -> None:
        """One artifacts directory per stage (``stage-0`` ..), written next to each other."""
        artifacts.save_target(directory)
        self.compile()
        pipeline.save(self.stages, directory)

    @locked
    def load(self, directory: str | os.PathLike) -> PipelineForSampling:
        pipeline.load(self.stages, directory)
        return self

    @locked
    def forward(self, input_ids, attention_mask=None) -> np.ndarray:
        ids, mask, n = self.prepare(input_ids, attention_mask, None)
        logits, _ = pp_run.encode(self, ids, mask)
        if not self.stages[-1].local:  # multi-host: the last stage's process has them
            logits = [np.zeros((self.stages[0].batch_size, self.cfg.vocab_size), np.float32)] * len(logits)
        out = np.concatenate([sharding.fetch(x) for x in logits])
        if jax.process_count() > 1:
            out = multihost_utils.broadcast_one_to_all(out, is_source=self.stages[-1].local)
        return out[:n]

    def score(self, *args, **kwargs):
        raise ValueError("score() is not supported with pp_degree > 1 yet; load the model with pp_degree=1")

    def enable_speculative_decoder(self, speculation_length) -> None:
        raise ValueError("speculative decoding is not supported with pp_degree > 1 yet; use pp_degree=1")

    def sample(self, *args, **kwargs):
        """``Sampler.sample`` (``CausalLMForSampling.sample``'s arguments and output) on the stages;
        the strategies that need graphs of their own are refused."""
        refused = {"num_return_sequences": (None, 1), "num_beams": (1,), "draft_model": (None,),
                   "speculation_length": (None,), "prompt_lookup_num_tokens": (None,)}  # fmt: skip
        for name, ok in refused.items():
            if kwargs.pop(name, ok[0]) not in ok:
                raise ValueError(f"{name} is not supported with pp_degree > 1 yet; use a pp_degree=1 model")
        return super().sample(*args, **kwargs)

    def _run(self, *args) -> np.ndarray | generation.GenerateOutput:
        return pp_run.run(self, *args)
