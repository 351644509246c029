"""Speculative decoding: a small draft proposes ``k`` tokens, the target checks them in one call.

Per round (two graph calls, one host sync):

1. ``("spec_draft", k, W)`` on the draft: ``k + 1`` greedy steps in a ``fori_loop`` feeding the
   last committed token and then its own proposals ``d1..dk`` (the last step only writes
   ``dk``'s keys/values, so the draft cache holds whatever the target accepts).
2. ``("spec_verify", k, W)`` on the target: one forward of the ``k + 1`` tokens
   ``[last, d1..dk]`` at slots ``idx..idx+k`` (a graph per token bucket ``W``), the target's
   own greedy tokens ``t0..tk`` and per-row acceptance ``a`` = leading ``d_j == t_{j-1}``.
   Row ``r`` commits ``t0..t_{a_r}``: the accepted drafts and the target's correction (or
   bonus) token, so the output is exactly the target's greedy output.

**Slots at batch > 1.** Rows share one write slot (the graphs write ``T`` tokens at one
slot), but rows accept different numbers of tokens. Each row keeps its own positions
(RoPE / learned positions follow ``pos``, not the slot); the shared slot advances by the
largest count kept, and a row that kept fewer tokens leaves the rest of its slots as
padding (``pos = -1``: invisible to every query). These holes cost cache slots, so the host
keeps each row's tokens only while the cache can still hold the worst case of the rest of
the request; otherwise every row keeps the round's smallest count (no holes; rows that
accepted more simply re-propose). Rollback is the same rule for both caches: slot ``idx+j``
of row ``r`` keeps its entry iff ``j < keep_r``, applied by the next round's graphs (each
takes ``prev_idx``, ``keep``). At batch 1 there are never holes. With a sliding window the
window is counted in slots (as transformers does), so holes widen it slightly: at batch > 1
on sliding-window models, use ``speculation_length`` only when exactness is not required.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aotlm import buckets as bk
from aotlm import generation, inputs, params, sampling, sharding
from aotlm.models import decoder

MAX_EOS = 8


def graph_keys(model) -> list[tuple]:
    ks = getattr(model, "speculation_length", None) or ()
    return [("spec_verify", k, w) for k in ks for w in model.tg_buckets]


def draft_keys(model, k: int) -> list[tuple]:
    return [("spec_draft", k, w) for w in model.tg_buckets]


# ------------------------------------------------------------------------------ graphs
def rollback(cache, prev_idx, keep, k: int):
    """Slots ``prev_idx + j`` of row ``r`` become padding (``pos = -1``) for ``j >= keep[r]``."""
    b = keep.shape[0]
    chunk = lax.dynamic_slice(cache["pos"], (0, prev_idx), (b, k + 1))
    chunk = jnp.where(jnp.arange(k + 1)[None, :] >= keep[:, None], -1, chunk)
    return dict(cache, pos=lax.dynamic_update_slice(cache["pos"], chunk, (0, prev_idx)))


SP_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "seed")
DRAFT, ACCEPT, RESIDUAL = 0, 1, 2  # random streams: uniform(seed, position, round * 4 + stream)


def _logprobs(logits, sp):
    """Processed log-probs ``[..., V]`` (HF warpers, per row) for logits ``[B, ..., V]``."""
    shape = logits.shape
    reps = 1 if len(shape) == 2 else shape[1]
    flat = {k: jnp.repeat(sp[k], reps) for k in SP_KEYS}
    return sampling.sort_free_logprobs(logits.reshape(-1, shape[-1]), flat).reshape(shape).astype(jnp.float32)


def _u(sp, position, rnd, stream):
    return sampling.uniform(sp["seed"], position, rnd * 4 + stream)


def draft_graph(cfg, k: int, width: int, params, cache, st):
    """``k`` proposals ``[B, k]`` and their log-probs ``[B, k, V]`` (``k + 1`` steps: the last only
    writes ``dk``'s keys). Greedy rows propose the argmax; sampled rows draw from the draft's
    processed distribution (same warpers as the target)."""
    cache = rollback(cache, st["prev_idx"], st["keep"], k)
    sp, b, v = st["sp"], st["last"].shape[0], cfg.vocab_size
    samp = sampling.sampled_rows(sp)

    def body(j, carry):
        cache, tok, out, logq = carry
        h, cache = decoder.forward(
            cfg, params, cache, tok[:, None], (st["pos"] + j)[:, None], st["idx"] + j, width
        )
        lg = decoder.logits(cfg, params, h[:, 0])
        greedy = jnp.argmax(lg, -1).astype(jnp.int32)

        def sampled():  # only when some row samples: greedy rounds skip the warpers
            lq = _logprobs(lg, sp)
            drawn = sampling.draw(jnp.exp(lq), _u(sp, st["pos"] + j + 1, st["rnd"], DRAFT))
            return lq, jnp.where(samp, drawn, greedy).astype(jnp.int32)

        lq, nxt = lax.cond(jnp.any(samp), sampled, lambda: (jnp.zeros_like(lg), greedy))
        jj = jnp.minimum(j, k - 1)
        keep_old = j >= k
        out = jnp.where(keep_old, out, lax.dynamic_update_slice(out, nxt[:, None], (0, jj)))
        logq = jnp.where(keep_old, logq, lax.dynamic_update_slice(logq, lq[:, None], (0, jj, 0)))
        return cache, nxt, out, logq

    init = (cache, st["last"], jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k, v), jnp.float32))
    cache, _, drafts, logq = lax.fori_loop(0, k + 1, body, init)
    return cache, drafts, logq


def verify_graph(cfg, k: int, width: int, params, cache, st, drafts, logq):
    """Tokens ``t [B, k+1]`` and acceptance ``a [B]`` for ``[last, drafts]``.

    Greedy rows: ``t`` = the target's argmax at each position, ``a`` = leading ``d_j == t_{j-1}``.
    Sampled rows: the standard rule (Leviathan et al., Chen et al.): accept ``d_j`` with
    probability ``min(1, p(d_j) / q(d_j))``; at the first rejection draw from
    ``norm(max(0, p - q))``; after ``k`` acceptances draw a bonus token from ``p``. Each
    committed token then follows the target's processed distribution exactly.
    """
    cache = rollback(cache, st["prev_idx"], st["keep"], k)
    sp = st["sp"]
    tokens = jnp.concatenate([st["last"][:, None], drafts], 1)
    positions = st["pos"][:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    h, cache = decoder.forward(cfg, params, cache, tokens, positions, st["idx"], width)
    lg = decoder.logits(cfg, params, h)
    t_g = jnp.argmax(lg, -1).astype(jnp.int32)
    a_g = jnp.sum(jnp.cumprod((drafts == t_g[:, :k]).astype(jnp.int32), 1), 1)
    samp = sampling.sampled_rows(sp)

    def sampled(_):
        logp = _logprobs(lg, sp)  # [B, k+1, V]
        pd = jnp.take_along_axis(logp[:, :k], drafts[..., None], 2)[..., 0]
        qd = jnp.take_along_axis(logq, drafts[..., None], 2)[..., 0]
        u = jax.vmap(lambda j: _u(sp, positions[:, j] + 1, st["rnd"], ACCEPT), out_axes=1)(jnp.arange(k))
        ok = u < jnp.exp(jnp.minimum(pd - qd, 0.0))
        a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), 1), 1)
        p_a = jnp.exp(jnp.take_along_axis(logp, a[:, None, None], 1)[:, 0])
        q_pad = jnp.concatenate([jnp.exp(logq), jnp.zeros_like(p_a)[:, None]], 1)  # bonus: q = 0
        resid = jnp.maximum(p_a - jnp.take_along_axis(q_pad, a[:, None, None], 1)[:, 0], 0.0)
        resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_a)
        pos_a = jnp.take_along_axis(positions, a[:, None], 1)[:, 0] + 1
        corr = sampling.draw(resid, _u(sp, pos_a, st["rnd"], RESIDUAL))
        j = jnp.arange(k + 1)[None, :]
        d_pad = jnp.concatenate([drafts, drafts[:, :1]], 1)
        return jnp.where(j < a[:, None], d_pad, corr[:, None]).astype(jnp.int32), a

    t_s, a_s = lax.cond(jnp.any(samp), sampled, lambda _: (t_g, a_g), None)
    t = jnp.where(samp[:, None], t_s, t_g)
    a = jnp.where(samp, a_s, a_g)
    return cache, t, a.astype(jnp.int32)


def _state_spec(model):
    rep, b = model._repl, model.batch_size
    s = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
    sp = {
        "do_sample": s((b,), jnp.bool_),
        "temperature": s((b,), jnp.float32),
        "top_k": s((b,), jnp.int32),
        "top_p": s((b,), jnp.float32),
        "min_p": s((b,), jnp.float32),
        "seed": s((b,), jnp.uint32),
    }
    st = {"last": s((b,)), "pos": s((b,)), "idx": s(()), "prev_idx": s(()), "keep": s((b,)), "rnd": s(())}
    return dict(st, sp=sp)


def lower(model, key: tuple):
    kind, k, w = key
    p, cache, st = model._abstract(model.params), model._cache_specs(), _state_spec(model)
    rep, cache_sh = model._repl, model._shardings(cache)
    if kind == "spec_draft":
        fn = jax.jit(
            functools.partial(draft_graph, model.cfg, k, w),
            donate_argnums=(1,),
            out_shardings=(cache_sh, rep, rep),
        )
        return fn.lower(p, cache, st)
    b, v = model.batch_size, model.cfg.vocab_size
    drafts = jax.ShapeDtypeStruct((b, k), jnp.int32, sharding=rep)
    logq = jax.ShapeDtypeStruct((b, k, v), jnp.float32, sharding=rep)
    fn = jax.jit(
        functools.partial(verify_graph, model.cfg, k, w),
        donate_argnums=(1,),
        out_shardings=(cache_sh, rep, rep),
    )
    return fn.lower(p, cache, st, drafts, logq)


# ------------------------------------------------------------------------------ host side
def _tokenizer_vocab(path: str):
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text()).get("model", {}).get("vocab")
    except (OSError, ValueError):
        return None


class SpeculativeGenerator:
    """``SpeculativeGenerator(draft, target, k)``: greedy speculative decoding (transformers-neuronx name).

    ``draft`` and ``target`` are ``AutoModelForSampling`` models with the same vocabulary and
    tokenizer and the same ``batch_size``. ``generate(input_ids, ...)`` returns what
    ``target.sample(input_ids, ...)`` returns (greedy), usually in fewer target calls.
    """

    def __init__(self, draft, target, k: int):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculation_length must be an int >= 1, got {k!r}")
        if draft is None:
            raise ValueError("speculative decoding needs a draft_model")
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({draft.cfg.vocab_size} tokens) differs from the target's "
                f"({target.cfg.vocab_size}); use a draft trained with the target's tokenizer"
            )
        dv, tv = _tokenizer_vocab(draft.path), _tokenizer_vocab(target.path)
        if dv is not None and tv is not None and dv != tv:
            raise ValueError(
                "the draft's tokenizer.json differs from the target's; use a draft with the same tokenizer"
            )
        for name in ("bos_token_id", "eos_token_id"):
            d, t = getattr(draft.hf_config, name, None), getattr(target.hf_config, name, None)
            if d is not None and t is not None and d != t:
                raise ValueError(f"draft {name}={d} differs from the target's {t}: not the same tokenizer")
        if draft.batch_size != target.batch_size:
            raise ValueError(
                f"draft batch_size={draft.batch_size} differs from the target's {target.batch_size}; "
                "load both with the same batch_size"
            )
        self.draft, self.target, self.k = draft, target, k
        self.stats: dict = {}

    def graph_keys(self) -> dict:
        return {
            "target": [("spec_verify", self.k, w) for w in self.target.tg_buckets],
            "draft": draft_keys(self.draft, self.k),
        }

    def compile(self) -> SpeculativeGenerator:
        """Compile (or load) the prefill graphs of both models and the speculative graphs."""
        keys = self.graph_keys()
        for model, extra in ((self.target, keys["target"]), (self.draft, keys["draft"])):
            with model._lock:
                for key in [k for k in model.graph_keys() if k[0] in ("prefill", "select")] + extra:
                    model._executable(key)
        return self

    def generate(
        self,
        input_ids,
        max_new_tokens=None,
        sequence_length=None,
        attention_mask=None,
        start_ids=None,
        eos_token_id=None,
        pad_token_id=None,
        **sampling_kwargs,
    ) -> np.ndarray:
        """Greedy by default; ``do_sample=True`` with ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``seed`` (one value or one per row) samples from the target's distribution."""
        unknown = set(sampling_kwargs) - set(SP_KEYS)
        if unknown:
            raise ValueError(f"{sorted(unknown)} not supported with speculative decoding")
        t, d = self.target, self.draft
        with t._lock, d._lock:
            return self._generate(
                input_ids,
                max_new_tokens,
                sequence_length,
                attention_mask,
                start_ids,
                eos_token_id,
                pad_token_id,
                sampling_kwargs,
            )

    def _generate(
        self, input_ids, max_new_tokens, sequence_length, attention_mask, start_ids, eos_token_id, pad, skw
    ):
        from aotlm.beam import new_tokens

        t, d, k = self.target, self.draft, self.k
        ids, mask, n = t._prepare(input_ids, attention_mask, start_ids)
        b, plen = ids.shape
        new = new_tokens(t, plen, max_new_tokens, sequence_length)
        s = min(t.n_positions, d.n_positions)
        if plen + new + k - 1 > s:
            raise ValueError(
                f"prompt ({plen}) + max_new_tokens ({new}) + speculation_length ({k}) - 1 = "
                f"{plen + new + k - 1} exceeds n_positions={s} (a verify call writes k+1 slots); "
                "shorten the request or raise n_positions"
            )
        eos = inputs.eos_ids(eos_token_id, MAX_EOS)
        eos_set = {int(e) for e in eos if e >= 0}
        pad = pad if pad is not None else (int(eos[0]) if eos[0] >= 0 else 0)
        cfg = params.GenerationConfig(**skw)
        sp = {key: v for key, v in generation.sampling_params(cfg, n, b).items() if key in SP_KEYS}
        logits, positions = t._encode(ids, mask)
        d._encode(ids, mask)
        # the first token: the target's own select graph (same token as target.sample, same seed)
        state = generation.initial_state(t, ids, mask, positions, n, np.full(b, plen + new - 1), cfg)
        first = sharding.fetch(t._executable(("select",))(logits, t._put_tree(state))["tok"]).astype(np.int32)
        gen = [[int(x)] for x in first]
        done = np.array([(int(x) in eos_set) or new == 1 for x in first])
        done[n:] = True
        last, pos = first.copy(), (positions.max(1) + 1).astype(np.int32)
        idx, prev_idx, keep = plen, plen, np.zeros(b, np.int32)
        rounds = proposed = accepted = uneven = 0
        put_tree = t._put_tree
        while not done.all():
            st = {
                "last": last,
                "pos": pos,
                "idx": np.int32(idx),
                "prev_idx": np.int32(prev_idx),
                "keep": keep,
                "rnd": np.int32(rounds),
                "sp": sp,
            }
            d.cache, drafts, logq = d._executable(("spec_draft", k, bk.decode_bucket(d.tg_buckets, idx + k)))(
                d.params, d.cache, d._put_tree(st)
            )
            exe = t._executable(("spec_verify", k, bk.decode_bucket(t.tg_buckets, idx + k)))
            t.cache, tok, acc = exe(t.params, t.cache, put_tree(st), drafts, logq)
            tok, acc = sharding.fetch(tok), sharding.fetch(acc)
            live = ~done
            rounds += 1
            proposed += int(live.sum()) * k
            accepted += int(acc[live].sum())
            c = np.where(live, acc + 1, 0)
            rem = np.array([new - len(g) for g in gen])
            if idx + c.max() + max(0, int((rem - c)[live].max())) + k <= s:
                keep = c  # every row keeps all it accepted (holes where it kept fewer)
                uneven += int(len(set(c[live].tolist())) > 1)
            else:
                keep = np.where(live, c[live].min(), 0)  # aligned rows: no holes
            for r in np.nonzero(live)[0]:
                for x in tok[r, : keep[r]]:
                    gen[r].append(int(x))
                    if int(x) in eos_set or len(gen[r]) >= new:
                        done[r] = True
                        break
            last = np.where(keep > 0, tok[np.arange(b), np.maximum(keep - 1, 0)], last).astype(np.int32)
            pos = (pos + keep).astype(np.int32)
            prev_idx, idx = idx, idx + int(keep.max())
            keep = keep.astype(np.int32)
        self.stats = {
            "rounds": rounds,
            "proposed": proposed,
            "accepted": accepted,
            "acceptance": accepted / proposed if proposed else 0.0,
            "uneven_rounds": uneven,  # rounds where rows kept different numbers of tokens
            "slots": idx - plen,
        }
        width = max(len(g) for g in gen[:n])
        out = np.full((n, width), pad, np.int64)
        for r in range(n):
            out[r, : len(gen[r])] = gen[r]
        return np.concatenate([ids[:n].astype(np.int64), out], axis=1)


def sample_with_draft(target, draft, k, call: dict):
    """``target.sample(..., draft_model=draft, speculation_length=k)``."""
    if k is None:
        k = (getattr(target, "speculation_length", None) or (None,))[0]
    if k is None:
        raise ValueError("give speculation_length=k (>= 1) with draft_model")
    gen = SpeculativeGenerator(draft, target, k)
    unsupported = {
        key: v
        for key, v in call.items()
        if key
        not in (
            "input_ids",
            "max_new_tokens",
            "sequence_length",
            "attention_mask",
            "start_ids",
            "eos_token_id",
            "pad_token_id",
        )
    }
    for key in SP_KEYS:
        unsupported.pop(key, None)
    if unsupported:
        raise ValueError(f"{sorted(unsupported)} not supported with draft_model")
    call.pop("return_dict", None)
    out = gen.generate(**call)
    target.last_speculative_stats = gen.stats
    return out
