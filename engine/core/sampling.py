"""In-graph token selection with transformers' logits-processor semantics.

Everything here runs inside the compiled graphs. The sampling parameters are **traced**
per-row arrays (``params``: a ``RowParams``, one array per "row" entry of
``aotlm.core.sampler_params.TABLE``), so new values never recompile and one batch
mixes greedy and sampled rows. The only static numbers are the array widths below.

Order (as ``generate``): repetition penalty, no-repeat-ngram, then for sampled rows
temperature, top-h, top-k, top-p, min-p, typical, epsilon, eta (``aotlm.core.warpers``). Greedy
rows take the argmax of the penalized scores.

Sampling never sorts the vocabulary (a 50k sort costs ~16 ms per row on XLA:CPU):

* top-k and min-p are value thresholds (the k-th largest value comes from ``lax.top_k``
  with a small static width; larger k bisect on counts); typical-p too (a bisection on how
  close each token's surprise is to the entropy, over what top-p leaves: only when some row
  uses it);
* top-p is exact **rejection sampling**: draw a token from the candidates with one uniform
  (inverse CDF over vocabulary blocks); accept it when the probability mass ranked above it
  is below ``top_p`` (ranked by value; among equal values the lower index ranks higher, as a
  stable sort would: torch's unstable sort breaks such ties arbitrarily, so at an exact tie
  on the boundary HF keeps the same number of tokens, not always the same ones); otherwise
  only tokens ranked above it stay candidates and we draw again. The accepted token follows
  exactly the top-p distribution; the expected number of rounds is about ``1 / top_p``, and
  each rejection removes at least one token, so it ends.

Randomness: each draw's uniform is a hash of (seed, position, round) (``uniform``), so a
row's tokens depend only on its seed and positions, not on its batch companions or chunking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from aotlm import kernels
from aotlm.core.sampler_params import NGRAM_MAX
from aotlm.core.warpers import active_cutoff, bisect_largest, cutoff_mask, top_h_mask, typical_mask

TOPK_WIDTH = 64  # static width of the lax.top_k used for top_k <= 64 (larger k bisect)
TOP_LOGPROBS_MAX = 5  # widest top_logprobs (static: the output buffer width)
MAX_LOGIT_BIAS = 300  # logit_bias entries per row (static width; OpenAI's limit too)
_BLOCK = 256  # vocabulary block of the inverse-CDF draw
NEG = -jnp.inf


# --------------------------------------------------------------------------- penalties
def repetition_penalty(scores, penalty, seen):
    """HF RepetitionPenaltyLogitsProcessor over the tokens in ``seen [B,V]`` (prompt + generated)."""
    pen = penalty[:, None]
    hit = seen & (pen != 1.0)
    return jnp.where(hit, jnp.where(scores < 0, scores * pen, scores / pen), scores)


def ngram_bans(out, slot, n):
    """``[B,V]``-shaped list of banned tokens as ``(rows, tokens)`` for no_repeat_ngram_size ``n [B]``.

    ``out [B,S]`` is the sequence by cache slot (``-1`` = padding / empty), ``slot`` the slot
    of the newest token. Every window ``j..j+n-1`` inside the history whose first ``n-1``
    tokens equal the last ``n-1`` tokens bans its last token (HF NoRepeatNGramLogitsProcessor).
    """
    b, s = out.shape
    j = jnp.arange(s, dtype=jnp.int32)[None, :]
    nn = n[:, None]
    outp = jnp.concatenate([out, jnp.full((b, NGRAM_MAX), -3, out.dtype)], axis=1)

    def offset(o, match):  # offset o of the window matters when o < n-1
        want = jnp.take_along_axis(out, jnp.clip(slot - nn + 2 + o, 0, s - 1), axis=1)
        here = lax.dynamic_slice_in_dim(outp, o, s, axis=1)
        return match & ((o >= nn - 1) | (here == want))

    match = lax.fori_loop(0, NGRAM_MAX - 1, offset, (nn > 0) & (j + nn - 1 <= slot))
    banned = jnp.take_along_axis(outp, jnp.clip(j + nn - 1, 0, s + NGRAM_MAX - 1), axis=1)
    return match & (banned >= 0), banned


# Does some row use it? (traced; each processor is skipped in the graph when none does, and ``plain``
# asks all of them)
_repeats = lambda params: jnp.any(params.repetition_penalty != 1.0)
_bans = lambda params: jnp.any(params.ngram > 0)
_biased = lambda bias_ids: jnp.any(bias_ids >= 0)
_masked = lambda allow: ~jnp.all(allow == jnp.uint32(0xFFFFFFFF))
_penalized = lambda presence, frequency: jnp.any((presence != 0) | (frequency != 0))


def penalize(scores, params, seen, out, slot):
    """Repetition penalty and n-gram bans; each only computed when some row uses it."""
    scores = lax.cond(
        _repeats(params),
        lambda s: repetition_penalty(s, params.repetition_penalty, seen),
        lambda s: s,
        scores,
    )

    def ban(s):
        ok, tok = ngram_bans(out, slot, params.ngram)
        rows = jnp.broadcast_to(jnp.arange(s.shape[0])[:, None], tok.shape)
        tok = jnp.where(ok, tok, s.shape[1])  # out of range -> dropped
        return s.at[rows, tok].set(NEG, mode="drop")

    return lax.cond(_bans(params), ban, lambda s: s, scores)


# --------------------------------------------------------------------------- warpers
def kth_largest(t, k):
    """Per-row k-th largest value of ``t [B,V]`` for ``k [B] >= 1`` (exact)."""
    width = min(TOPK_WIDTH, t.shape[-1])
    small = lambda: jnp.take_along_axis(lax.top_k(t, width)[0], jnp.clip(k - 1, 0, width - 1)[:, None], 1)[
        :, 0
    ]
    count = lambda m: jnp.sum(m, -1)
    return lax.cond(jnp.any(k > width), lambda: bisect_largest(t, count, k), small)


def warp(scores, params):
    """Temperature-scaled scores ``t``, the prefix mask of top-h and top-k, and the mask of the
    warpers after top-p (min-p, then typical, epsilon and eta over what top-p leaves)."""
    temp = jnp.where(params.temperature > 0, params.temperature, 1.0)
    t = scores / temp[:, None]
    v = t.shape[-1]
    samp = sampled_rows(params)
    k = params.top_k
    use_k = (k > 0) & (k < v)
    kth = lax.cond(jnp.any(use_k), lambda: kth_largest(t, jnp.maximum(k, 1)), lambda: jnp.full(k.shape, NEG))
    keep_k = t >= jnp.where(use_k, kth, NEG)[:, None]
    use_h = samp & (params.top_h > 0)  # before top-k in HF; both keep a prefix of the value order
    every = jnp.ones_like(keep_k)
    top_h = lambda: top_h_mask(t, jnp.where(use_h, params.top_h, 0.0))
    keep_k &= lax.cond(jnp.any(use_h), top_h, lambda: every)
    # min-p comes after top-k/top-p in HF, but the max token survives both, so its ratio test
    # p_i < min_p * p_max  <=>  t_i - t_max < log(min_p) is unchanged
    m = jnp.max(jnp.where(keep_k, t, NEG), -1, keepdims=True)
    p_min = params.min_p
    log_min = jnp.log(jnp.where(p_min > 0, p_min, 1.0))[:, None]
    keep_m = (p_min <= 0)[:, None] | (t - m >= log_min)
    use_typ = samp & (params.typical_p < 1.0)
    use_cut = samp & (active_cutoff(params.epsilon_cutoff) | active_cutoff(params.eta_cutoff))

    def after_top_p():  # typical, epsilon, eta: over what top-k, top-p and min-p leave
        q = jnp.where(keep_k, jnp.exp(t - m), 0.0)
        use_p = params.top_p < 1.0
        keep_p = ~use_p[:, None] | top_p_mask(t, q, params.top_p * jnp.sum(q, -1))
        keep = keep_m & (~use_typ[:, None] | typical_mask(t, keep_k & keep_p & keep_m, params.typical_p))
        off = lambda c: jnp.where(use_cut, c, 0.0)
        cut = cutoff_mask(t, keep_k & keep_p & keep, off(params.epsilon_cutoff), off(params.eta_cutoff))
        return keep & (~use_cut[:, None] | cut)

    return t, keep_k, lax.cond(jnp.any(use_typ | use_cut), after_top_p, lambda: keep_m)


def mass_above(q, t, c):
    """Mass of ``q`` ranked above token ``c [B]``: larger value, or equal value and lower index."""
    tc = jnp.take_along_axis(t, c[:, None], 1)
    idx = jnp.arange(t.shape[-1], dtype=jnp.int32)[None, :]
    above = (t > tc) | ((t == tc) & (idx < c[:, None]))
    return jnp.sum(jnp.where(above, q, 0.0), -1)


def top_p_mask(t, q, limit):
    """Tokens whose mass ranked above them is below ``limit [B]`` (HF's top-p set), without a sort.

    The boundary value is the largest ``x`` with ``mass(t >= x) >= limit``; of the tokens tied
    at it, the lowest-index ones are kept while the mass above them stays below ``limit``.
    """
    x = bisect_largest(t, lambda m: jnp.sum(jnp.where(m, q, 0.0), -1), limit)[:, None]
    above = jnp.sum(jnp.where(t > x, q, 0.0), -1, keepdims=True)
    tie = t == x
    q_tie = jnp.max(jnp.where(tie, q, 0.0), -1, keepdims=True)
    n_keep = jnp.ceil((limit[:, None] - above) / jnp.maximum(q_tie, 1e-38))
    rank = jnp.cumsum(tie.astype(jnp.int32), -1) - 1
    return (t > x) | (tie & (rank < jnp.maximum(n_keep, 1)))


def draw(w, u):
    """Index ``i`` with ``P(i) = w_i / sum(w)`` for ``u`` uniform in [0, 1): inverse CDF by blocks."""
    b, v = w.shape
    nb = -(-v // _BLOCK)
    wb = jnp.pad(w, ((0, 0), (0, nb * _BLOCK - v))).reshape(b, nb, _BLOCK)
    sums = wb.sum(-1)
    cb = jnp.cumsum(sums, -1)
    x = u * cb[:, -1]
    blk = jnp.sum(cb <= x[:, None], -1)
    last_blk = jnp.max(jnp.where(sums > 0, jnp.arange(nb)[None], 0), -1)  # rounding never lands
    blk = jnp.where(blk > last_blk, last_blk, blk)  # past the last block holding mass
    prev = jnp.take_along_axis(jnp.pad(cb, ((0, 0), (1, 0))), blk[:, None], 1)[:, 0]
    row = jnp.take_along_axis(wb, blk[:, None, None], 1)[:, 0]
    j = jnp.sum(jnp.cumsum(row, -1) + prev[:, None] <= x[:, None], -1)
    last_pos = jnp.max(jnp.where(row > 0, jnp.arange(_BLOCK)[None], 0), -1)
    return (blk * _BLOCK + jnp.minimum(j, last_pos)).astype(jnp.int32)


def _mix(x):
    """murmur3's 32-bit finalizer: a cheap, well-mixing bijection of uint32."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def uniform(seed, position, rnd):
    """A uniform in [0, 1) from (seed, position, round): a counter-based hash, not a PRNG state.

    It depends on nothing else (batch row, companions, bucket, chunk), and is a few integer
    ops in the graph (threefry's key handling made the sampler graph several times larger).
    """
    x = _mix(seed.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
    x = _mix(x ^ position.astype(jnp.uint32))
    x = _mix(x ^ (jnp.uint32(rnd) * jnp.uint32(0x27D4EB2F) + jnp.uint32(0x165667B1)))
    return (x >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def sample_rows(t, keep_k, keep_m, params, position):
    """One token per row from the top-k / top-p / min-p distribution of ``t`` (no sort)."""
    m = jnp.max(jnp.where(keep_k, t, NEG), -1, keepdims=True)
    q = jnp.where(keep_k, jnp.exp(t - m), 0.0)  # unnormalized top-k distribution
    top_p = params.top_p
    limit = top_p * jnp.sum(q, -1)
    idx = jnp.arange(t.shape[-1], dtype=jnp.int32)[None, :]

    def body(c):
        pv, pi, acc, tok, rnd = c
        allowed = keep_m & ((t > pv[:, None]) | ((t == pv[:, None]) & (idx < pi[:, None])))
        c_new = draw(jnp.where(allowed, q, 0.0), uniform(params.seed, position, rnd))
        ok = (top_p >= 1.0) | (mass_above(q, t, c_new) < limit)
        new = ~acc
        tok = jnp.where(new, c_new, tok)
        tc = jnp.take_along_axis(t, c_new[:, None], 1)[:, 0]
        pv = jnp.where(new & ~ok, tc, pv)
        pi = jnp.where(new & ~ok, c_new, pi)
        return pv, pi, acc | ok, tok, rnd + 1

    b = t.shape[0]
    big = jnp.full((b,), t.shape[-1], jnp.int32)  # pivot (-inf, V): every finite token is allowed
    init = (jnp.full((b,), NEG), big, ~sampled_rows(params), jnp.zeros((b,), jnp.int32), 0)
    return lax.while_loop(lambda c: ~jnp.all(c[2]), body, init)[3]


def sampled_rows(params):
    return params.do_sample & (params.temperature > 0)


# --------------------------------------------------------------------------- selection
def mask_words(vocab: int) -> int:
    """uint32 words of a ``vocab``-token allowed-token bitmask."""
    return -(-vocab // 32)


def unpack_allowed(allow, vocab: int):
    """``allow [B, ceil(V/32)]`` uint32 bitmask (bit ``t % 32`` of word ``t // 32`` = token ``t``
    allowed, llguidance's / xgrammar's layout) as ``[B, V]`` booleans."""
    bits = (allow[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)[None, None, :]) & jnp.uint32(1)
    return bits.reshape(allow.shape[0], -1)[:, :vocab].astype(jnp.bool_)


def constrain(scores, allow, bias_ids, bias_val):
    """OpenAI ``logit_bias`` (``bias_ids [B,N]`` -1 padded, ``bias_val [B,N]``) added, then the
    tokens a row's grammar forbids (``allow`` bitmask, all ones = unconstrained) set to ``-inf``.

    Both are skipped in the graph when no row uses them, so unconstrained batches pay two
    small reductions. Either argument may be None (a state without the field).
    """
    b, v = scores.shape
    if bias_ids is not None:

        def add(s):
            cols = jnp.where(bias_ids >= 0, bias_ids, v)  # padding: out of range, dropped
            rows = jnp.broadcast_to(jnp.arange(b)[:, None], cols.shape)
            return s.at[rows, cols].add(bias_val, mode="drop")

        scores = lax.cond(_biased(bias_ids), add, lambda s: s, scores)
    if allow is not None:
        mask = lambda s: jnp.where(unpack_allowed(allow, v), s, NEG)
        scores = lax.cond(_masked(allow), mask, lambda s: s, scores)
    return scores


def openai_penalties(scores, counts, presence, frequency):
    """OpenAI presence / frequency penalties (``presence [B]``, ``frequency [B]``) over ``counts
    [B,V]`` (how often each row generated each token), subtracted as vLLM does; only computed
    when some row uses them."""

    def sub(s):
        c = counts.astype(jnp.float32)
        return s - (frequency[:, None] * c + presence[:, None] * (c > 0))

    return lax.cond(_penalized(presence, frequency), sub, lambda s: s, scores)


def plain(params, want_logprobs, penalties=None, allow=None, sparse=None):
    """Traced scalar: does every row take the argmax of its raw logits (greedy, no penalty, bias,
    grammar or log-probs)? ``select``'s arguments of the same names."""
    busy = [jnp.any(sampled_rows(params)), jnp.asarray(want_logprobs, jnp.bool_)]
    busy += [_repeats(params), _bans(params)]
    if penalties is not None:
        busy.append(_penalized(*penalties[1:]))
    if allow is not None:
        busy.append(_masked(allow))
    if sparse is not None:
        busy.append(_biased(sparse[0]))
    return ~jnp.any(jnp.stack(busy))


def select(
    logits,
    params,
    seen,
    out,
    slot,
    position,
    want_logprobs,
    penalties=None,
    allow=None,
    sparse=None,
    path: str | None = None,
):
    """Choose the token of slot ``slot + 1`` for every row.

    ``slot`` is a scalar or ``[B, 1]`` (one per row). ``penalties`` (None or ``(counts [B,V],
    presence [B], frequency [B])``): OpenAI's presence / frequency penalties
    (``openai_penalties``), applied after the repetition penalty and the n-gram bans, in that
    order as vLLM does. Then ``constrain``: the ``sparse`` logit bias ``(ids, values)`` and the
    ``allow`` bitmask of structured outputs. Returns ``(token [B], logprob [B], top_ids
    [B,TOP_LOGPROBS_MAX], top_logprobs)``. The log-probs (of the distribution the row drew
    from) are only computed when ``want_logprobs`` (traced) is set. When no row needs more than
    an argmax (``plain``), the graph takes it of ``logits`` directly: the [B,V] passes of the
    processors (each a copy of the scores on XLA:CPU, ~2.7 ms of a 16-row GPT-2-small step)
    are skipped, with the same tokens. ``path`` (static): ``"plain"`` / ``"full"`` when the caller
    has already decided which (``graphs.decode`` with ``group``), so the graph holds no branch on it.
    """

    def argmax(scores):
        use = kernels.argmax_ok(scores)
        return kernels.argmax(scores) if use else jnp.argmax(scores, -1).astype(jnp.int32)

    def none(tok):
        z = jnp.zeros((tok.shape[0], TOP_LOGPROBS_MAX))
        return tok, jnp.zeros(tok.shape), z.astype(jnp.int32), z

    def full():
        scores = penalize(logits, params, seen, out, slot)
        if penalties is not None:
            scores = openai_penalties(scores, *penalties)
        ids, vals = sparse if sparse is not None else (None, None)
        scores = constrain(scores, allow, ids, vals)
        greedy = argmax(scores)
        samp = sampled_rows(params)

        def sampled():
            t, keep_k, keep_m = warp(scores, params)
            tok = jnp.where(samp, sample_rows(t, keep_k, keep_m, params, position), greedy)
            return tok, t, keep_k, keep_m

        every = jnp.ones_like(scores, dtype=jnp.bool_)
        tok, t, keep_k, keep_m = lax.cond(jnp.any(samp), sampled, lambda: (greedy, scores, every, every))

        def logprobs():
            full = final_logprobs(scores, t, keep_k, keep_m, params)
            top_lp, top_ids = lax.top_k(full, TOP_LOGPROBS_MAX)
            return tok, jnp.take_along_axis(full, tok[:, None], 1)[:, 0], top_ids.astype(jnp.int32), top_lp

        return lax.cond(want_logprobs, logprobs, lambda: none(tok))

    if path == "plain":
        return none(argmax(logits))
    if path == "full":
        return full()
    fast = plain(params, want_logprobs, penalties, allow, sparse)
    return lax.cond(fast, lambda: none(argmax(logits)), full)


def final_keep(t, keep_k, keep_m, params):
    """The tokens every warper keeps ``[B,V]`` (``warp``'s masks and top-p)."""
    use_p = sampled_rows(params) & (params.top_p < 1.0)

    def with_top_p():
        m = jnp.max(jnp.where(keep_k, t, NEG), -1, keepdims=True)
        q = jnp.where(keep_k, jnp.exp(t - m), 0.0)
        return keep_k & (~use_p[:, None] | top_p_mask(t, q, params.top_p * jnp.sum(q, -1)))

    return lax.cond(jnp.any(use_p), with_top_p, lambda: keep_k) & keep_m


def final_logprobs(scores, t, keep_k, keep_m, params):
    """Log-probs ``[B,V]`` each row draws from (``sort_free_logprobs``), from ``warp``."""
    samp = sampled_rows(params)
    warped = jax.nn.log_softmax(jnp.where(final_keep(t, keep_k, keep_m, params), t, NEG), -1)
    return jnp.where(samp[:, None], warped, jax.nn.log_softmax(scores, -1))


def processed_scores(logits, params, seen, out, slot, allow, sparse):
    """transformers' ``output_scores`` for the token of slot ``slot + 1``: the scores after the
    logits processors (as ``select`` applies them) and, in sampled rows, after the warpers
    (temperature-scaled, the tokens they remove at ``-inf``), from ``logits`` with eos masked."""
    scores = constrain(penalize(logits, params, seen, out, slot), allow, *sparse)
    t, keep_k, keep_m = warp(scores, params)
    warped = jnp.where(final_keep(t, keep_k, keep_m, params), t, NEG)
    return jnp.where(sampled_rows(params)[:, None], warped, scores)


def sort_free_logprobs(scores, params):
    """The log-probs ``[B,V]`` each row draws from, as the graphs compute them: thresholds and
    bisection, no sort (the tests hold them against a sorting reference and transformers)."""
    return final_logprobs(scores, *warp(scores, params), params)
