"""Typed generation state: the pytrees the decode graphs (``graphs``) and the slot graphs
(``aotlm.batching.slot_graphs``) carry from call to call.

Every field is traced: a device array donated to each graph call and replaced by its output,
so no value ever compiles. What is static is each field's shape, fixed by the graph's
signature: the batch ``B`` (or slots), the KV slots ``S``, the vocabulary ``V``,
``sampling.TOP_LOGPROBS_MAX`` (``K``), ``graphs.MAX_EOS`` and ``graphs.MAX_STOPS`` x
``graphs.MAX_STOP_LEN``. A field missing or misspelt fails where the state is built, not deep
inside tracing. On the host the same classes hold numpy arrays (``model.put_tree`` moves them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import jax

from aotlm.core.sampler_params import ROW, RowParams, as_pytree

Array = Any  # a jax.Array on the device, a numpy array on the host, a ShapeDtypeStruct to lower


def _pytree(cls):
    """Register ``cls`` (a dataclass) with every field a traced leaf."""
    return jax.tree_util.register_dataclass(cls, [f.name for f in dataclasses.fields(cls)], [])


as_pytree()  # the sampler settings inside both states


@dataclass
class SamplerState:
    """What both states share: one row per sequence, its output so far and its sampler settings.

    ``tok [B]``: the token of slot ``idx`` (already recorded); ``done [B]``, ``reason [B]``
    (``graphs.FinishReason`` values); ``last [B]``: the last slot a row may write;
    ``allow [B, ceil(V/32)]`` uint32 the tokens a row may choose next (structured outputs:
    a bitmask the host's grammar fills; all ones = unconstrained); ``bias_ids [B, MAX_LOGIT_BIAS]``
    (-1 padded) / ``bias_val``: a sparse bias added to the scores (OpenAI's ``logit_bias``,
    transformers' ``sequence_bias``);
    ``out [B, S]`` the prompt then the tokens (-1 unwritten), ``logp [B, S]`` their
    log-probabilities, ``top_ids`` / ``top_lp [B, S, K]`` the alternatives; ``seen [B, V]``
    the ids a row has seen (repetition penalty); ``stop [B, MAX_STOPS, MAX_STOP_LEN]`` its stop
    sequences, right-aligned, -2 padded; ``eos [MAX_EOS]`` (-1 padded) and ``pad []``;
    ``params``: the per-row sampler settings (``RowParams``: one ``[B]`` array per "row" entry of
    ``aotlm.core.sampler_params.TABLE``, read by ``aotlm.core.sampling``); ``adapter [B]`` int32
    each row's LoRA adapter slot (``aotlm.models.adapters``; -1: the base model); ``idx`` / ``first``:
    the slot of ``tok`` and of the first generated token (``[]`` in the decode state, where
    every row moves together; ``[B]`` in the slot state).
    """

    tok: Array
    done: Array
    reason: Array
    last: Array
    out: Array
    logp: Array
    top_ids: Array
    top_lp: Array
    seen: Array
    allow: Array
    bias_ids: Array
    bias_val: Array
    stop: Array
    eos: Array
    pad: Array
    params: RowParams
    adapter: Array
    idx: Array
    first: Array

    def replace(self, **changes) -> Any:
        return dataclasses.replace(self, **changes)


@_pytree
@dataclass
class DecodeState(SamplerState):
    """The decode graphs' state (``sample()``): rows move together, one slot per step.

    Adds ``pos [B]`` (model position of ``tok``), ``end [B]`` (the slot a row ended at),
    ``min_end [B]`` (eos masked before this slot: ``min_new_tokens`` / ``min_length``),
    ``limit []`` (the host's stop slot for this call), ``want_logprobs []``, and ``scores`` /
    ``raw [B, V]``: the processed scores and the model's logits the newest token was chosen from
    (transformers' ``output_scores`` / ``output_logits``), written only by the graphs lowered for
    a ``[B, V]`` state (``select_scores``, ``decode_scores``); the others carry ``[B, 1]``.
    """

    pos: Array
    end: Array
    min_end: Array
    limit: Array
    want_logprobs: Array
    scores: Array
    raw: Array


@_pytree
@dataclass
class SlotState(SamplerState):
    """The slot graphs' state (continuous batching): each row a request at its own slot.

    Adds ``counts [B, V]`` (generated-token counts: OpenAI penalties), ``ignore_eos [B]``,
    ``want [B]`` (logprobs asked), ``presence`` / ``frequency [B]`` (OpenAI penalties),
    and ``steps []`` (decode steps of the next call). ``SHARED`` fields belong to the whole batch;
    the others (``row_fields()``) are what ``slot_insert`` copies into a row.
    """

    counts: Array
    ignore_eos: Array
    want: Array
    presence: Array
    frequency: Array
    steps: Array

    SHARED: ClassVar[tuple[str, ...]] = ("eos", "pad", "steps")

    @classmethod
    def row_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.SHARED)


def layout() -> tuple[tuple[str, ...], ...]:
    """The field names of both states and of ``RowParams`` (with dtypes), in order: part of the
    compile-cache fingerprint, since a graph's argument layout follows them."""
    states = tuple(tuple(f.name for f in dataclasses.fields(c)) for c in (DecodeState, SlotState))
    return (*states, tuple(f"{p.name}:{p.dtype}" for p in ROW))
