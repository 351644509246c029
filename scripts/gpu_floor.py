"""The plain-JAX floor for ``bench_gpu.py --floor``: a minimal Llama decode loop on the same shapes.

No sampler, no stop checks, no buckets: greedy argmax inside a ``lax.fori_loop`` of fixed trip count,
a bf16 KV cache of ``prompt + new`` slots, bf16 weights (random), the layers unrolled as aotlm's are.
What XLA alone makes of one decode step on this device: the gap between it and aotlm's rows is
aotlm's own overhead, the gap between it and the HBM limit is XLA's.
"""

from __future__ import annotations

import statistics
import time


def _weights(cfg: dict):
    import jax
    import jax.numpy as jnp

    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    h, k, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    keys = iter(jax.random.split(jax.random.key(0), 16 * cfg["num_hidden_layers"] + 4))
    w = lambda *s: (jax.random.normal(next(keys), s, jnp.float32) * 0.02).astype(jnp.bfloat16)
    one = lambda n: jnp.ones((n,), jnp.bfloat16)
    layers = [
        dict(wqkv=w(d, (h + 2 * k) * dh), wo=w(h * dh, d), wgu=w(d, 2 * f), wd=w(f, d), n1=one(d), n2=one(d))
        for _ in range(cfg["num_hidden_layers"])
    ]
    return dict(embed=w(cfg["vocab_size"], d), norm=one(d), layers=layers)


def _rms(x, g, eps=1e-5):
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    return (xf * jnp.reciprocal(jnp.sqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps))).astype(x.dtype) * g


def _rope(x, pos, dh: int, theta: float):
    import jax.numpy as jnp

    inv = 1.0 / theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    ang = pos.astype(jnp.float32) * inv
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., : dh // 2].astype(jnp.float32), x[..., dh // 2 :].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def decode_loop(cfg: dict, steps: int, start: int):
    """``run(params, tok [B], kc, vc) -> (tok, kc, vc)``: ``steps`` greedy steps from slot ``start``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    h, k, dh, f = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["intermediate_size"],
    )
    theta = cfg["rope_theta"]

    def step(i, carry):
        params, tok, kc, vc = carry
        pos = start + i
        b = tok.shape[0]
        x = params["embed"][tok]
        for li, p in enumerate(params["layers"]):
            qkv = _rms(x, p["n1"]) @ p["wqkv"]
            q = _rope(qkv[:, : h * dh].reshape(b, k, h // k, dh), pos, dh, theta)
            kk = _rope(qkv[:, h * dh : (h + k) * dh].reshape(b, k, dh), pos, dh, theta)
            vv = qkv[:, (h + k) * dh :].reshape(b, k, dh)
            kc = lax.dynamic_update_slice(kc, kk[None, :, :, None], (li, 0, 0, pos, 0))
            vc = lax.dynamic_update_slice(vc, vv[None, :, :, None], (li, 0, 0, pos, 0))
            s = jnp.einsum("bkgd,bksd->bkgs", q, kc[li], preferred_element_type=jnp.float32) / dh**0.5
            s = jnp.where(jnp.arange(kc.shape[3]) <= pos, s, -jnp.inf)
            pr = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
            o = jnp.einsum("bkgs,bksd->bkgd", pr, vc[li]).reshape(b, h * dh)
            x = x + o @ p["wo"]
            gu = _rms(x, p["n2"]) @ p["wgu"]
            x = x + (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ p["wd"]
        logits = jnp.einsum(
            "bd,vd->bv", _rms(x, params["norm"]), params["embed"], preferred_element_type=jnp.float32
        )
        return params, jnp.argmax(logits, -1).astype(jnp.int32), kc, vc

    def run(params, tok, kc, vc):
        _, tok, kc, vc = lax.fori_loop(0, steps, step, (params, tok, kc, vc))
        return tok, kc, vc

    return jax.jit(run, donate_argnums=(2, 3))


def floor_row(cfg: dict, b: int, args) -> dict:
    """A bench row (``bench_gpu.finish``'s fields) for the plain-JAX loop at batch ``b``."""
    import jax
    import jax.numpy as jnp

    params = _weights(cfg)
    n_slots, k, dh = args.prompt + args.new, cfg["num_key_value_heads"], cfg["head_dim"]
    shape = (cfg["num_hidden_layers"], b, k, n_slots, dh)
    kc, vc = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)
    tok = jnp.zeros((b,), jnp.int32)
    t0 = time.perf_counter()
    run = decode_loop(cfg, args.new, args.prompt)
    tok, kc, vc = run(params, tok, kc, vc)
    tok.block_until_ready()
    t_compile = time.perf_counter() - t0
    ts = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        tok, kc, vc = run(params, tok, kc, vc)
        tok.block_until_ready()
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts)
    weights = sum(a.nbytes for a in jax.tree.leaves(params))
    return dict(engine="plain JAX loop (floor)", batch=b, t_pre=0.0, t_gen=t * (args.new - 1) / args.new,
                t_long=float("nan"), load_s=0.0, compile_s=t_compile, weights=weights, kv_elem=2)  # fmt: skip
