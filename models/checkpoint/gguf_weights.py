"""A GGUF file read as a checkpoint's weights: no converted copy, one tensor at a time.

:class:`GGUFWeights` has :class:`~aotlm.models.checkpoint.WeightReader`'s interface (``names``,
``in``, ``get``, ``items``, ``close``), so the generic loader (``aotlm.models.weights.load_params``)
reads a ``.gguf`` file as it reads safetensors: each tensor under its HF name, llama.cpp's layout
changes undone (``gguf_names``), F32 / F16 / BF16 widened to float32, block types dequantized to
float32 (gguf-py), and handed to the weight rewriter, which stores it in its final form.

The file is memory-mapped once; a tensor's bytes are read through that map, converted into a new
array, and the map's pages of that tensor are then dropped from the process (``madvise(DONTNEED)``:
they stay in the page cache, not in this process's resident memory), so loading holds at most one
tensor's bytes of the file and its float32 copy beyond the stored weights. :meth:`GGUFWeights.codes`
gives a 4-bit matrix's codes and group scales from the same bytes instead (what ``quant="int4"``
keeps, ``aotlm.models.checkpoint.gguf_q4k``).

Which file backs a converted directory: ``SOURCE_POINTER`` there, rewritten by ``gguf.convert``
whenever a ``.gguf`` path resolves to it, records the path with its size and modification time; a
file that moved or changed since is refused with one line (load the ``.gguf`` path itself again).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from aotlm.models.checkpoint.formats import CheckpointError, drop_pages
from aotlm.models.checkpoint.gguf_file import QUANT_TYPES, Plan, Tensor, inspect, tensor_array
from aotlm.models.checkpoint.gguf_lookup import BLOCKS, grouped_rows
from aotlm.models.checkpoint.gguf_names import transform
from aotlm.models.checkpoint.gguf_q4k import CODE_BYTES, codes, groups
from aotlm.models.codes4 import Codes, Groups4
from aotlm.models.lookup import GroupedRows

SOURCE_POINTER = "aotlm_gguf_source.json"


def note_source(checkpoint: Path, gguf_path: Path) -> None:
    """Record ``gguf_path`` (with its size and mtime) as the file behind ``checkpoint`` (atomic; a
    read-only cache keeps its earlier record)."""
    st = gguf_path.stat()
    rec = {"path": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    target = checkpoint / SOURCE_POINTER
    try:
        if target.is_file() and json.loads(target.read_text()) == rec:
            return
        fd, tmp = tempfile.mkstemp(dir=checkpoint, prefix=".source-")
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, target)
    except (OSError, ValueError):
        pass


def source_of(checkpoint: str | os.PathLike) -> Path | None:
    """The GGUF file behind a converted directory, checked unchanged; None for any other checkpoint."""
    f = Path(checkpoint) / SOURCE_POINTER
    if not f.is_file():
        return None
    try:
        rec = json.loads(f.read_text())
        path = Path(rec["path"])
        st = path.stat()
        same = (st.st_size, st.st_mtime_ns) == (rec["size"], rec["mtime_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        path, same = Path(str(f)), False
    if not same:
        raise CheckpointError(
            f"{checkpoint} is a GGUF model whose weights are read from {path}, which moved or changed since; "
            "load the .gguf file itself (aotlm finds this directory again by its content)"
        )
    return path


class GGUFWeights:
    """Name -> float32 tensor access over a GGUF file (see the module docstring)."""

    def __init__(self, gguf_path: Path, checkpoint: Path):
        self.path = Path(gguf_path)
        self.plan, self._reader = inspect(self.path)
        self._meta = json.loads((Path(checkpoint) / "config.json").read_text())
        self._by_hf: dict[str, Tensor] = {t.hf: t for t in self.plan.tensors}
        self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    @property
    def source(self) -> Plan:
        return self.plan

    def stored_type(self, name: str) -> str | None:
        """The GGUF type tensor ``name`` is stored in (``Q4_K``, ``F16``, ...), None if absent."""
        t = self._by_hf.get(name)
        return None if t is None else t.qtype

    def names(self) -> list[str]:
        return list(self._by_hf)

    def __contains__(self, name: str) -> bool:
        return name in self._by_hf

    @contextlib.contextmanager
    def _stored(self, t: Tensor) -> Iterator[np.ndarray]:
        """Tensor ``t``'s stored bytes as gguf-py shapes them, read through this reader's map; the map's
        pages of the tensor are dropped from the process when the block ends."""
        rt = self._reader.tensors[t.index]
        start = int(rt.data_offset)
        raw = np.frombuffer(self._map, dtype=rt.data.dtype, count=rt.data.size, offset=start)
        try:
            yield raw.reshape(rt.data.shape)
        finally:
            drop_pages(self._map, start, int(rt.n_bytes))

    def get(self, name: str) -> np.ndarray:
        """One tensor in its HF layout; floats as float32 (a new array: nothing refers to the map)."""
        t = self._by_hf.get(name)
        if t is None:
            raise CheckpointError(f"tensor {name!r} is missing from {self.path}; the file is incomplete")
        with self._stored(t) as raw:
            arr = tensor_array(self._reader, self.plan, t, self._meta, data=raw)
            if t.dtype == "BF16":  # bf16 bits as stored: float32 is the bits << 16
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            elif np.may_share_memory(arr, raw) or arr.dtype != np.float32 and arr.dtype.kind == "f":
                arr = np.array(arr, dtype=np.float32 if arr.dtype.kind == "f" else arr.dtype)
        return arr

    def codes(self, name: str) -> Codes | None:
        """A 4-bit matrix (Q4_0, Q4_1, Q4_K) or a 5- / 6-bit one (Q5_0, Q5_1, Q5_K, Q6_K) as its codes and
        group scales (``gguf_q4k.codes``), in its HF layout; None for any other tensor."""
        t = self._by_hf.get(name)
        if t is None or t.qtype not in CODE_BYTES or len(t.shape) != 2:
            return None
        with self._stored(t) as raw:
            return codes(self.plan, t, self._meta, raw)

    def groups4(self, name: str, fn) -> Groups4 | None:
        """A 4-bit matrix (Q4_0, Q4_1, Q4_K) or a 5- / 6-bit one moved by an out-only layout function ``fn``
        as its codes and group scales (``gguf_q4k.groups``); None for any other tensor or layout."""
        t = self._by_hf.get(name)
        if t is None or t.qtype not in CODE_BYTES:
            return None
        with self._stored(t) as raw:
            return groups(self.plan, t, self._meta, raw, fn)

    def q8_blocks(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """A Q8_0 matrix stored as HF stores it (no layout change) as its blocks hold it: codes int8
        ``[out, in]`` and f16 scales ``[out, in / 32]`` (no float32 on the way); None for any other."""
        t = self._by_hf.get(name)
        if t is None or t.qtype != "Q8_0" or len(t.shape) != 2:
            return None
        if transform(self.plan.arch_name, t.gguf, self._meta) is not None:
            return None
        with self._stored(t) as raw:
            blocks = np.asarray(raw).reshape(-1, 34)  # f16 d, then 32 int8 codes
            d = blocks[:, :2].copy().view(np.float16).reshape(t.shape[0], -1)
            return np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(t.shape), d

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape in its HF layout."""
        return self._by_hf[name].shape

    def row_chunks(self, name: str, rows: int = 1024) -> Iterator[np.ndarray] | None:
        """A block-quantized matrix stored as HF stores it (no layout change), dequantized to float32
        ``rows`` HF rows at a time (what a loader that rounds it per row holds: one chunk, not the whole
        float32 matrix); None for any other tensor."""
        t = self._by_hf.get(name)
        if t is None or t.qtype not in QUANT_TYPES or len(t.shape) != 2:
            return None
        if transform(self.plan.arch_name, t.gguf, self._meta) is not None:
            return None
        return self._chunks(t, rows)

    def _chunks(self, t: Tensor, rows: int) -> Iterator[np.ndarray]:
        from gguf.constants import GGMLQuantizationType  # local: optional dependency (GGUF files only)
        from gguf.quants import dequantize  # local: as above

        with self._stored(t) as raw:
            by_row = raw.reshape(t.shape[0], -1)
            for i in range(0, t.shape[0], rows):
                yield dequantize(by_row[i : i + rows], GGMLQuantizationType[t.qtype])

    def lookup(self, name: str) -> GroupedRows | None:
        """An embedding table in blocks (Q4_0 ... Q8_0, Q6_K) as its codes with their groups' scales and
        offsets (``gguf_lookup``); None for any other tensor or one stored with a layout change."""
        t = self._by_hf.get(name)
        if t is None or t.qtype not in BLOCKS or transform(self.plan.arch_name, t.gguf, self._meta):
            return None
        with self._stored(t) as raw:
            return grouped_rows(t.qtype, raw, t.shape)

    def items(self):
        for n in self._by_hf:
            yield n, self.get(n)

    def close(self) -> None:
        self._map.close()
        self._file.close()
