"""Turning user inputs (numpy, nested lists, torch tensors) into checked int32 arrays.

Every problem is reported as a ``ValueError``/``TypeError`` naming the argument and the
fix, before any device work starts.
"""

from __future__ import annotations

import numpy as np


def to_numpy(x, name: str) -> np.ndarray:
    if x is None:
        raise ValueError(f"{name} is required")
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        x = x.detach().cpu().numpy()
    elif hasattr(x, "__array__") and not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if isinstance(x, list | tuple):
        try:
            x = np.asarray(x)
        except ValueError as e:
            raise ValueError(
                f"{name} is a ragged nested list; left-pad the prompts to one length and pass an "
                "attention_mask (or start_ids)"
            ) from e
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, nested list or torch tensor, got {type(x).__name__}")
    return x


def token_ids(input_ids, vocab_size: int) -> np.ndarray:
    """``[batch, len]`` int32 token ids (a 1-D sequence is one row)."""
    ids = to_numpy(input_ids, "input_ids")
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2:
        raise ValueError(
            f"input_ids must have shape [batch, length], got rank {ids.ndim} {ids.shape}; "
            "pass one row of token ids per prompt"
        )
    if ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: give at least one prompt")
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: input_ids needs at least one token per row")
    if ids.dtype.kind not in "iu":
        raise TypeError(
            f"input_ids must hold integers, got dtype {ids.dtype}; pass integer token ids (e.g. .astype(int))"
        )
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(
            f"input_ids[{r}, {c}] = {ids[r, c]} is not a valid token id (vocab_size={vocab_size}); "
            f"token ids must be in [0, {vocab_size - 1}]"
        )
    return ids.astype(np.int32)


def prompt_mask(ids: np.ndarray, attention_mask=None, start_ids=None) -> np.ndarray:
    """``[batch, len]`` 0/1 mask of real prompt tokens (left padding is 0)."""
    if attention_mask is not None and start_ids is not None:
        raise ValueError("give attention_mask or start_ids, not both")
    b, n = ids.shape
    if start_ids is not None:
        start = to_numpy(start_ids, "start_ids").reshape(-1)
        if start.dtype.kind not in "iu":
            raise TypeError(f"start_ids must hold integers, got dtype {start.dtype}; pass integer indices")
        if start.shape[0] != b:
            raise ValueError(f"start_ids has {start.shape[0]} entries for {b} prompts")
        if (start < 0).any() or (start >= n).any():
            raise ValueError(f"start_ids must be in [0, {n - 1}] (the first real token of each row)")
        return (np.arange(n)[None, :] >= start[:, None]).astype(np.int32)
    if attention_mask is None:
        return np.ones_like(ids, dtype=np.int32)
    m = to_numpy(attention_mask, "attention_mask")
    if m.ndim == 1:
        m = m[None, :]
    if m.shape != ids.shape:
        raise ValueError(
            f"attention_mask shape {m.shape} differs from input_ids shape {ids.shape}; give one 0/1 mask "
            "entry per token"
        )
    if not np.isin(m, (0, 1)).all():
        raise ValueError("attention_mask must hold only 0 and 1 (1 = real token, 0 = left padding)")
    m = m.astype(np.int32)
    empty = np.where(m.sum(1) == 0)[0]
    if empty.size:
        raise ValueError(
            f"row {int(empty[0])} of attention_mask is all zeros: that prompt is empty; give every row at "
            "least one real token (mask 1)"
        )
    if (m[:, -1] == 0).any():
        raise ValueError(
            "attention_mask has padding at the end of a row: aotlm (like transformers generate) expects "
            "left padding; pad prompts on the left"
        )
    return m


def count(value, name: str, allow_none: bool = True) -> int | None:
    """A non-bool integer argument (``max_new_tokens``, ``pad_token_id``, ...): never silently truncated."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__}); pass an int")
    return int(value)


def eos_ids(eos_token_id, max_eos: int) -> np.ndarray:
    """The eos ids as a fixed-size int32 array padded with -1 (the graph's traced eos input)."""
    if eos_token_id is None:
        ids = []
    elif isinstance(eos_token_id, list | tuple | np.ndarray):
        ids = [count(e, "each eos_token_id", allow_none=False) for e in np.asarray(eos_token_id).tolist()]
    else:
        ids = [count(eos_token_id, "eos_token_id", allow_none=False)]
    if len(ids) > max_eos:
        raise ValueError(
            f"at most {max_eos} eos token ids are supported, got {len(ids)}; pass the {max_eos} that matter"
        )
    if any(i < 0 for i in ids):
        raise ValueError(f"eos_token_id must be >= 0, got {ids}; pass real token ids")
    return np.asarray(ids + [-1] * (max_eos - len(ids)), dtype=np.int32)


def padded_batch(
    input_ids, attention_mask, start_ids, vocab_size: int, batch_size: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Checked prompts and their mask, padded to ``batch_size`` rows with copies of row 0 (trimmed
    on return): ``(ids, mask, real rows)``."""
    ids = token_ids(input_ids, vocab_size)
    mask = prompt_mask(ids, attention_mask, start_ids)
    n = ids.shape[0]
    if n > batch_size:
        raise ValueError(
            f"{n} prompts given but the model was compiled for batch_size={batch_size}; "
            "split the batch or load with a larger batch_size"
        )
    if n < batch_size:
        extra = batch_size - n
        ids = np.concatenate([ids, np.repeat(ids[:1], extra, 0)])
        mask = np.concatenate([mask, np.repeat(mask[:1], extra, 0)])
    return ids, mask, n
