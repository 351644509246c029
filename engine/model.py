"""``AutoModelForSampling``: a checkpoint as a set of ahead-of-time compiled bucket graphs.

Lifecycle: ``from_pretrained`` reads the config, loads weights shard by shard onto the
mesh and allocates the KV cache once; ``compile()`` lowers and compiles every bucket
graph (or loads it from the on-disk compile cache); ``sample()`` / ``forward()`` only
pick buckets and call executables: no tracing, no compiling.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aotlm import (
    artifacts,
    broadcast,
    extensions,
    generation,
    graphs,
    inputs,
    kernels,
    params,
    sampling,
    sharding,
)
from aotlm import buckets as bk
from aotlm.checkpoint import CheckpointError, WeightReader, load_hf_config
from aotlm.compile_cache import CompileCache
from aotlm.models import decoder, family_for, packing
from aotlm.models.quant import ParamRewriter, QuantizationConfig, quant_config
from aotlm.models.weights import load_params

AMP_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def _locked(method):
    """Run ``method`` holding the model's lock for the whole request.

    A model owns one KV cache (donated to and replaced by every graph call) and one table of
    executables, so two requests on one object must not interleave: the lock serializes them
    (streamed requests hold it until their last token). Each model object has its own lock,
    so a second model (another batch size, another checkpoint) runs concurrently.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _amp_dtype(amp: str):
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp={amp!r} is not supported; choose one of {list(AMP_DTYPES)}")
    return AMP_DTYPES[amp]


