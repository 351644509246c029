"""Subprocess worker for tests/core/test_sharding.py (multi-device runs need XLA_FLAGS before jax import).

    python tests/support/tp_worker.py single <job.json>   # every tp / GQA case on 8 forced CPU devices
    python tests/support/tp_worker.py multi <job.json>    # one process of a multi-process tp mesh

Writes a JSON result (tokens, logits, shard sizes, HLO collective counts, memory checks) to
``job["out"]``; test_sharding.py makes the assertions, so a failure shows the real numbers.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

MODE, JOB = sys.argv[1], json.loads(open(sys.argv[2]).read())
DEVICES = 8 if MODE == "single" else JOB["local_devices"]
TEST_FLAGS = os.environ.get("AOTLM_TEST_XLA_FLAGS", "")  # tests/conftest.py
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES} {TEST_FLAGS}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from aotlm.core import distributed  # noqa: E402

if MODE == "multi":
    distributed.initialize(initialization_timeout=60)  # from $AOTLM_* (set by the test)

from aotlm import AutoModelForSampling  # noqa: E402
from aotlm.core import memory, sharding  # noqa: E402
from aotlm.core.compile_cache import CompileCache  # noqa: E402

N_POS, CTX, NEW = 64, 64, 16  # one prefill + one decode graph per model


def prompts(batch: int, vocab: int):
    rng = np.random.default_rng(0)
    lengths = [5 + (7 * i) % 11 for i in range(batch)]
    n = max(lengths)
    ids = np.zeros((batch, n), np.int64)
    mask = np.zeros((batch, n), np.int64)
    for i, length in enumerate(lengths):
        ids[i, n - length :] = rng.integers(0, vocab, length)
        mask[i, n - length :] = 1
    return ids, mask


def collectives(hlo: str) -> dict:
    """Result shapes of every collective op in an HLO module, by kind."""
    out: dict = {}
    for kind in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        pat = rf"= (\S+) {kind}(?:-start)?\("
        out[kind] = [re.sub(r"\{[^}]*\}", "", s) for s in re.findall(pat, hlo)]
    return out


def shard_report(model) -> dict:
    """Per-device bytes and whether every sharded leaf holds exactly 1/tp per device."""
    tp = model.tp_degree
    bad, n_sharded = [], 0
    dev0 = model.mesh.devices.flat[0]
    flat = jax.tree_util.tree_flatten_with_path(model.params)[0]
    w_dev0 = 0
    for path, leaf in flat:
        spec = leaf.sharding.spec
        for sh in leaf.addressable_shards:
            if sh.device == dev0:
                w_dev0 += sh.data.nbytes
        if sharding.TP in tuple(spec):
            n_sharded += 1
            for sh in leaf.addressable_shards:
                if sh.data.size * tp != leaf.size:
                    bad.append(f"{jax.tree_util.keystr(path)}: {sh.data.shape} of {leaf.shape}")
    cache = jax.tree.leaves(model.cache)
    c_dev0 = sum(sh.data.nbytes for x in cache for sh in x.addressable_shards if sh.device == dev0)
    return {"bad": bad, "n_sharded": n_sharded, "weights_dev0": w_dev0, "cache_dev0": c_dev0}


def run_case(path: str, tp: int, gqa: str | None, batch: int, cache_dir=None) -> dict:
    t0 = time.perf_counter()
    m = AutoModelForSampling.from_pretrained(
        path,
        batch_size=batch,
        n_positions=N_POS,
        context_length_estimate=CTX,
        tp_degree=tp,
        gqa=gqa,
        compile_cache=cache_dir if cache_dir else False,
    )
    m.compile()
    ids, mask = prompts(batch, m.cfg.vocab_size)
    logits = m.forward(ids, attention_mask=mask)
    tokens = m.sample(ids, max_new_tokens=NEW, attention_mask=mask)
    scores = m.score(ids, attention_mask=mask)  # vocabulary-sharded log-softmax under tp
    rep = shard_report(m)
    shapes = memory.estimate_param_shapes(m.cfg, biases=m.cfg.model_type == "gpt2")
    plan = memory.memory_plan(m.cfg, batch, N_POS, m.amp, tp, m.gqa, shapes)
    hlo = {k[0]: collectives(exe.as_text()) for k, exe in m._executables.items() if hasattr(exe, "as_text")}
    return {
        "tp": tp,
        "gqa": m.gqa,
        "batch": batch,
        "n_layers": m.cfg.n_layers,
        "hidden": m.cfg.hidden_size,
        "tokens": tokens.tolist(),
        "logits": np.asarray(logits).tolist(),
        "logprobs": scores.logprobs.tolist(),
        "is_greedy": scores.is_greedy.tolist(),
        "shards": rep,
        "plan": plan,
        "hlo": hlo,
        "report": m.compile_report,
        "seconds": time.perf_counter() - t0,
        "mesh": [d.id for d in m.mesh.devices.flat],
    }


def single() -> dict:
    res: dict = {"cases": []}
    batch = JOB["batch"]
    for name, tp, gqa in JOB["cases"]:
        cache_dir = JOB["cache_dir"] if [name, tp, gqa] in JOB["cached"] else None
        r = run_case(JOB[name], tp, gqa, batch, cache_dir)
        r["model"] = name
        res["cases"].append(r)
        print(f"{name} tp={tp} {r['gqa']}: {r['seconds']:.1f}s", flush=True)
    # compile cache: entries of both meshes coexist; reloading tp=2 hits every graph
    cc = CompileCache(JOB["cache_dir"])
    res["entries"] = [e["fields"]["env"]["mesh"]["shape"] for e in cc.entries()]
    name, tp, gqa = JOB["cached"][0]
    r = run_case(JOB[name], tp, gqa, batch, JOB["cache_dir"])
    res["reload"] = {"tokens": r["tokens"], "hits": [i["hit"] for i in r["report"]], "tp": tp, "model": name}
    res["lora"] = [lora_case(tp, gqa, batch) for tp, gqa in JOB["lora_cases"]] if JOB.get("lora") else []
    return res


def lora_case(tp: int, gqa: str | None, batch: int) -> dict:
    """Llama with a per-row LoRA adapter on every projection, half the rows using it."""
    m = AutoModelForSampling.from_pretrained(
        JOB["llama"], batch_size=batch, n_positions=N_POS, context_length_estimate=CTX, tp_degree=tp, gqa=gqa,
        compile_cache=False, lora_adapters={"a": JOB["lora"]},
    )  # fmt: skip
    ids, mask = prompts(batch, m.cfg.vocab_size)
    names = ["a", None] * (batch // 2)
    layer = m.params["layers"][0]
    return {
        "tp": tp,
        "gqa": m.gqa,
        "logits": m.forward(ids, mask, adapter=names).tolist(),
        "tokens": m.sample(ids, attention_mask=mask, max_new_tokens=8, adapter=names).tolist(),
        "shards": {k: [list(layer[k].shape), list(layer[k].addressable_shards[0].data.shape)]
                   for k in ("wq_lora_b", "wk_lora_b", "wo_lora_a", "w_down_lora_a", "w_up_lora_b")},
    }  # fmt: skip


def multi() -> dict:
    t0 = time.perf_counter()
    info = distributed.describe()
    m = AutoModelForSampling.from_pretrained(
        JOB["llama"],
        batch_size=JOB["batch"],
        n_positions=N_POS,
        context_length_estimate=CTX,
        tp_degree=jax.device_count(),
        compile_cache=False,
    )
    ids, mask = prompts(JOB["batch"], m.cfg.vocab_size)
    logits = m.forward(ids, attention_mask=mask)
    tokens = m.sample(ids, max_new_tokens=NEW, attention_mask=mask)
    local = [d.id for d in m.mesh.devices.flat if d.process_index == jax.process_index()]
    return {
        **info,
        "tp": m.tp_degree,
        "gqa": m.gqa,
        "tokens": tokens.tolist(),
        "logits": np.asarray(logits).tolist(),
        "local_mesh_devices": local,
        "seconds": time.perf_counter() - t0,
    }


if __name__ == "__main__":
    result = single() if MODE == "single" else multi()
    with open(JOB["out"], "w") as f:
        json.dump(result, f)
    if MODE == "multi":
        distributed.shutdown()
