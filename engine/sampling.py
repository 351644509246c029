"""In-graph token selection.

A selector is a frozen (hashable) dataclass: it is a ``jax.jit`` static argument, so the
same selector object never retraces, and it is called inside the compiled prefill and
decode graphs as ``selector(logits [B, V] float32, state) -> tokens [B] int32``. ``state``
is the decode state dict (``None`` inside prefill); per-row sampling parameters will be
traced arrays in that state so that new values never recompile.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp


@dataclass(frozen=True)
class Greedy:
    """argmax, first index on ties (as torch.argmax and transformers greedy search)."""

    name: str = "greedy"

    def __call__(self, logits, state=None):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


GREEDY = Greedy()
