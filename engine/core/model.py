"""``CompiledModel``: a checkpoint as a set of ahead-of-time compiled bucket graphs.

Lifecycle: the constructor reads the config, loads weights shard by shard onto the mesh and
allocates the KV cache once; ``compile()`` lowers and compiles every bucket graph (or loads it
from the on-disk compile cache); ``forward()`` (and ``sample()`` in ``aotlm.generate``) only
pick buckets and call executables: no tracing, no compiling. Generation strategies that add
graph kinds (beam search, speculative decoding, broadcasting) plug in through
``_extra_graph_keys`` / ``_lower_extra`` in the ``aotlm.generate`` subclass, so this layer
never imports them.
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

from aotlm import kernels
from aotlm.core import artifacts, backend, graphs, heap, inputs, sampling, scoring, sharding
from aotlm.core import buckets as bk
from aotlm.core.bucket_config import resolve as merge_bucket_config
from aotlm.core.compile_cache import CompileCache
from aotlm.core.lora_slots import AdapterHost
from aotlm.core.spec import ModelSpec, SpecAttributes
from aotlm.core.state import layout as state_layout
from aotlm.core.weight_load import WeightLoading
from aotlm.models import family_for, lowp
from aotlm.models.arch import ArchConfig
from aotlm.models.checkpoint import CheckpointError, gguf, load_hf_config, lora
from aotlm.models.checkpoint.resolve import resolve
from aotlm.models.quant import QuantizationConfig
from aotlm.progress import bar

COMPILE_THREADS = int(os.environ.get("AOTLM_COMPILE_THREADS", "0"))  # 0: one per core


def locked(method):
    """Run ``method`` holding the model's lock for the whole request.

    A model owns one KV cache (donated to and replaced by every graph call) and one table of
    executables, so two requests on one object must not interleave: the lock serializes them
    (streamed requests hold it until their last token). Each model object has its own lock,
    so a second model (another batch size, another checkpoint) runs concurrently.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


# graph kinds this layer lowers itself; others come from ``_lower_extra`` (aotlm.generate)
# "select_scores" / "decode_scores": the same steps keeping each token's [B, V] scores (output_scores)
BASE_KINDS = ("prefill", "select", "decode", "score", "select_scores", "decode_scores")


