"""The in-graph sampler against transformers' logits processors, and its draws against its distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from sampling_reference import processed_logprobs
from transformers.generation import logits_process as lp

from aotlm.core import sampler_params, sampling

V = 101
S = 24  # history slots


def params(rows):
    """Per-row ``RowParams`` from a list of dicts (the sampler table's names; sampled unless a row
    says otherwise; seeds 0..n-1)."""
    cols = {}
    for q in sampler_params.ROW:
        default = True if q.name == "do_sample" else q.fill
        cols[q.name] = np.array([r.get(q.name, default) for r in rows], q.dtype)
    cols["seed"] = np.arange(len(rows), dtype=np.uint32)
    return jax.tree.map(jnp.asarray, sampler_params.row_params(cols))


def hf_processed(row: dict, history: np.ndarray, scores: np.ndarray) -> np.ndarray:
    procs = []
    if row.get("repetition_penalty", 1.0) != 1.0:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(float(row["repetition_penalty"])))
    if row.get("ngram", 0):
        procs.append(lp.NoRepeatNGramLogitsProcessor(row["ngram"]))
    if row.get("do_sample", True):
        if row.get("temperature", 1.0) != 1.0:
            procs.append(lp.TemperatureLogitsWarper(row["temperature"]))
        if row.get("top_h", 0.0):
            procs.append(lp.TopHLogitsWarper(row["top_h"]))
        if row.get("top_k", 0):
            procs.append(lp.TopKLogitsWarper(row["top_k"]))
        if row.get("top_p", 1.0) < 1.0:
            procs.append(lp.TopPLogitsWarper(row["top_p"]))
        if row.get("min_p", 0.0):
            procs.append(lp.MinPLogitsWarper(row["min_p"]))
        if row.get("typical_p", 1.0) < 1.0:
            procs.append(lp.TypicalLogitsWarper(row["typical_p"]))
        if 0 < row.get("epsilon_cutoff", 0.0) < 1:
            procs.append(lp.EpsilonLogitsWarper(row["epsilon_cutoff"]))
        if 0 < row.get("eta_cutoff", 0.0) < 1:
            procs.append(lp.EtaLogitsWarper(row["eta_cutoff"]))
    ids = torch.tensor(history[None], dtype=torch.long)
    s = torch.tensor(scores[None], dtype=torch.float32)
    for p in procs:
        s = p(ids, s)
    return torch.log_softmax(s, -1)[0].numpy()


def ours(rows, histories, logits, fast=False):
    """penalize + processed_logprobs (or the sort-free path) on histories of equal length."""
    b, n = len(rows), histories.shape[1]
    out = np.full((b, S), -1, np.int32)
    out[:, :n] = histories
    seen = np.zeros((b, V), bool)
    for r in range(b):
        seen[r, histories[r]] = True
    p = params(rows)

    @jax.jit
    def f(lg, seen, out):
        sc = sampling.penalize(lg, p, seen, out, n - 1)
        return sampling.sort_free_logprobs(sc, p) if fast else processed_logprobs(sc, p)

    return np.asarray(f(jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(out)))


CASES = [
    {"temperature": 0.7},
    {"top_k": 5},
    {"top_k": 80},  # wider than sampling.TOPK_WIDTH: the bisection path
    {"top_k": 500},  # >= vocab: no filter
    {"top_p": 0.8},
    {"top_p": 1.0},
    {"min_p": 0.1},
    {"temperature": 1.7, "top_k": 20, "top_p": 0.6},
    {"repetition_penalty": 1.5},
    {"repetition_penalty": 0.6, "temperature": 0.9},
    {"ngram": 2},
    {"ngram": 1},
    {"ngram": 3, "repetition_penalty": 1.3, "temperature": 0.8, "top_k": 10, "top_p": 0.9, "min_p": 0.05},
    {"do_sample": False, "repetition_penalty": 1.2, "ngram": 2},
    {"typical_p": 0.5},
    {"typical_p": 0.95, "temperature": 1.3},
    {"typical_p": 0.2, "top_k": 30, "top_p": 0.9, "min_p": 0.02},
    {"do_sample": False, "typical_p": 0.3},  # greedy: warpers off
    {"top_h": 0.4},
    {"top_h": 0.999, "temperature": 9.0},  # nearly flat: the 100-token cap of a 101-token vocabulary
    {"top_h": 0.9, "temperature": 0.8, "top_k": 12, "top_p": 0.95},
    {"epsilon_cutoff": 0.02},
    {"eta_cutoff": 0.05, "temperature": 1.4},
    {"epsilon_cutoff": 0.01, "eta_cutoff": 0.02, "top_p": 0.9, "typical_p": 0.9},
    {"epsilon_cutoff": 1.0, "eta_cutoff": 1.0},  # transformers adds neither at 1
    {"top_h": 0.3, "epsilon_cutoff": 0.03, "min_p": 0.01},
    {"do_sample": False, "top_h": 0.2, "eta_cutoff": 0.1},
]


def test_processed_distribution_equals_transformers():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((len(CASES), V)) * 3).astype(np.float32)
    # histories with repeats so that n-grams and penalties bite
    hist = rng.integers(0, 12, (len(CASES), 14)).astype(np.int32)
    hist[:, -3:] = hist[:, 2:5]
    logits[:, :12] += 4  # the repeated tokens are likely ones
    got = ours(CASES, hist, logits)
    for r, row in enumerate(CASES):
        want = hf_processed(row, hist[r], logits[r])
        np.testing.assert_array_equal(np.isinf(got[r]), np.isinf(want), err_msg=str(row))
        fin = np.isfinite(want)
        np.testing.assert_allclose(np.exp(got[r][fin]), np.exp(want[fin]), atol=1e-5, err_msg=str(row))
    # the sort-free distribution the graphs use (thresholds, bisection) is the same
    fast = ours(CASES, hist, logits, fast=True)
    np.testing.assert_array_equal(np.isinf(fast), np.isinf(got))
    np.testing.assert_allclose(np.exp(fast), np.exp(got), atol=1e-6)


def test_edge_cases_ties_and_prompt_only_penalties():
    # ties straddling the top-p boundary: four equal tokens carry 0.25 each
    logits = np.full((2, V), -1e4, np.float32)
    logits[:, 10:14] = 2.0
    rows = [{"top_p": 0.5}, {"top_p": 0.6}]
    hist = np.zeros((2, 1), np.int32)
    got = ours(rows, hist, logits)
    np.testing.assert_array_equal(np.isinf(ours(rows, hist, logits, fast=True)), np.isinf(got))
    for r, row in enumerate(rows):
        want = hf_processed(row, hist[r], logits[r])
        # torch's unstable sort breaks the tie arbitrarily; the kept count and mass agree, and
        # aotlm keeps the lowest indices (its documented rule)
        kept = np.flatnonzero(np.isfinite(got[r]))
        n_keep = (2, 3)[r]
        assert len(kept) == np.isfinite(want).sum() == n_keep and list(kept) == list(range(10, 10 + n_keep))
        np.testing.assert_allclose(np.sort(got[r][kept]), np.sort(want[np.isfinite(want)]), atol=1e-6)
    # a penalty on tokens seen only in the prompt (history) applies to greedy scores too
    lg = np.zeros((1, V), np.float32)
    lg[0, 7], lg[0, 8] = 3.0, 2.0
    got = ours([{"do_sample": False, "repetition_penalty": 2.0}], np.array([[7, 7, 3]], np.int32), lg)
    assert np.argmax(got[0]) == 8


def chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper 0.9995 quantile of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "row",
    [
        {"temperature": 0.6},
        {"top_k": 4},
        {"top_p": 0.7},
        {"min_p": 0.2},
        {"top_k": 6, "top_p": 0.8, "min_p": 0.1},
        {"typical_p": 0.6},
        {"typical_p": 0.8, "top_p": 0.9},
        {"top_h": 0.6},
        {"epsilon_cutoff": 0.05, "top_k": 9},
        {"eta_cutoff": 0.1},
    ],
)
def test_draws_follow_the_processed_distribution(row):
    """Chi-square over 20000 draws (fixed seeds, so deterministic) on a 12-token vocabulary."""
    n, v = 20000, 12
    logits = np.tile(np.linspace(2.0, -1.5, v, dtype=np.float32), (n, 1))
    p = params([row] * n)
    p = p.replace(seed=jnp.arange(n, dtype=jnp.uint32))
    pos = jnp.full((n,), 5, jnp.int32)
    draw = jax.jit(lambda lg, p, pos: sampling.sample_rows(*sampling.warp(lg, p), p, pos))
    toks = np.asarray(draw(jnp.asarray(logits), p, pos))
    probs = np.exp(np.asarray(jax.jit(processed_logprobs)(jnp.asarray(logits[:1]), params([row]))))[0]
    counts = np.bincount(toks, minlength=v)
    assert counts[probs == 0].sum() == 0, "a masked token was drawn"
    live = probs > 0
    expected = n * probs[live]
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    assert stat < chi2_critical(int(live.sum()) - 1), (stat, counts, expected)


def test_select_takes_the_plain_argmax_only_when_no_row_needs_more():
    """``select``'s fast branch (argmax of the raw logits) runs only when every row is greedy with
    nothing to apply; each processor alone sends the whole batch down the full path, whose tokens
    then differ from the raw argmax where that processor changes the winner."""
    rng = np.random.default_rng(0)
    b = 3
    logits = jnp.asarray(rng.normal(size=(b, V)).astype(np.float32))
    raw = np.asarray(jnp.argmax(logits, -1))
    hist = np.full((b, S), -1, np.int32)
    hist[:, :4] = raw[:, None]  # each row's history holds its raw winner
    seen = np.zeros((b, V), bool)
    seen[np.arange(b), raw] = True
    counts = jnp.asarray(seen.astype(np.int32))
    zero = jnp.zeros(b, jnp.float32)
    ones = jnp.full((b, sampling.mask_words(V)), 0xFFFFFFFF, jnp.uint32)
    no_bias = (jnp.full((b, 2), -1, jnp.int32), jnp.zeros((b, 2), jnp.float32))
    greedy = [{"do_sample": False}] * b

    def run(rows=greedy, want=False, pres=zero, allow=ones, bias=no_bias):
        p = params(rows)
        args = (jnp.asarray(want), (counts, pres, zero), allow, bias)
        fast = bool(sampling.plain(p, *args))
        where = (jnp.asarray(seen), jnp.asarray(hist), jnp.int32(3), jnp.int32(4))
        tok = sampling.select(logits, p, *where, *args)[0]
        return fast, np.asarray(tok)

    assert run() == (True, pytest.approx(raw))
    # the raw winner penalized / masked / biased away in row 0 only
    pres = zero.at[0].set(1e4)
    allow = ones.at[0, raw[0] // 32].set(~np.uint32(1 << (raw[0] % 32)))
    bias = (no_bias[0].at[0, 0].set(raw[0]), no_bias[1].at[0, 0].set(-100.0))
    rep = [{"do_sample": False, "repetition_penalty": 1e4}] + greedy[1:]
    for kw in ({"pres": pres}, {"allow": allow}, {"bias": bias}, {"rows": rep}):
        fast, tok = run(**kw)
        assert not fast and tok[0] != raw[0] and np.array_equal(tok[1:], raw[1:]), kw
    assert not run(want=True)[0] and np.array_equal(run(want=True)[1], raw)
    assert not run(rows=[{"do_sample": True}] + greedy[1:])[0]
    assert not run(rows=[{"do_sample": False, "ngram": 2}] + greedy[1:])[0]
