"""Mixture-of-experts feed-forward (Mixtral-style top-k routing), used by ``decoder.feed_forward``
when ``cfg.n_experts > 0``.

Routing follows transformers' ``MixtralSparseMoeBlock``: ``softmax`` over the router logits
in float32, the ``top_k`` largest probabilities, renormalised to sum to 1. The experts are
computed densely (every expert on every token, then weighted by the routing weights, which
are zero for unselected experts): per-token expert choice is data dependent, and gathering
a different subset of experts per token would need dynamic shapes, whereas the dense form
has one static shape per bucket and is exact (an unselected expert contributes ``0 * y``).
It costs ``n_experts / top_k`` times the FLOPs of the sparse form.

Params per layer: ``router [D,E]``, ``e_gate``/``e_up [E,D,F]`` (or fused ``e_gu [E,D,2,F]``),
``e_down [E,F,D]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aotlm.models import layers as L
from aotlm.models.arch import ArchConfig


def routing_weights(logits: jax.Array, top_k: int) -> jax.Array:
    """``[..., E]`` router logits -> ``[..., E]`` float32 weights: renormalised top-k softmax."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, top_k)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(idx, probs.shape[-1], dtype=jnp.float32)  # [..., k, E]
    return jnp.einsum("...k,...ke->...e", top, one_hot)


def _expert_dense(spec: str, x: jax.Array, p: dict, name: str) -> jax.Array:
    """Float32 ``einsum(spec, x, p[name])``; an int8 expert weight (``models/quant.py``) is
    converted to ``x``'s dtype and its per-(expert, output) scale applied to the product."""
    w, scale = p[name], p.get(name + "_scale")
    y = jnp.einsum(spec, x, w if scale is None else w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y if scale is None else y * scale.astype(jnp.float32)[None, None]


def moe_mlp(cfg: ArchConfig, p: dict, x: jax.Array) -> jax.Array:
    """Top-``cfg.experts_per_token`` of ``cfg.n_experts`` gated MLP experts on ``x [B,T,D]``."""
    weights = routing_weights(L.dense(x, p["router"], name="router"), cfg.experts_per_token)  # [B,T,E]
    if "e_gu" in p:  # fused gate+up [E,D,2,F]: one einsum
        gu = _expert_dense("btd,edcf->btecf", x, p, "e_gu")
        gate, up = gu[..., 0, :], gu[..., 1, :]
    else:
        gate = _expert_dense("btd,edf->btef", x, p, "e_gate")
        up = _expert_dense("btd,edf->btef", x, p, "e_up")
    h = (L.activation(cfg.act, gate.astype(x.dtype)) * up.astype(x.dtype)).astype(x.dtype)
    y = _expert_dense("btef,efd->bted", h, p, "e_down").astype(x.dtype)
    return jnp.einsum("bted,bte->btd", y, weights, preferred_element_type=jnp.float32).astype(x.dtype)
