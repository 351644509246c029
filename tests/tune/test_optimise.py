"""Bucket tuning: the exact optimiser vs brute force, limits, length loaders, bucket-config round trip."""

import itertools
import json
import re

import numpy as np
import pytest

from aotlm import AutoModelForSampling
from aotlm.cli.app import main
from aotlm.core.bucket_config import load_bucket_config, write_bucket_config
from aotlm.tune import lengths
from aotlm.tune import optimise as tuning
from aotlm.tune.measure import _nnls, batch_candidates, fit_cost_model, measure


def _cost_model(rng) -> tuning.CostModel:
    """Random but plausible: prefill rises with C, decode per token with W, overheads, compile times."""
    u = lambda lo, hi: float(rng.uniform(lo, hi))
    return tuning.CostModel(
        p0=u(1e-3, 5e-3), p1=u(1e-4, 1e-3), p2=u(0, 1e-5), attn=u(0, 1e-5), d0=u(1e-3, 3e-3),
        d1=u(0, 1e-4), call=u(0, 5e-3), cp0=u(1, 3), cp1=u(0, 0.05), cd0=u(1, 3), cd1=u(0, 0.05),
    )  # fmt: skip


def _dist(rng, n=8, max_p=40, max_n=20) -> lengths.LengthDist:
    return lengths.from_counts(rng.integers(1, max_p, n), rng.integers(1, max_n, n), rng.integers(1, 10, n))


def _all_configs(cm, dist, c_cands, w_cands) -> list[tuple]:
    """Brute force: every (context subset, token subset) scored by the engine-rule evaluator."""
    subsets = lambda xs: (s for r in range(1, len(xs) + 1) for s in itertools.combinations(xs, r))
    out = []
    for ctx in subsets(sorted(c_cands)):
        for tg in subsets(sorted(w_cands)):
            if ctx[-1] >= dist.max_prompt and tg[-1] >= max(dist.max_total, ctx[-1]):
                keys = tuning.graph_keys(ctx, tg)
                ct = sum(cm.compile_s(k) for k in keys)
                out.append((tuning.expected_s(cm, ctx, tg, dist), len(keys), ct, ctx, tg))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_optimiser_equals_brute_force_and_respects_limits(seed):
    rng = np.random.default_rng(seed)
    cm, dist = _cost_model(rng), _dist(rng)
    c_cands = sorted(set(rng.choice(np.arange(4, 64, 4), 5, replace=False)) | {dist.max_prompt})
    w_cands = sorted(set(rng.choice(np.arange(8, 64, 8), 3, replace=False)) | {64})
    every = _all_configs(cm, dist, c_cands, w_cands)
    for max_graphs, budget in [(None, None), (3, None), (4, None), (6, None), (None, 12.0), (5, 15.0)]:
        args = (cm, dist, c_cands, w_cands, max_graphs, budget)
        ok = [
            e
            for e in every
            if (max_graphs is None or e[1] <= max_graphs) and (budget is None or e[2] <= budget)
        ]
        if not ok:
            with pytest.raises(ValueError, match="no bucket configuration"):
                tuning.optimise(*args)
            continue
        want = min(ok)
        got = tuning.optimise(*args)
        assert got.expected_s == pytest.approx(want[0], rel=1e-9), (max_graphs, budget, got, want)
        # the DP's own cost equals the engine-rule evaluator's on its choice
        assert tuning.expected_s(cm, got.ctx, got.tg, dist) == pytest.approx(got.expected_s, rel=1e-9)
        keys = got.graph_keys()
        assert max_graphs is None or len(keys) <= max_graphs
        assert budget is None or sum(cm.compile_s(k) for k in keys) <= budget
        assert max(got.ctx) >= dist.max_prompt  # covers the longest prompt: never chunks
        assert max(got.tg) >= dist.max_total and max(got.ctx) <= max(got.tg)


def test_graph_count_matches_the_engine_and_default_buckets(gpt2_path):
    m = AutoModelForSampling.from_pretrained(
        gpt2_path, n_positions=[32, 64], context_length_estimate=[8, 16], compile_cache=False
    )
    assert tuning.graph_keys(m.ctx_buckets, m.tg_buckets) == m.graph_keys()
    assert tuning.default_buckets(576) == ((64, 128, 256, 288), (128, 256, 512, 576))


