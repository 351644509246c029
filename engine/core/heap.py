"""The host's C heap after a warm start: freed memory given back to the OS.

Deserializing the compiled graphs on a thread per core (``CompiledModel.compile``) leaves glibc's
per-thread arenas holding the pages XLA freed; they would count in the process's resident memory for
its whole life (figures: ``scripts/README.md``, bench_sizes). ``release()`` asks glibc to return every
free page (``malloc_trim(0)``); elsewhere (another C library, another OS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and others: no malloc_trim
        return None


def release() -> bool:
    """Give the heap's free pages back to the OS; True where the C library could (glibc)."""
    trim = _trim()
    if trim is None:
        return False
    trim(0)
    return True
