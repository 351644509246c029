"""Names and defaults of the generation parameters: one list, shared by sample() and every front end.

Kept free of JAX so that command-line parsing and record validation stay cheap to import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GenerationConfig:
    """transformers' generation parameters (greedy by default: no surprise top_k=50).

    Also ``aotlm.config.GenerationConfig`` (transformers-neuronx's ``on_device_generation``): one
    class, so a setting means the same thing wherever it is given. ``max_length`` (prompt + new
    tokens) applies when neither ``max_new_tokens`` nor ``sequence_length`` is given;
    ``min_new_tokens`` / ``min_length`` mask the eos ids until reached (transformers' processors).
    """

    do_sample: Any = False
    temperature: Any = 1.0
    top_k: Any = 0
    top_p: Any = 1.0
    min_p: Any = 0.0
    repetition_penalty: Any = 1.0
    no_repeat_ngram_size: Any = 0
    seed: Any = None
    eos_token_id: Any = None
    pad_token_id: int | None = None
    stop_sequences: Any = None
    max_new_tokens: Any = None
    max_length: int | None = None
    min_new_tokens: Any = 0
    min_length: Any = 0
    top_logprobs: int = 0

    def replace(self, **kw) -> GenerationConfig:
        return dataclasses.replace(self, **kw)


FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}


@dataclass(frozen=True)
class SamplingParams:
    """One serving request's settings, OpenAI-named (checked by ``aotlm.generate.slots.check``).

    ``temperature == 0`` is greedy (OpenAI); ``stop_token_ids`` are token-id stop sequences
    checked in the graph (text stop strings are the HTTP layer's job); ``logprobs=k`` returns
    each token's log-probability and its ``k`` most likely alternatives (``k`` may be 0);
    ``logit_bias`` ``(token id, value)`` pairs are added to the logits (OpenAI's, up to 300).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


# the sampling settings (one value or one per row) with their greedy defaults
SAMPLING_FIELDS = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_new_tokens",
    "seed",
)
GREEDY_DEFAULTS = {k: getattr(GenerationConfig(), k) for k in SAMPLING_FIELDS}
# settings that belong to a prompt (and follow it when its row is repeated or reordered)
PER_ROW_FIELDS = ("max_new_tokens",) + SAMPLING_FIELDS[:-1]
