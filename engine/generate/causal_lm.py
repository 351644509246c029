"""``CausalLMForSampling``: the compiled model plus generation (``sample()`` and its strategies).

``aotlm.core.model.CompiledModel`` owns weights, KV cache and graphs; this subclass adds what a
request needs on top: generation parameters, the decode loop (``generation.run``), and the
strategies that add graph kinds (``extensions``: beam search, speculative decoding, context
broadcasting), plugged in through the base class's ``_extra_graph_keys`` / ``_lower_extra``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from aotlm.core import graphs, inputs, pipeline, sampling, sharding
from aotlm.core.model import CompiledModel, _locked
from aotlm.generate import (
    broadcast,
    extensions,
    generation,
    params,
    pp_run,
    slot_graphs,
    speculative,
    stopping,
)
from aotlm.generate import neuron_config as nc
from aotlm.generate.strategies import Strategies, speculation_lengths


class CausalLMForSampling(CompiledModel):
    """A causal LM compiled per bucket, with ``sample()``. Use ``AutoModelForSampling.from_pretrained``.

    ``prompt_batch_size``, ``num_beams`` and ``speculation_length`` add the graphs of those
    strategies (``extensions``). ``continuous_batching=True`` makes the model a server's: its
    graphs are the slot graphs (``slot_graphs``: each batch row a slot that requests enter and
    leave, driven by ``slots.SlotBatch``); ``sample()`` still works, compiling its graphs on first
    use. ``neuron_config`` (``aotlm.config.NeuronConfig``, transformers-neuronx's) sets ``quant``,
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
        neuron_config: nc.NeuronConfig | None = None,
        **kwargs,
    ):
        self.default_generation = nc.apply(neuron_config, kwargs) or params.GenerationConfig()
        super().__init__(path, *args, **kwargs)
        self.strategies = Strategies.build(self.batch_size, prompt_batch_size, num_beams, speculation_length)
        if not isinstance(continuous_batching, bool):
            raise TypeError(f"continuous_batching must be True or False, got {continuous_batching!r}")
        self.continuous_batching = continuous_batching

    def graph_keys(self) -> list[tuple]:
        if self.continuous_batching:
            return slot_graphs.graph_keys(self.ctx_buckets, self.tg_buckets)
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

    @extensions.routed
    @_locked
    def sample(
        self,
        input_ids,
        max_new_tokens: int | Sequence[int] | None = None,
        sequence_length: int | None = None,
        attention_mask=None,
        start_ids=None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        *,
        generation_config: params.GenerationConfig | None = None,
        streamer=None,
        stopping_criteria=None,
        stopping_criteria_list=None,
        return_dict: bool = False,
        **generation_kwargs,
    ) -> np.ndarray | generation.GenerateOutput:
        """Generate: ``[batch, prompt_len + new]`` (prompt as given, then new tokens), or a
        ``GenerateOutput`` with ``return_dict=True``.

        Greedy by default. ``generation_kwargs`` are ``GenerationConfig`` fields with HF names
        (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
        ``no_repeat_ngram_size``, ``seed``, ``stop_sequences``, ``top_logprobs``); each sampling
        value and ``max_new_tokens`` may be one value or one per row. They override
        ``generation_config``, which defaults to the model's (``NeuronConfig(on_device_generation=
        ...)``, else greedy). ``sequence_length`` (total length, transformers-neuronx style),
        ``max_new_tokens`` or the config's ``max_length`` bound the output; none means "up to
        n_positions". ``min_new_tokens`` / ``min_length`` hold eos back until reached. A row stops
        at an eos id, at a stop sequence (kept in the output) or at its length; finished rows
        are filled with ``pad_token_id`` (default: the first eos id) and the output is trimmed
        to the longest row, as transformers does. ``streamer`` (HF ``BaseStreamer``: ``put``
        gets the prompt, then each new token as it is produced: one ``[batch]`` array per step) and
        ``stopping_criteria`` (HF ``StoppingCriteria``, or ``stopping_criteria_list`` as
        transformers-neuronx calls it; checked after every token) make the decode loop run one
        token per call (``generation.STREAM_CHUNK``).
        """
        cfg = generation_config or self.default_generation
        if stopping_criteria is not None and stopping_criteria_list is not None:
            raise ValueError("give stopping_criteria or stopping_criteria_list, not both")
        unknown = set(generation_kwargs) - params.FIELDS
        if unknown:
            raise TypeError(
                f"sample() got unknown generation arguments {sorted(unknown)}; known: {sorted(params.FIELDS)}"
            )
        given = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id, max_new_tokens=max_new_tokens)
        cfg = cfg.replace(**{k: v for k, v in given.items() if v is not None}, **generation_kwargs)
        if not isinstance(cfg.top_logprobs, int) or not 0 <= cfg.top_logprobs <= sampling.TOP_LOGPROBS_MAX:
            raise ValueError(f"top_logprobs must be an int in [0, {sampling.TOP_LOGPROBS_MAX}]")
        generation.check_streamer(streamer)
        inputs.eos_ids(cfg.eos_token_id, graphs.MAX_EOS), inputs.count(cfg.pad_token_id, "pad_token_id")
        criteria = stopping.criteria_list(
            stopping_criteria if stopping_criteria is not None else stopping_criteria_list
        )
        ids, mask, n = self.prepare(input_ids, attention_mask, start_ids)
        if sequence_length is None and cfg.max_new_tokens is None and cfg.max_length is not None:
            sequence_length = cfg.max_length
        new = self.token_budget(ids.shape[1], n, cfg.max_new_tokens, sequence_length)
        cfg = cfg.replace(max_new_tokens=None, max_length=None)
        generation.sampling_params(cfg, n, self.batch_size)  # validate before any device work
        generation.stop_array(cfg.stop_sequences, n, self.batch_size, self.cfg.vocab_size)
        want = bool(return_dict or cfg.top_logprobs)
        return self._run(ids, mask, n, new, cfg, streamer, criteria, want)

    def _run(self, *args):
        """The request on the device (a pipelined model chains its stages: ``PipelineForSampling``)."""
        return generation.run(self, *args)

    def token_budget(self, p_len: int, n: int, max_new_tokens, sequence_length: int | None) -> np.ndarray:
        """Per-row new-token budgets ``[n]`` (one value may serve every row)."""
        if max_new_tokens is not None and sequence_length is not None:
            raise ValueError("give max_new_tokens or sequence_length, not both")
        if sequence_length is not None:
            max_new_tokens = inputs.count(sequence_length, "sequence_length") - p_len
        if max_new_tokens is None:
            max_new_tokens = self.n_positions - p_len
        new = generation.per_row(max_new_tokens, "max_new_tokens", n, np.int64)
        if (new < 1).any():
            raise ValueError(f"max_new_tokens must be >= 1 (prompt has {p_len} tokens), got {new.min()}")
        top = int(new.max())
        if p_len + top > self.n_positions:
            raise ValueError(
                f"prompt ({p_len} tokens) + max_new_tokens ({top}) = {p_len + top} "
                f"exceeds n_positions={self.n_positions}; shorten the request or load the model with "
                f"n_positions >= {p_len + top}"
            )
        return new.astype(np.int32)


