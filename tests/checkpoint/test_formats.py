"""Weights from sharded safetensors and from pytorch_model.bin load to the same model."""

import sys

import numpy as np
import pytest
import transformers
from conformance import hf_last_logits, hf_model, make_checkpoint

from aotlm import AutoModelForSampling
from aotlm.models.checkpoint import SAFE_INDEX, TORCH_SINGLE, CheckpointError


def _cfg():
    return transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=101,
        max_position_embeddings=128,
    )


def _check_logits(path):
    ids = np.random.default_rng(0).integers(0, 101, (2, 9))
    model = AutoModelForSampling.from_pretrained(path, batch_size=2, n_positions=32, compile_cache=False)
    np.testing.assert_allclose(model.forward(ids), hf_last_logits(hf_model(path), ids), atol=1e-4, rtol=0)


def test_sharded_safetensors(tmp_path):
    path = make_checkpoint(tmp_path / "sharded", _cfg(), max_shard_size="40KB")
    assert (path / SAFE_INDEX).is_file() and len(list(path.glob("model-*.safetensors"))) > 1
    _check_logits(path)


@pytest.fixture(scope="module")
def torch_bin(tmp_path_factory):
    import torch

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_cfg()).eval()
    path = tmp_path_factory.mktemp("bin") / "ckpt"
    path.mkdir()
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / TORCH_SINGLE)
    return path


def test_pytorch_model_bin(torch_bin):
    _check_logits(torch_bin)


def test_pytorch_model_bin_without_torch_is_a_clear_error(torch_bin, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(CheckpointError, match="need torch: pip install torch==2.13.0"):
        AutoModelForSampling.from_pretrained(torch_bin, n_positions=32, compile_cache=False)
