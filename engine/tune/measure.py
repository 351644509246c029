"""Measuring graph latencies, replaying a length distribution, exploring batch sizes.

Shared by ``aotlm tune`` / ``aotlm explore-batch`` and ``scripts/tune_buckets.py`` /
``scripts/explore_batch.py``. Measurements compile into memory only (``compile_cache=False``), so
tuning never fills the user's compile cache with probe graphs.

Cost model fit (why: compiling every candidate bucket would take longer than the tuning saves):
a few context buckets ``C`` are compiled and timed, and ``p0 + p1*C + p2*C**2`` (non-negative least
squares) interpolates the rest; chunk graphs ``C x W`` add ``attn*C*W`` (fitted from the measured
chunk graphs, else ``p2``); a decode call generating ``k`` tokens at width ``W`` is timed for two
values of ``k``, the slope is the per-token cost, fitted as ``d0 + d1*W``, the intercept the per-call
overhead; compile seconds are fitted linearly in ``C`` and ``W``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.core import sharding
from aotlm.core.contract import GraphHost
from aotlm.core.memory import GIB, plan_for_checkpoint
from aotlm.generate import generation, params
from aotlm.tune.lengths import LengthDist
from aotlm.tune.optimise import CostModel


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (exhaustive over column subsets: 2-3 columns)."""
    best, best_r = np.zeros(x.shape[1]), float("inf")
    for r in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), r):
            coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (coef >= 0).all():
                res = float(np.sum((x[:, cols] @ coef - y) ** 2))
                if res < best_r:
                    best_r, best = res, np.zeros(x.shape[1])
                    best[list(cols)] = coef
    return best


def _spread(xs: Sequence[int], k: int) -> list[int]:
    xs = sorted(xs)
    idx = np.unique(np.round(np.linspace(0, len(xs) - 1, min(k, len(xs)))).astype(int))
    return [xs[i] for i in idx]


def _median_time(fn: Callable, runs: int) -> float:
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _prefill_call(model: GraphHost, c: int, w: int):
    """One prefill graph call, exactly as ``model.encode`` makes it."""
    b, start = model.batch_size, (0 if w == c else w - c)
    tok = model.put(np.zeros((b, c), np.int32))
    pos = model.put(np.broadcast_to(np.arange(start, start + c, dtype=np.int32), (b, c)).copy())
    exe = model.executable(("prefill", c, w))
    rows = model.put(np.full(b, -1, np.int32))  # every row the base model

    def run():
        logits, model.cache = exe(
            model.params, model.cache, tok, pos, model.put(np.int32(start)), model.put(np.int32(c - 1)), rows
        )
        sharding.fetch(logits)

    return run


def _decode_call(model: GraphHost, w: int, k: int):
    """One decode graph call generating ``k`` tokens, with the state ``generation.run`` builds."""
    b, start = model.batch_size, max(1, w - k - 1)
    ids = np.ones((b, start), np.int32)
    positions = np.broadcast_to(np.arange(start, dtype=np.int32), (b, start))
    host = generation.initial_state(
        model, ids, np.ones_like(ids), positions, b, np.full(b, start + k), params.GenerationConfig()
    )
    host.limit = np.int32(start + k)
    exe = model.executable(("decode", w))

    def run():
        model.cache, st = exe(model.params, model.cache, model.put_tree(host))
        sharding.fetch(st.idx)

    return run