def test_tuned_choice_beats_default_on_its_cost_model():
    cm = tuning.CostModel(p0=2e-3, p1=6e-4, p2=2e-7, attn=2e-7, d0=2e-2, d1=1e-6, call=1e-3)
    dist = lengths.load_lengths("normal:300:60:1:512", new_tokens=64)
    c, w = tuning.candidate_edges(dist, 32, 1024)
    d_ctx, d_tg = tuning.default_buckets(1024)
    n_default = len(tuning.graph_keys(d_ctx, d_tg))
    got = tuning.optimise(cm, dist, c, w, max_graphs=n_default, max_width=1024)
    assert len(got.graph_keys()) <= n_default
    assert got.expected_s < tuning.expected_s(cm, d_ctx, d_tg, dist)
    assert max(got.ctx) >= 512


def test_candidates_and_lengths_over_the_limit():
    dist = lengths.from_counts([10, 100], [5, 5], [1, 1])
    c, w = tuning.candidate_edges(dist, 32, 256)
    assert 100 in c and max(c) <= max(w) and max(w) == 105  # the exact longest request
    with pytest.raises(ValueError, match="do not fit|at most 64 fit"):
        tuning.candidate_edges(dist, 32, 64)


def test_fit_recovers_a_known_cost_model():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert np.allclose(_nnls(np.stack([np.ones(4), x], 1), 2 + 3 * x), [2, 3])
    assert (_nnls(np.stack([np.ones(4), x], 1), 5 - x) >= 0).all()  # never a negative cost slope
    rows = [dict(graph="prefill", c=c, w=c, seconds=0.01 + 1e-3 * c, compile_s=2.0) for c in (32, 64, 128)]
    rows.append(dict(graph="prefill", c=128, w=256, seconds=0.01 + 0.128 + 1e-6 * 128 * 256, compile_s=2.0))
    rows += [
        dict(graph="decode", w=w, token_s=0.02 + 1e-5 * w, call_s=0.003, compile_s=3.0) for w in (64, 256)
    ]
    cm = fit_cost_model(rows)
    assert cm.prefill_s(100) == pytest.approx(0.11, rel=1e-6)
    assert cm.attn == pytest.approx(1e-6, rel=1e-6) and cm.token_s(128) == pytest.approx(0.02128)
    assert cm.call == pytest.approx(0.003) and cm.compile_s(("decode", 64)) == pytest.approx(3.0)
    assert batch_candidates(11, 32) == [1, 2, 4, 8, 11] and batch_candidates(500, 16) == [1, 2, 4, 8, 16]


