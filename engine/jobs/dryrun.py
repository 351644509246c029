"""``batch-generate --dry-run``: the plan, from config files and the compile cache only.

Which graphs each group needs and which are already in the compile cache is decided without
reading weights: a *shape-only* model (same constructor, no weights, no KV cache) yields every
compile-cache key field except the parameter tree, and the cache's manifests are matched on
all of those fields. The parameter tree follows from the architecture, dtype and tp degree
(all matched), so this agrees with what ``compile()`` will find.
"""

from __future__ import annotations

import json

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.core.compile_cache import CompileCache, entry_key
from aotlm.core.memory import GIB, plan_for_checkpoint
from aotlm.jobs.plan import Group

IGNORED = ("param_tree",)


class _ShapeOnly(AutoModelForSampling):
    """The model's configuration without its weights (for cache keys only)."""

    def _load_weights(self, family):
        return None

    def _alloc_cache(self):
        return None


class _PerStage(Exception):
    """A pipelined model: each stage has its own graphs (listed by ``aotlm compile --dry-run``)."""


def _comparable(fields: dict) -> str:
    model = {k: v for k, v in fields["model"].items() if k not in IGNORED}
    return json.dumps({"graph": fields["graph"], "model": model, "env": fields["env"]}, sort_keys=True)


def graph_status(g: Group, opts: dict) -> list[tuple[tuple, bool]]:
    """[(graph key, already in the compile cache)] for one group's model configuration."""
    return model_graph_status(g.key[0], g.model_kwargs(opts), opts.get("cache_dir"))


def model_graph_status(checkpoint: str, model_kwargs: dict, cache_dir) -> list[tuple[tuple, bool]]:
    """[(graph key, already in the compile cache)] of ``from_pretrained(checkpoint, **model_kwargs)``."""
    model_kwargs = dict(model_kwargs)
    if (model_kwargs.pop("pp_degree", None) or 1) > 1:  # stages list their own graphs
        raise ValueError("no graph plan for pp_degree > 1")
    m = _ShapeOnly(checkpoint, **{**model_kwargs, "compile_cache": cache_dir})
    cache = CompileCache.create(cache_dir)
    have = set()
    for e in cache.entries():
        try:
            have.add(_comparable(e["fields"]))
        except (KeyError, TypeError):
            continue
    fp = m.fingerprint()
    out = []
    for key in m.graph_keys():
        _, fields = entry_key(fp, key, m.mesh)
        out.append((key, _comparable(json.loads(json.dumps(fields))) in have))
    return out


def plan_rows(groups: list[Group], opts: dict, todo: dict) -> list[tuple]:
    """One table row per group: model, dtype, records, batches, buckets, graphs, memory."""
    out = []
    for k, g in enumerate(groups, 1):
        ckpt, amp, _ = g.key
        try:
            if (opts.get("pp_degree") or 1) > 1:
                raise _PerStage()
            status = graph_status(g, opts)
            cached = sum(c for _, c in status)
            graphs = f"{len(status) - cached} compile, {cached} cached"
        except _PerStage:
            status, graphs = [], "per stage (pp)"
        except Exception as e:  # the plan must not fail where the run would not
            status, graphs = [], f"unknown ({type(e).__name__})"
        mem = plan_for_checkpoint(ckpt, **g.model_kwargs(opts))
        n = todo[id(g)]
        buckets = sorted({"x".join(map(str, key[1:])) for key, _ in status if key[0] == "decode"})
        ctx = sorted({key[1] for key, _ in status if key[0] == "prefill"})
        out.append(
            (
                k,
                ckpt,
                amp,
                f"{n}/{len(g.records)}",
                -(-n // opts["batch_size"]),
                f"ctx {','.join(map(str, ctx))} / tok {','.join(buckets)}",
                graphs,
                _size(mem["total_bytes_per_device"]),
            )
        )
    return out


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


PLAN_HEADER = ("group", "model", "dtype", "records", "batches", "buckets", "graphs", "memory/device")
