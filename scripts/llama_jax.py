"""A Llama decoder in plain JAX with Hugging Face weight layout, and a hand-written AdamW step.

Used by ``train_default_model.py``. Weights keep HF shapes (linears ``[out, in]``, per-layer
tensors stacked on a leading axis for ``lax.scan``), so ``hf_state`` only renames and unstacks,
and the math (RMSNorm, rotate-half RoPE, GQA, SwiGLU, tied lm_head) equals transformers'
``LlamaForCausalLM``, which the tests check through aotlm and transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Arch:
    """Static model shape; hashable so the jitted functions can close over it."""

    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int = 256
    max_pos: int = 512
    theta: float = 10000.0
    eps: float = 1e-5

    @property
    def hd(self) -> int:
        return self.d // self.heads


# ---------------------------------------------------------------- model (HF Llama layout, in JAX)
def init_params(a: Arch, seed: int) -> dict:
    """Weights in HF shapes ([out, in] linears); per-layer tensors stacked on a leading axis."""
    import jax
    import jax.numpy as jnp

    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    L, std, res = a.layers, 0.02, 0.02 / math.sqrt(2 * a.layers)

    def n(shape, s):
        return s * jax.random.normal(next(ks), shape, jnp.float32)

    return {
        "embed": n((a.vocab, a.d), std),
        "norm": jnp.ones((a.d,)),
        "ln1": jnp.ones((L, a.d)),
        "ln2": jnp.ones((L, a.d)),
        "q": n((L, a.heads * a.hd, a.d), std),
        "k": n((L, a.kv_heads * a.hd, a.d), std),
        "v": n((L, a.kv_heads * a.hd, a.d), std),
        "o": n((L, a.d, a.heads * a.hd), res),
        "gate": n((L, a.ffn, a.d), std),
        "up": n((L, a.ffn, a.d), std),
        "down": n((L, a.d, a.ffn), res),
    }


def forward(a: Arch, p: dict, ids):
    """Logits [B, T, V] for token ids [B, T]; same math as transformers' LlamaForCausalLM."""
    import jax
    import jax.numpy as jnp

    B, T = ids.shape
    inv = 1.0 / (a.theta ** (jnp.arange(0, a.hd, 2, dtype=jnp.float32) / a.hd))
    f = jnp.arange(T, dtype=jnp.float32)[:, None] * inv[None]
    cos, sin = jnp.cos(jnp.concatenate([f, f], -1)), jnp.sin(jnp.concatenate([f, f], -1))
    causal = jnp.tril(jnp.ones((T, T), bool))

    def rms(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + a.eps) * w

    def rope(x):  # [B, H, T, hd]
        h = a.hd // 2
        return x * cos + jnp.concatenate([-x[..., h:], x[..., :h]], -1) * sin

    def layer(x, w):
        h = rms(x, w["ln1"])
        q = (h @ w["q"].T).reshape(B, T, a.heads, a.hd).transpose(0, 2, 1, 3)
        k = (h @ w["k"].T).reshape(B, T, a.kv_heads, a.hd).transpose(0, 2, 1, 3)
        v = (h @ w["v"].T).reshape(B, T, a.kv_heads, a.hd).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        rep = a.heads // a.kv_heads
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
        s = jnp.where(causal, (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(a.hd), -1e30)
        att = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(B, T, a.d)
        x = x + att @ w["o"].T
        h = rms(x, w["ln2"])
        x = x + (jax.nn.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T
        return x, None

    stacked = {k: p[k] for k in ("ln1", "ln2", "q", "k", "v", "o", "gate", "up", "down")}
    x, _ = jax.lax.scan(layer, p["embed"][ids], stacked)
    return rms(x, p["norm"]) @ p["embed"].T  # tied lm_head


def token_nll(a: Arch, p: dict, x):
    """Mean next-token negative log-likelihood (nats) over windows x [B, seq+1]."""
    import jax
    import jax.numpy as jnp

    logits = forward(a, p, x[:, :-1])
    lp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(lp, x[:, 1:, None], -1))


def make_step(a: Arch, wd: float = 0.1, b1: float = 0.9, b2: float = 0.95, clip: float = 1.0):
    """Jitted AdamW step with global-norm clipping; weight decay on matrices only."""
    import jax
    import jax.numpy as jnp

    def step(p, m, v, t, x, lr):
        loss, g = jax.value_and_grad(lambda q: token_nll(a, q, x))(p)
        gn = jnp.sqrt(sum(jnp.sum(gi * gi) for gi in jax.tree.leaves(g)))
        g = jax.tree.map(lambda gi: gi * jnp.minimum(1.0, clip / (gn + 1e-6)), g)
        m = jax.tree.map(lambda mi, gi: b1 * mi + (1 - b1) * gi, m, g)
        v = jax.tree.map(lambda vi, gi: b2 * vi + (1 - b2) * gi * gi, v, g)
        c1, c2 = 1 - b1**t, 1 - b2**t

        def upd(k):
            u = (m[k] / c1) / (jnp.sqrt(v[k] / c2) + 1e-8)
            decay = wd * p[k] if p[k].ndim >= 2 else 0.0
            return p[k] - lr * (u + decay)

        return {k: upd(k) for k in p}, m, v, loss, gn

    return jax.jit(step, donate_argnums=(0, 1, 2))


def hf_state(a: Arch, p: dict) -> dict[str, np.ndarray]:
    names = {
        "ln1": "input_layernorm",
        "ln2": "post_attention_layernorm",
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    }
    out = {"model.embed_tokens.weight": np.asarray(p["embed"]), "model.norm.weight": np.asarray(p["norm"])}
    for short, hf in names.items():
        arr = np.asarray(p[short])
        for i in range(a.layers):
            out[f"model.layers.{i}.{hf}.weight"] = np.ascontiguousarray(arr[i])
    return out


def n_params(p: dict) -> int:
    return int(sum(np.prod(x.shape) for x in p.values()))
