"""Building and loading the kernel library (``wmatmul.cc``), and whether graphs use it.

The package docstring (``aotlm.kernels``) says when and why; this module is the mechanics:
the source hash, the ``g++`` build into ``$AOTLM_KERNEL_CACHE``, FFI registration, and the
switches (``AOTLM_KERNELS=0``) that graphs consult while they are traced.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jaxlib
import numpy as np

from aotlm.kernels import isa

_DIR = Path(__file__).resolve().parent  # the sources ship beside this module
# The translation unit and every header beside it: the build hash covers them all, so a changed
# header (epilogue.h, argmax.h were once missing from a hand-kept list) always means a rebuild.
SOURCES = ("wmatmul.cc", *sorted(p.name for p in _DIR.glob("*.h")))
# The g++ flags of every level; the ISA level's own (``isa.LEVELS``: -mavx2 ... -mavx512vnni) go after -O3.
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-pthread")
TARGETS = {
    "aotlm_wmm_nn": "AotlmWmmNN",
    "aotlm_wmm_nt": "AotlmWmmNT",
    "aotlm_bdot": "AotlmBdot",
    "aotlm_dattn": "AotlmDattn",
    "aotlm_convert": "AotlmConvert",
    "aotlm_wmm_pk": "AotlmWmmPK",
    "aotlm_unpack": "AotlmUnpack",
    "aotlm_gemm": "AotlmGemm",
    "aotlm_gemm_pk": "AotlmGemmPk",
    "aotlm_attn": "AotlmAttn",
    "aotlm_argmax": "AotlmArgmax",
    "aotlm_lora": "AotlmLora",
    "aotlm_wmm_q4": "AotlmWmmQ4",
    "aotlm_unpack_q4": "AotlmUnpackQ4",
}
# More rows than this (prefill) stay on XLA's dot. f32 weights take the kernels too: XLA runs 2..16
# rows (batched decode, a speculative check) as a GEMM reading W 2-4x slower, and its one-row GEMV
# reached 87% of the read bandwidth in GPT-2-small decode where the kernel's row stream reaches 96%.
MAX_ROWS = 16
# Batched decode with more rows (17..ROW_KERNEL_ROWS: batch 32, 64) still takes the row kernels for
# int8 / bf16 / f16 weights (``dense.row_limit``); more rows (prompts) take the GEMMs of gemm.h or
# XLA's dot. W8A8 and the bdot attention keep MAX_ROWS as the prefill / decode line.
ROW_KERNEL_ROWS = 64


class KernelWarning(UserWarning):
    """The kernels could not be built or loaded; aotlm uses XLA's matmuls instead."""


@functools.cache
def isa_level() -> str:
    """The instruction-set level the kernels of this process are built for (``avx2``, ``avx512``,
    ``avx512vnni`` or ``avx512bf16``: ``aotlm.kernels.isa``), chosen once: ``AOTLM_KERNEL_ISA`` or
    the CPU's best.
    Raises ``isa.KernelIsaError`` (one line) for an unknown level or one this CPU lacks."""
    return isa.level()


def flags(level: str | None = None) -> tuple[str, ...]:
    """The g++ flags that build ``level`` (default: this process's)."""
    return (FLAGS[0], *isa.flags_for(level or isa_level()), *FLAGS[1:])


@functools.cache
def build_hash(level: str | None = None) -> str:
    """Identity of the kernel binary: sources, ISA level and its flags, compiler and jaxlib version."""
    level = level or isa_level()
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + (_DIR / name).read_bytes())
    h.update(level.encode() + " ".join(flags(level)).encode())
    h.update(jaxlib.__version__.encode() + _compiler_version().encode())
    return h.hexdigest()[:16]


