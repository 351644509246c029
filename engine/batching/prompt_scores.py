"""A request's prompt log-probabilities, from the chunks that encode its prompt to its answer.

``SlotRunner.prefill_scored`` scores each prefill chunk's next prompt tokens (``PromptScores``:
host arrays); ``answer`` joins a prompt's chunks into the ``PromptLogprobs`` the request streams
first (vLLM's ``prompt_logprobs``: one entry per prompt token, None for the first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aotlm.batching.types import PromptLogprobs, PromptToken


@dataclass(frozen=True)
class PromptScores:
    """The scores of prompt tokens ``first .. first + len(ids) - 1``: each one's log-probability
    ``logp``, ``rank`` (1: the most likely) and the ``K`` most likely tokens there (``top_ids``,
    ``top_lp``: ``[n, K]``, most likely first)."""

    first: int
    ids: np.ndarray
    logp: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_lp: np.ndarray


def answer(prompt_len: int, chunks: Sequence[PromptScores], k: int) -> PromptLogprobs:
    """``chunks`` (each prompt token from the second on scored by one of them, or by two alike where
    a plan's last chunk overlaps the one before) as the request's ``PromptLogprobs`` with ``k``
    alternatives a token; a token no chunk scored is an error."""
    tokens: list[PromptToken | None] = [None] * prompt_len
    for c in chunks:
        for j in range(len(c.ids)):
            top = tuple((int(t), float(lp)) for t, lp in zip(c.top_ids[j, :k], c.top_lp[j, :k], strict=True))
            tokens[c.first + j] = PromptToken(int(c.ids[j]), float(c.logp[j]), int(c.rank[j]), top)
    missing = [t for t in range(1, prompt_len) if tokens[t] is None]
    if missing:
        raise RuntimeError(f"prompt tokens {missing[:4]} were not scored (a prefix was reused?)")
    return PromptLogprobs(tuple(tokens))
