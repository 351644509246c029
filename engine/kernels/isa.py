"""Which instruction set the kernel library is built for: the CPU's features, read once, and the level.

Levels, lowest first (each needs every feature of the ones before it):

* ``avx2``: AVX2 + FMA + F16C, the baseline every kernel has (8-wide f32 FMAs, ``vpmaddwd``).
* ``avx512``: AVX-512 F/BW/VL/DQ, the GEMMs' and the prompt attention's micro-kernel 16-wide.
* ``avx512vnni``: AVX512-VNNI too, W8A8's GEMM on ``vpdpbusd`` (64 int8 multiply-adds per instruction)
  and the int8 row kernels on ``vpdpwssd`` (``vpmaddwd`` and its add in one).
* ``avx512bf16``: AVX512-BF16 too, ``quant="bf16a"``'s prefill GEMM on ``vdpbf16ps`` (bf16 activations
  times bf16 weights, 32 multiply-adds per instruction). Ice Lake has VNNI without it (``avx512vnni``).
* ``amx``: AMX-TILE + AMX-INT8 + AMX-BF16 too (Sapphire Rapids and later), W8A8's prefill GEMM on
  ``tdpbssd`` tiles (16,384 int8 multiply-adds per instruction; ``amx.h``, ``amx8.h``) and the bf16
  panels' on ``tdpbf16ps`` (8,192 bf16 ones; f32 x in three bf16 parts, bf16 x as it is: ``amx16.h``) and
  ``quant="int8"``'s prefill rows (int16 x in two int8 digits, the row kernels' sums: ``amx16i.h``) once
  Linux grants the process the tile state (asked on first use; refused, the AVX-512 kernels run).

The level is the highest the CPU has, or ``AOTLM_KERNEL_ISA`` (a lower one, e.g. to compare or to
build a cache for older CPUs); an unknown name or a level this CPU lacks is a ``KernelIsaError``.
The level picks the compiler flags (``FLAGS``), so it is part of the build hash and of
``cache_tag()``: executables compiled against one level are never loaded under another.
"""

from __future__ import annotations

import functools
import os

# level -> (/proc/cpuinfo flags it needs, g++ flags it adds), lowest first
LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    ),
    "avx512vnni": (("avx512_vnni",), ("-mavx512vnni",)),
    "avx512bf16": (("avx512_bf16",), ("-mavx512bf16",)),
    "amx": (("amx_tile", "amx_int8", "amx_bf16"), ("-mamx-tile", "-mamx-int8", "-mamx-bf16")),
}
ENV = "AOTLM_KERNEL_ISA"


class KernelIsaError(ValueError):
    """``AOTLM_KERNEL_ISA`` names no level, or one this CPU cannot run."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (``/proc/cpuinfo``); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The levels this CPU (or ``flags``) can run, lowest first. Without readable flags (not Linux):
    only ``avx2``, which the library checks itself when it loads (``__builtin_cpu_supports``)."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return ["avx2"]
    out, need = [], set()
    for name, (req, _) in LEVELS.items():
        need |= set(req)
        if not need <= flags:
            break
        out.append(name)
    return out


def lacking(level: str, flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags ``level`` needs that this CPU (or ``flags``) does not report."""
    flags = cpu_flags() if flags is None else flags
    names = list(LEVELS)
    need = [f for lv in names[: names.index(level) + 1] for f in LEVELS[lv][0]]
    return [f for f in need if f not in flags]


def choose(requested: str | None, flags: frozenset[str] | None = None) -> str:
    """The level for ``requested`` (``None`` or ``""``: the best this CPU has) on this CPU."""
    have = supported_levels(flags)
    if not requested:
        return have[-1] if have else "avx2"
    if requested not in LEVELS:
        raise KernelIsaError(
            f"{ENV}={requested!r} is not a kernel ISA level; use one of {', '.join(LEVELS)} or unset it"
        )
    if requested not in have:
        missing = " ".join(lacking(requested, flags)) or "its features"
        raise KernelIsaError(
            f"{ENV}={requested}: this CPU lacks {missing}; use one of {', '.join(have)} or unset it"
        )
    return requested


def level() -> str:
    """The kernel ISA level of this process (``AOTLM_KERNEL_ISA`` or the CPU's best), e.g. ``avx512vnni``."""
    return choose(os.environ.get(ENV, "").strip() or None)


def flags_for(name: str) -> tuple[str, ...]:
    """The g++ flags that build ``name``: its own and every lower level's."""
    names = list(LEVELS)
    return tuple(f for lv in names[: names.index(name) + 1] for f in LEVELS[lv][1])
