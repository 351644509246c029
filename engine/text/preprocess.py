"""The text-generation pipeline's prompt options, as ``transformers.pipeline("text-generation")`` has them.

* ``prefix``: text put before every text prompt when it is encoded (the records' ``generated_text``
  starts with the prompt as given); a total length (``max_length``, ``min_length``) then counts the
  prefix's tokens too, as transformers adds them.
* ``handle_long_generation="hole"``: a prompt too long to leave room for its new tokens loses its
  first tokens (transformers' cut); the room is the model's compiled ``n_positions`` (or the
  tokenizer's ``model_max_length``, when smaller).
* ``truncation``, ``padding``, ``tokenizer_encode_kwargs``: the tokenizer's own keywords, applied
  as transformers applies them to each prompt (``truncation`` with a pipeline ``max_length`` cuts the
  prompt to it). Pads the tokenizer adds are dropped: the pipeline pads its batches itself. For a chat,
  the other keys of ``tokenizer_encode_kwargs`` are its template's variables, as transformers passes
  them to ``apply_chat_template`` (Qwen3's ``{"enable_thinking": False}``).
"""

from __future__ import annotations

from collections.abc import Sequence

# the tokenizer keywords that shape one prompt's ids (others return more than ids or nothing of use here)
ENCODE_KEYS = ("add_special_tokens", "truncation", "max_length", "padding", "split_special_tokens", "verbose")
# apply_chat_template's own keywords, which the pipeline sets (not template variables)
TEMPLATE_OWN = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt")
TEMPLATE_OWN += ("tokenize",)
TEMPLATE_OWN += ("continue_final_message", "return_tensors", "return_dict", "tokenizer_kwargs")


def tokenizer_kwargs(truncation, padding, max_length, encode_kwargs, chat: bool = False) -> tuple[dict, dict]:
    """``(tokenizer keywords, chat template variables)`` as transformers builds them: ``truncation``,
    ``padding`` and (with ``truncation``) the pipeline's ``max_length``, then ``tokenizer_encode_kwargs``,
    whose other keys are, for a chat, variables of its template (``{"enable_thinking": False}``)."""
    kw = {"truncation": truncation, "padding": padding}
    if truncation:
        kw["max_length"] = max_length
    kw = {k: v for k, v in kw.items() if v is not None}
    if encode_kwargs is None:
        return kw, {}
    if not isinstance(encode_kwargs, dict):
        raise TypeError(f"tokenizer_encode_kwargs must be a dict, got {type(encode_kwargs).__name__}")
    other = {k: v for k, v in encode_kwargs.items() if k not in ENCODE_KEYS}
    if other and not chat:
        raise TypeError(
            f"tokenizer_encode_kwargs does not take {sorted(map(str, other))} with text prompts; it takes: "
            f"{list(ENCODE_KEYS)} (other keys are a chat template's variables)"
        )
    own = sorted(str(k) for k in other if k in TEMPLATE_OWN)
    if own:
        raise TypeError(f"tokenizer_encode_kwargs may not set {own}: the pipeline's own arguments set them")
    return {**kw, **{k: v for k, v in encode_kwargs.items() if k in ENCODE_KEYS}}, other


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
