"""A PEFT LoRA adapter's ``A`` / ``B`` matrices in the layout of aotlm's parameters (host side).

PEFT stores ``A [r, in]`` and ``B [out, r]`` against a module's weight in the checkpoint's layout
(``[out, in]``, or ``[in, out]`` for ``fan_in_fan_out`` modules such as GPT-2's ``Conv1D``). A
family's ``Row`` turns that weight into one or more parameters (transposes, head reshapes, fused
q / k / v splits): each parameter element is one element of the weight, moved. Running the row's
transform on two index arrays (each element's output index, each element's input index) says
where every input and output index went, so the same moves apply to ``A`` and ``B`` whatever the
family; a transform that mixed elements (none does) is refused. The tables' leaves are described
in ``aotlm.models.adapters``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aotlm.models.adapters import TARGETS
from aotlm.models.arch import ArchConfig
from aotlm.models.axes import CONTRACT_AXES, Path
from aotlm.models.checkpoint import CheckpointError
from aotlm.models.checkpoint.lora import LoraAdapter
from aotlm.models.weights import Row


def target_dims(cfg: ArchConfig, leaf: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(input dims, output dims)`` of projection ``leaf`` in aotlm's layout (before tp)."""
    d, h, k, dh, f = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "wq": ((d,), (h, dh)),
        "wk": ((d,), (k, dh)),
        "wv": ((d,), (k, dh)),
        "wo": ((h, dh), (d,)),
        "w_up": ((d,), (f,)),
        "w_gate": ((d,), (f,)),
        "w_down": ((f,), (d,)),
    }[leaf]


def targets(rows: Sequence[Row], cfg: ArchConfig) -> list[Path]:
    """The projections of a family that adapters may change: ``("layers", i, leaf)`` paths."""
    if cfg.n_experts:  # expert MLPs are stacks: only attention takes adapters
        allowed = {"wq", "wk", "wv", "wo"}
    else:
        allowed = set(TARGETS)
    found = {t for r in rows for t in r.targets if t[0] == "layers" and t[-1] in allowed and not r.more}
    return sorted(found, key=lambda t: (t[1], TARGETS.index(t[-1])))


class Factors:
    """Converts adapters for one model: ``convert(adapter)`` -> ``{path: (A [*in, r], B [r, *out])}``
    with the adapter's scale in ``B``. Index maps are computed once per (leaves, shape)."""

    def __init__(self, rows: Sequence[Row], prefixes: Sequence[str], cfg: ArchConfig):
        self._rows, self._prefixes, self._cfg = list(rows), tuple(prefixes), cfg
        self._allowed = set(targets(rows, cfg))
        self._maps: dict[tuple, list[tuple[np.ndarray, np.ndarray]]] = {}

    def _row_of(self, module: str) -> Row | None:
        for r in self._rows:
            if any(pre + r.hf == module for pre in self._prefixes):
                return r
        return None

    def convert(self, adapter: LoraAdapter) -> dict[Path, tuple[np.ndarray, np.ndarray]]:
        out: dict[Path, tuple[np.ndarray, np.ndarray]] = {}
        for module, (a_name, b_name, scale) in sorted(adapter.modules.items()):
            r = self._row_of(module)
            if r is None or r.more or any(t not in self._allowed for t in r.targets):
                what = "a module aotlm does not read" if r is None else f"aotlm's {r.targets[0][-1]}"
                raise CheckpointError(
                    f"LoRA adapter {adapter.path} changes {module!r} ({what}); per-row adapters take "
                    f"{', '.join(TARGETS)}: merge this adapter instead (merge_lora=True)"
                )
            a, b = adapter.tensors[a_name], adapter.tensors[b_name] * np.float32(scale)  # [r, in], [out, r]
            shape = (a.shape[1], b.shape[0])[:: 1 if adapter.fan_in_fan_out else -1]  # the stored weight's
            for path, (in_idx, out_idx) in zip(r.targets, self._index_maps(r, shape, adapter), strict=True):
                want = target_dims(self._cfg, path[-1])
                if (in_idx.shape, out_idx.shape) != want:
                    raise CheckpointError(
                        f"LoRA adapter {adapter.path}: module {module!r} does not fit aotlm's {path[-1]} "
                        f"({in_idx.shape} -> {out_idx.shape}, model {want[0]} -> {want[1]}); the adapter "
                        "was trained on another base model"
                    )
                out[path] = (a.T[in_idx], np.moveaxis(b[out_idx], -1, 0))
        return out

    def _index_maps(self, r: Row, shape: tuple[int, int], adapter: LoraAdapter):
        """Per target of row ``r``: (HF input index per aotlm input position, output index per output
        position), for a stored weight of ``shape``."""
        key = (tuple(t[-1] for t in r.targets), shape, adapter.fan_in_fan_out)
        if key not in self._maps:
            rows_, cols = np.indices(shape, dtype=np.int64)
            out_i, in_i = (cols, rows_) if adapter.fan_in_fan_out else (rows_, cols)
            moved_out, moved_in = r.fn(out_i), r.fn(in_i)
            moved_out = moved_out if isinstance(moved_out, tuple) else (moved_out,)
            moved_in = moved_in if isinstance(moved_in, tuple) else (moved_in,)
            maps = []
            for path, mo, mi in zip(r.targets, moved_out, moved_in, strict=True):
                n_in = len(CONTRACT_AXES[path[-1]])
                o, i = np.asarray(mo), np.asarray(mi)
                out_idx, in_idx = o[(0,) * n_in], i[(Ellipsis,) + (0,) * (i.ndim - n_in)]
                whole_out = np.broadcast_to(out_idx, o.shape)
                whole_in = np.broadcast_to(in_idx.reshape(in_idx.shape + (1,) * (i.ndim - n_in)), i.shape)
                if not (np.array_equal(o, whole_out) and np.array_equal(i, whole_in)):
                    raise CheckpointError(
                        f"LoRA adapter {adapter.path}: aotlm's layout of {r.hf!r} is not a rearrangement "
                        "of its rows and columns; merge this adapter instead (merge_lora=True)"
                    )
                maps.append((in_idx, out_idx))
            self._maps[key] = maps
        return self._maps[key]
