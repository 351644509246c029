"""Generation strategies beyond one greedy/sampled row per prompt, routed from ``sample()``.

``CompiledModel`` knows three graph kinds (prefill, select, decode);
the modules here add their own kinds, all compiled and cached through ``model.executable``:

* ``aotlm.generate.broadcast``: ``gather`` (copy KV-cache rows), ``bprefill`` (prefill of
  ``prompt_batch_size`` rows) for ``num_return_sequences`` and beam search;
* ``aotlm.generate.beam``: ``beam_init``, ``beam`` per token bucket;
* ``aotlm.generate.speculative``: ``spec`` (target + draft rounds in one loop) per pair of bucket widths;
* ``aotlm.generate.lookup``: ``lookup`` (prompt lookup rounds, no draft) per token bucket.

Graphs a model was built for (``prompt_batch_size=``, ``num_beams=`` in ``from_pretrained``)
are listed by ``graph_keys()`` and compiled by ``compile()``; the speculative ones depend on the
draft, so ``SpeculativeGenerator.graph_keys()`` / ``compile()`` list and compile them; other ones
compile on first use (once; then cached on disk).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import numpy as np

from aotlm.core import inputs
from aotlm.generate import beam, broadcast, lookup, speculative
from aotlm.generate.params import PER_ROW_FIELDS as PER_ROW
from aotlm.generate.strategies import StrategyHost

KINDS = {  # graph kind -> the module that lowers it
    "gather": broadcast,
    "bprefill": broadcast,
    "beam_init": beam,
    "beam": beam,
    "spec": speculative,
    "lookup": lookup,
}


def graph_keys(model: StrategyHost) -> list[tuple]:
    keys = []
    if model.strategies.prompt_batch_size or model.strategies.num_beams > 1:
        keys += broadcast.graph_keys(model)
    return keys + beam.graph_keys(model)  # speculative graphs depend on the draft: SpeculativeGenerator


def lower(model: StrategyHost, key: tuple):
    return KINDS[key[0]].lower(model, key)


def _expand(value, name: str, n: int, r: int):
    """A per-row argument given once per prompt, repeated for the prompt's ``r`` rows."""
    if isinstance(value, Sequence | np.ndarray) and not isinstance(value, str | bytes) and len(value) == n:
        return np.repeat(np.asarray(value), r, 0)
    return value


def _seeds(seed, n: int, r: int):
    """Row ``i*r + j`` (prompt ``i``, copy ``j``) gets seed ``seed_i + j``: copies differ, reproducibly."""
    if seed is None:
        return None
    base = np.asarray(seed, np.int64)
    base = np.full(n, base) if base.ndim == 0 else base
    if base.shape != (n,):
        raise ValueError(f"seed has {base.size} values for {n} prompts; give one value or one per prompt")
    return ((np.repeat(base, r) + np.tile(np.arange(r), n)) % 2**32).tolist()


def return_sequences(model: StrategyHost, sample, args: dict, r: int):
    """``num_return_sequences=r``: each prompt's rows repeat it; its prompt is encoded once."""
    ids = inputs.token_ids(args.pop("input_ids"), model.cfg.vocab_size)
    mask = inputs.prompt_mask(ids, args.pop("attention_mask", None), args.pop("start_ids", None))
    n = ids.shape[0]
    if n * r > model.batch_size:
        raise ValueError(
            f"{n} prompt(s) x num_return_sequences={r} = {n * r} rows exceed the compiled batch_size="
            f"{model.batch_size}; compiled batch = runtime batch x num_return_sequences x num_beams: "
            "load the model with a larger batch_size"
        )
    for name in (*PER_ROW, "adapter"):
        if name in args:
            args[name] = _expand(args[name], name, n, r)
    if "seed" in args:
        args["seed"] = _seeds(args["seed"], n, r)
    with model.strategies.broadcasting(r, n * r):
        return sample(model, np.repeat(ids, r, 0), attention_mask=np.repeat(mask, r, 0), **args)


def _broadcast_rows(model: StrategyHost, args: tuple, kwargs: dict) -> int:
    """transformers-neuronx's context broadcasting: a model built with ``prompt_batch_size=P``
    and ``batch_size=B`` continues ``P`` prompts in ``B / P`` rows each (output batch ``B``)."""
    pb = model.strategies.prompt_batch_size
    ids = args[0] if args else kwargs.get("input_ids")
    if not pb or pb == model.batch_size or ids is None or model.batch_size % pb:
        return 1
    return model.batch_size // pb if inputs.token_ids(ids, model.cfg.vocab_size).shape[0] == pb else 1


def routed(sample):
    """Decorator for ``sample``: ``num_return_sequences``, ``num_beams``, ``draft_model``,
    ``prompt_lookup_num_tokens``."""
    sig = inspect.signature(sample)

    @functools.wraps(sample)
    def wrapper(
        model,
        *args,
        num_return_sequences: int | None = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        draft_model=None,
        speculation_length: int | None = None,
        prompt_lookup_num_tokens: int | None = None,
        max_matching_ngram_size: int | None = None,
        **kwargs,
    ):
        if num_return_sequences is None:
            num_return_sequences = _broadcast_rows(model, args, kwargs) if num_beams == 1 else 1
        if (
            draft_model is None
            and speculation_length is None
            and num_beams == 1
            and num_return_sequences == 1
            and prompt_lookup_num_tokens is None
        ):
            if max_matching_ngram_size is not None:
                raise ValueError(
                    "max_matching_ngram_size is prompt lookup's: give prompt_lookup_num_tokens too"
                )
            return sample(model, *args, **kwargs)
        drafted = (
            draft_model is not None or speculation_length is not None or prompt_lookup_num_tokens is not None
        )
        if kwargs.get("adapter") is not None and (num_beams > 1 or drafted):
            raise ValueError("LoRA adapters (adapter=) run without num_beams, a draft model or prompt lookup")
        if kwargs.get("constraints") is not None:
            why = (
                "constraints (structured outputs) run without num_beams, num_return_sequences > 1 or a draft"
            )
            raise ValueError(why)
        named = {k: v for k, v in kwargs.items() if k in sig.parameters}
        bound = sig.bind_partial(model, *args, **named).arguments
        bound.pop("self", None)
        call = {k: v for k, v in bound.items() if v is not None}
        call.update(call.pop("generation_kwargs", None) or {})
        call.update({k: v for k, v in kwargs.items() if k not in sig.parameters})
        if not isinstance(num_return_sequences, int) or num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be an int >= 1, got {num_return_sequences!r}")
        with model.lock:
            if drafted and (num_beams != 1 or num_return_sequences != 1):
                raise ValueError("speculative decoding runs without num_beams / num_return_sequences")
            if prompt_lookup_num_tokens is not None:
                if draft_model is not None or speculation_length is not None:
                    raise ValueError("give a draft_model or prompt_lookup_num_tokens, not both")
                return lookup.sample_with_lookup(
                    model, prompt_lookup_num_tokens, max_matching_ngram_size, call
                )
            if draft_model is not None or speculation_length is not None:
                return speculative.sample_with_draft(model, draft_model, speculation_length, call)
            if num_beams > 1:
                return beam.sample(
                    model, call, num_beams, num_return_sequences, length_penalty, early_stopping
                )
            return return_sequences(model, sample, call, num_return_sequences)

    return wrapper
