"""Choosing bucket lists for a length distribution: a cost model and an exact optimiser.

Why exact: bucket choice is a small discrete problem (a few dozen candidate edges), and the
expected latency splits into a prefill part that depends only on the context buckets and a decode
part that depends only on the token buckets, each a sum over the gaps between consecutive edges.
Dynamic programming over sorted edges therefore finds the optimum, with Pareto labels
(cost, compile seconds) so a compile budget is honoured exactly too.

Which graphs a request uses (engine/buckets.py): a prompt of ``P`` tokens runs the ``C x C``
prefill graph of the smallest context bucket ``C >= P`` (tuned configs always have a context
bucket covering the longest prompt, so they never chunk); the token fed at cache slot ``s`` runs
in the decode graph of the smallest token bucket ``W > s``, one call per bucket visited. A config
compiles ``|ctx| + |tg| + #{W in tg: W > max(ctx)}`` graphs (the last are chunk graphs), plus the
one first-token selection graph every config has (its run time is the same for every config).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aotlm.core import buckets as bk
from aotlm.tune.lengths import LengthDist, from_counts


@dataclass(frozen=True)
class CostModel:
    """Seconds per graph call, fitted from measurements (see ``aotlm.tune.measure``).

    prefill ``C x C``: ``p0 + p1*C + p2*C**2``; chunk ``C x W``: that plus ``attn*C*W``; decode
    per token at width ``W``: ``d0 + d1*W`` plus ``call`` per decode call; compile seconds:
    ``cp0 + cp1*C`` per prefill graph and ``cd0 + cd1*W`` per decode graph.
    """

    p0: float
    p1: float
    p2: float
    attn: float
    d0: float
    d1: float
    call: float
    cp0: float = 0.0
    cp1: float = 0.0
    cd0: float = 0.0
    cd1: float = 0.0
    cs: float = 0.0  # compile seconds of the one first-token ("select") graph every config has

    def prefill_s(self, c: int, w: int | None = None) -> float:
        t = self.p0 + self.p1 * c + self.p2 * c * c
        return t if w is None or w == c else t + self.attn * c * w

    def token_s(self, w: int) -> float:
        return self.d0 + self.d1 * w

    def compile_s(self, key: tuple) -> float:
        if key[0] == "select":
            return self.cs
        if key[0] == "prefill":
            return self.cp0 + self.cp1 * key[1]
        return self.cd0 + self.cd1 * key[1]


@dataclass(frozen=True)
class Choice:
    ctx: tuple[int, ...]
    tg: tuple[int, ...]
    expected_s: float

    def graph_keys(self) -> list[tuple]:
        return graph_keys(self.ctx, self.tg)


def graph_keys(ctx: Sequence[int], tg: Sequence[int]) -> list[tuple]:
    """The graphs ``CausalLMForSampling.graph_keys`` would compile for these buckets."""
    return bk.graph_keys(ctx, tg)


def default_buckets(n_positions: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """aotlm's defaults for an int ``n_positions``: powers of two, context = half of each."""
    tg = bk.token_buckets(int(n_positions))
    return bk.context_buckets(None, tg), tg


def request_s(cm: CostModel, ctx: Sequence[int], tg: Sequence[int], p: int, n: int) -> float:
    """Modelled latency of one request, straight from the engine's bucket rules (chunking included)."""
    t = sum(cm.prefill_s(s.bucket, s.width) for s in bk.prefill_plan(p, ctx, tg))
    ws = [bk.decode_bucket(tg, s) for s in range(p, p + n - 1)]
    return t + sum(cm.token_s(w) for w in ws) + cm.call * len(set(ws))


def expected_s(cm: CostModel, ctx: Sequence[int], tg: Sequence[int], dist: LengthDist) -> float:
    """Expected seconds per request (the objective; also the evaluator used by the tests)."""
    ctx, tg = tuple(sorted(ctx)), tuple(sorted(tg))
    if dist.max_total > max(tg):
        raise ValueError(f"requests of {dist.max_total} tokens do not fit n_positions={max(tg)}")
    return float(
        sum(w * request_s(cm, ctx, tg, int(p), int(n)) for p, n, w in zip(*_arrays(dist), strict=True))
    )


def _arrays(dist: LengthDist):
    return dist.prompt_len, dist.new_tokens, dist.weight


def batch_dist(dist: LengthDist, batch: int, n: int = 4096, seed: int = 0) -> LengthDist:
    """Distribution of a full batch's (longest prompt, most new tokens): what a batch call pays."""
    if batch <= 1:
        return dist
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(dist.weight), size=(n, batch), p=dist.weight)
    return from_counts(dist.prompt_len[idx].max(1), dist.new_tokens[idx].max(1), np.ones(n), "batches")


def candidate_edges(dist: LengthDist, granularity: int, max_width: int) -> tuple[list[int], list[int]]:
    """Context and token-bucket candidates: multiples of ``granularity``, powers of two, exact maxima.

    Token candidates stop at the first one covering the longest request (a larger top bucket only
    costs memory); context candidates may reach it too (a context bucket as wide as the largest
    token bucket removes chunk graphs).
    """
    g, top_p, top_t = int(granularity), dist.max_prompt, dist.max_total
    if top_t > max_width:
        raise ValueError(
            f"requests need {top_t} positions (prompt + new tokens) but at most {max_width} fit "
            "(model positions, --n-positions or --memory-gb); shorten the requests or raise the limit"
        )
    grid = set(range(g, max_width + 1, g)) | {1 << k for k in range(20) if g <= 1 << k <= max_width}
    w = sorted(x for x in grid | {top_t} if x <= max_width)
    w_top = min(x for x in w if x >= top_t)
    w = [x for x in w if x <= w_top]
    c = sorted(x for x in set(w) | {top_p} if x <= w_top)
    return c, w


