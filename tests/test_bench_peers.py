"""``scripts/bench_peers.hf_checkpoint``: the peers that read a checkpoint directory (transformers,
CTranslate2's and OpenVINO's converters) get a GGUF model's float32 weights, which aotlm's converted
directory no longer holds (its weights are read from the file)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from bench_peers import hf_checkpoint  # noqa: E402


def test_a_gguf_models_peers_get_its_float32_weights_once(tmp_path, monkeypatch):
    from conformance import make_checkpoint
    from gguf import GGMLQuantizationType as T
    from gguf_builders import tiny_config, write_gguf

    from aotlm.models.checkpoint.resolve import resolve

    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "cache"))
    ckpt = make_checkpoint(tmp_path / "hf", tiny_config("llama"), scale=3.0)
    path = write_gguf(ckpt, "llama", T.Q4_0, tmp_path / "tiny.gguf")
    converted = resolve(str(path))
    assert not list(converted.glob("*.safetensors"))  # aotlm's directory: config and tokenizer only
    work = tmp_path / "work"
    out = hf_checkpoint(converted, work)
    assert out == work / f"hf-{converted.name}" and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() and sorted(p.name for p in work.iterdir()) == [out.name]
    ids = torch.tensor(np.arange(1, 9)[None])
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(ids).logits
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32
        )
        want = ref(ids).logits
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert hf_checkpoint(converted, work) == out and (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert hf_checkpoint(ckpt, work) == ckpt  # a directory with its weights: itself
