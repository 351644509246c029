"""Commands name a GGUF model by its ``.gguf`` file in what they write and log, not by the cached
directory its config and tokenizer were converted into."""

from __future__ import annotations

import json

from conformance import make_checkpoint
from gguf import GGMLQuantizationType as T
from gguf_builders import tiny_config, write_gguf

from aotlm.cli.app import main


def test_outputs_name_the_gguf_file_not_its_cached_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "gguf_cache"))
    ckpt = make_checkpoint(tmp_path / "hf", tiny_config("llama"), scale=3.0)
    path = write_gguf(ckpt, "llama", T.Q8_0, tmp_path / "llama-Q8_0.gguf")
    compile_dir = tmp_path / "cc"
    shape = ["--model", str(path), "--cache-dir", str(compile_dir), "--max-new-tokens", "2"]
    assert main(["generate", *shape, "--prompt", "def f(x):", "--n-positions", "32"]) == 0
    gen = json.loads(capsys.readouterr().out.splitlines()[-1])["generation"]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "def f(x):"}\n')
    assert main(["batch-generate", *shape, "--input", str(src), "--output", str(out)]) == 0
    batch = json.loads(out.read_text())["generation"]
    src.write_text('{"text": "def f(x): return x"}\n')
    score = ["score", "--model", str(path), "--cache-dir", str(compile_dir), "--n-positions", "32"]
    assert main([*score, "--input", str(src), "--output", str(tmp_path / "s.jsonl")]) == 0
    scored = json.loads((tmp_path / "s.jsonl").read_text())["scoring"]
    assert (
        gen["model"]
        == gen["tokenizer"]
        == batch["model"]
        == batch["tokenizer"]
        == scored["model"]
        == str(path)
    )
