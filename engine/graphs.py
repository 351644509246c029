"""The two compiled graph kinds: context encoding (prefill) and token generation (decode).

Both are pure functions of (params, cache, inputs). What is static (a ``jax.jit`` static
argument, baked into the executable) and what is traced:

* static: the ``ArchConfig``, the bucket sizes ``(C, W)`` / ``W``, the token selector.
  Changing any of these is a different graph.
* traced: every weight, the KV cache, token ids, positions, the write slot, the stop
  slot, eos / pad ids. New values of these never recompile.

The KV cache is donated to every call and updated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from aotlm.models import decoder

MAX_EOS = 8  # eos ids are a fixed-size traced array, padded with -1


def prefill(cfg, width: int, select, params, cache, tokens, positions, start, last):
    """Encode ``tokens [B,C]`` at cache slots ``start..start+C-1``.

    Returns the float32 logits of chunk position ``last`` (the last real prompt token),
    the token the selector picks from them, and the updated cache.
    """
    # a (C, C) graph always starts at slot 0 (see buckets.prefill_plan): no earlier slots to read
    old_width = 0 if width == tokens.shape[1] else width
    h, cache = decoder.forward(cfg, params, cache, tokens, positions, start, old_width)
    h_last = lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
    lg = decoder.logits(cfg, params, h_last)
    return lg, select(lg, None), cache


def decode(cfg, width: int, select, params, cache, state):
    """Generate tokens on device until slot ``width``, ``state['stop']`` or all rows done.

    ``state``: ``tok [B]`` token to feed at slot ``idx``; ``pos [B]`` its position;
    ``done [B]``; ``out [B,S]`` generated tokens by slot; ``stop`` first slot not fed;
    ``eos [MAX_EOS]``; ``pad``. One call covers one token-generation bucket, so the
    host only switches buckets (a handful of calls per request, not one per token).
    """
    limit = jnp.minimum(state["stop"], width)

    def cond(carry):
        _, st = carry
        return (st["idx"] < limit) & ~jnp.all(st["done"])

    def body(carry):
        cache, st = carry
        idx = st["idx"]
        h, cache = decoder.forward(cfg, params, cache, st["tok"][:, None], st["pos"][:, None], idx, width)
        lg = decoder.logits(cfg, params, h[:, 0])
        nxt = jnp.where(st["done"], st["pad"], select(lg, st))
        done = st["done"] | jnp.any(nxt[:, None] == st["eos"][None, :], axis=-1)
        out = lax.dynamic_update_slice(st["out"], nxt[:, None], (0, idx + 1))
        st = dict(st, tok=nxt, pos=st["pos"] + 1, idx=idx + 1, done=done, out=out)
        return cache, st

    return lax.while_loop(cond, body, (cache, state))


def state_spec(batch: int, n_slots: int, sharding) -> dict:
    """Abstract decode state (shapes/dtypes/sharding) used to lower the decode graphs."""
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    return {
        "tok": s((batch,), jnp.int32),
        "pos": s((batch,), jnp.int32),
        "done": s((batch,), jnp.bool_),
        "out": s((batch, n_slots), jnp.int32),
        "idx": s((), jnp.int32),
        "stop": s((), jnp.int32),
        "eos": s((MAX_EOS,), jnp.int32),
        "pad": s((), jnp.int32),
    }
