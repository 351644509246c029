"""Reading a GGUF file (llama.cpp's format) and checking it before anything is converted.

:func:`inspect` opens the file memory-mapped (gguf-py's ``GGUFReader``: nothing is read but the
header) and refuses, with one :class:`CheckpointError` line naming the problem and the fix, a file
that is not GGUF, is cut short, has an architecture aotlm cannot run, or holds a tensor type it
cannot convert. What it returns is the plan: each tensor's HF name, stored dtype and shape.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aotlm.models.checkpoint.formats import CheckpointError, gc_paused
from aotlm.models.checkpoint.gguf_names import (
    ARCHS,
    ROPE_FACTORS,
    UNSUPPORTED_TENSORS,
    Arch,
    hf_name,
    key_of,
    needs_float,
    transform,
    transposed,
)

# stored float dtype -> numpy dtype of its bytes (BF16: its bits, as stored)
NUMPY_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(np.uint16)}
# kept as stored (bit-exact); every other supported type is dequantized to float32
FLOAT_TYPES = ("F32", "F16", "BF16")
# block-quantized types gguf-py dequantizes (numpy), llama.cpp's 4- to 8-bit ones
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANT_TYPES)


@dataclass
class Tensor:
    """One tensor to convert: GGUF name and type, HF name, output dtype and shape."""

    gguf: str
    hf: str
    qtype: str  # the GGUF type name (F32, Q4_1, ...)
    dtype: str  # safetensors dtype written: F32, F16 or BF16
    shape: tuple[int, ...]  # the HF tensor's shape
    index: int  # position in reader.tensors


@dataclass
class Plan:
    """What :func:`inspect` found: the architecture, the tensors and their type counts."""

    path: Path
    arch_name: str
    arch: Arch
    tensors: list[Tensor]
    type_counts: dict[str, int] = field(default_factory=dict)
    has_tokenizer: bool = False
    rope_factors: int | None = None  # reader index of llama3's rope frequency divisors (a config tensor)

    def matrix_types(self) -> set[str]:
        """The types of the 2-D tensors (the weight matrices and the embedding)."""
        return {t.qtype for t in self.tensors if len(t.shape) == 2}

    def parameters(self) -> int:
        """Elements of the 2-D tensors: the model's size in parameters, less norms and biases."""
        return sum(t.shape[0] * t.shape[1] for t in self.tensors if len(t.shape) == 2)


def is_gguf(path: Path) -> bool:
    """A file named ``*.gguf`` (any case): handed to this module by ``aotlm.models.checkpoint.resolve``."""
    return path.suffix.lower() == ".gguf" and path.is_file()


def supported_archs() -> list[str]:
    """GGUF ``general.architecture`` values aotlm converts (Mistral files say ``llama``)."""
    return sorted(ARCHS)


def open_reader(path: Path):
    """gguf-py's memory-mapped reader, or one clear line when the file is not a readable GGUF."""
    try:
        import gguf  # local: optional dependency (pip install aotlm[gguf]), needed for GGUF files only
    except ImportError as e:
        raise CheckpointError(
            f"{path} is a GGUF file, which needs the gguf package: pip install gguf (or aotlm[gguf])"
        ) from e
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(
            f"{path} is not a GGUF file (starts with {magic!r}, not b'GGUF'); give a llama.cpp .gguf "
            "file or a checkpoint directory"
        )
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError / IndexError / struct errors on a broken header
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({why}): it is truncated or corrupt; "
            "copy or download it again"
        ) from e


