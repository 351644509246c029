"""transformers' entropy- and cutoff-based logits warpers as sort-free value masks over ``t [B,V]``
(temperature-scaled scores), for ``aotlm.core.sampling.warp``.

* ``top_h_mask``: ``TopHLogitsWarper`` (Top-H decoding): of the 100 likeliest tokens, the longest
  prefix whose cumulative entropy terms ``-p log p`` (``p`` renormalized over those 100) stay within
  ``top_h`` x their entropy; the likeliest always stays. A prefix of the value order, so it is a
  value threshold (ties at the boundary all stay; torch keeps the ones its top-k returned).
* ``typical_mask``: ``TypicalLogitsWarper`` (locally typical sampling) over what earlier warpers left.
* ``cutoff_mask``: ``EpsilonLogitsWarper`` (drop probabilities below ``epsilon``) and
  ``EtaLogitsWarper`` (below ``min(eta, sqrt(eta) exp(-entropy))``), over what earlier warpers left
  (renormalized); the likeliest token always stays, as both keep ``min_tokens_to_keep=1``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

NEG = -jnp.inf
TOP_H_WIDTH = 100  # the tokens Top-H weighs (transformers' ``top_n``)


def sortable(x):
    """float32 -> int32 with the same order (for bisection over exact float values)."""
    b = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b < 0, b ^ jnp.int32(0x7FFFFFFF), b)


def bisect_largest(t, score, target):
    """Per row, the largest value ``x`` of ``t [B,V]`` with ``score(t >= x) >= target``.

    ``score(mask) -> [B]`` must grow with the mask (a count, a mass). 32 halvings of the
    order-preserving int keys give the exact value; a compact loop (small graph).
    """
    keys = sortable(t)
    lo, hi = jnp.min(keys, -1), jnp.max(keys, -1)

    def body(_, c):
        lo, hi = c
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # ceil((lo + hi) / 2) without overflow
        ok = score(keys >= mid[:, None]) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, body, (lo, hi))
    return jnp.min(jnp.where(keys >= lo[:, None], t, jnp.inf), -1)  # the value whose key is lo


def _entropy_terms(logits):
    """``(-p log p, log p)`` of ``softmax(logits)`` along the last axis (0 where ``p`` is 0)."""
    logp = jax.nn.log_softmax(logits, -1)
    p = jnp.exp(logp)
    return jnp.where(p > 0, -p * logp, 0.0), logp


def top_h_mask(t, top_h):
    """Tokens Top-H keeps for ``top_h [B]`` in (0, 1] (rows with 0 keep everything)."""
    width = min(TOP_H_WIDTH, t.shape[-1])
    vals = lax.top_k(t, width)[0]  # descending
    terms, _ = _entropy_terms(vals)
    cum = jnp.cumsum(terms, -1)
    tau = top_h[:, None] * cum[:, -1:]
    n_keep = jnp.maximum(jnp.sum(cum <= tau, -1), 1)  # cum only grows: a prefix
    bound = jnp.take_along_axis(vals, (n_keep - 1)[:, None], 1)
    return (top_h <= 0)[:, None] | (t >= bound)


def typical_mask(t, keep, mass):
    """transformers' TypicalLogitsWarper without a sort: of the tokens ``keep [B,V]`` leaves, those
    whose surprise ``-log p`` is closest to the entropy, fewest first, until they hold ``mass [B]``
    of the probability (the boundary's ties all stay, as in transformers)."""
    logq = jax.nn.log_softmax(jnp.where(keep, t, NEG), -1)
    q = jnp.where(keep, jnp.exp(logq), 0.0)
    ent = -jnp.sum(jnp.where(keep, q * logq, 0.0), -1, keepdims=True)
    closeness = jnp.where(keep, -jnp.abs(-logq - ent), NEG)  # larger is more typical
    x = bisect_largest(closeness, lambda m: jnp.sum(jnp.where(m, q, 0.0), -1), mass)
    return keep & (closeness >= x[:, None])


def active_cutoff(c):
    """Rows whose epsilon / eta cutoff ``c [B]`` applies (transformers adds the warper for 0 < c < 1)."""
    return (c > 0) & (c < 1)


def cutoff_mask(t, keep, epsilon, eta):
    """Epsilon then eta sampling over the tokens ``keep [B,V]`` leaves (rows whose cutoff is off
    keep them)."""
    top = jnp.max(jnp.where(keep, t, NEG), -1, keepdims=True)
    cut = lambda keep, logq, bound: keep & ((jnp.exp(logq) >= bound[:, None]) | (t >= top))
    use_e, use_eta = active_cutoff(epsilon), active_cutoff(eta)
    _, logq = _entropy_terms(jnp.where(keep, t, NEG))
    keep = jnp.where(use_e[:, None], cut(keep, logq, epsilon), keep)
    terms, logq = _entropy_terms(jnp.where(keep, t, NEG))  # what epsilon left, renormalized
    safe = jnp.where(use_eta, eta, 0.0)
    bound = jnp.minimum(safe, jnp.sqrt(safe) * jnp.exp(-jnp.sum(terms, -1)))
    return jnp.where(use_eta[:, None], cut(keep, logq, bound), keep)