def _prune(labels: list[tuple]) -> list[tuple]:
    """Pareto front on (cost, compile seconds): keep labels no other one beats on both."""
    out, best = [], float("inf")
    for lab in sorted(labels, key=lambda x: (x[1], x[0])):
        if lab[0] < best - 1e-15:
            out.append(lab)
            best = lab[0]
    return out


def _chains(edges, seg, unit, ctime, limit_k, budget):
    """``F[j][k]``: Pareto labels (cost, ctime, edges) of edge chains ending at ``j``, ``k`` units."""
    m = len(edges)
    F = [dict() for _ in range(m)]
    for j in range(m):
        labs = {}
        if unit[j] <= limit_k and ctime[j] <= budget:
            labs.setdefault(unit[j], []).append((seg[-1][j], ctime[j], (edges[j],)))
        for i in range(j):
            for k, ls in F[i].items():
                k2 = k + unit[j]
                if k2 > limit_k:
                    continue
                for cost, ct, chain in ls:
                    if ct + ctime[j] <= budget:
                        labs.setdefault(k2, []).append((cost + seg[i][j], ct + ctime[j], chain + (edges[j],)))
        F[j] = {k: _prune(v) for k, v in labs.items()}
    return F


def _prefill_segments(cm: CostModel, dist: LengthDist, c: list[int]):
    """seg[i][j]: expected prefill seconds of prompts in (c_i, c_j] run in bucket c_j (i=-1: from 0)."""
    p, w = dist.prompt_len, dist.weight
    mass = lambda lo, hi: float(w[(p > lo) & (p <= hi)].sum())
    seg = {i: {} for i in range(-1, len(c))}
    for j, cj in enumerate(c):
        for i in range(-1, j):
            seg[i][j] = mass(c[i] if i >= 0 else 0, cj) * cm.prefill_s(cj)
    return seg


def _decode_segments(cm: CostModel, dist: LengthDist, wl: list[int]):
    """seg[i][j]: expected decode seconds of slots in [w_i, w_j) run in bucket w_j, plus call overheads."""
    p, n, wt = dist.prompt_len, dist.new_tokens, dist.weight
    first, last = p, p + n - 2  # slots fed to decode graphs; none when n == 1
    seg = {i: {} for i in range(-1, len(wl))}
    for j, wj in enumerate(wl):
        for i in range(-1, j):
            lo, hi = (wl[i] if i >= 0 else 0), wj - 1
            steps = np.clip(np.minimum(last, hi) - np.maximum(first, lo) + 1, 0, None)
            calls = (steps > 0).astype(float)
            seg[i][j] = float(np.sum(wt * (steps * cm.token_s(wj) + calls * cm.call)))
    return seg


def optimise(
    cm: CostModel,
    dist: LengthDist,
    c_cands: Sequence[int],
    w_cands: Sequence[int],
    max_graphs: int | None = None,
    compile_budget_s: float | None = None,
    max_width: int | None = None,
) -> Choice:
    """Context and token buckets minimising expected seconds per request, exactly, under the limits.

    Limits: at most ``max_graphs`` compiled graphs, at most ``compile_budget_s`` modelled compile
    seconds, largest token bucket <= ``max_width`` (n_positions / memory); the largest context
    bucket always covers the longest prompt and every request fits the largest token bucket.
    """
    c = sorted({int(x) for x in c_cands})
    wl = sorted({int(x) for x in w_cands if max_width is None or x <= max_width})
    top_p, top_t = dist.max_prompt, dist.max_total
    if not wl or wl[-1] < top_t:
        raise ValueError(f"no token-bucket candidate covers the longest request ({top_t} positions)")
    if c[-1] < top_p:
        raise ValueError(f"no context-bucket candidate covers the longest prompt ({top_p} tokens)")
    # every config also has the one first-token ("select") graph: take it off both limits
    limit = max_graphs - 1 if max_graphs is not None else len(c) + 2 * len(wl)
    budget = float("inf") if compile_budget_s is None else float(compile_budget_s) - cm.cs
    zero = compile_budget_s is None  # without a budget, compile time never matters: one label per state
    ctime_c = [0.0 if zero else cm.compile_s(("prefill", x, x)) for x in c]
    fc = _chains(c, _prefill_segments(cm, dist, c), [1] * len(c), ctime_c, limit, budget)
    seg_w = _decode_segments(cm, dist, wl)
    best = None
    for jc, cmax in enumerate(c):
        if cmax < top_p:
            continue
        unit = [1 + (w > cmax) for w in wl]
        ct_w = [
            0.0 if zero else cm.compile_s(("decode", w)) + (w > cmax) * cm.compile_s(("prefill", cmax, w))
            for w in wl
        ]
        fw = _chains(wl, seg_w, unit, ct_w, limit, budget)
        for jw, wmax in enumerate(wl):
            if wmax < max(top_t, cmax):
                continue
            for kc, lc in fc[jc].items():
                for kw, lw in fw[jw].items():
                    if kc + kw > limit:
                        continue
                    for a in lc:
                        for b in lw:
                            if a[1] + b[1] <= budget and (best is None or a[0] + b[0] < best[0] - 1e-15):
                                best = (a[0] + b[0], a[2], b[2])
    if best is None:
        budget_s = "no compile budget" if compile_budget_s is None else f"compile budget {compile_budget_s}s"
        raise ValueError(
            f"no bucket configuration fits max_graphs={max_graphs} and {budget_s}; "
            "raise --max-graphs or --compile-budget-s"
        )
    return Choice(tuple(best[1]), tuple(best[2]), best[0])
