"""Reading Hugging Face checkpoints: ``config.json`` plus safetensors (single or sharded).

Tensors are read memory-mapped, one at a time, and each tensor's pages are dropped from the process
once it is read (``SafetensorsFile``: the bytes stay in the page cache, not in this process's
resident memory), so host memory holds at most one full-precision tensor beyond the converted
parameters: loading a checkpoint peaks near its stored weights, not the file's size on top.
``pytorch_model.bin`` is read through torch when it is installed.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from aotlm import kernels

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_SINGLE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing files or holds unreadable ones."""


def load_hf_config(path: str | os.PathLike):
    """The transformers config of a checkpoint directory (never downloads)."""
    # local: slow to import (~1-2 s): kept out of `import aotlm` until text is needed
    from transformers import AutoConfig

    path = Path(path)
    cfg_file = path / "config.json"
    if path.is_file():
        raise CheckpointError(f"{path} is a file: give the checkpoint directory (holding config.json)")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist; check the path")
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing: a checkpoint directory needs config.json")
    try:
        json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); re-save the checkpoint") from e
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types, with multi-line messages
        why = " ".join(str(e).split("\n")[0].split())
        raise CheckpointError(
            f"{cfg_file} cannot be read by transformers AutoConfig ({why}); fix config.json (model_type, "
            "field types) or re-save the checkpoint"
        ) from e


# safetensors dtype -> numpy dtype of its bytes (BF16: its bits; widened to float32 by ``get``)
SAFE_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
               "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}  # fmt: skip


TRANSPOSE_ROWS = 16  # source rows per block of transposed(): a 64-byte line per output row (4-byte values)


