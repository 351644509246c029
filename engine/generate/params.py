"""The two parameter classes of a request: transformers' ``GenerationConfig`` (``sample()``, the
text front ends, batch records) and OpenAI's ``SamplingParams`` (one serving request).

Both take their sampling fields from ``aotlm.core.sampler_params.TABLE`` (names, defaults), so a
parameter added there appears in both; the fields here are the rest of a request. Kept free of
JAX so that command-line parsing and record validation stay cheap to import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aotlm.core import sampler_params as sp


def _replace(self, **kw: Any) -> Any:
    return dataclasses.replace(self, **kw)


def _pytype(p: sp.Param) -> Any:
    kind = bool if p.dtype == "bool" else int if p.integer else float
    return kind if p.default is not None else kind | None


def _derived(name: str, doc: str, sampling: list, rest: list) -> type:
    """A frozen dataclass of ``sampling`` fields (from the table) then ``rest``."""
    return dataclasses.make_dataclass(
        name,
        sampling + rest,
        frozen=True,
        namespace={"replace": _replace, "__doc__": doc, "__module__": __name__},
    )


GenerationConfig = _derived(
    "GenerationConfig",
    """transformers' generation parameters (greedy by default: no surprise top_k=50).

    The sampling fields are ``sampler_params.TABLE``'s transformers names (``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``seed``, ``min_new_tokens``, ``min_length``, ...), each one value
    or one per row. Also ``aotlm.config.GenerationConfig`` (transformers-neuronx's
    ``on_device_generation``): one class, so a setting means the same thing wherever it is given.
    ``max_length`` (prompt + new tokens) applies when neither ``max_new_tokens`` nor
    ``sequence_length`` is given; ``min_new_tokens`` / ``min_length`` mask the eos ids until
    reached (transformers' processors). ``suppress_tokens``, ``begin_suppress_tokens`` (token ids) and
    ``bad_words_ids`` (token-id lists) ban tokens for every row (``aotlm.generate.bans``);
    ``sequence_bias`` (``[[token ids], bias]`` pairs) biases them (``aotlm.generate.sequence_bias``).
    """,
    [(p.hf, Any, dataclasses.field(default=p.default)) for p in sp.TABLE if p.hf],
    [
        ("eos_token_id", Any, dataclasses.field(default=None)),
        ("pad_token_id", int | None, dataclasses.field(default=None)),
        ("stop_sequences", Any, dataclasses.field(default=None)),
        ("max_new_tokens", Any, dataclasses.field(default=None)),
        ("max_length", int | None, dataclasses.field(default=None)),
        ("top_logprobs", int, dataclasses.field(default=0)),
        ("suppress_tokens", Any, dataclasses.field(default=None)),
        ("begin_suppress_tokens", Any, dataclasses.field(default=None)),
        ("bad_words_ids", Any, dataclasses.field(default=None)),
        ("sequence_bias", Any, dataclasses.field(default=None)),
    ],
)

FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}

SamplingParams = _derived(
    "SamplingParams",
    """One serving request's settings, OpenAI-named (checked by ``aotlm.batching.slots.check``).

    The sampling fields are ``sampler_params.TABLE``'s OpenAI names (``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
    ``seed``, ...). ``temperature == 0`` is greedy (OpenAI); ``stop_token_ids`` are token-id stop
    sequences checked in the graph (text stop strings are the HTTP layer's job); ``logprobs=k``
    returns each token's log-probability and its ``k`` most likely alternatives (``k`` may be 0);
    ``logit_bias`` ``(token id, value)`` pairs are added to the logits (OpenAI's, up to 300);
    ``prompt_logprobs=k`` (vLLM's) reports each prompt token's log-probability, rank and ``k``
    most likely alternatives under the model's own distribution (a model built with
    ``prompt_logprobs=True``; the prompt is then encoded whole, no prefix reused); ``embed``: the
    request is its prompt's embedding (a model built with ``embeddings=True``; nothing generated);
    ``adapter``: a loaded LoRA adapter's name (None: the base model; the server's ``model`` field).
    """,
    [("max_tokens", int, dataclasses.field(default=16))]
    + [(p.openai, _pytype(p), dataclasses.field(default=p.default)) for p in sp.TABLE if p.openai],
    [
        ("stop_token_ids", tuple[tuple[int, ...], ...], dataclasses.field(default=())),
        ("ignore_eos", bool, dataclasses.field(default=False)),
        ("logprobs", int | None, dataclasses.field(default=None)),
        ("logit_bias", tuple[tuple[int, float], ...], dataclasses.field(default=())),
        ("prompt_logprobs", int | None, dataclasses.field(default=None)),
        ("embed", bool, dataclasses.field(default=False)),
        ("adapter", str | None, dataclasses.field(default=None)),
    ],
)

# the sampling settings (one value or one per row) with their greedy defaults
SAMPLING_FIELDS = sp.HF_NAMES
GREEDY_DEFAULTS = sp.GREEDY
# settings that belong to a prompt (and follow it when its row is repeated or reordered)
PER_ROW_FIELDS = ("max_new_tokens",) + tuple(k for k in SAMPLING_FIELDS if k != "seed")
