"""Memory plans count weights as stored: int8, fp8, int4 groups (with and without a minimum), bf16, the
embedding copy a tied lm_head gets, the kernels' vocab padding, a GGUF embedding kept as its blocks'
codes, a GGUF Q4_K file's own block scales under int4, a file mixing block types (each matrix in its
own form) -- compared with real models' parameters.

The comparison is exact (no tolerance): the plan reproduces each stored leaf's shape and dtype
(``memory.Storage``), so its bytes per device must equal the sum of ``nbytes`` of that device's shards,
at tp=1, tp=2 and pp=2 (one subprocess on 2 forced CPU devices, the device count being fixed before
jax is imported). Activations and executables are not part of either side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

QUANTS = ("none", "int8", "int4", "int4-asym", "bf16", "fp8")


def measure(ckpts: list[str]) -> list[dict]:
    """Per checkpoint, (tp, pp) and quant: each device's stored weight bytes and the plan's (in the child)."""
    import jax

    from aotlm import AutoModelForSampling
    from aotlm.core import memory
    from aotlm.models.checkpoint.resolve import resolve

    out = []
    for ckpt in ckpts:
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            gguf_file = ckpt.endswith(".gguf")  # default storage int4-a16 / int8, the lookup from its blocks
            # and Q4_K's own blocks under int4 (models.kscales; a tp shard splitting a block: f16 scales)
            # and Q6_K's (the tied lm_head's copy too: the embedding's blocks; tp=2 would split wo's block:
            # the default is int8 then); int8 re-rounds them per channel (a Q8_0 table's logits' copy: its
            # own groups)
            keeps = ckpt.endswith("Q4_K.gguf") or (ckpt.endswith("Q6_K.gguf") and tp == 1)
            keeps |= ckpt.endswith("Q8_0.gguf")  # int4 re-rounds a file without 4-bit blocks to 4 bits
            gguf_q = (None, "int4", "int8") if keeps else (None,)
            for q in gguf_q if gguf_file else QUANTS if pp == 1 else ("none", "int8", "int4"):
                kw = dict(quant=q, tp_degree=tp, pp_degree=pp, batch_size=1, n_positions=32)
                m = AutoModelForSampling.from_pretrained(ckpt, compile_cache=False, **kw)
                real: dict = {}
                for st in getattr(m, "stages", [m]):
                    for x in jax.tree_util.tree_leaves(st.params):
                        for sh in x.addressable_shards:
                            real[sh.device.id] = real.get(sh.device.id, 0) + sh.data.nbytes
                plan = memory.plan_for_checkpoint(resolve(ckpt), **kw)
                plan.pop("graphs")
                out.append(dict(ckpt=Path(ckpt).name, tp=tp, pp=pp, quant=q, real=real, plan=plan))
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    import transformers
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("memq")
    kw = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    kw.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ckpts = [
        str(make_checkpoint(root / name, transformers.LlamaConfig(**kw, tie_word_embeddings=tied)))
        for name, tied in (("tied", True), ("untied", False))
    ]
    # GGUF files (default storage: int8 matrices, the embedding kept as its blocks' codes for the lookup),
    # untied in Q4_K and tied in Q6_K (group 16, no offsets: the tied lm_head gets its own int8 copy, or
    # under int4 the embedding's blocks)
    from gguf import GGMLQuantizationType as T
    from gguf_builders import tiny_config, write_gguf

    # and tied in Q8_0 (its matrices and the lm_head's copy kept as int8 groups of 32 with f16 scales:
    # models.quant8), untied in Q5_1 (its 5-bit codes kept, models.q5scales; the lm_head's 1026 columns too,
    # padded to whole panels)
    files = (("untied", False, T.Q4_K), ("tied", True, T.Q6_K), ("tied8", True, T.Q8_0))
    # and a Q4_K_M-like mix (Q6_K, Q5_0 and Q8_0 matrices beside Q4_K ones: each matrix planned in its
    # own form, gguf.hf_types)
    mixed = {"ffn_down": T.Q6_K, "attn_v": T.Q5_0, "attn_k": T.Q8_0}
    for name, tied, qtype in (*files, ("untied5", False, T.Q5_1), ("mixed", False, T.Q4_K)):
        cfg = tiny_config("llama")
        cfg.tie_word_embeddings = tied
        hf = make_checkpoint(root / f"gguf-{name}", cfg)
        mix = mixed if name == "mixed" else None
        ckpts.append(str(write_gguf(hf, "llama", qtype, root / f"{name}-{qtype.name}.gguf", mix=mix)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env["AOTLM_GGUF_CACHE"] = str(root / "gguf-cache")
    r = subprocess.run(
        [sys.executable, __file__, *ckpts], capture_output=True, text=True, timeout=600, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_plan_weight_bytes_equal_the_stored_params(cases):
    assert len(cases) == 2 * (2 * len(QUANTS) + 3) + 9 + 7 + 9 + 3 + 9
    gguf_forms = {c["plan"]["weights"] for c in cases if c["ckpt"].endswith(".gguf")}
    split = [c["plan"]["weights"] for c in cases if c["ckpt"].endswith("Q6_K.gguf") and c["tp"] == 2]
    assert split == ["int8"]  # the default where tp=2 would split the Q6_K blocks int4-a16 keeps
    assert gguf_forms == {"int8", "int4-g32", "int4-g32-asym", "int4-g32-a16", "int4-g32-asym-a16"}
    for c in cases:
        name = f"{c['ckpt']} tp={c['tp']} pp={c['pp']} quant={c['quant']}"
        real = [c["real"][d] for d in sorted(c["real"], key=int)]  # device i: stage i (tp=1) / shard i
        assert c["plan"]["weights_bytes_per_device"] == max(real), name
        if c["pp"] > 1:  # a tied lm_head's quantized copy lives on the last stage only
            assert c["plan"]["weights_bytes_per_stage_device"] == real, name
    by = {(c["ckpt"], c["tp"], c["pp"], c["quant"]): max(c["real"].values()) for c in cases}
    for ck in ("tied", "untied"):  # the storages really differ, and int4 is the smallest
        for tp in (1, 2):
            f32, i8, i4, i4a = (by[(ck, tp, 1, q)] for q in ("none", "int8", "int4", "int4-asym"))
            assert f32 > i8 > i4a > i4, (ck, tp)
            assert f32 > by[(ck, tp, 1, "fp8")] > i4a, (ck, tp)  # one byte a weight, as int8
    forms = {"float32", "int8", "int4-g32", "int4-g32-asym", "bf16", "fp8"}
    assert {c["plan"]["weights"] for c in cases} == forms | gguf_forms


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1:])))
