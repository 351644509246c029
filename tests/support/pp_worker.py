"""Subprocess worker for tests/api/test_pipelined.py: pipeline parallelism on 8 forced CPU devices.

    python tests/support/pp_worker.py <job.json>          # every case on 8 forced CPU devices
    python tests/support/pp_worker.py <job.json> multi    # one process of a 2-process pipeline ($AOTLM_*)

Runs every case against the one-stage model and writes the raw results (tokens, logits, bytes,
compile counts, error messages) to ``job["out"]``; test_pipelined.py makes the assertions.
"""

from __future__ import annotations

import json
import os
import sys

JOB = json.loads(open(sys.argv[1]).read())
MULTI = sys.argv[2:] == ["multi"]
DEVICES = JOB.get("local_devices", 2) if MULTI else 8
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={DEVICES} {os.environ.get('AOTLM_TEST_XLA_FLAGS', '')}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from aotlm.core import distributed  # noqa: E402

if MULTI:
    distributed.initialize(initialization_timeout=60)  # from $AOTLM_* (set by the test), before any work

sys.path.insert(0, os.path.dirname(__file__))
from compile_counter import count_compiles  # noqa: E402

from aotlm import AutoModelForSampling  # noqa: E402
from aotlm.core import memory  # noqa: E402

PATH, CACHE = JOB["llama"], JOB["cache_dir"]
SHAPES = dict(n_positions=64, context_length_estimate=[16])
NEW = 12


def prompts(batch: int):
    rng = np.random.default_rng(batch)
    lengths = [11, 4, 8, 1][:batch] if batch > 1 else [9]
    width = max(lengths)
    ids, mask = np.zeros((batch, width), np.int64), np.zeros((batch, width), np.int64)
    for i, n in enumerate(lengths):
        ids[i, width - n :], mask[i, width - n :] = rng.integers(0, 101, n), 1
    return ids, mask


def device_bytes(model, tree_of) -> dict:
    out: dict = {}
    for st in getattr(model, "stages", [model]):
        for leaf in jax.tree.leaves(tree_of(st)):
            for sh in leaf.addressable_shards:
                out[sh.device.id] = out.get(sh.device.id, 0) + sh.data.nbytes
    return out


def run(model, batch: int) -> dict:
    ids, mask = prompts(batch)
    greedy = model.sample(ids, attention_mask=mask, max_new_tokens=NEW)
    seeds = list(range(7, 7 + batch))
    sampled = model.sample(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=20, seed=seeds)
    return {
        "greedy": greedy.tolist(),
        "sampled": sampled.tolist(),
        "logits": model.forward(ids, attention_mask=mask).tolist(),
    }


def case(pp: int, tp: int, batch: int, **kw) -> dict:
    model = AutoModelForSampling.from_pretrained(
        PATH, pp_degree=pp, tp_degree=tp, batch_size=batch, compile_cache=CACHE, **SHAPES, **kw
    )
    out = run(model.compile(), batch)
    out["weights"] = device_bytes(model, lambda st: st.params)
    out["caches"] = device_bytes(model, lambda st: getattr(st, "caches", st.cache))
    plan = memory.plan_for_checkpoint(
        PATH, batch_size=batch, tp_degree=tp, pp_degree=pp, quant=kw.get("quant"), **SHAPES
    )
    out["plan"] = {k: v for k, v in plan.items() if k != "graphs"}
    out["micro_batches"] = getattr(model, "micro_batches", 1)
    return out


def error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def main() -> dict:
    res: dict = {"cases": {}}
    for pp, tp in [(1, 1), (2, 1), (4, 1), (2, 2)]:
        for batch in (1, 4):
            res["cases"][f"{pp}x{tp}/b{batch}"] = case(pp, tp, batch)
    # warm start: a new model object compiles nothing; save/load too
    with count_compiles() as warm:
        m = AutoModelForSampling.from_pretrained(
            PATH, pp_degree=2, tp_degree=2, batch_size=4, compile_cache=CACHE, **SHAPES
        )
        again = run(m.compile(), 4)
    res["warm"] = {"compiles": warm, "greedy": again["greedy"], "hits": [r["hit"] for r in m.compile_report]}
    m.save(JOB["artifacts"])
    with count_compiles() as loaded:
        m2 = AutoModelForSampling.from_pretrained(
            PATH, pp_degree=2, tp_degree=2, batch_size=4, compile_cache=False, **SHAPES
        )
        res["loaded"] = {"greedy": run(m2.load(JOB["artifacts"]), 4)["greedy"]}
    res["loaded"]["compiles"] = loaded
    # weight options: int8 and int4 weights run the CPU kernels inside each stage
    for pp in (1, 2):
        res["cases"][f"int8 {pp}x1/b4"] = case(pp, 1, 4, quant="int8")
        res["cases"][f"int4 {pp}x1/b4"] = case(pp, 1, 4, quant="int4")
    # streaming and stopping criteria see every token
    m = AutoModelForSampling.from_pretrained(PATH, pp_degree=2, batch_size=4, compile_cache=CACHE, **SHAPES)
    puts: list = []

    class Streamer:
        def put(self, x):
            puts.append(np.asarray(x).tolist())

        def end(self):
            puts.append("end")

    ids, mask = prompts(4)
    streamed = m.sample(ids, attention_mask=mask, max_new_tokens=NEW, streamer=Streamer())
    res["stream"] = {"puts": puts, "greedy": streamed.tolist()}
    res["errors"] = {
        "pp3": error(lambda: AutoModelForSampling.from_pretrained(PATH, pp_degree=3, **SHAPES)),
        "devices": error(
            lambda: AutoModelForSampling.from_pretrained(PATH, pp_degree=4, tp_degree=4, **SHAPES)
        ),
        "beams": error(lambda: m.sample(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)),
        "serve": error(
            lambda: AutoModelForSampling.from_pretrained(
                PATH, pp_degree=2, continuous_batching=True, **SHAPES
            )
        ),
    }
    return res


def multi() -> dict:
    """One stage per process: pp=2 over 2 processes (tp = this process's device count)."""
    m = AutoModelForSampling.from_pretrained(
        PATH, pp_degree=2, tp_degree=jax.local_device_count(), batch_size=4, compile_cache=False, **SHAPES
    )
    out = run(m, 4)
    out["local_stages"] = [st.stage.index for st in m.stages if st.local]
    distributed.shutdown()
    return out


if __name__ == "__main__":
    result = multi() if MULTI else main()
    with open(JOB["out"], "w") as f:
        json.dump(result, f)