class CausalLMForSampling:
    """A causal LM compiled per bucket. Use ``AutoModelForSampling.from_pretrained``."""

    model_types: tuple[str, ...] | None = None  # subclasses restrict the family

    def __init__(
        self,
        path: str | os.PathLike,
        batch_size: int | None = None,
        n_positions: int | Sequence[int] | None = None,
        context_length_estimate: int | Sequence[int] | None = None,
        tp_degree: int = 1,
        amp: str = "f32",
        compile_cache: str | os.PathLike | None | bool = None,
        gqa: str | None = None,
        quant: str | QuantizationConfig | None = None,
        fuse_qkv: bool = False,
        bucket_config: str | os.PathLike | dict | None = None,
        prompt_batch_size: int | None = None,
        num_beams: int = 1,
        speculation_length: int | Sequence[int] | None = None,
    ):
        # bucket_config: a tuner-written JSON (or dict) of n_positions / context_length_estimate /
        # batch_size; explicitly passed arguments win over it (aotlm/bucket_config.py)
        if bucket_config is not None:
            from aotlm.bucket_config import resolve as merge_bucket_config

            bc = merge_bucket_config(bucket_config, batch_size=batch_size, n_positions=n_positions,
                                     context_length_estimate=context_length_estimate)  # fmt: skip
            batch_size, n_positions = bc.get("batch_size"), bc.get("n_positions")
            context_length_estimate = bc.get("context_length_estimate")
        batch_size = 1 if batch_size is None else batch_size
        n_positions = 128 if n_positions is None else n_positions
        from aotlm.resolve import resolve

        self._lock = threading.RLock()
        path = resolve(path)  # a checkpoint dir, a training run (its latest checkpoint), a bundled name
        self.path = str(path)
        self.hf_config = load_hf_config(path)
        mt = self.hf_config.model_type
        if self.model_types is not None and mt not in self.model_types:
            raise ValueError(f"{type(self).__name__} loads {list(self.model_types)}, but {path} is {mt!r}")
        family = family_for(mt)
        try:
            self.cfg: decoder.ArchConfig = family.arch_config(self.hf_config)
        except (ArithmeticError, TypeError, KeyError, AttributeError) as e:  # e.g. n_head: 0
            raise CheckpointError(
                f"{path}/config.json has unusable values ({type(e).__name__}: {e}); fix config.json"
            ) from e
        if inputs.count(batch_size, "batch_size") < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.amp = amp
        self.dtype = _amp_dtype(amp)
        # weight storage (models/quant.py): int8 + per-channel scales, fused q/k/v and gate/up.
        # Both change the params pytree, hence the compile-cache fingerprint (``param_tree``).
        self.quant = quant_config(quant)
        self.fuse_qkv = bool(fuse_qkv)
        self.tg_buckets = bk.token_buckets(n_positions)
        self.n_positions = max(self.tg_buckets)
        if self.cfg.position == "learned" and self.n_positions > self.cfg.max_positions:
            raise ValueError(
                f"n_positions={self.n_positions} exceeds this model's {self.cfg.max_positions} learned "
                f"positions; use n_positions <= {self.cfg.max_positions}"
            )
        self.ctx_buckets = bk.context_buckets(context_length_estimate, self.tg_buckets)
        self.tp_degree = int(tp_degree)
        self.gqa = sharding.choose_gqa(
            self.cfg.n_heads, self.cfg.n_kv_heads, self.batch_size, self.tp_degree, gqa
        )
        self.mesh = sharding.make_mesh(self.tp_degree)
        self._kv_rep = sharding.kv_replication(self.cfg.n_kv_heads, self.tp_degree, self.gqa)
        self._rules = sharding.rules(self.gqa, self.tp_degree)
        self._repl = sharding.replicated(self.mesh)
        self.compile_cache = CompileCache.create(compile_cache)
        self._executables: dict[tuple, Any] = {}
        self._fingerprint: dict | None = None
        self.compile_report: list[dict] = []
        self.params = self._load_weights(family)
        self.cache = self._alloc_cache()
        extensions.configure(self, prompt_batch_size, num_beams, speculation_length)

    # ------------------------------------------------------------------ loading
    def _place(self, path: tuple, arr: np.ndarray):
        """Pad / repeat for the mesh on the host, then copy each device only its own shard."""
        arr = sharding.prepare_param(path, arr, self.tp_degree, self.gqa, self.cfg.n_kv_heads)
        if self._pack:  # int8 weights in the kernels' panel layout (aotlm.models.packing)
            arr = packing.prepare(
                path[-1], arr, sharding.param_spec(path, arr.ndim, self._rules), self.tp_degree
            )
        shard = sharding.param_sharding(self.mesh, path, arr.ndim, self._rules)
        return jax.make_array_from_callback(arr.shape, shard, lambda idx: arr[idx])

    def _load_weights(self, family) -> dict:
        reader = WeightReader(self.path)
        try:
            from aotlm.progress import bar

            rows = bar(family.weight_rows(self.cfg, self.hf_config), "loading weights", unit="tensor")
            np_dtype = np.dtype(jnp.dtype(self.dtype))
            view = self.quant is not None and kernels.enabled()  # int8 embedding copy for a tied lm_head
            self._pack = view  # int8 / bf16 matrices in the kernels' panel layout
            rewriter = ParamRewriter(self.quant, self.fuse_qkv, view) if self.quant or self.fuse_qkv else None
            params = load_params(rows, reader, family.PREFIXES, np_dtype, self._place, rewriter, self.cfg)
            if "lm_head" in params:  # untied: the int8 embedding copy is not needed
                params.pop("embed_q", None), params.pop("embed_q_scale", None)
            return params
        finally:
            reader.close()

    def _cache_specs(self) -> dict:
        c = self.cfg
        sh = sharding.cache_sharding(self.mesh, self.gqa, self.tp_degree)
        b, kh, s, dh = self.batch_size, c.n_kv_heads * self._kv_rep, self.n_positions, c.head_dim
        k = jax.ShapeDtypeStruct((b, kh, s, dh), self.dtype, sharding=sh["kv"])
        v = jax.ShapeDtypeStruct((b, kh, dh, s), self.dtype, sharding=sh["kv"])  # values: slots last
        pos = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sh["pos"])
        return {"k": [k] * c.n_layers, "v": [v] * c.n_layers, "pos": pos}

    def _alloc_cache(self) -> dict:
        """Allocate the static KV cache once, directly in its sharded layout."""
        specs = self._cache_specs()
        zeros = lambda s: sharding.zeros(s.shape, s.dtype, s.sharding)
        return {
            "k": [zeros(s) for s in specs["k"]],
            "v": [zeros(s) for s in specs["v"]],
            "pos": sharding.zeros(specs["pos"].shape, np.int32, specs["pos"].sharding, fill=-1),
        }

    # ------------------------------------------------------------------ compiling
    def graph_keys(self) -> list[tuple]:
        return bk.graph_keys(self.ctx_buckets, self.tg_buckets) + extensions.graph_keys(self)

    def _abstract(self, tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

    def _lower(self, key: tuple):
        with kernels.mesh_context(self.mesh, self._rules):  # kernel calls shard_map over this mesh
            if key[0] in extensions.KINDS:  # beam search, speculative decoding, broadcasting
                return extensions.lower(self, key)
            return self._lower_graph(key)

    def _lower_graph(self, key: tuple):
        p, cache = self._abstract(self.params), self._cache_specs()
        b, rep = self.batch_size, self._repl
        state = graphs.state_spec(b, self.n_positions, self.cfg.vocab_size, rep)
        logits = jax.ShapeDtypeStruct((b, self.cfg.vocab_size), jnp.float32, sharding=rep)
        if key[0] == "prefill":
            _, c, w = key
            out = (rep, self._shardings(cache))  # pinned: outputs feed the next call
            fn = jax.jit(
                functools.partial(graphs.prefill, self.cfg, w), donate_argnums=(1,), out_shardings=out
            )
            tok = jax.ShapeDtypeStruct((b, c), jnp.int32, sharding=rep)
            scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
            return fn.lower(p, cache, tok, tok, scalar, scalar)
        if key[0] == "select":
            fn = jax.jit(graphs.select_first, donate_argnums=(1,), out_shardings=self._shardings(state))
            return fn.lower(logits, state)
        _, w = key
        out = (self._shardings(cache), self._shardings(state))
        decode = functools.partial(graphs.decode, self.cfg, w, replicated=rep)
        fn = jax.jit(decode, donate_argnums=(1, 2), out_shardings=out)
        return fn.lower(p, cache, state)

    @staticmethod
    def _shardings(specs):
        """Output shardings = input shardings: XLA may otherwise pick a layout the next call rejects."""
        return jax.tree.map(lambda s: s.sharding, specs)

    def fingerprint(self) -> dict:
        """Everything besides the graph key that changes an executable (compile-cache key).

        Fixed once the model is built, so it is computed once, not once per graph.
        """
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> dict:
        return {
            "arch": self.cfg,
            "batch_size": self.batch_size,
            "n_positions": self.n_positions,
            "amp": self.amp,
            "tp_degree": self.tp_degree,
            "gqa": self.gqa,
            "generation": (
                graphs.MAX_EOS,
                graphs.MAX_STOPS,
                graphs.MAX_STOP_LEN,
                sampling.NGRAM_MAX,
                sampling.TOP_LOGPROBS_MAX,
                sampling.TOPK_WIDTH,
            ),
            "param_tree": self._abstract(self.params),
            "cache_tree": self._cache_specs(),
        }

    def _keep(self, key: tuple, exe, info: dict, seconds: float):
        """Remember a ready executable and report how it was obtained."""
        info.update(graph=key[0], bucket=key[1:], seconds=seconds)
        self.compile_report.append(info)
        self._executables[key] = exe
        return exe

    def _executable(self, key: tuple):
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe, info = self.compile_cache.get_or_compile(
                self.fingerprint(), key, lambda: self._lower(key), self.mesh
            )
            exe = self._keep(key, exe, info, time.perf_counter() - t0)
        return exe

    @_locked
    def compile_graph(self, key: tuple):
        """Compile (or load from the cache) one graph, e.g. ``("decode", 128)``."""
        if key not in self.graph_keys():
            raise ValueError(f"{key} is not one of this model's graphs: {self.graph_keys()}")
        return self._executable(key)

    @_locked
    def compile(self) -> CausalLMForSampling:
        """Ahead of time: lower + compile (or load from the cache) every bucket graph now.

        Cached executables are deserialized on a thread per core first (XLA's loading releases
        the GIL, and it dominates a warm start); the misses are then compiled one by one.
        """
        todo = [k for k in self.graph_keys() if k not in self._executables]
        if self.compile_cache.dir is not None and len(todo) > 1:
            fp = self.fingerprint()

            def load(key):
                t0 = time.perf_counter()
                return key, self.compile_cache.lookup(fp, key, self.mesh), time.perf_counter() - t0

            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                for key, found, seconds in pool.map(load, todo):
                    if found is not None:
                        self._keep(key, *found, seconds)
        from aotlm.progress import bar

        for key in bar(self.graph_keys(), "compiling buckets", unit="graph"):
            self._executable(key)
        return self

    @_locked
    def save(self, directory: str | os.PathLike) -> None:
        """Write every compiled graph + a manifest to ``directory`` (relocatable)."""
        self.compile()
        artifacts.save(self, directory)

    @_locked
    def load(self, directory: str | os.PathLike) -> CausalLMForSampling:
        """Load graphs saved by ``save`` (zero compilations); refuses artifacts of another config."""
        self._executables.update(artifacts.load(self, directory))
        return self

    # ------------------------------------------------------------------ running
    def _put(self, x: np.ndarray):
        return sharding.put(x, self._repl)

    def _put_tree(self, tree):
        return jax.tree.map(lambda x: self._put(np.asarray(x)), tree)

    def _prepare(self, input_ids, attention_mask, start_ids):
        ids = inputs.token_ids(input_ids, self.cfg.vocab_size)
        mask = inputs.prompt_mask(ids, attention_mask, start_ids)
        n = ids.shape[0]
        if n > self.batch_size:
            raise ValueError(
                f"{n} prompts given but the model was compiled for batch_size={self.batch_size}; "
                "split the batch or load with a larger batch_size"
            )
        if n < self.batch_size:  # pad the batch with copies of row 0, trimmed on return
            extra = self.batch_size - n
            ids = np.concatenate([ids, np.repeat(ids[:1], extra, 0)])
            mask = np.concatenate([mask, np.repeat(mask[:1], extra, 0)])
        return ids, mask, n

    @broadcast.encoder
    def _encode(self, ids: np.ndarray, mask: np.ndarray):
        """Run every prefill step of the prompt; returns (logits of its last token, positions)."""
        p_len = ids.shape[1]
        positions = np.where(mask > 0, np.cumsum(mask, 1) - 1, -1).astype(np.int32)
        logits = None
        for step in bk.prefill_plan(p_len, self.ctx_buckets, self.tg_buckets):
            end = step.start + step.n_real
            tok = np.zeros((self.batch_size, step.bucket), np.int32)
            pos = np.full((self.batch_size, step.bucket), -1, np.int32)
            tok[:, : step.n_real] = ids[:, step.start : end]
            pos[:, : step.n_real] = positions[:, step.start : end]
            exe = self._executable(("prefill", step.bucket, step.width))
            logits, self.cache = exe(
                self.params,
                self.cache,
                self._put(tok),
                self._put(pos),
                self._put(np.int32(step.start)),
                self._put(np.int32(step.n_real - 1)),
            )
        return logits, positions

    @_locked
    def forward(self, input_ids, attention_mask=None) -> np.ndarray:
        """Float32 logits ``[batch, vocab]`` of the last prompt position."""
        ids, mask, n = self._prepare(input_ids, attention_mask, None)
        logits, _ = self._encode(ids, mask)
        return sharding.fetch(logits)[:n]

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
        return_dict: bool = False,
        **generation_kwargs,
    ) -> np.ndarray | generation.GenerateOutput:
        """Generate: ``[batch, prompt_len + new]`` (prompt as given, then new tokens), or a
        ``GenerateOutput`` with ``return_dict=True``.

        Greedy by default. ``generation_kwargs`` are ``GenerationConfig`` fields with HF names
        (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
        ``no_repeat_ngram_size``, ``seed``, ``stop_sequences``, ``top_logprobs``); each sampling
        value and ``max_new_tokens`` may be one value or one per row. They override
        ``generation_config``. ``sequence_length`` (total length, transformers-neuronx style)
        or ``max_new_tokens`` bound the output; neither means "up to n_positions". A row stops
        at an eos id, at a stop sequence (kept in the output) or at its length; finished rows
        are filled with ``pad_token_id`` (default: the first eos id) and the output is trimmed
        to the longest row, as transformers does. ``streamer`` (HF ``BaseStreamer``: ``put``
        gets the prompt, then the new tokens) and ``stopping_criteria`` (HF ``StoppingCriteria``)
        make the decode loop run in chunks of ``generation.STREAM_CHUNK`` tokens.
        """
        cfg = generation_config or params.GenerationConfig()
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
        criteria = generation.criteria_list(stopping_criteria)
        ids, mask, n = self._prepare(input_ids, attention_mask, start_ids)
        new = self._n_new(ids.shape[1], n, cfg.max_new_tokens, sequence_length)
        cfg = cfg.replace(max_new_tokens=None)
        generation.sampling_params(cfg, n, self.batch_size)  # validate before any device work
        generation.stop_array(cfg.stop_sequences, n, self.batch_size, self.cfg.vocab_size)
        want = bool(return_dict or cfg.top_logprobs)
        return generation.run(self, ids, mask, n, new, cfg, streamer, criteria, want)

    def _n_new(self, p_len: int, n: int, max_new_tokens, sequence_length: int | None) -> np.ndarray:
        """Per-row new-token budgets ``[n]`` (one value may serve every row)."""
        if max_new_tokens is not None and sequence_length is not None:
            raise ValueError("give max_new_tokens or sequence_length, not both")
        if sequence_length is not None:
            max_new_tokens = inputs.count(sequence_length, "sequence_length") - p_len
        if max_new_tokens is None:
            max_new_tokens = self.n_positions - p_len
        new = generation._per_row(max_new_tokens, "max_new_tokens", n, np.int64)
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
    """Picks the family from ``config.model_type``."""

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> CausalLMForSampling:
        return cls(path, **kwargs)


class GPT2ForSampling(AutoModelForSampling):
    model_types = ("gpt2",)


class LlamaForSampling(AutoModelForSampling):
    model_types = ("llama",)