def measure(
    path: str,
    c_cands: Sequence[int],
    w_cands: Sequence[int],
    batch_size: int = 1,
    amp: str = "f32",
    runs: int = 3,
    points: int = 4,
    min_prompt: int = 1,
    log: Callable = print,
) -> tuple[CostModel, list[dict]]:
    """Compile and time a few prefill / chunk / decode graphs; fit the ``CostModel``.

    Measured points are spread over the candidates the traffic can use: context buckets from the
    first one covering ``min_prompt``, token buckets above ``min_prompt`` (the first decode slot).
    """
    lo_c = min((c for c in c_cands if c >= min_prompt), default=min(c_cands))
    lo_w = max((w for w in w_cands if w <= min_prompt), default=0)
    w_pts = _spread([w for w in w_cands if w > lo_w] or w_cands, max(2, points - 1))
    c_pts = _spread([c for c in c_cands if lo_c <= c < w_pts[-1]] or [min(c_cands)], points)
    model = AutoModelForSampling.from_pretrained(
        path,
        batch_size=batch_size,
        n_positions=w_pts,
        context_length_estimate=c_pts,
        amp=amp,
        compile_cache=False,
    )
    rows: list[dict] = []
    k1, k2 = 1, 17
    for key in model.graph_keys():
        model.compile_graph(key)
        comp = model.compile_report[-1]["seconds"]
        if key[0] == "select":
            rows.append(dict(graph="select", compile_s=comp))
            continue
        if key[0] == "prefill":
            t = _median_time(_prefill_call(model, key[1], key[2]), runs)
            rows.append(dict(graph="prefill", c=key[1], w=key[2], seconds=t, compile_s=comp))
        else:
            w = key[1]
            ka, kb = min(k1, w - 1), min(k2, w - 1)
            ta = _median_time(_decode_call(model, w, ka), runs) if ka > 0 else 0.0
            tb = _median_time(_decode_call(model, w, kb), runs)
            tok = (tb - ta) / (kb - ka) if kb > ka else tb
            if tok <= 0:  # noise swamped the difference: charge the whole long call per token
                tok, ta, ka = tb / kb, 0.0, 0
            rows.append(
                dict(graph="decode", w=w, token_s=tok, call_s=max(0.0, ta - ka * tok), compile_s=comp)
            )
        log(f"  measured {key[0]} {'x'.join(map(str, key[1:]))}: " + _fmt_row(rows[-1]))
    return fit_cost_model(rows), rows


def _fmt_row(r: dict) -> str:
    if r["graph"] == "prefill":
        return f"{r['seconds'] * 1e3:.1f} ms (compile {r['compile_s']:.1f} s)"
    tok, call = r["token_s"] * 1e3, r["call_s"] * 1e3
    return f"{tok:.2f} ms/token + {call:.1f} ms/call (compile {r['compile_s']:.1f} s)"


def fit_cost_model(rows: list[dict]) -> CostModel:
    sq = [r for r in rows if r["graph"] == "prefill" and r["c"] == r["w"]]
    ch = [r for r in rows if r["graph"] == "prefill" and r["c"] != r["w"]]
    de = [r for r in rows if r["graph"] == "decode"]
    c = np.array([r["c"] for r in sq], float)
    p = _nnls(np.stack([np.ones_like(c), c, c * c], 1), np.array([r["seconds"] for r in sq]))
    base = lambda x: p[0] + p[1] * x + p[2] * x * x
    attn = [max(0.0, (r["seconds"] - base(r["c"])) / (r["c"] * r["w"])) for r in ch]
    w = np.array([r["w"] for r in de], float)
    d = _nnls(np.stack([np.ones_like(w), w], 1), np.array([r["token_s"] for r in de]))
    pre = [r for r in rows if r["graph"] == "prefill"]
    cc = np.array([r["c"] for r in pre], float)
    cp = _nnls(np.stack([np.ones_like(cc), cc], 1), np.array([r["compile_s"] for r in pre]))
    cd = _nnls(np.stack([np.ones_like(w), w], 1), np.array([r["compile_s"] for r in de]))
    return CostModel(
        p0=float(p[0]),
        p1=float(p[1]),
        p2=float(p[2]),
        attn=float(np.median(attn)) if attn else float(p[2]),
        d0=float(d[0]),
        d1=float(d[1]),
        call=float(statistics.median(r["call_s"] for r in de)),
        cp0=float(cp[0]),
        cp1=float(cp[1]),
        cd0=float(cd[0]),
        cd1=float(cd[1]),
        cs=float(statistics.median([r["compile_s"] for r in rows if r["graph"] == "select"] or [0.0])),
    )