def test_length_loaders(tmp_path):
    import h5py

    hist = tmp_path / "h.json"
    hist.write_text(json.dumps({"prompt_len": [10, 20, 10], "new_tokens": [5, 5, 5], "count": [1, 2, 1]}))
    d = lengths.load_lengths(str(hist))
    assert d.prompt_len.tolist() == [10, 20] and d.weight.tolist() == [0.5, 0.5]
    csv = tmp_path / "h.csv"
    csv.write_text("prompt_len,new_tokens,count\n10,5,1\n30,7,3\n")
    d = lengths.load_lengths(str(csv))
    assert d.max_total == 37 and d.weight.tolist() == [0.25, 0.75]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt_ids": [1, 2, 3], "new_tokens": 4}\n{"prompt_ids": [1], "new_tokens": 2}\n')
    assert lengths.load_lengths(str(jl)).max_total == 7
    with pytest.raises(ValueError, match="--tokenizer"):
        (tmp_path / "t.jsonl").write_text('{"prompt": "hello world"}\n')
        lengths.load_lengths(str(tmp_path / "t.jsonl"), new_tokens=3)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    wl = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    jl.write_text(
        '{"prompt": "hello world hello", "completion": "world world"}\n{"text": "hi", "new_tokens": 3}\n'
    )
    d = lengths.load_lengths(str(jl), tokenizer=str(tmp_path / "tok"))
    assert d.prompt_len.tolist() == [1, 3] and d.new_tokens.tolist() == [3, 2]
    bd = tuning.batch_dist(d, 4)  # a batch pays its longest prompt and most new tokens
    assert bd.mean(bd.prompt_len) > d.mean(d.prompt_len) and bd.max_total == 6
    h5 = tmp_path / "d.h5"
    data = np.zeros((3, 16), np.int32)
    data[0, 5], data[1, 9], data[2, 1] = 7, 7, 7  # prompts of 5, 9, 1 tokens before start token 7
    with h5py.File(h5, "w") as f:
        f["data"] = data
    d = lengths.load_lengths(str(h5), start_token=7, new_tokens=4)
    assert sorted(d.prompt_len.tolist()) == [1, 5, 9]
    with pytest.raises(ValueError, match="--start-token"):
        lengths.load_lengths(str(h5), new_tokens=4)
    with pytest.raises(ValueError, match="--new-tokens"):
        lengths.load_lengths(str(h5), start_token=7)
    with pytest.raises(ValueError, match="empty"):
        hist.write_text(json.dumps({"prompt_len": [], "new_tokens": [], "count": []}))
        lengths.load_lengths(str(hist))
    with pytest.raises(ValueError, match="no such file"):
        lengths.load_lengths(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        lengths.load_lengths(str(tmp_path / "bad.json"))


def test_bucket_config_round_trip(gpt2_path, tmp_path, capsys):
    cfg = tmp_path / "buckets.json"
    data = write_bucket_config(cfg, [12, 24], [40])
    assert data == {"n_positions": [40], "context_length_estimate": [12, 24]}
    m = AutoModelForSampling.from_pretrained(gpt2_path, bucket_config=str(cfg), compile_cache=False)
    assert (m.ctx_buckets, m.tg_buckets, m.batch_size) == ((12, 24), (40,), 1)
    assert m.graph_keys() == tuning.graph_keys([12, 24], [40])
    out = m.sample(np.arange(1, 11)[None], max_new_tokens=5)  # prefill 12x12 + decode 40
    ref = AutoModelForSampling.from_pretrained(
        gpt2_path, n_positions=40, context_length_estimate=16, compile_cache=False
    )
    assert (out == ref.sample(np.arange(1, 11)[None], max_new_tokens=5)).all()
    # explicit arguments win over the file; a dict works too
    m = AutoModelForSampling.from_pretrained(
        gpt2_path, bucket_config=data, n_positions=[48], batch_size=2, compile_cache=False
    )
    assert (m.tg_buckets, m.ctx_buckets, m.batch_size) == ((48,), (12, 24), 2)
    with pytest.raises(ValueError, match="unknown keys"):
        load_bucket_config({"n_positions": [40], "buckets": [1]})
    with pytest.raises(ValueError, match="cannot read bucket config"):
        AutoModelForSampling.from_pretrained(gpt2_path, bucket_config=str(tmp_path / "nope.json"))
    assert main(["compile", str(gpt2_path), "--config", str(cfg), "--dry-run"]) == 0
    text = capsys.readouterr().out
    # 12x12, 24x24, chunk 24x40, first-token select, decode 40
    assert "5 graphs would be compiled" in text and "24x40" in text


def test_tune_cli_bad_inputs_exit_2(gpt2_path, tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"prompt_len": [], "new_tokens": [], "count": []}))
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"prompt_len": [200], "new_tokens": [100], "count": [1]}))
    base = ["tune", "--model", str(gpt2_path), "--out", str(tmp_path / "o.json")]
    for lengths_arg, want in [
        (str(empty), "empty"),
        (str(long), "longest request needs 300 positions"),
        (str(tmp_path / "missing.csv"), "no such file"),
    ]:
        assert main([*base, "--lengths", lengths_arg]) == 2
        assert want in capsys.readouterr().err
    assert main(["explore-batch", "--model", str(gpt2_path), "--lengths", str(long)]) == 2
    capsys.readouterr()
    # flags out of range: refused before any graph is measured, each naming the flag and its value
    ok = [*base, "--lengths", "12", "--new-tokens", "4"]
    for flags, want in [
        (["--max-graphs", "0"], "--max-graphs must be >= 1, got 0"),
        (["--granularity", "0"], "--granularity must be >= 1, got 0"),
        (["--measure-runs", "0"], "--measure-runs must be >= 1, got 0"),
        (["--memory-gb", "-1"], "--memory-gb must be > 0, got -1.0"),
        (["--compile-budget-s", "0"], "--compile-budget-s must be > 0, got 0.0"),
        (["--batch", "--batches", "0"], "--batches must be >= 1, got 0"),
        (["--replay", "-1"], "--replay must be >= 0"),
        (["--plot", str(tmp_path / "no" / "p.png")], "the directory .*no does not exist; create it first"),
        (["--lengths", "normal:40:-3"], "needs MEAN >= 1, STD >= 0"),
    ]:
        assert main([*ok, *flags]) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(want, err[0]), (flags, err)
    assert main(["explore-batch", "--model", str(gpt2_path), "--lengths", "12", "--max-batch", "0"]) == 2
    assert "--max-batch must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_lengths_listed_on_the_command_line_and_a_model_by_name(tmp_path, capsys):
    import argparse

    from aotlm.cli.tune import load_dist
    from aotlm.models.checkpoint.resolve import resolve

    dist = lengths.load_lengths("10, 20,300,20", new_tokens=4)
    assert dist.prompt_len.tolist() == [10, 20, 300] and dist.weight.tolist() == [0.25, 0.5, 0.25]
    with pytest.raises(ValueError, match="prompt lengths only; pass --new-tokens"):
        lengths.load_lengths("10,20")
    with pytest.raises(ValueError, match="no such file; give .* prompt lengths such as"):
        lengths.load_lengths("10,2o", new_tokens=4)
    prompts = tmp_path / "p.jsonl"  # prompt text: the model's own tokenizer counts it (no --tokenizer)
    prompts.write_text('{"prompt": "def f(x):", "generation": {"max_new_tokens": 3}}\n')  # batch-generate's
    args = argparse.Namespace(model="aotlm/tiny-py", lengths=str(prompts), tokenizer=None, new_tokens=None,
                              start_token=None)  # fmt: skip
    dist = load_dist(args)
    assert args.model == str(resolve("aotlm/tiny-py")) and dist.new_tokens.tolist() == [3]
    assert main(["tune", "--model", "aotlm/tiny-py", "--lengths", "4000", "--new-tokens", "4"]) == 2
    assert "longest request needs 4004 positions" in capsys.readouterr().err  # resolved, then checked


