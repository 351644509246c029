"""Progress bars and the ``aotlm`` logger, switched off in one place.

Loading weights, compiling every bucket and generating over many prompts can take long
enough that a silent terminal looks hung, so those loops go through :func:`bar`. Bars are
drawn on stderr only when it is a terminal (tqdm's ``disable=None``) and can be turned off
for a whole process (``--quiet``, ``AOTLM_PROGRESS=0``) or one block (``with quiet():``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger("aotlm")

_enabled = os.environ.get("AOTLM_PROGRESS", "1").lower() not in ("0", "false", "no", "off")


def set_enabled(on: bool) -> None:
    """Turn progress bars on or off for the whole process."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def quiet(active: bool = True) -> Iterator[None]:
    """No progress bars inside the block (when ``active``)."""
    global _enabled
    before = _enabled
    if active:
        _enabled = False
    try:
        yield
    finally:
        _enabled = before


def bar(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterable[T]:
    """``items`` wrapped in a tqdm bar on stderr, or ``items`` itself when bars are off."""
    if not _enabled:
        return items
    try:
        from tqdm import tqdm  # local: optional: progress bars only when installed
    except ImportError:  # tqdm comes with transformers; without it, no bars
        return items
    return tqdm(items, desc=desc, total=total, unit=unit, disable=None, leave=False, dynamic_ncols=True)
