"""Every supported family under tensor parallelism: tp=2 on 2 forced CPU devices gives the same greedy
tokens as tp=1 and last-position logits within 1e-4 (batch of 2 left-padded prompts, 12 new tokens).

All families run in ONE subprocess (``tests/support/tpf_worker.py``): the forced device count must be set
before jax is imported, and jax start-up is paid once. The worker records per-family results
(or a traceback) as JSON; each family is its own test id here, so a failure names the family.
Multi-query families (1 kv head) take ``gqa='replicated-heads'`` automatically; ALiBi families
use head counts that split into several heads per device (slopes must follow their heads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tpf_worker import CASES, TP

from aotlm.core import sharding
from aotlm.models import supported_model_types

WORKER = str(Path(__file__).parents[1] / "support" / "tpf_worker.py")
pytestmark = pytest.mark.slow  # ~2.5 min on 2 cores; tests/core/test_sharding.py covers tp in the default run


@pytest.fixture(scope="module")
def tpf_run(tmp_path_factory, ckpt_dir) -> dict:
    tmp = tmp_path_factory.mktemp("tpf")
    job = {"ckpt_dir": str(ckpt_dir), "out": str(tmp / "out.json"), "cases": list(CASES)}
    (tmp / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    proc = subprocess.run(
        [sys.executable, WORKER, str(tmp / "job.json")], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())["cases"]


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_tp1(tpf_run, name):
    r = tpf_run[name]
    assert "error" not in r, r.get("error")
    t1, t2 = r["tp1"], r["tp2"]
    k = t2["n_kv_heads"]
    # tp=2 really ran sharded: 2 devices, weights split, kv heads split (or repeated for MQA)
    assert t1["n_devices"] == 1 and t2["n_devices"] == TP
    assert t1["n_sharded_leaves"] == 0 and t2["n_sharded_leaves"] > 0
    assert t2["gqa"] == ("shard-over-heads" if k % TP == 0 else "replicated-heads")
    assert t2["kv_heads_per_device"] == k * sharding.kv_replication(k, TP, t2["gqa"]) // TP
    assert t1["kv_heads_per_device"] == k
    logits1, logits2 = np.array(t1["logits"]), np.array(t2["logits"])
    assert logits1.shape == (2, 101) and np.ptp(logits1, axis=-1).min() > 0.1  # not degenerate
    diff = float(np.abs(logits1 - logits2).max())
    assert diff <= 1e-4, f"{name}: tp=2 last-position logits differ from tp=1 by {diff}"
    assert t2["tokens"] == t1["tokens"], f"{name}: tp=2 greedy tokens differ from tp=1"


def test_every_supported_family_is_covered():
    assert sorted({mt for mt, _ in CASES.values()}) == supported_model_types()
