"""Host-side stopping criteria: transformers' ``StoppingCriteria`` protocol, checked after each token.

``aotlm.stopping_criteria`` re-exports ``StoppingCriteria`` / ``StoppingCriteriaList`` under
transformers-neuronx's module path. Any callable ``(input_ids, scores) -> bool | [batch] bools``
works, transformers' own classes included; ``scores`` is ``None`` (logits stay on device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class StoppingCriteria:
    """Base class of a stopping rule: ``__call__(input_ids, scores, **kwargs)`` returns True
    (every row stops) or one bool per row. ``input_ids`` is the prompt plus the tokens so far."""

    def __call__(self, input_ids, scores, **kwargs) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(input_ids, scores)")


class StoppingCriteriaList(list):
    """A list of criteria; calling it ORs them (a row stops when any criterion says so)."""

    def __call__(self, input_ids, scores, **kwargs) -> np.ndarray:
        rows = np.shape(input_ids)[0]
        hit = np.zeros(rows, bool)
        for c in self:
            hit |= _as_rows(c(input_ids, scores, **kwargs), rows)
        return hit


def _as_rows(result, rows: int) -> np.ndarray:
    r = result.detach().cpu().numpy() if hasattr(result, "detach") else np.asarray(result)
    return np.broadcast_to(r.astype(bool), (rows,))


def criteria_list(stopping_criteria) -> list:
    """One criterion or a sequence of them (``None``: none), each checked to be callable."""
    if stopping_criteria is None:
        return []
    items = list(stopping_criteria) if isinstance(stopping_criteria, Sequence) else [stopping_criteria]
    for c in items:
        if not callable(c):
            raise TypeError(f"stopping_criteria must be callables (transformers StoppingCriteria), got {c!r}")
    return items


def criteria_hit(criteria: list, sequences: np.ndarray) -> np.ndarray:
    """Rows that any criterion ends; they get torch tensors when torch is importable (HF's own
    criteria index them as tensors)."""
    ids: Any = sequences
    try:
        import torch  # local: optional (HF interop / .bin checkpoints): kept out of `import aotlm`

        ids = torch.from_numpy(np.ascontiguousarray(sequences).astype(np.int64))
    except ImportError:
        pass
    hit = np.zeros(sequences.shape[0], bool)
    for c in criteria:
        hit |= _as_rows(c(ids, None), hit.shape[0])
    return hit
