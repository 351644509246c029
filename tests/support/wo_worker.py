"""Subprocess worker for tests/models/test_quant.py: int8 / fuse_qkv under tensor parallelism.

    python tests/support/wo_worker.py <job.json>

job: {"out", "cases": [[name, path, tp, gqa, quant, fuse]]}

Runs on 2 forced CPU devices (the count is fixed at jax import, hence the subprocess). Records
per case: last-position logits, greedy tokens, and per leaf the dtype, partition spec and
whether each device holds exactly 1/tp of a sharded leaf. The test makes the assertions.
"""

from __future__ import annotations

import json
import os
import sys

TEST_FLAGS = os.environ.get("AOTLM_TEST_XLA_FLAGS", "")  # tests/conftest.py
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {TEST_FLAGS}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from aotlm import AutoModelForSampling  # noqa: E402
from aotlm.core import sharding  # noqa: E402

N_POS, NEW = 32, 12


def leaves(model) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        spec = tuple(leaf.sharding.spec)
        even = all(sh.data.size * model.tp_degree == leaf.size for sh in leaf.addressable_shards)
        out[jax.tree_util.keystr(path)] = {
            "dtype": str(leaf.dtype),
            "spec": [str(s) for s in spec],
            "sharded_evenly": even if sharding.TP in spec else None,
        }
    return out


def run(path: str, tp: int, gqa: str | None, quant: str | None, fuse: bool) -> dict:
    m = AutoModelForSampling.from_pretrained(
        path,
        batch_size=2,
        n_positions=N_POS,
        context_length_estimate=N_POS,
        tp_degree=tp,
        gqa=gqa,
        quant=quant,
        fuse_qkv=fuse,
        compile_cache=False,
    )
    ids = np.random.default_rng(1).integers(0, m.cfg.vocab_size, (2, 9))
    logits = m.forward(ids)
    tokens = m.sample(ids, max_new_tokens=NEW)
    return {"gqa": m.gqa, "logits": logits.tolist(), "tokens": tokens.tolist(), "leaves": leaves(m)}


if __name__ == "__main__":
    job = json.loads(open(sys.argv[1]).read())
    results = [{"case": c, **run(*c[1:])} for c in job["cases"]]
    with open(job["out"], "w") as f:
        json.dump(results, f)
