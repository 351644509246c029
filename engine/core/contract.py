"""``GraphHost``: the public contract between a compiled model and the code that runs its graphs.

``CompiledModel`` (``aotlm.core.model``) implements it; the generation strategies
(``aotlm.generate``: the decode loop, beam search, broadcasting, speculative decoding, the slot
graphs of continuous batching, pipeline stages), the score graphs (``aotlm.core.scoring``) and
the tuner's measurements are written against it and nothing else of the model. A graph is
named by its key (``("prefill", C, W)``, ``("decode", W)``, ...); a strategy lowers new kinds
with ``abstract`` / ``cache_specs`` / ``shardings`` / ``replicated`` and calls any kind through
``executable``, holding ``lock`` while it uses the model's KV cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
from jax.sharding import Mesh, Sharding

from aotlm.models.arch import ArchConfig


@runtime_checkable
class GraphHost(Protocol):
    """What code outside ``aotlm.core.model`` may use of a compiled model.

    Shapes: ``batch_size`` rows, ``n_positions`` KV slots, prompt chunks of ``ctx_buckets``
    and decode widths of ``tg_buckets`` (``aotlm.core.buckets``). State: ``params`` (the
    weights pytree on ``mesh``) and ``cache`` (the KV cache, donated to and replaced by every
    graph that writes it). ``lock`` serializes requests on one model object.
    """

    cfg: ArchConfig
    batch_size: int
    n_positions: int
    ctx_buckets: list[int]
    tg_buckets: list[int]
    mesh: Mesh | None
    params: Any
    cache: Any
    lock: threading.RLock
    replicated: Sharding  # every device holds the whole array: host inputs, sampler state

    def executable(self, key: tuple) -> Callable:
        """The compiled graph ``key`` (compiled, or loaded from the compile cache, on first use)."""
        ...

    def lower(self, key: tuple) -> Any:
        """``jax.stages.Lowered`` of graph ``key`` (what ``executable`` compiles)."""
        ...

    def put(self, x: np.ndarray) -> Any:
        """A host array as a replicated device array on this model's mesh."""
        ...

    def put_tree(self, tree: Any) -> Any:
        """``put`` over every leaf of a pytree of host arrays."""
        ...

    def cache_specs(self) -> dict:
        """``ShapeDtypeStruct`` (with sharding) of every KV-cache leaf: ``{"k", "v", "pos"}``."""
        ...

    def abstract(self, tree: Any) -> Any:
        """``ShapeDtypeStruct`` (with sharding) of every leaf of ``tree`` (e.g. ``params``)."""
        ...

    def shardings(self, specs: Any) -> Any:
        """The sharding of every leaf of ``specs``: a graph's outputs pinned to its inputs' layout."""
        ...

    def prepare(
        self, input_ids: Any, attention_mask: Any, start_ids: Any
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Checked prompts padded to ``batch_size`` rows: ``(ids, mask, real rows)``."""
        ...

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> tuple:
        """Run every prefill step of ``ids``: ``(logits of the last prompt token, positions)``."""
        ...
