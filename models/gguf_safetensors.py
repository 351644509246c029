"""Writing a safetensors file one tensor at a time.

``safetensors.numpy.save_file`` needs every tensor in memory at once (a dequantized 135M-parameter
model is 540 MB of float32); the format is a JSON header of names, dtypes, shapes and byte ranges
followed by the raw bytes, so with the shapes known up front each tensor can be made, written and
dropped in turn. The file is fsynced; the caller renames its directory into place.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

# safetensors dtype -> numpy dtype of its bytes (BF16: its bits, as stored)
NUMPY_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(np.uint16)}


def write_safetensors(
    path: Path, tensors: Sequence[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]]
) -> None:
    """``tensors``: ``(name, dtype F32 / F16 / BF16, shape, make)``; ``make()`` returns the array."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, _ in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * NUMPY_DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name, dtype, shape, make in tensors:
            arr = make()
            if arr.dtype != NUMPY_DTYPES[dtype] or arr.shape != tuple(shape):
                raise ValueError(f"{name}: made {arr.dtype} {arr.shape}, declared {dtype} {tuple(shape)}")
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        f.flush()
        os.fsync(f.fileno())
