"""``Strategies``: the typed hook through which generation strategies attach to a model.

A ``CausalLMForSampling`` holds one ``Strategies`` (``model.strategies``): the construction
options that add graph kinds (``prompt_batch_size``, ``num_beams``, ``speculation_length``),
the draft models paired with it for speculative decoding, and, during one request, the
broadcast plan its ``encode`` follows. The strategy modules (``broadcast``, ``beam``,
``speculative``, ``extensions``) read and write only this object, never the model's own
attributes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aotlm.core.contract import GraphHost


@dataclass
class Strategies:
    """What a model was built for, plus the per-request state the strategies share.

    ``prompt_batch_size``: rows the ``bprefill`` graphs encode (context broadcasting), or None.
    ``num_beams``: beams of the compiled beam graphs (1: none). ``speculation_length``: the
    ``k`` values ``enable_speculative_decoder`` allowed, or None (any). ``drafts``: draft tag ->
    draft model (``SpeculativeGenerator`` pairs them; the target's spec graphs lower with it).
    ``broadcast``: ``(rows per prompt, real rows)`` while a request encodes each prompt once
    for several rows (``broadcasting``), else None.
    """

    prompt_batch_size: int | None = None
    num_beams: int = 1
    speculation_length: tuple[int, ...] | None = None
    drafts: dict[str, Any] = field(default_factory=dict)
    broadcast: tuple[int, int] | None = None

    @classmethod
    def build(
        cls,
        batch_size: int,
        prompt_batch_size: int | None = None,
        num_beams: int = 1,
        speculation_length: int | Sequence[int] | None = None,
    ) -> Strategies:
        """Validate the construction options that add graphs against ``batch_size``."""
        if prompt_batch_size is not None and not 1 <= int(prompt_batch_size) <= batch_size:
            raise ValueError(
                f"prompt_batch_size must be in [1, batch_size={batch_size}], got {prompt_batch_size}"
            )
        if not isinstance(num_beams, int) or num_beams < 1:
            raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}")
        if num_beams > 1 and batch_size % num_beams:
            raise ValueError(
                f"batch_size={batch_size} is not a multiple of num_beams={num_beams}; compiled batch = "
                "prompts x num_beams"
            )
        pb = None if prompt_batch_size is None else int(prompt_batch_size)
        return cls(pb, num_beams, speculation_lengths(speculation_length))

    @contextlib.contextmanager
    def broadcasting(self, group: int, n_rows: int) -> Iterator[None]:
        """Within the block, ``encode`` encodes each group of ``group`` equal rows once."""
        self.broadcast = (group, n_rows)
        try:
            yield
        finally:
            self.broadcast = None


def _is_positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def positive(value, name: str) -> int:
    """``value`` checked as an int >= 1 (tokens per speculative round, an n-gram size)."""
    if not _is_positive(value):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def speculation_lengths(speculation_length: int | Sequence[int] | None) -> tuple[int, ...] | None:
    """``k`` or several ``k`` (draft tokens per speculative round) as a tuple, validated."""
    if speculation_length is None:
        return None
    ks = [speculation_length] if isinstance(speculation_length, int) else list(speculation_length)
    if not ks or not all(_is_positive(k) for k in ks):
        raise ValueError(f"speculation_length must be an int >= 1, got {speculation_length!r}")
    return tuple(ks)


class StrategyHost(GraphHost, Protocol):
    """A ``GraphHost`` with its ``Strategies`` (``CausalLMForSampling``): what ``broadcast``,
    ``beam``, ``speculative`` and ``extensions`` take as ``model``."""

    strategies: Strategies