def _batch_inputs(reqs: Sequence[tuple[int, int]], vocab: int, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """Left-padded prompts + attention mask for one batch call, and its max_new_tokens."""
    p_len = max(p for p, _ in reqs)
    ids = np.zeros((len(reqs), p_len), np.int32)
    mask = np.zeros((len(reqs), p_len), np.int32)
    for i, (p, _) in enumerate(reqs):
        ids[i, p_len - p :] = rng.integers(0, vocab, p)
        mask[i, p_len - p :] = 1
    return ids, mask, max(n for _, n in reqs)


def _run(model, reqs, rng) -> float:
    ids, mask, new = _batch_inputs(reqs, model.cfg.vocab_size, rng)
    t0 = time.perf_counter()
    model.sample(ids, max_new_tokens=new, attention_mask=mask)
    return time.perf_counter() - t0


def load_compiled(path: str, ctx, tg, batch_size: int = 1, amp: str = "f32", compile_all: bool = True):
    """A model with these buckets, every graph compiled (or, ``compile_all=False``, on first use)."""
    model = AutoModelForSampling.from_pretrained(
        path,
        batch_size=batch_size,
        n_positions=list(tg),
        context_length_estimate=list(ctx),
        amp=amp,
        compile_cache=False,
    )
    t0 = time.perf_counter()
    if compile_all:
        model.compile()
    return model, time.perf_counter() - t0


def replay(
    path: str,
    configs: dict[str, tuple[Sequence[int], Sequence[int]]],
    requests: Sequence[tuple[int, int]],
    amp: str = "f32",
    seed: int = 0,
    batch_size: int = 1,
    log: Callable = print,
) -> dict[str, dict]:
    """Run the same requests (in calls of ``batch_size``) through every config, round-robin.

    The order of the configs alternates per call, so machine noise hits both alike.
    """
    out = {}
    models = {}
    calls = [list(requests[i : i + batch_size]) for i in range(0, len(requests), batch_size)]
    for name, (ctx, tg) in configs.items():
        models[name], secs = load_compiled(path, ctx, tg, batch_size, amp)
        out[name] = dict(graphs=len(models[name].graph_keys()), compile_s=secs, latencies=[])
        log(f"  {name}: {out[name]['graphs']} graphs compiled in {secs:.1f} s")
        _run(models[name], calls[0], np.random.default_rng(seed))  # warm-up, not counted
    names = list(models)
    for i, reqs in enumerate(calls):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name]["latencies"].append(_run(models[name], reqs, np.random.default_rng(seed + i)))
        if (i + 1) % 10 == 0:
            log(f"  replayed {i + 1}/{len(calls)} calls")
    return out


def summary(latencies: Sequence[float]) -> dict:
    a = np.asarray(latencies) * 1e3
    return dict(mean=float(a.mean()), p50=float(np.percentile(a, 50)), p99=float(np.percentile(a, 99)))


def fitting_batch(path: str, n_positions: int, memory_gb: float, amp: str = "f32", cap: int = 4096) -> int:
    """Largest batch whose weights + KV cache fit ``memory_gb`` per ``aotlm.core.memory`` (0 if none)."""
    fits = lambda b: (
        plan_for_checkpoint(path, b, n_positions, amp=amp)["total_bytes_per_device"] <= memory_gb * GIB
    )
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def batch_candidates(max_fit: int, max_batch: int) -> list[int]:
    top = min(max_fit, max_batch)
    out = [1 << k for k in range(20) if 1 << k <= top]
    return sorted(set(out) | ({max_fit} if 0 < max_fit <= max_batch else set()))


def explore_batch(
    path: str,
    dist: LengthDist,
    ctx,
    tg,
    batch_sizes: Sequence[int],
    n_batches: int = 3,
    amp: str = "f32",
    seed: int = 0,
    log: Callable = print,
) -> list[dict]:
    """Generated tokens/s and batch latency at each batch size (each row a full batch of requests)."""
    rows = []
    for b in batch_sizes:
        model, _ = load_compiled(path, ctx, tg, b, amp, compile_all=False)
        reqs = dist.sample(b * (n_batches + 1), seed)
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        _run(model, reqs[:b], rng)  # warm-up: compiles the graphs these requests use
        secs = time.perf_counter() - t0
        lat, toks = [], 0
        for i in range(1, n_batches + 1):
            batch = reqs[i * b : (i + 1) * b]
            lat.append(_run(model, batch, rng))
            toks += sum(n for _, n in batch)
        s = summary(lat)
        rows.append(dict(batch=b, compile_s=secs, tok_s=toks / sum(lat), **s))
        log(f"  batch {b}: {toks / sum(lat):.1f} tok/s, median batch latency {s['p50']:.0f} ms")
        del model
    return rows


def recommend(rows: list[dict], max_latency_ms: float | None) -> dict | None:
    """Highest throughput whose median batch latency is within the limit."""
    ok = [r for r in rows if max_latency_ms is None or r["p50"] <= max_latency_ms]
    return max(ok, key=lambda r: r["tok_s"]) if ok else None
