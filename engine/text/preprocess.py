"""The text-generation pipeline's prompt options, as ``transformers.pipeline("text-generation")`` has them.

* ``prefix``: text put before every text prompt when it is encoded (the records' ``generated_text``
  starts with the prompt as given); a total length (``max_length``, ``min_length``) then counts the
  prefix's tokens too, as transformers adds them.
* ``handle_long_generation="hole"``: a prompt too long to leave room for its new tokens loses its
  first tokens (transformers' cut); the room is the model's compiled ``n_positions`` (or the
  tokenizer's ``model_max_length``, when smaller).
* ``truncation``, ``padding``, ``tokenizer_encode_kwargs``: the tokenizer's own keywords, applied
  as transformers applies them to each prompt (``truncation`` with a pipeline ``max_length`` cuts the
  prompt to it). Pads the tokenizer adds are dropped: the pipeline pads its batches itself.
"""

from __future__ import annotations

from collections.abc import Sequence

# the tokenizer keywords that shape one prompt's ids (others return more than ids or nothing of use here)
ENCODE_KEYS = ("add_special_tokens", "truncation", "max_length", "padding", "split_special_tokens", "verbose")


def tokenizer_kwargs(truncation, padding, max_length, encode_kwargs) -> dict:
    """The keywords the pipeline's tokenizer call takes, as transformers builds them: ``truncation``,
    ``padding`` and (with ``truncation``) the pipeline's ``max_length``, then ``tokenizer_encode_kwargs``."""
    kw = {"truncation": truncation, "padding": padding}
    if truncation:
        kw["max_length"] = max_length
    kw = {k: v for k, v in kw.items() if v is not None}
    if encode_kwargs is None:
        return kw
    if not isinstance(encode_kwargs, dict):
        raise TypeError(f"tokenizer_encode_kwargs must be a dict, got {type(encode_kwargs).__name__}")
    unknown = sorted(str(k) for k in encode_kwargs if k not in ENCODE_KEYS)
    if unknown:
        raise TypeError(f"tokenizer_encode_kwargs does not take {unknown}; it takes: {list(ENCODE_KEYS)}")
    return {**kw, **encode_kwargs}


def hole_check(handle_long_generation) -> bool:
    """Whether the prompts are cut to fit (``"hole"``); None: they are refused when too long."""
    if handle_long_generation is None:
        return False
    if handle_long_generation != "hole":
        raise ValueError(
            f"handle_long_generation={handle_long_generation!r} is not a valid value; give None or 'hole'"
        )
    return True


def hole(rows: Sequence[list[int]], new: Sequence[int], limit: int) -> list[list[int]]:
    """Each prompt cut from the left so that it and its ``new`` tokens fit in ``limit`` positions."""
    out = []
    for i, (row, n) in enumerate(zip(rows, new, strict=True)):
        keep = limit - n
        if keep <= 0:
            raise ValueError(
                f"prompt {i}: handle_long_generation='hole' cannot fit {n} new tokens in the model's {limit} "
                "positions; lower max_new_tokens"
            )
        out.append(list(row[-keep:]) if len(row) > keep else list(row))
    return out


def shifted(kwargs: dict, offset: int) -> dict:
    """``min_length`` (one value or one per prompt) counting ``offset`` more tokens, unless
    ``min_new_tokens`` is set (transformers' rule for a prefix's tokens)."""
    value = kwargs.get("min_length")
    if not offset or value is None or kwargs.get("min_new_tokens") is not None:
        return kwargs

    def shift(v):  # another type is left to sample()'s own check
        return v + offset if isinstance(v, int) and not isinstance(v, bool) else v

    many = isinstance(value, list | tuple)
    return {**kwargs, "min_length": [shift(v) for v in value] if many else shift(value)}
