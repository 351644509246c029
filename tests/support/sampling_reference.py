"""The sampler's distribution computed the plain way (full sorts, as transformers' warpers do): the
oracle ``aotlm.core.sampling.sort_free_logprobs`` and the draws are tested against."""

import jax
import jax.numpy as jnp

from aotlm.core.sampling import NEG, sampled_rows


def processed_logprobs(scores, params):
    """Log-probabilities of the distribution a row draws from, with HF's masks (-inf), exactly.

    ``scores`` are penalized. Greedy rows get ``log_softmax(scores)``. Uses full sorts, so it
    is the tests' oracle for the sort-free distribution the graphs draw from.
    """
    v = scores.shape[-1]
    temp = jnp.where(params.temperature > 0, params.temperature, 1.0)
    t = scores / temp[:, None]
    t = _top_h(t, params.top_h)
    k = params.top_k
    desc = -jnp.sort(-t, axis=-1)
    kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, v - 1)[:, None], 1)
    t = jnp.where(((k > 0) & (k < v))[:, None] & (t < kth), NEG, t)
    # top-p: ascending sort, cumulative probability <= 1 - top_p removed, keep the last; among
    # ties the higher index comes first (is dropped first), matching the sort-free sampler
    order = v - 1 - jnp.argsort(t[:, ::-1], axis=-1, stable=True)
    st = jnp.take_along_axis(t, order, 1)
    cum = jnp.cumsum(jax.nn.softmax(st, -1), -1)
    drop = cum <= (1.0 - params.top_p)[:, None]
    drop = drop.at[:, -1].set(False)
    rows = jnp.arange(t.shape[0])[:, None]
    drop = jnp.zeros_like(drop).at[rows, order].set(drop)
    t = jnp.where((params.top_p < 1.0)[:, None] & drop, NEG, t)
    # min-p
    pr = jax.nn.softmax(t, -1)
    top = jnp.max(pr, -1, keepdims=True)
    gone = (pr < params.min_p[:, None] * top) & (t < jnp.max(t, -1, keepdims=True))
    t = jnp.where((params.min_p > 0)[:, None] & gone, NEG, t)
    # typical: tokens by |surprise - entropy| ascending; those past the one where the cumulative
    # probability reaches typical_p go (ties with it stay)
    logq = jax.nn.log_softmax(t, -1)
    ent = -jnp.sum(jnp.where(jnp.isfinite(t), jnp.exp(logq) * logq, 0.0), -1, keepdims=True)
    dist = jnp.where(jnp.isfinite(t), jnp.abs(-logq - ent), jnp.inf)
    order = jnp.argsort(dist, axis=-1, stable=True)
    cum = jnp.cumsum(jnp.take_along_axis(jnp.exp(logq), order, 1), -1)
    last = jnp.minimum(jnp.sum(cum < params.typical_p[:, None], -1), v - 1)
    bound = jnp.take_along_axis(jnp.take_along_axis(dist, order, 1), last[:, None], 1)
    t = jnp.where((params.typical_p < 1.0)[:, None] & (dist > bound), NEG, t)
    t = _cutoff(t, params.epsilon_cutoff, eta=False)
    t = _cutoff(t, params.eta_cutoff, eta=True)
    return jnp.where(sampled_rows(params)[:, None], jax.nn.log_softmax(t, -1), jax.nn.log_softmax(scores, -1))


def _top_h(t, top_h):
    """Top-H: a stable descending sort, the 100 first renormalized, their cumulative entropy terms
    against top_h x their entropy; the first always stays."""
    v = t.shape[-1]
    order = jnp.argsort(-t, axis=-1, stable=True)[:, : min(100, v)]
    p = jax.nn.softmax(jnp.take_along_axis(t, order, 1), -1)
    terms = jnp.where(p > 0, -p * jnp.log(p), 0.0)
    cum = jnp.cumsum(terms, -1)
    sel = (cum <= top_h[:, None] * jnp.sum(terms, -1, keepdims=True)).at[:, 0].set(True)
    rows = jnp.arange(t.shape[0])[:, None]
    keep = jnp.zeros(t.shape, bool).at[rows, order].set(sel)
    return jnp.where((top_h > 0)[:, None] & ~keep, NEG, t)


def _cutoff(t, c, eta: bool):
    """Epsilon (probabilities below c go) or eta (below min(c, sqrt(c) exp(-entropy))); the
    likeliest stays."""
    pr = jax.nn.softmax(t, -1)
    ent = -jnp.sum(jnp.where(pr > 0, pr * jnp.log(pr), 0.0), -1, keepdims=True)
    bound = jnp.minimum(c[:, None], jnp.sqrt(c)[:, None] * jnp.exp(-ent)) if eta else c[:, None]
    gone = (pr < bound) & (t < jnp.max(t, -1, keepdims=True))
    return jnp.where(((c > 0) & (c < 1))[:, None] & gone, NEG, t)
