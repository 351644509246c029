"""Pipeline parallelism (``pp_degree``): stages on their own devices give the one-stage model's tokens.

Multi-device runs need XLA_FLAGS before jax starts, so everything runs in one subprocess
(``tests/support/pp_worker.py``, 8 forced CPU devices); the assertions are here.
"""

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

from aotlm.core import distributed

WORKER = str(Path(__file__).parents[1] / "support" / "pp_worker.py")


@pytest.fixture(scope="module")
def llama4(ckpt_dir):
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=4,
        vocab_size=101,
        max_position_embeddings=128,
    )
    return make_checkpoint(ckpt_dir / "llama4", cfg)


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory, llama4):
    llama = llama4
    tmp = tmp_path_factory.mktemp("pp")
    job = {
        "llama": str(llama),
        "cache_dir": str(tmp / "cc"),
        "artifacts": str(tmp / "art"),
        "out": str(tmp / "o.json"),
    }
    (tmp / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, WORKER, str(tmp / "job.json")], capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "o.json").read_text())


def test_tokens_equal_one_stage(pp_run):
    """Greedy and seeded-sampled tokens equal pp=1 for pp=2, pp=4 and pp=2 x tp=2, batch 1 and 4
    (left-padded prompts of lengths 11, 4, 8, 1); last-position logits within 1e-5."""
    cases = pp_run["cases"]
    for batch in (1, 4):
        ref = cases[f"1x1/b{batch}"]
        for name in (f"2x1/b{batch}", f"4x1/b{batch}", f"2x2/b{batch}"):
            got = cases[name]
            assert got["greedy"] == ref["greedy"], name
            assert got["sampled"] == ref["sampled"], name
            assert np.abs(np.array(got["logits"]) - np.array(ref["logits"])).max() < 1e-5, name
    assert cases["2x1/b4"]["micro_batches"] == 2 and cases["4x1/b4"]["micro_batches"] == 4
    assert cases["int8 2x1/b4"]["greedy"] == cases["int8 1x1/b4"]["greedy"]  # the kernels inside stages
    assert cases["int8 2x1/b4"]["greedy"] != cases["1x1/b4"]["greedy"]  # (int8 really changes numbers)


def test_int4_stages_give_one_stage_tokens(pp_run):
    """quant="int4" (4-bit groups, the kernel in each stage): pp=2 gives pp=1's tokens and logits, the
    weights really are int4's, and the memory plan counts them exactly."""
    c = pp_run["cases"]
    one, two, f32 = c["int4 1x1/b4"], c["int4 2x1/b4"], c["1x1/b4"]
    assert two["greedy"] == one["greedy"] and two["sampled"] == one["sampled"]
    assert np.abs(np.array(two["logits"]) - np.array(one["logits"])).max() < 1e-5
    assert np.abs(np.array(one["logits"]) - np.array(f32["logits"])).max() > 1e-3  # int4 changes numbers
    assert sum(one["weights"].values()) < sum(c["int8 1x1/b4"]["weights"].values()) / 1.5
    for case in (one, two):
        assert max(case["weights"].values()) == case["plan"]["weights_bytes_per_device"]
        assert case["plan"]["weights"] == "int4-g32"


def test_each_device_holds_its_stage(pp_run):
    """Weights and KV cache per device <= 1.5 / (pp x tp) of the whole; the memory plan is exact."""
    cases = pp_run["cases"]
    for batch in (1, 4):
        w_all = sum(cases[f"1x1/b{batch}"]["weights"].values())
        kv_all = sum(cases[f"1x1/b{batch}"]["caches"].values())
        for pp, tp in ((2, 1), (4, 1), (2, 2)):
            c = cases[f"{pp}x{tp}/b{batch}"]
            assert len(c["weights"]) == pp * tp
            assert max(c["weights"].values()) <= 1.5 * w_all / (pp * tp), (pp, tp, c["weights"], w_all)
            assert max(c["caches"].values()) <= 1.5 * kv_all / (pp * tp), (pp, tp, c["caches"], kv_all)
            assert max(c["weights"].values()) == c["plan"]["weights_bytes_per_device"]
            assert max(c["caches"].values()) == c["plan"]["kv_cache_bytes_per_device"]


def test_warm_start_and_artifacts_compile_nothing(pp_run):
    ref = pp_run["cases"]["2x2/b4"]["greedy"]
    warm, loaded = pp_run["warm"], pp_run["loaded"]
    assert warm["compiles"]["backend"] == 0 and all(warm["hits"]) and warm["greedy"] == ref
    assert loaded["compiles"]["backend"] == 0 and loaded["greedy"] == ref


def test_streaming_puts_every_token(pp_run):
    s = pp_run["stream"]
    assert s["greedy"] == pp_run["cases"]["1x1/b4"]["greedy"]
    puts = s["puts"]
    assert puts[-1] == "end" and len(puts) == 1 + (len(s["greedy"][0]) - 11) + 1  # prompt, tokens, end
    got = np.array(puts[1:-1]).T  # [rows, new]
    np.testing.assert_array_equal(got, np.array(s["greedy"])[:, 11:])


def test_errors(pp_run):
    e = pp_run["errors"]
    assert "pp_degree=3 does not divide this model's 4 layers" in e["pp3"] and "[2, 4]" in e["pp3"]
    assert "pp_degree=4 x tp_degree=4 needs 16 devices but only 8" in e["devices"]
    assert "num_beams is not supported with pp_degree > 1" in e["beams"]
    assert "continuous_batching is not supported with pp_degree > 1" in e["serve"]


@pytest.mark.parametrize("local_devices", [2])
def test_one_stage_per_process(tmp_path, llama4, pp_run, local_devices):
    """Multi-host: 2 processes, each running one stage (tp = its devices); hand-offs are a
    collective-permute between them; both return the one-stage model's tokens and logits."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for pid in range(2):
        job = {"llama": str(llama4), "cache_dir": "", "local_devices": local_devices,
               "out": str(tmp_path / f"out{pid}.json")}  # fmt: skip
        (tmp_path / f"job{pid}.json").write_text(json.dumps(job))
        env = {**os.environ, "JAX_PLATFORMS": "cpu", distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
               distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: str(pid)}  # fmt: skip
        env.pop("XLA_FLAGS", None)
        cmd = [sys.executable, WORKER, str(tmp_path / f"job{pid}.json"), "multi"]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        )
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=300)[1])
    finally:
        for p in procs:  # never leave a process waiting on its peer
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errs)
    ref = pp_run["cases"]["1x1/b4"]
    for pid in range(2):
        got = json.loads((tmp_path / f"out{pid}.json").read_text())
        assert got["local_stages"] == [pid]
        assert got["greedy"] == ref["greedy"] and got["sampled"] == ref["sampled"]
        assert np.abs(np.array(got["logits"]) - np.array(ref["logits"])).max() < 1e-5