def field_value(reader, key: str):
    """A metadata field's value (str, int, float, bool or list), or None when absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _check_size(path: Path, reader) -> None:
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise CheckpointError(
                f"{path} is truncated: tensor {t.name!r} needs bytes up to {end}, the file has {size}; "
                "copy or download it again"
            )


def _check_arch(path: Path, reader) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHS:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; aotlm converts: "
            f"{', '.join(supported_archs())} (Mistral files say 'llama')"
        )
    return arch


def plan_tensor(path: Path, arch_name: str, arch: Arch, t, index: int) -> Tensor:
    """The conversion of one reader tensor, or the reason it cannot be converted."""
    qtype = t.tensor_type.name
    if qtype not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has GGUF type {qtype}, which aotlm cannot convert; supported: "
            f"{', '.join(SUPPORTED_TYPES)}: re-quantize the model to one of them (llama-quantize)"
        )
    base = key_of(t.name)
    if base in UNSUPPORTED_TENSORS:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} holds {UNSUPPORTED_TENSORS[base]}, which aotlm does not support yet; "
            "use a model without it"
        )
    hf = hf_name(arch, t.name)
    if hf is None:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} has no place in a {arch.model_type} checkpoint (unknown GGUF name); "
            "the file does not match its architecture"
        )
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
    if transposed(arch_name, t.name) and len(shape) == 2:
        shape = shape[::-1]
    dtype = qtype if qtype in FLOAT_TYPES else "F32"
    if needs_float(arch_name, t.name):
        dtype = "F32"
    return Tensor(t.name, hf, qtype, dtype, shape, index)


_LAST: dict = {}  # the last file inspected: a first load converts, then reads, the same file


def inspect(path: str | os.PathLike) -> tuple[Plan, object]:
    """``(plan, reader)`` for a GGUF file: every check done, no tensor data read. The last file's
    answer is kept while its size and modification time stay (gguf-py reads every metadata field,
    the tokenizer's too, when it opens a file: seconds for a large vocabulary)."""
    st = Path(path).stat() if Path(path).is_file() else None
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns) if st is not None else None
    if key is not None and key in _LAST:
        return _LAST[key]
    found = _inspect(Path(path))
    _LAST.clear()
    if key is not None:
        _LAST[key] = found
    return found


def _inspect(path: Path) -> tuple[Plan, object]:
    with gc_paused():  # gguf-py makes an object per metadata element (the tokenizer's: ~10^6)
        reader = open_reader(path)
    _check_size(path, reader)
    arch_name = _check_arch(path, reader)
    arch = ARCHS[arch_name]
    factors = next((i for i, t in enumerate(reader.tensors) if key_of(t.name) == ROPE_FACTORS), None)
    if factors is not None and (arch_name != "llama" or reader.tensors[factors].tensor_type.name != "F32"):
        raise CheckpointError(f"{path}: a {ROPE_FACTORS} tensor is only read in F32 llama files; this file "
                              "has another form of rope scaling aotlm does not support yet")  # fmt: skip
    tensors = [plan_tensor(path, arch_name, arch, t, i) for i, t in enumerate(reader.tensors) if i != factors]
    seen = Counter(t.hf for t in tensors)
    dup = [n for n, c in seen.items() if c > 1]
    if dup:
        raise CheckpointError(f"{path}: tensor {dup[0]!r} appears twice; the file is corrupt")
    counts = dict(sorted(Counter(t.qtype for t in tensors).items()))
    has_tok = field_value(reader, "tokenizer.ggml.model") is not None
    return Plan(path, arch_name, arch, tensors, counts, has_tok, factors), reader


def rope_factors(reader, plan: Plan) -> list[float] | None:
    """The file's llama3 rope frequency divisors (``[head_dim / 2]``), or None without them."""
    if plan.rope_factors is None:
        return None
    return [float(v) for v in np.asarray(reader.tensors[plan.rope_factors].data, np.float32).ravel()]


def tensor_array(reader, plan: Plan, t: Tensor, meta: dict, data: np.ndarray | None = None) -> np.ndarray:
    """Tensor ``t`` as the HF checkpoint stores it: dequantized (f32) or as stored (f32 / f16 / bf16 bits).
    ``data``: its stored bytes as gguf-py shapes them (default: the reader's own view of the file)."""
    import gguf  # local: optional dependency (pip install aotlm[gguf]), needed for GGUF files only

    rt = reader.tensors[t.index]
    data = rt.data if data is None else data
    if t.dtype == t.qtype:  # F32 / F16 / BF16 kept as stored
        logical = tuple(int(n) for n in reversed(rt.shape))
        arr = np.asarray(data).view(NUMPY_DTYPES[t.qtype]).reshape(logical)
    else:
        arr = gguf.quants.dequantize(data, rt.tensor_type)
    fn = transform(plan.arch_name, t.gguf, meta)
    if fn is not None:
        arr = fn(arr)
    arr = np.ascontiguousarray(arr, dtype=np.float32 if t.dtype == "F32" else arr.dtype)
    if arr.shape != t.shape:
        raise CheckpointError(f"{plan.path}: tensor {t.gguf!r} has shape {arr.shape}, expected {t.shape}")
    return arr
