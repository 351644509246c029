"""Progress bars and the ``aotlm`` logger, switched off in one place.

Loading weights, compiling every bucket and generating over many prompts can take long
enough that a silent terminal looks hung, so those loops go through :func:`bar`. Bars are
drawn on stderr only when it is a terminal (tqdm's ``disable=None``); where it is not (a log
file, a container's log, a pipe) a loop that runs longer than :data:`LOG_EVERY` seconds logs
an INFO line on the ``aotlm`` logger every :data:`LOG_EVERY` seconds instead (``compiling
buckets: 12 of 71 graphs, 95 s``). Both can be turned off for a whole process (``--quiet``,
``AOTLM_PROGRESS=0``) or one block (``with quiet():``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger("aotlm")

LOG_EVERY = 30.0  # seconds between the progress lines of a loop whose bar is not drawn

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
    if not _is_terminal(sys.stderr):
        return _logged(items, desc, total, unit)
    try:
        from tqdm import tqdm  # local: optional: progress bars only when installed
    except ImportError:  # tqdm comes with transformers; without it, no bars
        return items
    return tqdm(items, desc=desc, total=total, unit=unit, disable=None, leave=False, dynamic_ncols=True)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _logged(items: Iterable[T], desc: str, total: int | None, unit: str) -> Iterator[T]:
    """``items``, with a line on the ``aotlm`` logger every :data:`LOG_EVERY` s while they last."""
    t0 = time.monotonic()
    last = t0
    of = f" of {total}" if total is not None else ""
    plural = unit + ("es" if unit.endswith(("s", "ch", "sh", "x")) else "s")
    for i, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= LOG_EVERY and (total is None or i < total):
            last = now
            units = "" if unit == "it" else " " + (unit if i == 1 and total is None else plural)
            logger.info("%s: %d%s%s, %.0f s", desc, i, of, units, now - t0)
