"""A checkpoint's ``generation_config.json`` as the defaults of the text front ends.

transformers' ``pipeline()`` and ``generate()`` take their defaults (``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``max_new_tokens``, ...) from the
checkpoint's ``generation_config.json``, with transformers' own defaults for the fields it leaves
unset (``top_k=50`` when sampling, for instance). ``aotlm.pipeline``, ``aotlm generate`` and
``HuggingFaceGenerationModelAdapter`` do the same; explicit arguments win. Without the file
generation is greedy (``model.sample()`` never reads the file: like transformers-neuronx's).
"""

from __future__ import annotations

import logging
import os

from aotlm.core import sampler_params
from aotlm.generate import bans
from aotlm.text.tokens import generation_defaults

log = logging.getLogger("aotlm")

# transformers' defaults for the fields aotlm's sampler implements (GenerationConfig())
HF_DEFAULTS = sampler_params.HF_DEFAULTS
WARPERS = sampler_params.WARPERS
LENGTH_KEYS = ("max_new_tokens", "max_length")
# fields a generation config may set that change nothing aotlm generates or returns
NO_EFFECT = frozenset(
    {
        "bos_token_id",
        "decoder_start_token_id",
        "transformers_version",
        "_from_model_config",
        "use_cache",
        "cache_implementation",
        "output_scores",
        "output_logits",
        "output_attentions",
        "output_hidden_states",
        "return_dict_in_generate",
    }
)
# ... and in a checkpoint's generation_config.json also these (eos: read by tokens.eos_ids; the rest
# belong to beam search and several sequences, which the defaults do not start)
_INERT = NO_EFFECT | {
    "eos_token_id",
    "pad_token_id",
    "num_beams",
    "num_return_sequences",
    "length_penalty",
    "early_stopping",
}


def sampling_defaults(checkpoint: str | os.PathLike) -> dict:
    """``sample()`` keyword arguments from ``checkpoint/generation_config.json`` ({} without one).

    Sampling fields it leaves unset take transformers' defaults (so ``{"do_sample": true}``
    samples with ``top_k=50``, as transformers does); length fields only when set. Fields aotlm
    cannot apply are logged once and left out (explicit arguments would be refused instead).
    """
    raw = generation_defaults(checkpoint)
    if not raw:
        return {}
    out = {k: v for k, v in HF_DEFAULTS.items() if v is not None}
    for k, v in raw.items():
        if v is None:
            continue
        if k in HF_DEFAULTS or k in LENGTH_KEYS or k in bans.FIELDS:
            out[k] = v
        elif k not in _INERT:
            log.warning("%s/generation_config.json: %s=%r is not applied by aotlm", checkpoint, k, v)
    return out


def merged(defaults: dict, given: dict) -> dict:
    """``given`` (explicit, non-None) over ``defaults``; when the result is greedy, the sampling
    warpers that came from the defaults are dropped (they change nothing and would only clutter
    what is reported)."""
    given = {k: v for k, v in given.items() if v is not None}
    out = {**defaults, **given}
    if not out.get("do_sample"):
        for k in WARPERS:
            if k not in given:
                out.pop(k, None)
    return out
