"""Bad input gives a clear error naming the problem and the fix, before any device work."""

import json

import numpy as np
import pytest

from aotlm import AutoModelForSampling
from aotlm.models.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def model(gpt2_path):
    return AutoModelForSampling.from_pretrained(gpt2_path, batch_size=2, n_positions=64, compile_cache=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=np.ones((1, 40), int), max_new_tokens=30), "exceeds n_positions=64"),
        (dict(input_ids=np.ones((1, 0), int)), "prompt is empty"),
        (dict(input_ids=[[1, 2, 101]]), r"input_ids\[0, 2\] = 101 is not a valid token id"),
        (dict(input_ids=[[1, -2]]), "not a valid token id"),
        (dict(input_ids=np.ones((1, 4), np.float32)), "must hold integers"),
        (dict(input_ids=np.ones((1, 2, 3), int)), "shape \\[batch, length\\]"),
        (dict(input_ids=[[1, 2], [3]]), "ragged"),
        (dict(input_ids=np.ones((3, 4), int)), "batch_size=2"),
        (dict(input_ids=np.ones((1, 4), int), attention_mask=np.ones((1, 5))), "differs from input_ids"),
        (dict(input_ids=np.ones((1, 4), int), attention_mask=[[1, 1, 1, 0]]), "left padding"),
        (dict(input_ids=np.ones((1, 4), int), attention_mask=[[0, 0, 0, 0]]), "all zeros"),
        (dict(input_ids=np.ones((1, 4), int), max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(input_ids=np.ones((1, 4), int), start_ids=[9]), "start_ids must be in"),
        (dict(input_ids="hello"), "numpy array, nested list or torch tensor"),
        (
            dict(input_ids=[[1, 2]], generation_config={"max_new_tokens": 3}),
            "must be an aotlm.GenerationConfig, got builtins.dict; pass its fields as keywords",
        ),
    ],
)
def test_bad_sample_inputs(model, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        model.sample(**kwargs)


def test_transformers_generation_config_points_at_the_hf_adapter(model):
    import transformers

    cfg = transformers.GenerationConfig(max_new_tokens=3)
    with pytest.raises(
        TypeError, match=r"got transformers\..*GenerationConfig; .*HuggingFaceGenerationModelAdapter"
    ):
        model.sample([[1, 2]], generation_config=cfg)


def test_bad_load_arguments(gpt2_path, tmp_path):
    with pytest.raises(ValueError, match="amp="):
        AutoModelForSampling.from_pretrained(gpt2_path, amp="f8", compile_cache=False)
    with pytest.raises(ValueError, match="learned"):
        AutoModelForSampling.from_pretrained(gpt2_path, n_positions=4096, compile_cache=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        AutoModelForSampling.from_pretrained(tmp_path / "nope", compile_cache=False)
    with pytest.raises(ValueError, match="tp_degree=4 needs 4 devices"):
        AutoModelForSampling.from_pretrained(gpt2_path, tp_degree=4, compile_cache=False)
    for kw, match in [
        (dict(n_positions="64"), r"n_positions takes an int or a list of ints, got '64' \(str\)"),
        (dict(n_positions=64.5), "n_positions takes an int"),
        (dict(context_length_estimate=[16.5]), "context_length_estimate takes an int"),
        (dict(tp_degree=1.5), r"tp_degree must be an integer, got 1.5 \(float\)"),
        (dict(fuse_qkv="false"), "fuse_qkv must be True or False, got 'false'"),
        (dict(compile_cache=123), r"compile_cache takes a directory path, None .* or False .* got 123"),
    ]:
        with pytest.raises(TypeError, match=match):
            AutoModelForSampling.from_pretrained(gpt2_path, **{"compile_cache": False, **kw})


def test_unknown_architecture_lists_supported(gpt2_path, tmp_path):
    import shutil

    d = tmp_path / "t5ish"
    shutil.copytree(gpt2_path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "bert"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown architecture model_type='bert'; aotlm supports: .*gpt2"):
        AutoModelForSampling.from_pretrained(d, compile_cache=False)


def test_corrupt_or_missing_weights(gpt2_path, tmp_path):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(gpt2_path, d)
    (d / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt"):
        AutoModelForSampling.from_pretrained(d, compile_cache=False)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights in"):
        AutoModelForSampling.from_pretrained(d, compile_cache=False)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        AutoModelForSampling.from_pretrained(d, compile_cache=False)