class AutoModelForSampling(CausalLMForSampling):
    """Picks the family from ``config.model_type`` (``aotlm.generate.families``: one class per family);
    ``pp_degree > 1`` gives a ``PipelineForSampling``."""

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, pp_degree: int = 1, **kwargs) -> CausalLMForSampling:
        if pp_degree != 1:
            return PipelineForSampling(path, pp_degree=pp_degree, model_types=cls.model_types, **kwargs)
        return cls(path, **kwargs)


UNSUPPORTED_PP = {  # construction options pipelined models refuse (each needs graphs of its own)
    "prompt_batch_size": None,
    "num_beams": 1,
    "speculation_length": None,
    "continuous_batching": False,
    "scoring": False,
}


class PipelineForSampling(CausalLMForSampling):
    """``pp_degree`` stages chained by the host (``aotlm.core.pipeline``, ``aotlm.generate.pp_run``).

    ``sample()``, ``forward()``, ``compile()`` / ``to_neuron()``, ``save()`` / ``load()`` and
    ``graph_keys()`` work as on one-stage models; each stage compiles and caches its own graphs.
    Beam search, ``num_return_sequences``, speculative decoding, continuous batching and the
    score graphs are refused with a clear error (each needs graphs the stages do not have).
    ``micro_batches`` (default: the largest divisor of ``batch_size`` up to ``pp_degree``) splits
    the batch so that stages work concurrently.
    """

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
        for name in ("path", "hf_config", "cfg", "amp", "quant", "precision", "dtype", "fuse_qkv", "gqa",
                     "kv_cache_dtype", "tp_degree", "tg_buckets", "n_positions", "ctx_buckets",
                     "compile_cache"):  # fmt: skip
            setattr(self, name, getattr(head, name))
        self.batch_size, self.pp_degree = batch, pp_degree
        self.mesh = None  # each stage has its own: self.stages[s].mesh
        self.strategies = Strategies()
        self.continuous_batching, self.scoring = False, False

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

    @_locked
    def compile_graph(self, key: tuple):
        """Compile (or load) one graph of ``graph_keys()``: ``("stage", s, *stage_key)``."""
        if key not in self.graph_keys():
            raise ValueError(f"{key} is not one of this model's graphs: {self.graph_keys()}")
        return self.stages[key[1]].compile_graph(tuple(key[2:]))

    @_locked
    def compile(self) -> PipelineForSampling:
        for st in self.stages:
            st.compile()
        return self

    def to_neuron(self) -> PipelineForSampling:
        return self.compile()

    @_locked
    def save(self, directory: str | os.PathLike) -> None:
        """One artifacts directory per stage (``stage-0`` ..), written next to each other."""
        self.compile()
        pipeline.save(self.stages, directory)

    @_locked
    def load(self, directory: str | os.PathLike) -> PipelineForSampling:
        pipeline.load(self.stages, directory)
        return self

    @_locked
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
        """``CausalLMForSampling.sample`` (its arguments and output) on the stages."""
        refused = {"num_return_sequences": (None, 1), "num_beams": (1,), "draft_model": (None,),
                   "speculation_length": (None,)}  # fmt: skip
        for name, ok in refused.items():
            if kwargs.pop(name, ok[0]) not in ok:
                raise ValueError(f"{name} is not supported with pp_degree > 1 yet; use a pp_degree=1 model")
        return CausalLMForSampling.sample.__wrapped__(self, *args, **kwargs)

    def _run(self, *args):
        return pp_run.run(self, *args)
