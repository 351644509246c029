"""What a prompt's prefill gives besides its logits: its log-probabilities, or its embedding.

``encode`` runs one chunk of a request's prompt through the runner's graph for it:
``SlotRunner.prefill_scored`` scores each chunk's next prompt tokens (``PromptScores``: host arrays)
for ``prompt_logprobs``; ``prefill_embedded`` returns an ``embed`` request's last hidden state from its
last chunk. ``answer`` joins a prompt's chunks into the ``PromptLogprobs`` the request streams first
(vLLM's ``prompt_logprobs``: one entry per prompt token, None for the first); ``after_prompt`` pushes
what the request gets once its prompt is in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aotlm.batching.rows import Active
from aotlm.batching.types import Embedding, PromptLogprobs, PromptToken
from aotlm.core.buckets import PrefillStep


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


def encode(runner, row: int, a: Active, step: PrefillStep) -> None:
    """Encode one chunk of ``a``'s prompt into ``row`` of ``runner`` (a ``SlotRunner``): scored for
    ``prompt_logprobs``, embedded if it is an ``embed`` request's last chunk, else plain."""
    params = a.req.params
    if params.prompt_logprobs is not None:
        a.logits, scores = runner.prefill_scored(row, a.prompt, step, params.adapter)
        a.scores.append(scores)
    elif params.embed and not a.plan:
        a.vector = runner.prefill_embedded(row, a.prompt, step, params.adapter)
    else:
        a.logits = runner.prefill_step(row, a.prompt, step, params.adapter)
    a.filled = max(a.filled, step.start + step.n_real)


def after_prompt(a: Active) -> bool:
    """Push what ``a``'s request gets once its whole prompt is encoded (its ``PromptLogprobs``, or its
    ``Embedding``); True when that is its whole answer (``embed``: nothing is generated)."""
    k = a.req.params.prompt_logprobs
    if k is not None:
        a.req.push(answer(len(a.prompt), a.scores, k))
    if a.req.params.embed:
        a.req.push(Embedding(tuple(float(x) for x in a.vector)))
        return True
    return False