@functools.cache
def _compiler_version() -> str:
    try:
        return subprocess.run(["g++", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "no g++"


def _build() -> Path:
    """The compiled library, building it once per machine (atomic rename, so racing builds agree)."""
    root = Path(os.environ.get("AOTLM_KERNEL_CACHE", Path.home() / ".cache" / "aotlm" / "kernels"))
    lib = root / build_hash() / "libaotlm_kernels.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = ["g++", *flags(), f"-I{jax.ffi.include_dir()}", f"-I{_DIR}", str(_DIR / SOURCES[0]), "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"g++ failed: {res.stderr.strip()[-2000:]}")
    os.replace(tmp, lib)
    return lib


@functools.cache
def _load() -> ctypes.CDLL | None:
    """Build, load and register the FFI targets once; ``None`` (with a warning) on any failure but a
    bad ``AOTLM_KERNEL_ISA``, which raises ``isa.KernelIsaError`` (the user's error, not a reason to
    fall back quietly)."""
    isa_level()
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
        if not lib.aotlm_kernels_cpu_ok():
            lacks = ", ".join(isa.lacking(isa_level()))
            why = f"this CPU lacks the {isa_level()} level's instructions ({lacks})"
            warnings.warn(f"{why}: aotlm kernels disabled", KernelWarning, stacklevel=3)
            return None
        lib.aotlm_kernels_isa.restype = ctypes.c_char_p
        built = lib.aotlm_kernels_isa().decode()
        if built != isa_level():  # a binary built with other flags under this level's hash
            raise RuntimeError(f"{path} is built for {built}, not {isa_level()}")
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        return lib
    except Exception as e:  # no compiler, no headers, unwritable cache...: fall back to XLA
        warnings.warn(f"aotlm kernels unavailable ({e}); using XLA's matmuls", KernelWarning, stacklevel=3)
        return None


def enabled() -> bool:
    """Whether graphs traced now use the kernels (``AOTLM_KERNELS=0`` forces them off). Raises
    ``isa.KernelIsaError`` when ``AOTLM_KERNEL_ISA`` asks for a level this CPU cannot run."""
    if os.environ.get("AOTLM_KERNELS", "1") == "0" or jax.default_backend() != "cpu":
        return False
    return _load() is not None


def ensure_registered() -> None:
    """Register the FFI targets before deserializing executables that may call them."""
    if os.environ.get("AOTLM_KERNELS", "1") != "0" and jax.default_backend() == "cpu":
        _load()


def cache_tag() -> str:
    """Compile-cache key field: graphs with and without kernels, of another ISA level (whose
    executables may hold instructions another CPU lacks) or of another build differ."""
    return f"wmatmul-{isa_level()}-{build_hash()}" if enabled() else "off"


def threads() -> int:
    lib = _load()
    return int(lib.aotlm_kernels_threads()) if lib is not None else 0


def read_gbps(mib: int = 512, runs: int = 7) -> float | None:
    """Streaming read bandwidth (GB/s, median of runs) by the kernels' threads; None without them."""
    lib = _load()
    if lib is None:
        return None
    lib.aotlm_read_gbps.restype = ctypes.c_double
    return float(lib.aotlm_read_gbps(ctypes.c_int64(mib), ctypes.c_int(runs)))


def fma_peak(runs: int = 5) -> float | None:
    """f32 FMA peak (GFLOP/s, best of runs) of the kernels' threads at their ISA level's vector
    width (8 lanes under ``avx2``, 16 under ``avx512*``); None without them."""
    lib = _load()
    if lib is None:
        return None
    lib.aotlm_fma_peak.restype = ctypes.c_double
    return float(lib.aotlm_fma_peak(ctypes.c_int(runs)))


def int8_peak(runs: int = 5) -> float | None:
    """int8 multiply-add peak (Gop/s, 2 per multiply-add, best of runs) of the kernels' threads with
    the instruction W8A8's GEMM uses at this ISA level: ``vpdpbusd`` on 512 bits (``avx512vnni``),
    else ``vpmaddwd`` + ``vpaddd`` on sign-extended int8; None without the kernels."""
    lib = _load()
    if lib is None:
        return None
    lib.aotlm_int8_peak.restype = ctypes.c_double
    return float(lib.aotlm_int8_peak(ctypes.c_int(runs)))


def bf16_peak(runs: int = 5) -> float | None:
    """bf16 multiply-add peak (GFLOP/s, 2 per multiply-add, best of runs) of the kernels' threads with
    ``vdpbf16ps`` on 512 bits (``avx512bf16``, ``quant="bf16a"``'s GEMM); 0 at a level without it, None
    without the kernels."""
    lib = _load()
    if lib is None:
        return None
    lib.aotlm_bf16_peak.restype = ctypes.c_double
    return float(lib.aotlm_bf16_peak(ctypes.c_int(runs)))


def amx_tiles() -> bool:
    """Whether the prefill GEMMs run on AMX tiles: the ``amx`` level and Linux granted this process the
    tile state (``arch_prctl``; a kernel or hypervisor that refuses it leaves them on ``vpdpbusd`` /
    ``vdpbf16ps``)."""
    lib = _load()
    return bool(lib is not None and lib.aotlm_amx_tiles())


def transpose(a: np.ndarray) -> np.ndarray | None:
    """``a.T`` of a 2-D array as a new C-contiguous array, copied in tiles by the kernels' threads
    (``host.h``, through ctypes: the GIL is released meanwhile); None without the kernels or for an
    element size other than 1, 2, 4 or 8 bytes (the caller copies it itself)."""
    if a.ndim != 2 or a.dtype.itemsize not in (1, 2, 4, 8) or not enabled():
        return None
    src = np.ascontiguousarray(a)
    out = np.empty(src.shape[::-1], src.dtype)
    lib = _load()
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    sizes = (i64(src.shape[0]), i64(src.shape[1]), i64(src.itemsize))
    if lib.aotlm_transpose(ptr(src.ctypes.data), ptr(out.ctypes.data), *sizes):
        return None
    return out


def pack_panels(w: np.ndarray, codes: bool) -> np.ndarray | None:
    """The panel layout of a 2-D ``w [K, N]`` (``host.h``): ``[N / 16, K / 2, 16, 2]`` (int8 / bf16 / f16 /
    f32 pairs of rows, ``packed.h``), or for 4-bit ``codes`` (uint8, one per byte) ``[N / 16, K / 8, 16, 4]``
    bytes of two codes each (``int4.h``); None without the kernels (the caller packs it with numpy)."""
    rows = 8 if codes else 2
    k, n = w.shape
    if k % rows or n % 16 or w.dtype.itemsize not in ((1,) if codes else (1, 2, 4)) or not enabled():
        return None
    src = np.ascontiguousarray(w)
    out = np.empty((n // 16, k // rows, 16, 4 if codes else 2), np.uint8 if codes else src.dtype)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    sizes = (i64(k), i64(n), i64(src.itemsize), ctypes.c_int(int(codes)))
    if _load().aotlm_pack_panels(ptr(src.ctypes.data), ptr(out.ctypes.data), *sizes):
        return None
    return out
