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
from aotlm.models.adapters import leaf_names, scale_name
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
        self.sources: dict[str, str] = {}  # each loaded adapter's directory, as given
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
        if max_loras is not None and max_loras < 0:
            raise ValueError(f"max_loras (adapter slots) must be >= 0, got {max_loras}")
        if max_lora_rank is not None and max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        if not wanted and not max_loras:
            return
        n = max_loras if max_loras is not None else max(len(wanted), 1)
        if len(wanted) > n:
            raise ValueError(f"{len(wanted)} adapters given for max_loras={n}; raise max_loras")
        rank = max_lora_rank if max_lora_rank is not None else DEFAULT_RANK
        slots = AdapterSlots(n, rank, targets(rows, self.cfg), Factors(rows, prefixes, self.cfg), self.cfg)
        read = {name: slots.read(name, path) for name, path in wanted.items()}  # checked before placing
        self.adapter_slots = slots
        shapes = slots.shapes()
        for path in slots.paths:
            a_path, b_path = ((*path[:-1], n) for n in leaf_names(path[-1]))
            a, b = np.zeros(shapes[a_path], np.float32), np.zeros(shapes[b_path], np.float32)
            for i, entries in enumerate(read.values()):
                a[i], b[i] = entries.get(a_path, 0.0), entries.get(b_path, 0.0)
            for leaf, host in self._stored(path, a, b).items():
                self._place_table(leaf, host)
        slots.names[: len(read)] = list(read)
        slots.sources.update({name: str(path) for name, path in wanted.items()})

    def _stored(self, path: tuple, a: np.ndarray, b: np.ndarray) -> dict[tuple, np.ndarray]:
        """Projection ``path``'s tables ``a [n, *in, R]``, ``b [n, R, *out]`` (float32, n slots) as stored:
        the table dtype, or int8 with per slot and rank scales (``A``'s column absmax over its inputs,
        ``B``'s row absmax over its outputs, / 127; their product the ``_lora_s`` leaf)."""
        a_name, b_name = leaf_names(path[-1])
        leaf = lambda name: (*path[:-1], name)  # noqa: E731
        dt = self.table_dtype
        if dt != np.int8:
            return {leaf(a_name): a.astype(dt), leaf(b_name): b.astype(dt)}
        sa = np.abs(a).max(axis=tuple(range(1, a.ndim - 1))) / 127.0  # [n, R]
        sb = np.abs(b).max(axis=tuple(range(2, b.ndim))) / 127.0  # [n, R]
        inv = lambda s: np.divide(1.0, s, out=np.zeros_like(s), where=s > 0)  # noqa: E731
        qa = np.rint(a * inv(sa).reshape(sa.shape[0], *[1] * (a.ndim - 2), -1)).astype(np.int8)
        qb = np.rint(b * inv(sb).reshape(*sb.shape, *[1] * (b.ndim - 2))).astype(np.int8)
        return {leaf(a_name): qa, leaf(b_name): qb, leaf(scale_name(path[-1])): (sa * sb).astype(np.float32)}

    def _place_table(self, path: tuple, host: np.ndarray) -> None:
        arr = sharding.prepare_param(path, host, self.tp_degree, self.gqa, self.cfg.n_kv_heads)
        self.params["layers"][path[1]][path[-1]] = self._place_final(path, arr)

    @property
    def table_dtype(self) -> np.dtype:
        """The tables' storage: the compute dtype over float weights (exact against PEFT in f32), int8
        with per slot and rank scales over quantized ones (int8, int4, GGUF blocks: already approximate;
        a quarter of float32's bytes a step reads, as llama.cpp's q8_0 adapters)."""
        if self.precision.quant is not None:
            return np.dtype(np.int8)
        return np.dtype(jnp.dtype(self.dtype))

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded adapters."""
        return [n for n in (self.adapter_slots.names if self.adapter_slots else []) if n is not None]

    def adapter_source(self, name: str) -> str | None:
        """The directory adapter ``name`` was loaded from (None: no such adapter)."""
        return self.adapter_slots.sources.get(name) if self.adapter_slots else None

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
            slots.sources[name] = str(path)
        return slot

    def unload_adapter(self, name: str) -> None:
        """Free adapter ``name``'s slot (zeros: a stale index would add nothing)."""
        slots = self._need_slots()
        with self.lock, slots.lock:
            slot = slots.slot_of(name)
            self._write_slot(slot, {})
            slots.names[slot] = None
            slots.sources.pop(name, None)

    def _write_slot(self, slot: int, entries: dict) -> None:
        shapes = self.adapter_slots.shapes()
        for path in self.adapter_slots.paths:
            a_path, b_path = ((*path[:-1], n) for n in leaf_names(path[-1]))
            one = [entries.get(p, np.zeros(shapes[p][1:], np.float32))[None] for p in (a_path, b_path)]
            for leaf, host in self._stored(path, *one).items():
                prepared = sharding.prepare_param(leaf, host, self.tp_degree, self.gqa, self.cfg.n_kv_heads)
                table = np.array(sharding.fetch(self.params["layers"][leaf[1]][leaf[-1]]))
                table[slot] = prepared[0]
                self.params["layers"][leaf[1]][leaf[-1]] = self._place_final(leaf, table)

    def adapter_rows(self, adapter: str | Sequence[str | None] | None, n: int) -> np.ndarray | None:
        """``sample(adapter=...)`` as each row's slot, or None (every row the base model)."""
        if adapter is None:
            return None
        return self._need_slots().rows(adapter, n, self.batch_size)
