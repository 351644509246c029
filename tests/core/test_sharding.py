"""Tensor parallelism: tp / GQA strategies vs tp=1, shard sizes, HLO collectives, memory plan,
compile-cache keys per mesh, and a 2-process x 2-device mesh.

Multi-device runs happen in subprocesses (``tests/support/tp_worker.py``), because the forced CPU
device count must be set before jax is imported; every tp case shares one subprocess so
jax import and start-up are paid once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers
from conformance import make_checkpoint

from aotlm import AutoModelForSampling
from aotlm.core import distributed, memory, sharding

WORKER = str(Path(__file__).parents[1] / "support" / "tp_worker.py")
BATCH = 8
CASES = [  # (model, tp, gqa); tp=1 first per model (the reference)
    ("gpt2", 1, None),
    ("gpt2", 2, "shard-over-heads"),
    ("gpt2", 4, "shard-over-heads"),
    ("gpt2", 2, "shard-over-batch"),
    ("llama", 1, None),
    ("llama", 2, "shard-over-heads"),
    ("llama", 2, "shard-over-batch"),
    ("llama", 4, "replicated-heads"),
    ("llama", 4, "shard-over-batch"),
    ("llama", 8, "replicated-heads"),
    ("llama", 8, "shard-over-batch"),
]
CACHED = [("llama", 2, "shard-over-heads"), ("llama", 4, "replicated-heads")]


@pytest.fixture(scope="module")
def llama_gqa_path(ckpt_dir):
    """Llama with 8 query heads and 2 kv heads (GQA groups of 4)."""
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=101,
        max_position_embeddings=128,
    )
    return make_checkpoint(ckpt_dir / "llama_h8kv2", cfg)


def _run(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, WORKER, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, gpt2_path, llama_gqa_path):
    """Every tp case on 8 forced CPU devices, in one subprocess."""
    tmp = tmp_path_factory.mktemp("tp")
    job = {
        "gpt2": str(gpt2_path),
        "llama": str(llama_gqa_path),
        "batch": BATCH,
        "cache_dir": str(tmp / "cc"),
        "out": str(tmp / "out.json"),
        "cases": [list(c) for c in CASES],
        "cached": [list(c) for c in CACHED],
        "lora": lora_adapter(llama_gqa_path, tmp / "lora"),
        "lora_cases": [[1, None], [2, "shard-over-heads"], [4, "replicated-heads"], [2, "shard-over-batch"]],
    }
    (tmp / "job.json").write_text(json.dumps(job))
    proc = _run(["single", str(tmp / "job.json")], timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def lora_adapter(base, out) -> str | None:
    """A PEFT adapter on every projection of ``base`` (None without peft: those cases are skipped)."""
    try:
        import peft  # local: the [test] extra's; the other tp cases run without it
        import torch  # local: as peft
        from conformance import hf_model  # local: torch-backed helpers, with peft only
    except ImportError:
        return None
    torch.manual_seed(5)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = peft.LoraConfig(target_modules=targets, init_lora_weights=False, r=4, lora_alpha=8)
    peft.get_peft_model(hf_model(base), cfg).save_pretrained(str(out))
    return str(out)


def test_lora_tables_shard_like_their_projections(tp_run):
    if not tp_run["lora"]:
        pytest.skip("peft is not installed (the [test] extra): no adapter to shard")
    ref = tp_run["lora"][0]
    for c in tp_run["lora"][1:]:
        name = f"LoRA tp={c['tp']} {c['gqa']}"
        diff = np.abs(np.array(c["logits"]) - np.array(ref["logits"])).max()
        assert diff <= 1e-4, f"{name}: logits differ from tp=1 by {diff}"
        assert c["tokens"] == ref["tokens"], f"{name}: greedy tokens differ from tp=1"
        s, tp = c["shards"], c["tp"]
        if c["gqa"] == "shard-over-batch":  # attention weights whole; the MLP split
            assert s["wq_lora_b"][1] == s["wq_lora_b"][0], name
        else:  # column-parallel B split on heads, row-parallel A on its input heads
            assert s["wq_lora_b"][1][2] == s["wq_lora_b"][0][2] // tp, name
            assert s["wo_lora_a"][1][1] == s["wo_lora_a"][0][1] // tp, name
            assert s["wk_lora_b"][1][2] * tp == s["wk_lora_b"][0][2], name  # kv heads repeated, then split
        assert s["w_up_lora_b"][1][2] * tp == s["w_up_lora_b"][0][2], name
        assert s["w_down_lora_a"][1][1] * tp == s["w_down_lora_a"][0][1], name


def _ref(run, model):
    return next(c for c in run["cases"] if c["model"] == model and c["tp"] == 1)


def test_tp_matches_tp1_tokens_and_logits(tp_run):
    for c in tp_run["cases"]:
        ref = _ref(tp_run, c["model"])
        name = f"{c['model']} tp={c['tp']} {c['gqa']}"
        diff = np.abs(np.array(c["logits"]) - np.array(ref["logits"])).max()
        assert diff <= 1e-4, f"{name}: logits differ from tp=1 by {diff}"
        assert c["tokens"] == ref["tokens"], f"{name}: greedy tokens differ from tp=1"
        diff = np.abs(np.array(c["logprobs"]) - np.array(ref["logprobs"])).max()
        assert diff <= 1e-4, f"{name}: score() log-probs differ from tp=1 by {diff}"
        assert c["is_greedy"] == ref["is_greedy"], f"{name}: score() argmax flags differ from tp=1"
    got = {(c["model"], c["tp"], c["gqa"]) for c in tp_run["cases"]}
    assert got == {(m, t, g or "shard-over-heads") for m, t, g in CASES}  # default gqa = shard-over-heads


def test_each_device_holds_1_over_tp_and_memory_plan_is_exact(tp_run):
    for c in tp_run["cases"]:
        name, s = f"{c['model']} tp={c['tp']} {c['gqa']}", c["shards"]
        assert s["bad"] == [], f"{name}: shards not 1/tp: {s['bad']}"
        assert (s["n_sharded"] > 0) == (c["tp"] > 1), name
        assert s["weights_dev0"] == c["plan"]["weights_bytes_per_device"], name
        assert s["cache_dev0"] == c["plan"]["kv_cache_bytes_per_device"], name
    by = {(c["model"], c["tp"], c["gqa"]): c["shards"] for c in tp_run["cases"]}
    # Llama: 2 kv heads; tp=2 shards them, tp=4 / tp=8 repeat them so each device holds one head
    kv1 = by[("llama", 1, "shard-over-heads")]["cache_dev0"]
    pos = BATCH * 64 * 4  # the replicated slot-position table
    assert by[("llama", 2, "shard-over-heads")]["cache_dev0"] - pos == (kv1 - pos) // 2
    assert by[("llama", 8, "replicated-heads")]["cache_dev0"] - pos == (kv1 - pos) // 2
    assert by[("llama", 8, "shard-over-batch")]["cache_dev0"] - pos == (kv1 - pos) // 8


def _shape(s: str) -> list[int]:
    inner = s[s.index("[") + 1 : s.index("]")]
    return [int(x) for x in inner.split(",")] if inner else []


def test_hlo_has_one_all_reduce_after_attention_and_one_after_mlp(tp_run):
    for c in tp_run["cases"]:
        if c["tp"] == 1:
            assert all(not v for h in c["hlo"].values() for v in h.values())
            continue
        name, n_layers, d = f"{c['model']} tp={c['tp']} {c['gqa']}", c["n_layers"], c["hidden"]
        dec = c["hlo"]["decode"]
        assert not dec["all-to-all"] and not dec["collective-permute"] and not dec["reduce-scatter"], name
        # nothing weight- or cache-sized is ever gathered while decoding: every collective is batch-major
        for s in dec["all-gather"] + dec["all-reduce"]:
            assert _shape(s)[:1] in ([BATCH], []), f"{name}: unexpected collective {s}"
        hidden = [s for s in dec["all-reduce"] if _shape(s) == [BATCH, 1, d]]
        if c["gqa"] == "shard-over-batch":  # attention is batch-parallel: MLP all-reduce only
            assert len(hidden) == 1 + n_layers, (name, dec)
        else:  # embedding (vocab-sharded lookup) + one after attention + one after the MLP per layer
            assert len(hidden) == 1 + 2 * n_layers, (name, dec)
            pre = c["hlo"]["prefill"]
            assert len([s for s in pre["all-reduce"] if _shape(s) == [BATCH, 64, d]]) == 1 + 2 * n_layers
            assert all(_shape(s)[0] == BATCH for s in pre["all-gather"]), (name, pre)
        # score: the [B, T, vocab] logits stay vocabulary-sharded (reductions, never a gather of them)
        sc = c["hlo"]["score"]
        vocab = [s for s in sc["all-gather"] if len(_shape(s)) >= 3 and 101 <= _shape(s)[-1] <= 104]
        assert not vocab, (name, sc)  # (padded vocab 101 -> 102 / 104 under tp 2 / 4, 8)


def test_compile_cache_entries_for_tp2_and_tp4_coexist(tp_run):
    meshes = sorted(tuple(e) for e in tp_run["entries"])
    assert meshes == [(2,)] * 4 + [(4,)] * 4  # prefill, select, decode and score for each mesh
    reload = tp_run["reload"]
    assert reload["hits"] and all(reload["hits"]), reload["hits"]
    want = next(c for c in tp_run["cases"] if (c["model"], c["tp"], c["gqa"]) == CACHED[0])
    assert reload["tokens"] == want["tokens"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_form_one_tp4_mesh(tmp_path, llama_gqa_path, tp_run):
    job = {"llama": str(llama_gqa_path), "batch": BATCH, "local_devices": 2}
    procs = []
    port = _free_port()
    for pid in range(2):
        j = dict(job, out=str(tmp_path / f"out{pid}.json"))
        (tmp_path / f"job{pid}.json").write_text(json.dumps(j))
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
            distributed.ENV_NUM_PROCESSES: "2",
            distributed.ENV_PROCESS_ID: str(pid),
        }
        env.pop("XLA_FLAGS", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, "multi", str(tmp_path / f"job{pid}.json")],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=240)
            errs.append(err)
    finally:
        for p in procs:  # never leave a process waiting on its peer
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errs)
    ref = next(c for c in tp_run["cases"] if c["model"] == "llama" and c["tp"] == 1)
    for pid in range(2):
        r = json.loads((tmp_path / f"out{pid}.json").read_text())
        assert (r["process_index"], r["process_count"], r["global_devices"], r["tp"]) == (pid, 2, 4, 4)
        assert len(r["local_mesh_devices"]) == 2 and r["gqa"] == "replicated-heads"
        assert r["tokens"] == ref["tokens"]
        assert np.abs(np.array(r["logits"]) - np.array(ref["logits"])).max() <= 1e-4


# ---------------------------------------------------------------- in-process (no extra devices)
@pytest.mark.parametrize(
    "args, match",
    [
        ((8, 2, 1, 3, None), r"8 attention heads cannot be split over tp=3; use tp in \{1, 2, 4, 8\}"),
        (
            (24, 8, 1, 3, "shard-over-heads"),
            r"8 kv heads cannot be sharded over tp=3; use tp in \{1, 2, 4, 8\} or gqa='replicated-heads'",
        ),
        (
            (8, 2, 4, 4, "shard-over-heads"),
            r"2 kv heads cannot be sharded over tp=4; use tp in \{1, 2\} or gqa='replicated-heads' or "
            r"gqa='shard-over-batch'",
        ),
        (
            (8, 2, 3, 2, "shard-over-batch"),
            r"batch_size=3 cannot be sharded over tp=2.*gqa='shard-over-heads'",
        ),
        ((8, 2, 1, 2, "shard-over-kv"), r"unknown gqa strategy 'shard-over-kv'; choose one of"),
        ((8, 2, 1, 0, None), r"tp_degree must be >= 1"),
    ],
)
def test_invalid_tp_and_gqa_give_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        sharding.choose_gqa(*args)


def test_gqa_defaults_and_kv_replication():
    assert sharding.choose_gqa(8, 2, 1, 2, None) == "shard-over-heads"
    assert sharding.choose_gqa(8, 2, 1, 4, None) == "replicated-heads"
    assert sharding.choose_gqa(8, 2, 4, 4, "shard-over-batch") == "shard-over-batch"
    assert [sharding.kv_replication(2, t, "replicated-heads") for t in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert sharding.kv_replication(4, 6, "replicated-heads") == 3  # lcm(4, 6) = 12 kv heads, 2 per device
    assert sharding.kv_replication(2, 8, "shard-over-batch") == 1
    wk = np.arange(3 * 2 * 2).reshape(3, 2, 2)
    out = sharding.prepare_param(("layers", 0, "wk"), wk, 4, "replicated-heads", 2)
    np.testing.assert_array_equal(out[:, [0, 1, 2, 3]], wk[:, [0, 0, 1, 1]])  # device d gets kv head d // 2
    emb = sharding.prepare_param(("embed",), np.ones((101, 4)), 8, "shard-over-heads", 2)
    assert emb.shape == (104, 4) and emb[101:].sum() == 0


def test_model_errors_before_device_work(llama_gqa_path, gpt2_path):
    with pytest.raises(ValueError, match=r"8 attention heads cannot be split over tp=3"):
        AutoModelForSampling.from_pretrained(llama_gqa_path, tp_degree=3, compile_cache=False)
    with pytest.raises(ValueError, match=r"2 kv heads cannot be sharded over tp=4"):
        AutoModelForSampling.from_pretrained(
            llama_gqa_path, tp_degree=4, gqa="shard-over-heads", compile_cache=False
        )
    with pytest.raises(ValueError, match=r"tp_degree=2 needs 2 devices but only 1 are visible"):
        AutoModelForSampling.from_pretrained(gpt2_path, tp_degree=2, compile_cache=False)


def test_memory_plan_and_check_fits(monkeypatch):
    from aotlm.core import precision

    resolve = precision.resolve
    cpu = lambda amp, quant, _=None, kv=None: resolve(amp, quant, True, kv)  # bf16 matrices, f32 rest
    gpu = lambda amp, quant, _=None, kv=None: resolve(amp, quant, False, kv)  # amp = compute dtype
    monkeypatch.setattr(precision, "resolve", gpu)
    cfg = transformers.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        num_hidden_layers=32,
        vocab_size=128256,
        max_position_embeddings=8192,
    )
    from aotlm.models import family_for

    arch = family_for("llama").arch_config(cfg)  # Llama-3-8B shapes, no weights needed
    p1 = memory.memory_plan(arch, batch_size=4, n_positions=4096, amp="bf16", tp=1)
    assert abs(p1["weights_bytes"] / 1e9 - 16.06) < 0.01  # 8.03 B params x 2 bytes
    assert p1["kv_cache_bytes"] == 2 * 32 * 4 * 4096 * 8 * 128 * 2  # 2 GiB
    p8 = memory.memory_plan(arch, batch_size=4, n_positions=4096, amp="bf16", tp=8)
    assert p8["gqa"] == "shard-over-heads" and p8["kv_heads_per_device"] == 1
    assert p8["kv_cache_bytes_per_device"] == p1["kv_cache_bytes"] // 8 + 4 * 4096 * 4
    assert p1["weights_bytes"] / 8 < p8["weights_bytes_per_device"] < p1["weights_bytes"] / 7.9
    p16 = memory.memory_plan(arch, batch_size=4, n_positions=4096, amp="bf16", tp=16, gqa=None)
    assert p16["gqa"] == "replicated-heads" and p16["kv_heads_per_device"] == 1  # 8 kv heads -> 16
    assert p16["kv_cache_bytes_per_device"] == p8["kv_cache_bytes_per_device"]  # 1 head is the floor
    sob = memory.memory_plan(arch, batch_size=8, n_positions=4096, amp="bf16", tp=8, gqa="shard-over-batch")
    assert sob["weights_bytes_per_device"] > p8["weights_bytes_per_device"]  # attention weights replicated
    memory.check_fits(p8, 16)
    with pytest.raises(memory.MemoryPlanError, match=r"needs 16\.96 GiB per device .* has 16\.00 GiB"):
        memory.check_fits(p1, 16)
    assert "tp=8 gqa=shard-over-heads" in memory.format_plan(p8)
    monkeypatch.setattr(precision, "resolve", cpu)  # amp="bf16" on CPU with the kernels
    cpu_plan = memory.memory_plan(arch, batch_size=4, n_positions=4096, amp="bf16", tp=1)
    assert cpu_plan["kv_cache_bytes"] == 2 * p1["kv_cache_bytes"]  # the KV cache stays f32
    embed = 128256 * 4096
    norms = (2 * 32 + 1) * 4096
    assert cpu_plan["weights_bytes"] - p1["weights_bytes"] == (embed + norms) * 2  # these stay f32
    with pytest.raises(ValueError, match="cannot be split over tp=3"):
        memory.memory_plan(arch, 1, 128, "bf16", tp=3)


def test_distributed_initialize_arguments(monkeypatch):
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(k, raising=False)
    assert distributed.initialize() is False  # single process: nothing to do
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
    with pytest.raises(ValueError, match="missing: .*AOTLM_NUM_PROCESSES.*AOTLM_PROCESS_ID"):
        distributed.initialize()
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, 2\)"):
        distributed.initialize(num_processes=2, process_id=2)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="must be an integer"):
        distributed.initialize()
