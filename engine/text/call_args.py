"""The pipeline's call arguments read as transformers reads them: prompts, the return flags, token
ids, lengths, and ``num_return_sequences``' copies; each wrong value is a one-line error naming it."""

from __future__ import annotations

import dataclasses
import operator

from aotlm.generate.params import PER_ROW_FIELDS, GenerationConfig
from aotlm.text.defaults import NO_EFFECT

PER_PROMPT = (*PER_ROW_FIELDS, "seed")  # arguments that take one value per prompt


def text_prompts(text_inputs) -> list[str]:
    listed = isinstance(text_inputs, list | tuple)
    wrong = [p for p in text_inputs if not isinstance(p, str)] if listed else [text_inputs]
    if wrong:
        got = ("a list holding " if listed else "") + type(wrong[0]).__name__
        raise TypeError(
            "text_inputs must be a string, a list of strings, a chat (a list of {'role', 'content'} "
            f"messages) or a list of chats; got {got}"
        )
    return list(text_inputs)


def return_type(full_text: bool | None, text: bool | None, tensors: bool | None) -> str:
    """transformers' reading of the three flags: "full", "new" or "ids" (the first one given wins,
    and they exclude each other, as in its ``_sanitize_parameters``)."""
    if full_text is not None:
        if text is not None or tensors is not None:
            other = "return_text" if text is not None else "return_tensors"
            raise ValueError(f"return_full_text is mutually exclusive with {other}")
        return "full" if full_text else "new"
    if tensors is not None:
        if text is not None:
            raise ValueError("return_text is mutually exclusive with return_tensors")
        return "ids"
    return "full"


def integer(value, error: str) -> int:
    """``value`` as an int (numpy's too); a float, a string or a bool is ``TypeError(error)``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(error)
    return operator.index(value)


def token_ids(given, name: str, default: list) -> list:
    """``eos_token_id`` given to a call: one id or a list of them (None: ``default``)."""
    if given is None:
        return default
    error = f"{name} must be a token id (an int) or a list of them, got {given!r}"
    ids = [given] if hasattr(given, "__index__") else given
    if not isinstance(ids, list | tuple):
        raise TypeError(error)
    return [integer(t, error) for t in ids]


def max_length(value) -> int | None:
    error = f"max_length must be an int >= 1 (prompt + new tokens), got {value!r}"
    if value is not None and integer(value, error) < 1:
        raise TypeError(error)
    return None if value is None else operator.index(value)


def repeated(kwargs: dict, n: int, k: int, sampling: bool) -> dict:
    """``kwargs`` for each of ``n`` prompts repeated ``k`` times (``num_return_sequences``): per-prompt
    lists repeated, and a given seed made one per copy (seed + j), so the copies differ."""
    if k == 1:
        return kwargs
    if not sampling:
        raise ValueError(
            f"greedy search does not support num_return_sequences different than 1 (got {k}): every "
            "copy would be the same; pass do_sample=True"
        )
    out = {}
    for key, v in kwargs.items():
        listed = key in PER_PROMPT and isinstance(v, list | tuple)
        if listed and len(v) != n:
            raise ValueError(f"{key} has {len(v)} values for {n} prompts; give one value or one per prompt")
        out[key] = [x for x in v for _ in range(k)] if listed else v
    seed = kwargs.get("seed")
    if seed is not None:  # copy j gets seed + j, as sample(num_return_sequences=k) gives its copies
        seeds = seed if isinstance(seed, list | tuple) else [seed] * n
        out["seed"] = [(int(s) + j) % 2**32 for s in seeds for j in range(k)]
    return out


def new_tokens(value) -> int | None:
    """A ``max_new_tokens`` given to a call: None or an int (numpy ints too; 3.5, "3", True: no counts)."""
    if value is None:
        return None
    return integer(value, f"max_new_tokens must be an int (or one per prompt), got {value!r}")


def pad_id(given) -> int | None:
    """A ``pad_token_id`` given to a call: None or one token id."""
    if given is None:
        return None
    return integer(given, f"pad_token_id must be a token id (an int), got {given!r}")


def return_sequences(kwargs: dict) -> int:
    """``num_return_sequences`` taken out of ``kwargs`` (default 1)."""
    k = kwargs.pop("num_return_sequences", None)
    k = 1 if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_return_sequences must be an int >= 1, got {k!r}")
    return k


def _is_set(value, default) -> bool:
    if value is None or value is default:
        return False
    try:
        return bool(value != default)
    except ValueError:  # an array of per-row values
        return True


def with_config(kwargs: dict) -> dict:
    """``kwargs`` with a ``generation_config`` given to the call spread into keywords (the ones given
    win): aotlm's ``GenerationConfig`` (its fields set away from the defaults) or transformers' (what
    it sets); a field the pipeline does not apply is then named by the keyword check."""
    config = kwargs.get("generation_config")
    if config is None:
        return kwargs
    if isinstance(config, GenerationConfig):
        fields = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if _is_set(getattr(config, f.name), f.default)
        }
    elif callable(getattr(config, "to_diff_dict", None)):  # transformers.GenerationConfig
        fields = {k: v for k, v in config.to_diff_dict().items() if k not in NO_EFFECT}
    else:
        raise TypeError(
            "generation_config must be an aotlm.GenerationConfig or a transformers GenerationConfig, "
            f"got {type(config).__name__}"
        )
    rest = {k: v for k, v in kwargs.items() if k != "generation_config" and v is not None}
    return {**fields, **rest}
