"""``typical_p`` (transformers' TypicalLogitsWarper) through every front end: ``sample()``, the HF
``generate()`` adapter, ``aotlm generate``, a batch job and the server, each against transformers'
``generate`` on the same checkpoint.

With a tiny mass only the most typical token of each step survives, so transformers' sampled
tokens are deterministic and every front end must give exactly them (and not the greedy ones).
The distribution itself is checked against the warper in ``test_sampling`` (core).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from starlette.testclient import TestClient
from textkit import make_text_checkpoint

from aotlm import AutoModelForSampling
from aotlm.batching.engine import Engine
from aotlm.cli import main
from aotlm.serve.app import create_app
from aotlm.text.hf_adapter import HuggingFaceGenerationModelAdapter
from aotlm.text.tokens import eos_ids, tokenizer_for

MASS = 1e-3
NEW = 8
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("typical")
    ckpt = make_text_checkpoint(root / "llama")
    tok = tokenizer_for(ckpt)
    ids = tok(PROMPT)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    x = torch.tensor([ids])

    def hf_new(**kw) -> list[int]:
        torch.manual_seed(0)
        out = hf.generate(x, max_new_tokens=NEW, pad_token_id=tok.eos_token_id, **kw)[0, len(ids) :]
        return [t for t in out.tolist() if t != tok.eos_token_id]

    want = hf_new(do_sample=True, typical_p=MASS, top_k=0)
    assert want != hf_new(do_sample=False), "the checkpoint's typical tokens must differ from greedy"
    model = AutoModelForSampling.from_pretrained(
        ckpt, batch_size=1, n_positions=64, compile_cache=str(root / "cache")
    )
    return ckpt, tok, ids, want, model, root


def test_sample_and_the_hf_adapter(setup):
    ckpt, tok, ids, want, model, _ = setup
    eos = eos_ids(ckpt, model.hf_config, tok)
    for seed in (0, 1):
        out = model.sample(
            np.array([ids]), max_new_tokens=NEW, do_sample=True, typical_p=MASS, seed=seed, eos_token_id=eos
        )
        assert [t for t in out[0, len(ids) :].tolist() if t not in eos] == want
    adapter = HuggingFaceGenerationModelAdapter(model.hf_config, model)
    out = adapter.generate(torch.tensor([ids]), do_sample=True, typical_p=MASS, top_k=0, max_new_tokens=NEW)
    assert [t for t in out[0, len(ids) :].tolist() if t not in eos] == want


def test_generate_command_and_batch_job(setup, tmp_path, capsys):
    ckpt, tok, _, want, _, root = setup
    text = tok.decode(want, skip_special_tokens=True)
    flags = ["--max-new-tokens", str(NEW), "--do-sample", "--typical-p", str(MASS), "--top-k", "0"]
    argv = ["generate", "--model", str(ckpt), "--prompt", PROMPT, *flags, "--cache-dir", str(root / "cache")]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["completion"] == text
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    gen = {"do_sample": True, "typical_p": MASS, "top_k": 0, "max_new_tokens": NEW, "seed": 5}
    src.write_text(json.dumps({"prompt": PROMPT, "generation": gen}) + "\n")
    argv = ["batch-generate", "--input", str(src), "--output", str(dst), "--model", str(ckpt)]
    assert main([*argv, "--cache-dir", str(root / "cache"), "--quiet"]) == 0
    assert json.loads(dst.read_text().splitlines()[0])["completion"] == text
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": PROMPT, "generation": {"typical_p": 0}}) + "\n")
    argv = ["batch-generate", "--input", str(bad), "--output", str(tmp_path / "o2.jsonl")]
    argv += ["--model", str(ckpt)]
    assert main([*argv, "--dry-run"]) == 2
    assert "typical_p=0 is out of range" in capsys.readouterr().err


def test_server(setup):
    ckpt, tok, ids, want, _, root = setup
    model = AutoModelForSampling.from_pretrained(
        ckpt, continuous_batching=True, batch_size=2, n_positions=64, compile_cache=str(root / "cache")
    )
    engine = Engine(model, eos_token_id=eos_ids(ckpt, model.hf_config, tok), max_queue=4).start()
    try:
        client = TestClient(create_app(engine, tok, "tiny"))
        body = {"prompt": ids, "max_tokens": NEW, "temperature": 1.0, "typical_p": MASS, "seed": 3}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
        r = client.post("/v1/completions", json={**body, "typical_p": 1.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "typical_p"
    finally:
        engine.shutdown(timeout=5)
