"""Context broadcasting: encode each distinct prompt once, copy its KV-cache rows on device.

``sample(prompts, num_return_sequences=R)`` and beam search continue every prompt in ``R``
(or ``num_beams``) batch rows, grouped per prompt as transformers does (rows
``i*R .. i*R+R-1`` continue prompt ``i``). Instead of encoding each prompt ``R`` times, the
distinct prompts are encoded once and a ``("gather",)`` graph copies cache rows
(``row r <- row src[r]``) on device: no re-encoding, no host copy of the cache.

With ``prompt_batch_size=P`` (transformers-neuronx's name) the prompts are encoded by
prefill graphs compiled for ``P`` rows only (``("bprefill", P, C, W)``), so the prefill
compute is ``P`` rows instead of the compiled batch: with ``batch_size=8, prompt_batch_size=2``
two prompts x 4 continuations cost a 2-row prefill. Without it the distinct prompts go
through the ordinary (full-batch) prefill graphs, still once, then the same gather.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax

from aotlm.core import buckets as bk
from aotlm.core import graphs, sharding
from aotlm.generate.strategies import StrategyHost


def graph_keys(model: StrategyHost) -> list[tuple]:
    keys = [("gather",)]
    pb = model.strategies.prompt_batch_size
    if pb:
        keys += [
            ("bprefill", pb, c, w) for c, w in bk.prefill_graph_shapes(model.ctx_buckets, model.tg_buckets)
        ]
    return keys


def gather_rows(cache, src):
    """``cache`` with row ``r`` replaced by row ``src[r]`` (every layer and the positions table)."""
    take = lambda a: jax.numpy.take(a, src, axis=0)
    return {"k": [take(a) for a in cache["k"]], "v": [take(a) for a in cache["v"]], "pos": take(cache["pos"])}


def prefill_rows(cfg, width, rows, params, cache, tokens, positions, start, last):
    """``graphs.prefill`` over the first ``rows`` cache rows only (``tokens [rows, C]``)."""
    sub = jax.tree.map(lambda a: a[:rows], cache)
    logits, sub = graphs.prefill(cfg, width, params, sub, tokens, positions, start, last)
    cache = jax.tree.map(lambda a, s: lax.dynamic_update_slice(a, s, (0,) * a.ndim), cache, sub)
    return logits, cache


def lower(model: StrategyHost, key: tuple):
    p, cache = model.abstract(model.params), model.cache_specs()
    rep = model.replicated
    out_cache = model.shardings(cache)
    if key[0] == "gather":
        src = jax.ShapeDtypeStruct((model.batch_size,), np.int32, sharding=rep)
        return jax.jit(gather_rows, donate_argnums=(0,), out_shardings=out_cache).lower(cache, src)
    _, rows, c, w = key
    tok = jax.ShapeDtypeStruct((rows, c), np.int32, sharding=rep)
    scalar = jax.ShapeDtypeStruct((), np.int32, sharding=rep)
    fn = jax.jit(
        functools.partial(prefill_rows, model.cfg, w, rows),
        donate_argnums=(1,),
        out_shardings=(rep, out_cache),
    )
    return fn.lower(p, cache, tok, tok, scalar, scalar)


def _encode_rows(model: StrategyHost, ids: np.ndarray, mask: np.ndarray, rows: int):
    """The prefill steps of ``model.encode`` on ``rows`` (< batch) prompt rows."""
    positions = np.where(mask > 0, np.cumsum(mask, 1) - 1, -1).astype(np.int32)
    out = None
    for step in bk.prefill_plan(ids.shape[1], model.ctx_buckets, model.tg_buckets):
        end = step.start + step.n_real
        tok = np.zeros((rows, step.bucket), np.int32)
        pos = np.full((rows, step.bucket), -1, np.int32)
        tok[:, : step.n_real] = ids[:, step.start : end]
        pos[:, : step.n_real] = positions[:, step.start : end]
        exe = model.executable(("bprefill", rows, step.bucket, step.width))
        put = model.put
        out = exe(
            model.params,
            model.cache,
            put(tok),
            put(pos),
            put(np.int32(step.start)),
            put(np.int32(step.n_real - 1)),
        )
        model.cache = out[-1]
    return (*out[:-1], positions)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([x, np.repeat(x[:1], rows - x.shape[0], 0)]) if x.shape[0] < rows else x


def encode(
    model: StrategyHost, plain_encode, ids: np.ndarray, mask: np.ndarray, group: int, n_rows: int, lora=None
):
    """``model.encode`` for ``ids`` whose rows ``i*group .. i*group+group-1`` repeat prompt ``i``.

    ``n_rows`` rows are real (the rest pad the compiled batch). Returns exactly what
    ``plain_encode(ids, mask)`` would: device outputs with one row per batch row, then positions.
    ``lora [B]`` (each row's adapter slot) repeats like the prompts.
    """
    b = model.batch_size
    n_prompts = -(-n_rows // group)
    first = np.arange(n_prompts) * group
    pb = model.strategies.prompt_batch_size
    if pb and n_prompts <= pb and (lora is None or (lora < 0).all()):
        out = _encode_rows(model, _pad_rows(ids[first], pb), _pad_rows(mask[first], pb), pb)
    else:
        rows = None if lora is None else _pad_rows(lora[first], b)
        out = plain_encode(model, _pad_rows(ids[first], b), _pad_rows(mask[first], b), rows)
    src = np.zeros(b, np.int32)
    src[:n_rows] = np.arange(n_rows) // group
    model.cache = model.executable(("gather",))(model.cache, model.put(src))
    device, positions = out[:-1], out[-1]
    gathered = tuple(model.put(np.take(sharding.fetch(x), src, axis=0)) for x in device)
    return (*gathered, np.take(positions, src, axis=0))


def encoder(plain_encode):
    """Decorator for ``CausalLMForSampling.encode``: broadcast while a request holds
    ``model.strategies.broadcasting``."""

    @functools.wraps(plain_encode)
    def wrapper(model: StrategyHost, ids: np.ndarray, mask: np.ndarray, lora=None):
        plan = model.strategies.broadcast
        if plan is None:
            return plain_encode(model, ids, mask, lora)
        group, n_rows = plan
        return encode(model, plain_encode, ids, mask, group, n_rows, lora)

    return wrapper
