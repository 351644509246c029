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
    return jnp.where(sampled_rows(params)[:, None], jax.nn.log_softmax(t, -1), jax.nn.log_softmax(scores, -1))
