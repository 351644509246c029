"""Score graphs: the log-probability of every given next token, computed on the device.

Scoring (the log-likelihood of a continuation, the perplexity of a text) needs, at every
position ``t``, ``log softmax(logits_t)[token_{t+1}]`` and whether that token is the argmax.
Moving ``[batch, length, vocab]`` logits to the host would cost ``4 * V`` bytes per token (200 KB
for GPT-2); the ``("score", C, W)`` graph does the log-softmax, the gather and the argmax test
inside, per block of positions, and returns ``[B, C]`` float32 log-probs and ``[B, C]`` flags.

It is a prefill graph with one more input (the targets) and the same buckets: a text that fits
a context bucket is one call; a longer one (up to ``n_positions``) is encoded in chunks, each
reading the KV cache the previous chunks wrote (``buckets.prefill_plan``). Static: the
``ArchConfig``, ``(C, W)`` and the position block (from ``B``, ``C`` and the vocabulary size);
traced: weights, cache, token ids, positions, targets, the chunk's first slot. Under tensor
parallelism the logits stay vocabulary-sharded: the max, the sum of exponentials, the target's
logit and the first argmax are each a shard-local reduction plus one all-reduce.

The graphs are listed by ``graph_keys()`` (and compiled by ``compile()``) when the model is
built with ``scoring=True``; otherwise ``score()`` compiles them on first use (then the compile
cache has them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aotlm.core import buckets as bk
from aotlm.core import sharding
from aotlm.core.contract import GraphHost
from aotlm.models import decoder

LOGITS_BUDGET = 1 << 23  # logits elements per position block (32 MB of float32)


def block_size(batch: int, length: int, vocab: int) -> int:
    """Positions per block: a power of two keeping ``[B, block, V]`` logits within the budget."""
    blk = 1
    while blk * 2 <= length and batch * blk * 2 * vocab <= LOGITS_BUDGET:
        blk *= 2
    return blk


def _lse(logits):
    """(the max, log-sum-exp) over the last axis."""
    mx = jnp.max(logits, -1, keepdims=True)
    return mx, jnp.log(jnp.sum(jnp.exp(logits - mx), -1)) + mx[..., 0]


def _picked(logits, targets):
    iota = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return iota, jnp.sum(jnp.where(iota == targets[..., None], logits, 0.0), -1)


def token_scores(logits, targets):
    """``logits [..., V]`` float32, ``targets [...]`` (-1: none) -> (log-prob of the target, is it
    the first argmax), as ``log_softmax(logits)[target]`` and ``argmax(logits) == target``."""
    v = logits.shape[-1]
    mx, lse = _lse(logits)
    iota, picked = _picked(logits, targets)
    first_max = jnp.min(jnp.where(logits == mx, iota, v), -1)
    valid = targets >= 0
    return jnp.where(valid, picked - lse, 0.0), valid & (first_max == targets)


def ranked_scores(logits, targets, k: int):
    """``logits [..., V]``, ``targets [...]`` (-1: none) -> (the target's log-prob, its rank: 1 +
    the tokens more likely, the ``k`` most likely tokens' ids and log-probs, most likely first):
    vLLM's prompt log-probabilities (of the model's own distribution)."""
    _, lse = _lse(logits)
    _, picked = _picked(logits, targets)
    valid = targets >= 0
    rank = 1 + jnp.sum(logits > picked[..., None], -1, dtype=jnp.int32)
    top_val, top_ids = lax.top_k(logits, min(k, logits.shape[-1]))
    logp = jnp.where(valid, picked - lse, 0.0)
    return logp, jnp.where(valid, rank, 0), top_ids, top_val - lse[..., None]


def blocked(cfg, params, h, targets, fn):
    """``fn(logits [B, blk, V], targets [B, blk])`` over ``h [B, C, D]``'s positions in blocks
    (``block_size``: the logits of a whole prompt never exist at once); each of ``fn``'s outputs
    ``[B, blk, ...]`` comes back as ``[B, C, ...]``."""
    b, c, d = h.shape
    blk = block_size(b, c, cfg.vocab_size)
    n = -(-c // blk)
    pad = n * blk - c
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    tg = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=-1)
    hb = jnp.moveaxis(h.reshape(b, n, blk, d), 1, 0)  # [n, B, blk, D]
    tb = jnp.moveaxis(tg.reshape(b, n, blk), 1, 0)
    out = lax.map(lambda a: fn(decoder.logits(cfg, params, a[0]), a[1]), (hb, tb))
    unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * blk, *x.shape[3:])[:, :c]
    return jax.tree.map(unblock, out)


def score(cfg, width: int, params, cache, tokens, positions, start, targets):
    """Encode ``tokens [B,C]`` at cache slots ``start..`` (as ``graphs.prefill``) and score
    ``targets [B,C]`` (the token after each position, -1 where there is none): returns
    ``logp [B,C]`` float32, ``greedy [B,C]`` bool and the updated cache."""
    old_width = 0 if width == tokens.shape[1] else width
    h, cache = decoder.forward(cfg, params, cache, tokens, positions, start, old_width)
    logp, greedy = blocked(cfg, params, h, targets, token_scores)
    return logp, greedy, cache


def graph_keys(ctx_buckets, tg_buckets) -> list[tuple]:
    """One score graph per prefill shape ``(C, W)``."""
    return [("score", c, w) for c, w in bk.prefill_graph_shapes(ctx_buckets, tg_buckets)]


def lower(model: GraphHost, key: tuple):
    """Lower ``("score", C, W)`` for ``model`` (a ``CompiledModel``)."""
    _, c, w = key
    rep = model.replicated
    cache = model.cache_specs()
    p = model.abstract(model.params)
    out = (rep, rep, model.shardings(cache))
    fn = jax.jit(functools.partial(score, model.cfg, w), donate_argnums=(1,), out_shardings=out)
    tok = jax.ShapeDtypeStruct((model.batch_size, c), jnp.int32, sharding=rep)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    return fn.lower(p, cache, tok, tok, scalar, tok)


@dataclasses.dataclass(frozen=True)
class ScoreOutput:
    """Per-token scores of ``input_ids [n, L]``, aligned with the tokens.

    ``logprobs[i, t]`` = log p(``input_ids[i, t]`` | ``input_ids[i, :t]``), float32; ``is_greedy[i, t]``:
    that token is the argmax there (the first one on ties, as ``torch.argmax``); ``scored[i, t]``:
    the entry exists (a real token with a real token before it: not padding, not a row's first
    token). Entries that are not scored hold 0.0 / False.
    """

    logprobs: np.ndarray
    is_greedy: np.ndarray
    scored: np.ndarray

    def sum(self, start: int | np.ndarray = 0) -> np.ndarray:
        """Sum of log-probs per row over positions ``>= start`` (an int or one per row)."""
        cols = np.arange(self.logprobs.shape[1])[None, :] >= np.reshape(start, (-1, 1))
        return np.where(self.scored & cols, self.logprobs, 0.0).sum(1, dtype=np.float64)


def run(model: GraphHost, ids: np.ndarray, mask: np.ndarray, n: int) -> ScoreOutput:
    """Score the padded batch ``ids [B, L]`` (``mask`` 1 = real token) on ``model``; rows ``< n`` kept.

    The last token is only a target: the graphs encode ``ids[:, :-1]`` and score ``ids[:, 1:]``, so a
    text of ``n_positions + 1`` tokens fits (as lm-eval feeds a window of ``max_length`` tokens and
    scores ``max_length`` predictions).
    """
    b, length = ids.shape
    if length - 1 > model.n_positions:
        raise ValueError(
            f"{length} tokens do not fit n_positions={model.n_positions} (at most n_positions + 1 tokens are "
            "scored at once); score shorter texts, load the model with a larger n_positions, or use "
            "aotlm.text.scoring (rolling windows)"
        )
    real = mask > 0
    scored = np.zeros((b, length), bool)
    scored[:, 1:] = real[:, 1:] & real[:, :-1]
    logp = np.zeros((b, length), np.float32)
    greedy = np.zeros((b, length), bool)
    if length > 1:
        _encode(model, ids[:, :-1], real[:, :-1], np.where(scored[:, 1:], ids[:, 1:], -1), logp, greedy)
    return ScoreOutput(logp[:n], (greedy & scored)[:n], scored[:n])


def _encode(model: GraphHost, tokens, real, targets, logp, greedy) -> None:
    """Run the score graphs over ``tokens [B, T]`` chunk by chunk (``buckets.prefill_plan``); write
    the scores of ``targets[:, t]`` (the token at ``t + 1``) into ``logp`` / ``greedy [:, t + 1]``."""
    positions = np.where(real, np.cumsum(real, 1) - 1, -1).astype(np.int32)
    for step in bk.prefill_plan(tokens.shape[1], model.ctx_buckets, model.tg_buckets):
        end = step.start + step.n_real
        exe = model.executable(("score", step.bucket, step.width))
        lp, gr, model.cache = exe(
            model.params,
            model.cache,
            model.put(_chunk(tokens, step, 0).astype(np.int32)),
            model.put(_chunk(positions, step, -1)),
            model.put(np.int32(step.start)),
            model.put(_chunk(targets, step, -1).astype(np.int32)),
        )
        valid = targets[:, step.start : end] >= 0
        logp[:, step.start + 1 : end + 1] = np.where(valid, sharding.fetch(lp)[:, : step.n_real], 0.0)
        greedy[:, step.start + 1 : end + 1] = valid & sharding.fetch(gr)[:, : step.n_real]


def _chunk(a: np.ndarray, step: bk.PrefillStep, fill: int) -> np.ndarray:
    """Columns ``step.start ..`` of ``a``: the step's real tokens, right-padded to its bucket."""
    real = a[:, step.start : step.start + step.n_real]
    return np.pad(real, ((0, 0), (0, step.bucket - step.n_real)), constant_values=fill)