def transposed(a: np.ndarray) -> np.ndarray:
    """``a.T`` as a new C-contiguous array. ``np.ascontiguousarray(a.T)`` walks the source column by
    column, the largest single cost of converting a 1B-8B model (matrices of tens to hundreds of MB): a
    2-D ``a`` is copied in tiles by the kernels' threads, else ``TRANSPOSE_ROWS`` source rows at a time
    (each output row gets them as one run; 4-6x faster than numpy's own copy)."""
    if a.ndim != 2 or a.size < 1 << 16:
        return np.ascontiguousarray(a.T)
    done = kernels.transpose(a)  # tiles on every core (the kernels' host.h)
    if done is not None:
        return done
    src = np.asarray(a)  # a memmap's slices would each go through its __array_finalize__
    out = np.empty(src.shape[::-1], src.dtype)
    for i in range(0, src.shape[0], TRANSPOSE_ROWS):
        out[:, i : i + TRANSPOSE_ROWS] = src[i : i + TRANSPOSE_ROWS].T
    return out


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a checkpoint is read and converted: that makes ~10^6
    small objects (gguf-py's metadata fields, numpy views), each counting toward a collection that walks
    every live object (5-7% of a 1B model's conversion under perf); nothing read forms cycles that
    must be freed meanwhile. Nests; a collector already off stays off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def drop_pages(m: mmap.mmap, start: int, n: int) -> None:
    """Drop the whole pages of ``m``'s bytes ``[start, start + n)`` from this process's resident memory
    (``madvise(DONTNEED)``; a read-only file map re-reads them from the page cache if touched again)."""
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + n) // page * page
    if last > first and hasattr(m, "madvise"):
        m.madvise(mmap.MADV_DONTNEED, first, last - first)


class SafetensorsFile:
    """One safetensors file, memory-mapped: its header parsed once, each tensor read through the map
    and its whole pages then dropped from the process (``madvise(DONTNEED)``)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if not 2 <= n <= os.path.getsize(path) - 8:
                raise ValueError(f"header length {n} does not fit the file")
            header = json.loads(f.read(n))
            self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        self._start = 8 + n
        self._tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        size = os.path.getsize(path)
        for name, t in self._tensors.items():
            if t.get("dtype") not in SAFE_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {t.get('dtype')!r}, which aotlm does not read")
            lo, hi = t["data_offsets"]
            if not 0 <= lo <= hi or self._start + hi > size:
                raise ValueError(f"tensor {name!r} lies past the end of the file (truncated?)")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor as a new array (nothing refers to the map afterwards)."""
        t = self._tensors[name]
        lo, hi = t["data_offsets"]
        dt = np.dtype(SAFE_DTYPES[t["dtype"]])
        shape = tuple(t["shape"])
        start = self._start + lo
        if hi - lo != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise ValueError(f"its byte range {hi - lo} does not match {t['dtype']} {list(shape)}")
        if hi == lo:
            return np.zeros(shape, dt)
        view = np.frombuffer(self._map, dtype=dt, count=(hi - lo) // dt.itemsize, offset=start).reshape(shape)
        if t["dtype"] == "BF16":
            arr = (view.astype(np.uint32) << 16).view(np.float32)
        elif dt.kind == "f":
            arr = np.array(view, dtype=np.float32)
        else:
            arr = np.array(view)
        drop_pages(self._map, start, hi - lo)
        return arr

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        self._file.close()


class WeightReader:
    """Name -> numpy tensor access over the checkpoint's weight files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._stack = ExitStack()
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        self._torch_state: dict[str, object] | None = None
        p = self.path
        if (p / SAFE_INDEX).is_file():
            self._index(p / SAFE_INDEX)
        elif (p / SAFE_SINGLE).is_file():
            self._open_safetensors(SAFE_SINGLE)
        elif (p / TORCH_INDEX).is_file() or (p / TORCH_SINGLE).is_file():
            self._load_torch()
        else:
            raise CheckpointError(
                f"no weights in {p}: expected {SAFE_SINGLE}, {SAFE_INDEX} or {TORCH_SINGLE}; copy the "
                "weight files next to config.json"
            )

    def _index(self, index_file: Path) -> None:
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{index_file} is not a valid safetensors index ({e}); re-download or re-save the checkpoint"
            ) from e
        for fname in sorted(set(weight_map.values())):
            self._open_safetensors(fname)

    def _open_safetensors(self, fname: str) -> None:
        f = self.path / fname
        if not f.is_file():
            raise CheckpointError(
                f"weight file {f} is missing (named in {SAFE_INDEX}); copy every shard of the checkpoint"
            )
        try:
            handle = SafetensorsFile(f)
            self._stack.callback(handle.close)
            names = handle.keys()
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(
                f"weight file {f} is corrupt or not safetensors ({e}); re-download or re-save the checkpoint"
            ) from e
        self._files[fname] = handle
        for n in names:
            self._where[n] = fname

    def _load_torch(self) -> None:
        try:
            import torch  # local: optional (HF interop / .bin checkpoints): kept out of `import aotlm`
        except ImportError as e:
            raise CheckpointError(
                f"{self.path} holds only pytorch_model.bin weights, which need torch: "
                "pip install torch==2.13.0, or convert the checkpoint to safetensors"
            ) from e
        p = self.path
        files = [TORCH_SINGLE]
        if (p / TORCH_INDEX).is_file():
            files = sorted(set(json.loads((p / TORCH_INDEX).read_text())["weight_map"].values()))
        self._torch_state = {}
        for fname in files:
            try:
                sd = torch.load(str(p / fname), map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise CheckpointError(f"weight file {p / fname} cannot be read by torch: {e}") from e
            self._torch_state.update(sd)
        self._where = {n: "torch" for n in self._torch_state}

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        """One tensor as a numpy array (float tensors widened to float32)."""
        if name not in self._where:
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint in {self.path}; re-save the checkpoint"
            )
        if self._torch_state is not None:
            t = self._torch_state[name]
            arr = t.float().numpy() if t.is_floating_point() else t.numpy()
        else:
            fname = self._where[name]
            try:
                arr = self._files[fname].get_tensor(name)
            except Exception as e:
                raise CheckpointError(
                    f"tensor {name!r} in {self.path / fname} is unreadable ({e}); re-save the checkpoint"
                ) from e
        if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
            arr = np.asarray(arr, dtype=np.float32)
        return arr

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for n in self._where:
            yield n, self.get(n)

    def close(self) -> None:
        self._stack.close()
        self._torch_state = None
