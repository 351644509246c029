"""Prompt lookup decoding: ``sample(..., prompt_lookup_num_tokens=k, max_matching_ngram_size=n)``.

transformers' ``PromptLookupCandidateGenerator`` (Saxena's prompt lookup decoding) with aotlm's
speculative rounds: the proposals are not a draft model's but the continuation of the sequence's
last n-gram where it occurred before (in the prompt or in what was generated), so input-grounded
outputs (summaries, edits, extraction, code) take several tokens a target forward. The target's
check, acceptance, rollback and stop rules are ``spec_graphs``'; the output is plain decoding's
(greedy: the same tokens; sampled: the same distribution, a proposal kept with probability
``p(d)``).

One graph ``("lookup", k, Wt, n)`` per token bucket runs whole rounds on the device until a
bucket edge or every row is done: the n-gram search over the row's tokens (``propose``: from
``n`` tokens down to 1, the first match left to right whose continuation is not empty, as
transformers), the target's forward of ``k + 1`` tokens and the commit. Where a row has no
match (or a continuation shorter than ``k``), the rest of its proposals are token 0: checked like
any other, so they cost nothing but the forward they ride in.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax import lax

from aotlm.core import buckets as bk
from aotlm.generate import spec_graphs as sg
from aotlm.generate import spec_listen, speculative
from aotlm.generate.strategies import StrategyHost, positive

DEFAULT_NGRAM = 2  # transformers' max_matching_ngram_size default
NAMES = ("prompt_lookup_num_tokens", "max_matching_ngram_size")  # its sample() keywords


def propose(hist, length, k: int, ngram: int):
    """Proposals ``[B, k]`` and whether a match was found ``[B]`` for rows ``hist[r, :length[r]]``
    (``hist [B, C]``, -1 where the row has left padding)."""
    b, c = hist.shape
    col = jnp.arange(c, dtype=jnp.int32)[None, :]
    drafts, found = jnp.zeros((b, k), jnp.int32), jnp.zeros(b, jnp.bool_)
    for n in range(ngram, 0, -1):  # the longest n-gram first
        tail = jnp.take_along_axis(hist, jnp.maximum(length[:, None] - n + jnp.arange(n)[None, :], 0), 1)
        ok = (length >= n + 1) & jnp.all(tail >= 0, 1)  # transformers: n <= the sequence's length - 1
        match = col + n < length[:, None]  # a window whose continuation is not empty
        for m in range(n):
            shifted = jnp.concatenate(
                [hist[:, m:], jnp.full((b, m), -2, hist.dtype)], 1
            )  # [:, i] = hist[:, i + m]
            match &= shifted == tail[:, m : m + 1]
        first = jnp.argmax(match, 1).astype(jnp.int32)  # the first match, left to right
        take = ok & jnp.any(match, 1) & ~found
        at = first[:, None] + n + jnp.arange(k, dtype=jnp.int32)[None, :]
        cont = jnp.take_along_axis(hist, jnp.minimum(at, c - 1), 1)
        cont = jnp.where(at < length[:, None], cont, 0)
        drafts = jnp.where(take[:, None], cont, drafts)
        found |= take
    return drafts, found


def loop(cfg, k: int, ngram: int, wt: int, capacity: int, params, cache, st, replicated=None):
    """Rounds until every row is done or the next round would pass slot ``min(wt, limit)``. While no
    live row finds a match, plain one-token steps (a forward of ``k + 1`` tokens would buy nothing);
    then one round that checks the proposals."""
    end = jnp.minimum(st["limit"], wt)

    def step(j: int):
        def run(carry):
            cache, s, drafts = carry
            cache, t, a, lp = sg.verify(cfg, j, wt, params, cache, s, drafts[:, :j], None, replicated)
            keep, s2 = sg.commit(s, t, a, lp, j, capacity)
            return sg.rollback(cache, s["idx"], keep, j), s2

        return run

    def looked_up(carry):
        cache, s = carry
        return cache, s, propose(s["out"], s["n_out"], k, ngram)

    def no_match(carry):
        _, s, (_, found) = carry
        room = s["idx"] + 1 + k + 1 <= end  # a step leaves room for the round after it
        return room & ~jnp.any(found & ~s["done"]) & ~jnp.all(s["done"])

    def plain(carry):
        cache, s, (drafts, _) = carry
        return looked_up(step(0)((cache, s, drafts)))

    def body(carry):
        cache, s, (drafts, _) = lax.while_loop(no_match, plain, looked_up(carry))
        return step(k)((cache, s, drafts))

    def cond(carry):
        _, s = carry
        return (s["idx"] + k + 1 <= end) & ~jnp.all(s["done"])

    return lax.while_loop(cond, body, (cache, st))


def graph_keys(model: StrategyHost, k: int, ngram: int | None, first: int, last: int) -> list[tuple]:
    """The ``("lookup", k, Wt, ngram)`` graphs rounds may call for tokens at slots ``first..last - 1``
    (a front end compiles them before it generates)."""
    top, n = model.n_positions - 1, DEFAULT_NGRAM if ngram is None else ngram
    widths = {bk.decode_bucket(model.tg_buckets, min(i + k, top)) for i in range(first, max(first + 1, last))}
    return [("lookup", k, w, n) for w in sorted(widths)]


def lower(model: StrategyHost, key: tuple):
    """Lower ``("lookup", k, Wt, ngram)`` for ``model``."""
    _, k, wt, ngram = key
    rep = model.replicated
    cache = model.cache_specs()
    st = sg.state_spec(model.batch_size, model.n_positions, rep)
    fn = jax.jit(
        functools.partial(loop, model.cfg, k, ngram, wt, model.n_positions, replicated=rep),
        donate_argnums=(1,),
        out_shardings=(model.shardings(cache), model.shardings(st)),
    )
    return fn.lower(model.abstract(model.params), cache, st)


def sample_with_lookup(model: StrategyHost, k, ngram, call: dict):
    """``model.sample(..., prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram)``; the
    acceptance stats land in ``model.last_speculative_stats``."""
    k = positive(k, "prompt_lookup_num_tokens")
    ngram = positive(DEFAULT_NGRAM if ngram is None else ngram, "max_matching_ngram_size")
    call = speculative.applicable(call, "prompt_lookup_num_tokens")
    t, t0 = model, time.perf_counter()  # the target: the one model of the rounds
    ids, mask, n = t.prepare(call["input_ids"], call.get("attention_mask"), call.get("start_ids"))
    lengths = (call.get("max_new_tokens"), call.get("sequence_length"))
    name = "prompt_lookup_num_tokens"
    listen, want = spec_listen.split(dict(call), n, t.batch_size, t.cfg.vocab_size, name)
    skw = {key: v for key, v in call.items() if key in sg.SP_KEYS}
    req = speculative.begin(
        t,
        k,
        t.n_positions,
        ids,
        mask,
        n,
        lengths,
        call.get("eos_token_id"),
        call.get("pad_token_id"),
        skw,
        True,
        listen=listen,
        want=want,
        t0=t0,
    )

    def one_call(idx: int, st):
        wt = bk.decode_bucket(t.tg_buckets, idx + k)
        t.cache, st = t.executable(("lookup", k, wt, ngram))(t.params, t.cache, st)
        return st

    out, model.last_speculative_stats = speculative.rounds(t, req, one_call)
    return out
