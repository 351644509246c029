"""Memory plans count weights as stored: int8, int4 groups (with and without a minimum), the embedding
copy a tied lm_head gets, the kernels' vocab padding -- compared with a real model's parameters.

The comparison is exact: the plan reproduces each stored leaf's shape and dtype (``memory.Storage``),
so the bytes on device 0 must equal the sum of ``nbytes`` of device 0's shards, at tp=1 and tp=2
(one subprocess on 2 forced CPU devices, the device count being fixed before jax is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

QUANTS = ("none", "int8", "int4", "int4-asym", "bf16")


def measure(ckpts: list[str]) -> list[dict]:
    """Per checkpoint, tp and quant: device 0's stored weight bytes and the plan's (run in the child)."""
    import jax

    from aotlm import AutoModelForSampling
    from aotlm.core import memory

    out = []
    for ckpt in ckpts:
        for tp in (1, 2):
            for q in QUANTS:
                m = AutoModelForSampling.from_pretrained(
                    ckpt, quant=q, tp_degree=tp, batch_size=1, n_positions=32, compile_cache=False
                )
                leaves = jax.tree_util.tree_leaves(m.params)
                dev0 = sum(x.addressable_shards[0].data.nbytes for x in leaves)
                shapes = memory.estimate_param_shapes(m.cfg)
                plan = memory.memory_plan(m.cfg, 1, 32, m.amp, tp, m.gqa, shapes, quant=q)
                out.append(dict(ckpt=Path(ckpt).name, tp=tp, quant=q, real=dev0, plan=plan))
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    import transformers
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("memq")
    kw = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    kw.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ckpts = [
        str(make_checkpoint(root / name, transformers.LlamaConfig(**kw, tie_word_embeddings=tied)))
        for name, tied in (("tied", True), ("untied", False))
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    r = subprocess.run(
        [sys.executable, __file__, *ckpts], capture_output=True, text=True, timeout=600, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_plan_weight_bytes_equal_the_stored_params(cases):
    assert len(cases) == 2 * 2 * len(QUANTS)
    for c in cases:
        name = f"{c['ckpt']} tp={c['tp']} quant={c['quant']}"
        assert c["plan"]["weights_bytes_per_device"] == c["real"], name
    by = {(c["ckpt"], c["tp"], c["quant"]): c["real"] for c in cases}
    for ck in ("tied", "untied"):  # the storages really differ, and int4 is the smallest
        for tp in (1, 2):
            f32, i8, i4, i4a = (by[(ck, tp, q)] for q in ("none", "int8", "int4", "int4-asym"))
            assert f32 > i8 > i4a > i4, (ck, tp)
    assert {c["plan"]["weights"] for c in cases} == {"float32", "int8", "int4-g32", "int4-g32-asym", "bf16"}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1:])))
