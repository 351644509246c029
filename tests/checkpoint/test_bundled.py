"""The bundled trained models (aotlm/tiny-py and its draft) and the script that trains them.

They are normal HF checkpoints: aotlm's greedy tokens must equal transformers' on them, the
model must beat the bigram baseline its training run recorded, and the training script must
produce a loadable checkpoint in seconds on a tiny configuration.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conformance import hf_generate, hf_model

from aotlm import AutoModelForSampling
from aotlm.models.checkpoint.bundled import BUNDLED_MODELS, DEFAULT_MODEL, bundled_path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n"]


def _tokenize(path: Path, text: str) -> np.ndarray:
    from transformers import AutoTokenizer

    return np.array([AutoTokenizer.from_pretrained(str(path))(text)["input_ids"]], np.int64)


def _assert_greedy_equal(path: Path, prompts: list[str], new: int) -> None:
    ref = hf_model(path)
    model = AutoModelForSampling.from_pretrained(
        path, n_positions=64, context_length_estimate=[16, 32], compile_cache=False
    )
    for text in prompts:
        ids = _tokenize(path, text)
        out = model.sample(ids, max_new_tokens=new)
        np.testing.assert_array_equal(out, hf_generate(ref, ids, new))
        assert out.shape == (1, ids.shape[1] + new)


def test_bundled_names_resolve_inside_the_package():
    assert DEFAULT_MODEL in BUNDLED_MODELS and "aotlm/tiny-py-draft" in BUNDLED_MODELS
    for name in BUNDLED_MODELS:
        path = bundled_path(name)
        assert path is not None and path.parent.name == "data", name
        for f in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "training.json"):
            assert (path / f).is_file(), (name, f)
    assert bundled_path("aotlm/no-such-model") is None


def test_bundled_model_beats_bigram_and_draft_is_smaller():
    main = json.loads((bundled_path(DEFAULT_MODEL) / "training.json").read_text())
    draft = json.loads((bundled_path("aotlm/tiny-py-draft") / "training.json").read_text())
    assert main["heldout_loss"] < main["bigram_loss"] - 0.1, (main["heldout_loss"], main["bigram_loss"])
    assert main["curve"][-1]["heldout_loss"] < main["curve"][0]["heldout_loss"] - 1.0
    assert main["params"] >= 5 * draft["params"]
    assert draft["vocab"] == main["vocab"] and draft["heldout_files"] == main["heldout_files"]
    main_tok = (bundled_path(DEFAULT_MODEL) / "tokenizer.json").read_bytes()
    assert (bundled_path("aotlm/tiny-py-draft") / "tokenizer.json").read_bytes() == main_tok


def test_bundled_model_greedy_equals_transformers():
    _assert_greedy_equal(bundled_path(DEFAULT_MODEL), PROMPTS, 24)


def test_bundled_draft_loads_and_equals_transformers():
    _assert_greedy_equal(bundled_path("aotlm/tiny-py-draft"), PROMPTS[:1], 16)


def test_training_script_tiny_run_gives_loadable_checkpoint(tmp_path):
    out = tmp_path / "tiny"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_default_model.py"), "--steps", "20", "--tiny"]
    proc = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((out / "training.json").read_text())
    assert meta["steps"] == 20 and meta["tokens_seen"] > 0
    assert meta["curve"][-1]["train_loss"] < meta["curve"][0]["train_loss"]  # it learned something
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["eos_token_id"] == meta["eos_id"]
    _assert_greedy_equal(out, ["def f(x):\n"], 8)