class CompiledModel(SpecAttributes, WeightLoading, AdapterHost):
    """A causal LM compiled per bucket (weights, KV cache, graphs). ``aotlm.generate``'s
    ``CausalLMForSampling`` adds ``sample()``; use ``AutoModelForSampling.from_pretrained``."""

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
        scoring: bool = False,
        kv_cache_dtype: str | None = None,
        lora_adapters: dict[str, str | os.PathLike] | None = None,
        merge_lora: bool = False,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
    ):
        # scoring: list the score graphs (aotlm.core.scoring) in graph_keys(), so compile() makes them
        # bucket_config: a tuner-written JSON (or dict) of n_positions / context_length_estimate /
        # batch_size; explicitly passed arguments win over it (aotlm/bucket_config.py)
        if bucket_config is not None:
            bc = merge_bucket_config(bucket_config, batch_size=batch_size, n_positions=n_positions,
                                     context_length_estimate=context_length_estimate)  # fmt: skip
            batch_size, n_positions = bc.get("batch_size"), bc.get("n_positions")
            context_length_estimate = bc.get("context_length_estimate")
        self.lock = threading.RLock()
        path = resolve(path)  # a checkpoint dir, a training run (its latest checkpoint), a bundled name
        self.path = str(path)
        self.hf_config = load_hf_config(path)
        self.lora = lora.merged_adapter(lora_adapters, merge_lora)  # PEFT LoRA merged as weights are read
        family, cfg = self._family()
        if not isinstance(scoring, bool):
            raise TypeError(f"scoring must be True or False, got {scoring!r}")
        self.scoring = scoring
        if quant is None:  # none given for a GGUF model: the storage it was converted for
            quant = gguf.default_quant(path, tp_degree)
        quant = gguf.int4_form(path, quant)  # a GGUF file's Q4_1 / Q4_K blocks: asymmetric groups
        self.spec = ModelSpec.resolve(
            cfg, batch_size, n_positions, context_length_estimate, tp_degree, amp, gqa, quant, fuse_qkv,
            kv_cache_dtype,
        )  # fmt: skip
        self.mesh = self._make_mesh()
        self._kv_rep = sharding.kv_replication(self.cfg.n_kv_heads, self.tp_degree, self.gqa)
        self._rules = sharding.rules(self.gqa, self.tp_degree)
        self.replicated = sharding.replicated(self.mesh)
        self.compile_cache = CompileCache.create(compile_cache)
        self._executables: dict[tuple, Any] = {}
        self._fingerprint: dict | None = None
        self.compile_report: list[dict] = []
        self.params = self._load_weights(family)
        per_row = None if merge_lora else lora_adapters  # adapter slots (aotlm.core.lora_slots)
        self._init_adapters(self._weight_rows(family), family.PREFIXES, per_row, max_loras, max_lora_rank)
        self.cache = self._alloc_cache()

    # ------------------------------------------------------------------ loading
    def _family(self) -> tuple[Any, ArchConfig]:
        """The checkpoint's family (``aotlm.models``) and architecture, checked against ``model_types``."""
        mt = self.hf_config.model_type
        if self.model_types is not None and mt not in self.model_types:
            raise ValueError(
                f"{type(self).__name__} loads {list(self.model_types)} checkpoints, but {self.path} is "
                f"{mt!r}; use AutoModelForSampling (or NeuronAutoModelForCausalLM), which picks the family"
            )
        family = family_for(mt)
        try:
            return family, family.arch_config(self.hf_config)
        except (ArithmeticError, TypeError, KeyError, AttributeError) as e:  # e.g. n_head: 0
            raise CheckpointError(
                f"{self.path}/config.json has unusable values ({type(e).__name__}: {e}); fix config.json"
            ) from e

    def _make_mesh(self):
        """The devices this model runs on (a pipeline stage: its own, ``aotlm.core.pipeline``)."""
        return sharding.make_mesh(self.tp_degree)

    def cache_specs(self) -> dict:
        c = self.cfg
        sh = sharding.cache_sharding(self.mesh, self.gqa, self.tp_degree)
        b, kh, s, dh = self.batch_size, c.n_kv_heads * self._kv_rep, self.n_positions, c.head_dim
        kv = self.precision.kv_buffer  # bf16 on CPU: its bits (aotlm.core.precision)
        k = jax.ShapeDtypeStruct((b, kh, s, dh), kv, sharding=sh["kv"])
        v = jax.ShapeDtypeStruct((b, kh, dh, s), kv, sharding=sh["kv"])  # values: slots last
        pos = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sh["pos"])
        return {"k": [k] * c.n_layers, "v": [v] * c.n_layers, "pos": pos}

    def _alloc_cache(self) -> dict:
        """Allocate the static KV cache once, directly in its sharded layout."""
        specs = self.cache_specs()
        zeros = lambda s: sharding.zeros(s.shape, s.dtype, s.sharding)
        return {
            "k": [zeros(s) for s in specs["k"]],
            "v": [zeros(s) for s in specs["v"]],
            "pos": sharding.zeros(specs["pos"].shape, np.int32, specs["pos"].sharding, fill=-1),
        }

    # ------------------------------------------------------------------ compiling
    def graph_keys(self) -> list[tuple]:
        score = scoring.graph_keys(self.ctx_buckets, self.tg_buckets) if self.scoring else []
        return bk.graph_keys(self.ctx_buckets, self.tg_buckets) + score + self._extra_graph_keys()

    def _extra_graph_keys(self) -> list[tuple]:
        """Graphs a subclass adds (``aotlm.generate``: beam search, broadcasting)."""
        return []

    def _lower_extra(self, key: tuple):
        raise ValueError(f"no graph kind {key[0]!r} in {type(self).__name__}")

    def abstract(self, tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

    def lower(self, key: tuple):
        # kernel calls trace a shard_map over this mesh with the params' partition specs
        q = self.precision.quant
        low = q.activations if q is not None else None  # prefill activations rounded: int8 / bf16
        mesh = kernels.mesh_context(self.mesh, sharding.spec_of(self._rules))
        with mesh, lowp.activations(low), jax.default_matmul_precision(self.precision.matmul):
            if key[0] not in BASE_KINDS:  # beam search, speculative decoding, broadcasting
                return self._lower_extra(key)
            return scoring.lower(self, key) if key[0] == "score" else self._lower_graph(key)

    def _lower_graph(self, key: tuple):
        p, cache = self.abstract(self.params), self.cache_specs()
        b, rep = self.batch_size, self.replicated
        scores = key[0].endswith("_scores")
        state = graphs.state_spec(b, self.n_positions, self.cfg.vocab_size, rep, scores)
        logits = jax.ShapeDtypeStruct((b, self.cfg.vocab_size), jnp.float32, sharding=rep)
        if key[0] == "prefill":
            _, c, w = key
            out = (rep, self.shardings(cache))  # pinned: outputs feed the next call
            fn = jax.jit(
                functools.partial(graphs.prefill, self.cfg, w), donate_argnums=(1,), out_shardings=out
            )
            tok = jax.ShapeDtypeStruct((b, c), jnp.int32, sharding=rep)
            scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
            rows = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rep)  # each row's adapter slot
            return fn.lower(p, cache, tok, tok, scalar, scalar, rows)
        if key[0] in ("select", "select_scores"):
            # a fresh callable: jax reuses a function's traces across jit wrappers, and the trace
            # decides whether the sampler calls a kernel (AOTLM_KERNELS, the mesh)
            select = functools.partial(graphs.select_first)
            fn = jax.jit(select, donate_argnums=(1,), out_shardings=self.shardings(state))
            return fn.lower(logits, state)
        _, w = key
        out = (self.shardings(cache), self.shardings(state))
        group = 0 if scores else self.decode_group  # scores: one step a call, read after each
        decode = functools.partial(graphs.decode, self.cfg, w, replicated=rep, group=group)
        fn = jax.jit(decode, donate_argnums=(1, 2), out_shardings=out)
        return fn.lower(p, cache, state)

    @property
    def decode_group(self) -> int:
        """``graphs.decode``'s ``group`` on this model's backend (``aotlm.core.backend``)."""
        return backend.decode_group(next(iter(self.mesh.devices.flat)).platform)

    @staticmethod
    def shardings(specs):
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
            **self.spec.fingerprint(),
            "generation": (
                graphs.MAX_EOS,
                graphs.MAX_STOPS,
                graphs.MAX_STOP_LEN,
                sampling.NGRAM_MAX,
                sampling.TOP_LOGPROBS_MAX,
                sampling.TOPK_WIDTH,
            ),
            "decode_group": self.decode_group,  # the loop's shape on this backend (aotlm.core.backend)
            "state_layout": state_layout(),  # the graphs' state pytrees (their fields, in order)
            "param_tree": self.abstract(self.params),
            "cache_tree": self.cache_specs(),
        }

    def _keep(self, key: tuple, exe, info: dict, seconds: float):
        """Remember a ready executable and report how it was obtained."""
        info.update(graph=key[0], bucket=key[1:], seconds=seconds)
        self.compile_report.append(info)
        self._executables[key] = exe
        return exe

    def executable(self, key: tuple):
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe, info = self.compile_cache.get_or_compile(
                self.fingerprint(), key, lambda: self.lower(key), self.mesh
            )
            exe = self._keep(key, exe, info, time.perf_counter() - t0)
        return exe

    def is_compiled(self, key: tuple) -> bool:
        """Whether graph ``key`` is ready in memory (compiled or loaded from the cache)."""
        return key in self._executables

    @locked
    def compile_graph(self, key: tuple):
        """Compile (or load from the cache) one graph, e.g. ``("decode", 128)``."""
        if key not in self.graph_keys():
            raise ValueError(f"{key} is not one of this model's graphs: {self.graph_keys()}")
        return self.executable(key)

    @locked
    def compile(self) -> CompiledModel:
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
        misses = [k for k in self.graph_keys() if k not in self._executables]
        workers = min(len(misses), COMPILE_THREADS or os.cpu_count() or 1)
        if workers > 1:  # lowering holds the GIL, XLA's compile does not: overlap them
            self.fingerprint()
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for _ in bar(pool.map(self.executable, misses), "compiling buckets", len(misses), "graph"):
                    pass
        else:
            for _ in bar(map(self.executable, misses), "compiling buckets", len(misses), "graph"):
                pass
        for key in self.graph_keys():
            self.executable(key)
        heap.release()  # what loading and compiling freed, out of the resident set
        return self

    @locked
    def save(self, directory: str | os.PathLike) -> None:
        """Write every compiled graph + a manifest to ``directory`` (relocatable); a file or a
        directory of other files there is refused before anything compiles."""
        artifacts.save_target(directory)
        self.compile()
        artifacts.save(self, directory)

    @locked
    def load(self, directory: str | os.PathLike) -> CompiledModel:
        """Load graphs saved by ``save`` (zero compilations); refuses artifacts of another config."""
        self._executables.update(artifacts.load(self, directory))
        return self

    # ------------------------------------------------------------------ running
    def put(self, x: np.ndarray):
        return sharding.put(x, self.replicated)

    def put_tree(self, tree):
        return jax.tree.map(lambda x: self.put(np.asarray(x)), tree)

    def prepare(self, input_ids, attention_mask, start_ids) -> tuple[np.ndarray, np.ndarray, int]:
        return inputs.padded_batch(input_ids, attention_mask, start_ids, self.cfg.vocab_size, self.batch_size)

    def encode(self, ids: np.ndarray, mask: np.ndarray, lora: np.ndarray | None = None):
        """Run every prefill step of the prompt (``lora [B]``: each row's adapter slot, default -1:
        none); returns (logits of its last token, positions)."""
        p_len = ids.shape[1]
        rows = self.put(
            np.full(self.batch_size, -1, np.int32) if lora is None else np.asarray(lora, np.int32)
        )
        positions = np.where(mask > 0, np.cumsum(mask, 1) - 1, -1).astype(np.int32)
        logits = None
        for step in bk.prefill_plan(p_len, self.ctx_buckets, self.tg_buckets):
            end = step.start + step.n_real
            tok = np.zeros((self.batch_size, step.bucket), np.int32)
            pos = np.full((self.batch_size, step.bucket), -1, np.int32)
            tok[:, : step.n_real] = ids[:, step.start : end]
            pos[:, : step.n_real] = positions[:, step.start : end]
            exe = self.executable(("prefill", step.bucket, step.width))
            logits, self.cache = exe(
                self.params,
                self.cache,
                self.put(tok),
                self.put(pos),
                self.put(np.int32(step.start)),
                self.put(np.int32(step.n_real - 1)),
                rows,
            )
        return logits, positions

    @locked
    def forward(self, input_ids, attention_mask=None, adapter=None) -> np.ndarray:
        """Float32 logits ``[batch, vocab]`` of the last prompt position (``adapter``: ``sample()``'s)."""
        ids, mask, n = self.prepare(input_ids, attention_mask, None)
        logits, _ = self.encode(ids, mask, self.adapter_rows(adapter, n))
        return sharding.fetch(logits)[:n]

    @locked
    def score(self, input_ids, attention_mask=None) -> scoring.ScoreOutput:
        """Per-token log-probabilities of ``input_ids [n, L]`` (left-padded batch, ``L <= n_positions + 1``)
        and argmax flags, computed in the score graphs (``aotlm.core.scoring.ScoreOutput``)."""
        ids, mask, n = self.prepare(input_ids, attention_mask, None)
        return scoring.run(self, ids, mask, n)
