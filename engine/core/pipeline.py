"""Pipeline parallelism: the layers split into stages, each stage a compiled model on its own devices.

``pp_degree = S`` cuts the ``L`` layers into ``S`` contiguous stages of ``L / S`` layers (balanced
by layer count: ``S`` must divide ``L``). The first stage also holds the embedding (and learned
positions / input projection), the last the final norm and lm_head (a tied lm_head: a copy of
the embedding there). Devices form a ``(pp, tp)`` grid: stage ``s`` runs on devices
``s*tp .. s*tp+tp-1`` as a tensor-parallel model of its own (today's GQA strategies and CPU
kernels inside it), holding only its layers' weights and KV cache.

Each stage is a ``StageModel``: a ``CompiledModel`` restricted to its layers, with its own mesh,
compile-cache entries and artifacts. Its graphs:

* ``("pp_prefill", C, W)``: encode ``C`` positions of its layers; the first stage takes token
  ids, the others the previous stage's hidden states ``[b, C, D]``; the last returns the logits
  of position ``last``.
* ``("pp_step", W)``: one decode step of its layers; the last stage also samples (``graphs.emit``
  on its generation state, as the one-program decode loop does).
* ``("select",)`` (last stage): the first token from the prefill logits.

The host chains the stages (``aotlm.generate.pp_run``): JAX dispatches asynchronously and each
device runs its calls in order, so while stage ``s`` works on micro-batch ``m`` stage ``s - 1``
already works on ``m + 1``. The batch is split into ``micro_batches`` (default: the largest
divisor of the batch ``<= S``) of ``b = B / M`` rows each; each stage keeps one KV cache per
micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from aotlm.core import artifacts, graphs, sharding
from aotlm.core import buckets as bk
from aotlm.core.model import CompiledModel
from aotlm.durable import atomic_write_bytes
from aotlm.models import decoder, family_for
from aotlm.models.checkpoint import load_hf_config
from aotlm.models.checkpoint.resolve import resolve

FIRST_LEAVES = ("embed", "pos_embed", "proj_in", "embed_norm_scale", "embed_norm_bias")
LAST_LEAVES = ("final_norm_scale", "final_norm_bias", "proj_out", "lm_head", "lm_head_bias")
KINDS = ("pp_prefill", "pp_step")


@dataclasses.dataclass(frozen=True)
class Stage:
    """Which layers a stage runs (static: part of its graphs)."""

    index: int
    n_stages: int
    first: int  # its first layer
    count: int  # how many layers

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1


def split_layers(n_layers: int, pp_degree: int) -> tuple[Stage, ...]:
    """Contiguous stages of ``n_layers / pp_degree`` layers each."""
    if isinstance(pp_degree, bool) or not isinstance(pp_degree, int) or pp_degree < 1:
        raise ValueError(f"pp_degree must be an int >= 1, got {pp_degree!r}")
    if n_layers % pp_degree:
        ok = [d for d in sharding.divisors(n_layers) if d > 1]
        raise ValueError(
            f"pp_degree={pp_degree} does not divide this model's {n_layers} layers (stages hold equal "
            f"numbers of layers); use pp_degree in {ok}"
        )
    per = n_layers // pp_degree
    return tuple(Stage(s, pp_degree, s * per, per) for s in range(pp_degree))


def stage_meshes(pp_degree: int, tp_degree: int) -> list[Mesh]:
    """One ``("tp",)`` mesh per stage over consecutive devices (process by process: with one
    process per host, each host's devices form whole stages)."""
    if tp_degree < 1:
        raise ValueError(f"tp_degree must be >= 1, got {tp_degree}")
    need = pp_degree * tp_degree
    devices = sharding.global_devices(need, f"pp_degree={pp_degree} x tp_degree={tp_degree}")
    if jax.process_count() > 1 and need != len(devices):
        raise ValueError(
            f"pp_degree={pp_degree} x tp_degree={tp_degree} = {need} devices in a "
            f"{jax.process_count()}-process run: the stages must cover every process's devices "
            f"({len(devices)}); use pp x tp = {len(devices)}"
        )
    grid = np.array(devices[:need]).reshape(pp_degree, tp_degree)
    for s, row in enumerate(grid):
        if len({d.process_index for d in row}) > 1:
            raise ValueError(
                f"stage {s} would span processes {sorted({d.process_index for d in row})}: each stage runs "
                "in one process; use a tp_degree that divides every process's device count"
            )
    return [Mesh(row, (sharding.TP,)) for row in grid]


def is_local(mesh: Mesh) -> bool:
    """Whether this process owns the stage's devices (all of them: a stage never spans processes)."""
    return mesh.devices.flat[0].process_index == jax.process_index()


def n_layers(path: str | os.PathLike) -> int:
    """The checkpoint's layer count (from config.json; reads no weights)."""
    hf = load_hf_config(resolve(path))
    return family_for(hf.model_type).arch_config(hf).n_layers


def micro_batches(batch_size: int, pp_degree: int, requested: int | None = None) -> int:
    """How many micro-batches the batch splits into (each stage keeps one KV cache per micro-batch)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"micro_batches must be an int >= 1, got {requested!r}")
        if batch_size % requested:
            raise ValueError(f"micro_batches={requested} does not divide batch_size={batch_size}")
        return requested
    return max(d for d in sharding.divisors(batch_size) if d <= pp_degree)


def _keeps(stage: Stage, leaf: str, tied: bool) -> bool:
    """Whether a non-layer parameter ``leaf`` lives on ``stage``."""
    if leaf in FIRST_LEAVES:
        return stage.is_first or (leaf == "embed" and tied and stage.is_last)
    if leaf in LAST_LEAVES:
        return stage.is_last
    raise ValueError(f"no pipeline stage owns parameter {leaf!r}; add it to aotlm.core.pipeline")


def owners(stages: tuple[Stage, ...], path: tuple, tied: bool) -> list[Stage]:
    """The stages holding parameter ``path`` (``("layers", i, ...)`` or a top-level leaf)."""
    if path[0] == "layers":
        return [st for st in stages if st.first <= path[1] < st.first + st.count]
    if len(stages) == 1:
        return list(stages)
    return [st for st in stages if _keeps(st, path[0], tied)]


class RemoteStage:
    """A stage another process runs (multi-host): its layout, no weights, no graphs."""

    local = False
    compile_report: list = []

    def __init__(self, stage: Stage, mesh: Mesh, batch_size: int):
        self.stage, self.mesh, self.batch_size = stage, mesh, batch_size
        self.replicated = sharding.replicated(mesh)

    def graph_keys(self) -> list[tuple]:
        return []

    def compile(self) -> RemoteStage:
        return self


class StageModel(CompiledModel):
    """One pipeline stage: its layers (and the embedding / head it owns) on its own devices.

    ``batch_size`` here is the micro-batch; ``caches[m]`` is micro-batch ``m``'s KV cache.
    """

    local = True

    def __init__(self, path: str | os.PathLike, stage: Stage, mesh: Mesh, n_micro: int, model_types=None,
                 **kwargs):  # fmt: skip
        self.stage, self._stage_mesh, self.model_types = stage, mesh, model_types
        super().__init__(path, **kwargs)
        self.caches = [self.cache] + [self._alloc_cache() for _ in range(n_micro - 1)]

    def _make_mesh(self):
        return self._stage_mesh

    def _weight_rows(self, family) -> list:
        rows = family.weight_rows(self.cfg, self.hf_config)
        tied = not any(t[0] == "lm_head" for r in rows for t in r.targets)
        lo, hi = self.stage.first, self.stage.first + self.stage.count
        out = []
        for r in rows:
            head = r.targets[0]
            if head[0] == "layers":
                if lo <= head[1] < hi:
                    out.append(
                        dataclasses.replace(
                            r, targets=tuple(("layers", t[1] - lo, *t[2:]) for t in r.targets)
                        )
                    )
            elif _keeps(self.stage, head[0], tied):
                out.append(r)
        return out

    def _load_weights(self, family) -> dict:
        params = super()._load_weights(family)
        if not self.stage.is_last:  # the int8 copy of a tied embedding is the lm_head's
            params.pop("embed_q", None), params.pop("embed_q_scale", None)
        return params

    def cache_specs(self) -> dict:
        specs = super().cache_specs()
        n = self.stage.count
        return {"k": specs["k"][:n], "v": specs["v"][:n], "pos": specs["pos"]}

    def graph_keys(self) -> list[tuple]:
        shapes = bk.prefill_graph_shapes(self.ctx_buckets, self.tg_buckets)
        keys = [("pp_prefill", c, w) for c, w in shapes] + [("pp_step", w) for w in self.tg_buckets]
        return keys + ([("select",)] if self.stage.is_last else [])

    def _compute_fingerprint(self) -> dict:
        return {**super()._compute_fingerprint(), "stage": dataclasses.asdict(self.stage)}

    def hidden_spec(self, length: int) -> jax.ShapeDtypeStruct:
        """The hidden states a stage hands the next: ``[b, length, D]`` in the compute dtype."""
        return jax.ShapeDtypeStruct(
            (self.batch_size, length, self.cfg.hidden_size), self.dtype, sharding=self.replicated
        )

    def _lower_extra(self, key: tuple):
        if key[0] not in KINDS:
            return super()._lower_extra(key)
        p, cache, rep, b = self.abstract(self.params), self.cache_specs(), self.replicated, self.batch_size
        ids = lambda n: jax.ShapeDtypeStruct((b, n), jnp.int32, sharding=rep)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        cache_out = self.shardings(cache)
        st = self.stage
        if key[0] == "pp_prefill":
            _, c, w = key
            x = ids(c) if st.is_first else self.hidden_spec(c)
            fn = functools.partial(stage_prefill, self.cfg, w, st)
            jit = jax.jit(fn, donate_argnums=(1,), out_shardings=(rep, cache_out))
            return jit.lower(p, cache, x, ids(c), scalar, scalar)
        _, w = key
        x = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rep) if st.is_first else self.hidden_spec(1)
        if st.is_last:
            state = graphs.state_spec(b, self.n_positions, self.cfg.vocab_size, rep)
            fn = functools.partial(last_step, self.cfg, w, st, replicated=rep)
            jit = jax.jit(fn, donate_argnums=(1, 3), out_shardings=(cache_out, self.shardings(state)))
            return jit.lower(p, cache, x, state)
        fn = functools.partial(stage_step, self.cfg, w, st)
        jit = jax.jit(fn, donate_argnums=(1,), out_shardings=(rep, cache_out))
        return jit.lower(p, cache, x, jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rep), scalar)


# ---------------------------------------------------------------------------- stage graphs
def stage_prefill(cfg, width: int, stage: Stage, params, cache, x, positions, start, last):
    """``x``: token ids ``[b, C]`` (first stage) or hidden states ``[b, C, D]``. Returns the hidden
    states for the next stage, or (last stage) the float32 logits ``[b, V]`` of position ``last``."""
    old_width = 0 if width == x.shape[1] else width  # as graphs.prefill
    h, cache = decoder.forward(cfg, params, cache, x, positions, start, old_width, stage.first)
    if not stage.is_last:
        return h, cache
    h_last = lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
    return decoder.logits(cfg, params, h_last), cache


def stage_step(cfg, width: int, stage: Stage, params, cache, x, pos, idx):
    """One decode step of a stage before the last: ``x`` = tokens ``[b]`` (first stage) or hidden
    states ``[b, 1, D]`` at cache slot ``idx``, model positions ``pos [b]``."""
    x = x[:, None] if x.ndim == 1 else x
    return decoder.forward(cfg, params, cache, x, pos[:, None], idx, width, stage.first)


def last_step(cfg, width: int, stage: Stage, params, cache, x, state, replicated=None):
    """The last stage's decode step: its layers, the logits and the sampler (``graphs.emit``), for
    the token at slot ``state['idx']``; the state then holds the next token (as ``graphs.decode``)."""
    idx = state.idx
    h, cache = decoder.forward(cfg, params, cache, x, state.pos[:, None], idx, width, stage.first)
    logits = decoder.logits(cfg, params, h[:, 0])
    if replicated is not None:
        logits = lax.with_sharding_constraint(logits, replicated)
    return cache, graphs.emit(state.replace(pos=state.pos + 1, idx=idx + 1), logits, idx + 1)


# ---------------------------------------------------------------------------- artifacts
MANIFEST = artifacts.PIPELINE_MANIFEST


def save(stages: list[StageModel], directory: str | os.PathLike) -> None:
    """``directory/stage-<s>`` per stage (``artifacts.save``) and a manifest naming the stages;
    written under a temporary name and renamed, so a crash leaves the old directory or none."""
    directory = artifacts.save_target(directory)
    if jax.process_count() > 1:  # each host writes its own stages (each directory atomically)
        for st in stages:
            if st.local:
                artifacts.save(st, directory / f"stage-{st.stage.index}")
        if jax.process_index() == 0:
            atomic_write_bytes(directory / MANIFEST, _manifest(stages).encode())
        return
    tmp = directory.with_name(f".{directory.name}.tmp-{uuid.uuid4().hex}")
    try:
        for st in stages:
            artifacts.save(st, tmp / f"stage-{st.stage.index}")
        (tmp / MANIFEST).write_text(_manifest(stages))
        artifacts.swap_in(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _manifest(stages) -> str:
    return json.dumps({"pp_degree": len(stages), "stages": [dataclasses.asdict(s.stage) for s in stages]})


def load(stages: list[StageModel], directory: str | os.PathLike) -> None:
    """Load ``save``'s stages (zero compiles); refuses a directory of another pipeline layout."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{directory} holds no pipeline artifacts ({MANIFEST}: {e}); save them with model.save()"
        ) from e
    want = [dataclasses.asdict(s.stage) for s in stages]
    if manifest.get("stages") != want:
        raise ValueError(
            f"{directory} was saved with pp_degree={manifest.get('pp_degree')} ({manifest.get('stages')}); "
            f"this model has pp_degree={len(stages)}: load it with the saved layout"
        )
    for st in stages:
        if st.local:
            st.load(directory / f"stage-{st.stage.index}")
