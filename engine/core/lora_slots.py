"""Per-row LoRA adapters of a compiled model: the slot tables on the mesh and their names.

``from_pretrained(path, lora_adapters={"name": dir}, max_loras=N, max_lora_rank=R)`` adds to every
layer the adapter tables of ``aotlm.models.adapters`` (``N`` slots of rank ``R`` per projection the
family has, zeros) and loads the named adapters into them. ``load_adapter(name, dir)`` /
``unload_adapter(name)`` write a slot later: the tables are traced weights of every graph, so no
graph recompiles. A request names its adapter (``sample(adapter=...)``, a batch record's
``adapter``, a server request's ``model``); ``rows`` turns names into each row's slot index.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from aotlm.core import sharding
from aotlm.models.adapter_factors import Factors, target_dims, targets
from aotlm.models.adapters import leaf_names
from aotlm.models.checkpoint import CheckpointError
from aotlm.models.checkpoint.lora import read_adapter

DEFAULT_RANK = 16  # vLLM's default max_lora_rank


class AdapterSlots:
    """Which adapter is in which slot; the host side of the tables. ``names`` in slot order."""

    def __init__(self, n_slots: int, rank: int, paths: list, factors: Factors, cfg):
        if not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"max_loras must be an int >= 1, got {n_slots!r}")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"max_lora_rank must be an int >= 1, got {rank!r}")
        if not paths:
            raise ValueError(f"{cfg.model_type} has no projection per-row adapters can change")
        self.n_slots, self.rank, self.paths, self._factors, self._cfg = n_slots, rank, paths, factors, cfg
        self.names: list[str | None] = [None] * n_slots
        self.lock = threading.Lock()

    def shapes(self) -> dict[tuple, tuple[int, ...]]:
        """Every table leaf's path and (unsharded) shape."""
        out = {}
        for path in self.paths:
            ins, outs = target_dims(self._cfg, path[-1])
            a, b = leaf_names(path[-1])
            out[(*path[:-1], a)] = (self.n_slots, *ins, self.rank)
            out[(*path[:-1], b)] = (self.n_slots, self.rank, *outs)
        return out

    def slot_of(self, name: str) -> int:
        if name in self.names:
            return self.names.index(name)
        known = [n for n in self.names if n is not None]
        raise ValueError(
            f"no LoRA adapter named {name!r} is loaded (loaded: {known}); load_adapter() it first"
        )

    def read(self, name: str, path: str | os.PathLike) -> dict:
        """The adapter in directory ``path`` as table entries ``{leaf path: array}`` padded to the rank."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter name must be a non-empty string, got {name!r}")
        adapter = read_adapter(path)
        entries = {}
        for target, (a, b) in self._factors.convert(adapter).items():
            r = a.shape[-1]
            if r > self.rank:
                raise CheckpointError(
                    f"LoRA adapter {adapter.path} has rank {r} > max_lora_rank={self.rank}; load the model "
                    f"with max_lora_rank={r} or more"
                )
            a_name, b_name = leaf_names(target[-1])
            pad_a = np.zeros((*a.shape[:-1], self.rank), np.float32)
            pad_a[..., :r] = a
            pad_b = np.zeros((self.rank, *b.shape[1:]), np.float32)
            pad_b[:r] = b
            entries[(*target[:-1], a_name)], entries[(*target[:-1], b_name)] = pad_a, pad_b
        return entries

    def rows(self, adapter, n: int, batch: int) -> np.ndarray | None:
        """Each row's slot (``[batch]``, -1: base) for ``sample(adapter=...)``: one name (or None) for
        every row, or one per row; None when no row names one."""
        if adapter is None:
            return None
        names = [adapter] * n if isinstance(adapter, str) else list(adapter)
        if len(names) != n:
            raise ValueError(
                f"adapter has {len(names)} entries for {n} prompts; give one name or one per prompt"
            )
        out = np.full(batch, -1, np.int32)
        for i, name in enumerate(names):
            if name is not None:
                out[i] = self.slot_of(name)
        return out


class AdapterHost:
    """The model methods of per-row adapters (``CompiledModel`` inherits them). A model without
    tables (``max_loras`` 0) refuses a request that names an adapter."""

    adapter_slots: AdapterSlots | None = None

    def _init_adapters(self, rows, prefixes, lora_adapters, max_loras, max_lora_rank) -> None:
        """Build the tables when asked (``max_loras`` or ``lora_adapters`` without merging)."""
        wanted = dict(lora_adapters or {})
        if not wanted and not max_loras:
            return
        n = max_loras if max_loras is not None else max(len(wanted), 1)
        if len(wanted) > n:
            raise ValueError(f"{len(wanted)} adapters given for max_loras={n}; raise max_loras")
        rank = max_lora_rank if max_lora_rank is not None else DEFAULT_RANK
        slots = AdapterSlots(n, rank, targets(rows, self.cfg), Factors(rows, prefixes, self.cfg), self.cfg)
        read = {name: slots.read(name, path) for name, path in wanted.items()}  # checked before placing
        self.adapter_slots = slots
        for path, shape in slots.shapes().items():
            host = np.zeros(shape, np.float32)
            for i, entries in enumerate(read.values()):
                host[i] = entries.get(path, 0.0)
            self._set_leaf(path, host)
        slots.names[: len(read)] = list(read)

    def _set_leaf(self, path: tuple, host: np.ndarray) -> None:
        arr = sharding.prepare_param(path, host, self.tp_degree, self.gqa, self.cfg.n_kv_heads)
        arr = arr.astype(self.table_dtype)
        layer = self.params["layers"][path[1]]
        layer[path[-1]] = self._place_final(path, arr)

    @property
    def table_dtype(self) -> np.dtype:
        """The tables' storage: the compute dtype over float weights (exact against PEFT in f32), bf16
        over quantized ones (int8, int4, GGUF blocks: already approximate; half the bytes a step reads)."""
        if self.precision.quant is not None:
            return np.dtype(jnp.bfloat16)
        return np.dtype(jnp.dtype(self.dtype))

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded adapters."""
        return [n for n in (self.adapter_slots.names if self.adapter_slots else []) if n is not None]

    def _need_slots(self) -> AdapterSlots:
        if self.adapter_slots is None:
            raise ValueError(
                "this model has no adapter slots; load it with max_loras=N (and max_lora_rank=R) or "
                "lora_adapters={'name': dir}"
            )
        return self.adapter_slots

    def load_adapter(self, name: str, path: str | os.PathLike) -> int:
        """Put the PEFT adapter in directory ``path`` into a free slot (or the slot already named
        ``name``) and return the slot. No graph recompiles."""
        slots = self._need_slots()
        entries = slots.read(name, path)
        with self.lock, slots.lock:
            if name in slots.names:
                slot = slots.names.index(name)
            elif None in slots.names:
                slot = slots.names.index(None)
            else:
                raise ValueError(
                    f"all {slots.n_slots} adapter slots are taken ({slots.names}); unload_adapter() one "
                    "or load the model with a larger max_loras"
                )
            self._write_slot(slot, entries)
            slots.names[slot] = name
        return slot

    def unload_adapter(self, name: str) -> None:
        """Free adapter ``name``'s slot (zeros: a stale index would add nothing)."""
        slots = self._need_slots()
        with self.lock, slots.lock:
            slot = slots.slot_of(name)
            self._write_slot(slot, {})
            slots.names[slot] = None

    def _write_slot(self, slot: int, entries: dict) -> None:
        for path, shape in self.adapter_slots.shapes().items():
            host = np.array(sharding.fetch(self.params["layers"][path[1]][path[-1]]), np.float32)
            one = entries.get(path, np.zeros(shape[1:], np.float32))
            prepared = sharding.prepare_param(path, one[None], self.tp_degree, self.gqa, self.cfg.n_kv_heads)
            host[slot] = prepared[0]
            layer = self.params["layers"][path[1]]
            layer[path[-1]] = self._place_final(path, host.astype(self.table_dtype))

    def adapter_rows(self, adapter: str | Sequence[str | None] | None, n: int) -> np.ndarray | None:
        """``sample(adapter=...)`` as each row's slot, or None (every row the base model)."""
        if adapter is None:
            return None
        return self._need_slots().rows(adapter, n, self.batch_size)