def test_plot_writes_a_png_or_says_why_not(tmp_path, capsys):
    from aotlm.cli.tune import plot

    dist = lengths.load_lengths("normal:300:60:1:512", new_tokens=64)
    rows = [dict(graph="prefill", c=c, w=c, seconds=1e-3 * c, compile_s=1.0) for c in (64, 256, 512)]
    rows.append(dict(graph="decode", w=576, token_s=0.02, call_s=0.0, compile_s=1.0))
    cm = fit_cost_model(rows)
    plot(
        str(tmp_path / "p.png"),
        dist,
        {"default": ((256, 512), (1024,)), "tuned": ((320, 512), (576,))},
        rows,
        cm,
    )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert (tmp_path / "p.png").stat().st_size > 1000


def test_measure_fits_a_usable_cost_model(gpt2_path):
    lines = []
    cm, rows = measure(str(gpt2_path), [8, 16], [32], runs=1, points=2, log=lines.append)
    assert [(r["graph"], r.get("c"), r["w"]) for r in rows if r["graph"] != "select"] == [
        ("prefill", 8, 8), ("prefill", 16, 16), ("prefill", 16, 32), ("decode", None, 32)
    ]  # fmt: skip
    assert len(lines) == 4 and all(r["compile_s"] > 0 for r in rows)
    assert cm.prefill_s(16) > 0 and cm.token_s(32) > 0 and cm.call >= 0 and cm.compile_s(("decode", 32)) > 0
