"""The transformers-neuronx guide's examples run on aotlm with only the import and paths changed.

``tnx_guide.py`` holds the examples; it runs once in a subprocess with 8 forced CPU devices (the
guide uses ``tp_degree=2`` and ``8``) and reports what each example shows; each test below
asserts one example.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def guide(tmp_path_factory):
    work = tmp_path_factory.mktemp("tnx-guide")
    out = work / "results.json"
    env = dict(os.environ, AOTLM_CACHE_DIR=str(work / "cache"))
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    proc = subprocess.run(
        [sys.executable, str(TESTS / "support" / "tnx_guide.py"), str(work), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _ok(guide, name):
    r = guide[name]
    assert r["ok"], r.get("trace")
    return r["value"]


def test_01_neuron_auto_model_tp2_f16(guide):
    v = _ok(guide, "example_01_from_pretrained")
    assert v["tp"] == 2 and v["amp"] == "f16" and v["graphs"] > 0


def test_02_auto_model_and_family_classes(guide):
    v = _ok(guide, "example_02_auto_model")
    assert v["classes"] == [
        "AutoModelForSampling",
        "AutoModelForSampling",
        "BloomForSampling",
        "LlamaForSampling",
    ]
    assert v["n_positions"] == [2048, 256]  # default 2048, capped at the checkpoint's positions
    assert v["compiled_second"] == 0  # the family classes load what the auto class compiled


def test_03_hf_generate_adapter_with_reset_generation(guide):
    v = _ok(guide, "example_03_hf_generate")
    assert v["n"] == 1 and v["prompt_len"] < v["shape"][1] <= 256


def test_04_int8_weights_with_bf16_dequant(guide):
    v = _ok(guide, "example_04_int8")
    assert v["weights"] == "int8" and v["shape"][1] <= 256


def test_05_context_length_estimate(guide):
    v = _ok(guide, "example_05_context_length_estimate")
    assert v["ctx"] == [256] and v["shape"][1] <= 256


def test_06_prompt_batch_1_gives_5_outputs(guide):
    v = _ok(guide, "example_06_prompt_batch_size")
    assert v["n_outputs"] == 5
    assert v["distinct_sampled"] > 1  # with do_sample=True the 5 rows differ


def test_07_save_load_then_to_neuron_compiles_nothing(guide):
    v = _ok(guide, "example_07_save_load")
    assert v["compiled_after_load"] == 0 and v["shape"][1] <= 256


def test_08_gqa_and_no_repeat_ngram(guide):
    v = _ok(guide, "example_08_gqa")
    assert v["gqa"] == "shard-over-heads" and v["shape"][1] <= 256
    toks = v["ngram"]
    grams = [tuple(toks[i : i + 3]) for i in range(len(toks) - 2)]
    assert len(grams) == len(set(grams))


def test_09_on_device_top_k_tp8(guide):
    v = _ok(guide, "example_09_top_k")
    assert v["shape"][1] <= 128
    assert v["distinct_runs"] > 1  # on_device_generation's do_sample=True is the default


def test_10_streamer_gets_prompt_then_each_token(guide):
    v = _ok(guide, "example_10_streamer")
    assert v["puts"] == 1 + (v["total_len"] - v["prompt_len"])
    assert v["shapes"][0] == [1, v["prompt_len"]] and v["shapes"][1] == [1] and v["ended"]


def test_11_time_limit_stops_the_loop(guide):
    v = _ok(guide, "example_11_stopping_criteria")
    assert v["total_len"] < 200  # 20 ms per token: the 0.5 s limit ends it long before 256


def test_12_speculative_equals_target_greedy(guide):
    v = _ok(guide, "example_12_speculative")
    assert v["equal"] and v["len"] <= 30 and v["stats"]["rounds"] > 0


def test_13_fuse_qkv_and_bucket_lists(guide):
    v = _ok(guide, "example_13_fuse_qkv_and_buckets")
    assert v == {"ctx": [64, 96, 128], "tg": [128, 256], "fused": True}
