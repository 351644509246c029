"""Top-H, epsilon and eta sampling (``aotlm.core.warpers``) against transformers' own warpers where the
rules bite: the top-100 cap, renormalization over what earlier warpers left, the likeliest token kept,
banned (-inf) tokens; the rest of the sampler's cases are in test_sampling.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as lp

from aotlm.core import sampler_params, sampling

WARPERS = {  # ours -> transformers' warper
    "temperature": lp.TemperatureLogitsWarper,
    "top_h": lp.TopHLogitsWarper,
    "top_k": lp.TopKLogitsWarper,
    "top_p": lp.TopPLogitsWarper,
    "epsilon_cutoff": lp.EpsilonLogitsWarper,
    "eta_cutoff": lp.EtaLogitsWarper,
}


def hf(row: dict, scores: np.ndarray) -> np.ndarray:
    s = torch.tensor(scores[None], dtype=torch.float32)
    for name, warper in WARPERS.items():  # transformers' order
        if name in row:
            s = warper(row[name])(torch.zeros((1, 1), dtype=torch.long), s)
    return torch.softmax(s, -1)[0].numpy()


def ours(row: dict, scores: np.ndarray) -> np.ndarray:
    cols = {q.name: np.array([row.get(q.name, q.fill)], q.dtype) for q in sampler_params.ROW}
    cols["do_sample"][:] = True
    p = jax.tree.map(jnp.asarray, sampler_params.row_params(cols))
    lp_ = jax.jit(sampling.sort_free_logprobs)(jnp.asarray(scores[None]), p)
    return np.exp(np.asarray(lp_))[0]


def check(row: dict, scores: np.ndarray) -> np.ndarray:
    got, want = ours(row, scores), hf(row, scores)
    np.testing.assert_array_equal(got > 0, want > 0, err_msg=str(row))
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=str(row))
    return got


def test_epsilon_and_eta_renormalize_over_what_top_k_left():
    # full softmax: token 2 holds 0.16; over the top 3 it holds 0.186
    scores = np.log(np.array([0.4, 0.3, 0.16, *[0.14 / 97] * 97], np.float32))
    kept = check({"top_k": 3, "epsilon_cutoff": 0.17}, scores)
    assert (kept > 0).sum() == 3, "epsilon judged the full distribution, not top-k's"
    assert (check({"epsilon_cutoff": 0.17}, scores) > 0).sum() == 2
    check({"top_k": 3, "eta_cutoff": 0.2}, scores)
    check({"top_p": 0.8, "eta_cutoff": 0.3}, scores)


def test_the_likeliest_token_stays_when_every_one_falls_below_epsilon():
    # (eta's bound sqrt(eta) exp(-entropy) is below the likeliest's probability: it never bites there)
    scores = np.linspace(0.0, -0.01, 100).astype(np.float32)  # nearly flat: each ~1/100
    kept = check({"epsilon_cutoff": 0.5}, scores)
    assert (kept > 0).sum() == 1 and kept[0] == pytest.approx(1.0)
    check({"epsilon_cutoff": 0.5}, np.zeros(100, np.float32))  # all tied with the likeliest: all stay
    check({"eta_cutoff": 0.5}, scores)


def test_top_h_caps_at_100_tokens_and_skips_banned_ones():
    rng = np.random.default_rng(3)
    flat = (rng.standard_normal(150) * 0.05).astype(np.float32)
    kept = check({"top_h": 0.999}, flat)
    assert (kept > 0).sum() == 99, "top-h weighs the 100 likeliest only"
    banned = (rng.standard_normal(150) * 2).astype(np.float32)
    banned[40:] = -np.inf  # 40 live tokens, as after bans or a grammar
    for h in (0.2, 0.7, 0.95):
        assert (check({"top_h": h}, banned)[40:] == 0).all()
    check({"temperature": 0.6, "top_h": 0.5, "top_k": 5}, banned)


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(top_h=1.5), "top_h=1.5 is invalid: must be in \\[0, 1\\]"),
        (dict(epsilon_cutoff=-0.1), "epsilon_cutoff=-0.1 is invalid"),
        (dict(eta_cutoff=2.0), "eta_cutoff=2.0 is invalid"),
    ],
)
def test_out_of_range_values_are_named(kw, err):
    bad = sampler_params.violations(kw)
    assert bad and re.search(err, bad[0][1]), bad
