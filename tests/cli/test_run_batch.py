"""``aotlm run-batch``: an OpenAI batch file through the real serving engine (a tiny GPT-2): the
records hold what ``sample()`` gives each prompt, in input order; a second run resumes where the output
stops; a bad input file is one line naming the line (exit 2) before any model loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from textkit import make_text_checkpoint

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.cli.app import main
from aotlm.durable import read_jsonl
from aotlm.text.tokens import tokenizer_for

pytest.importorskip("fastapi")
FLAGS = [
    "--n-positions",
    "64",
    "--context-length-estimate",
    "16",
    "--batch-size",
    "2",
    "--no-warmup",
    "--quiet",
]


def test_a_batch_file_runs_and_resumes(tmp_path, capsys):
    ckpt = make_text_checkpoint(tmp_path / "gpt2", family="gpt2")
    cache = str(tmp_path / "cc")
    prompts = ["def add(a, b):", "import os", "class Point:", "for i in range(3):", "x = 1"]
    line = lambda cid, url, body: {"custom_id": cid, "method": "POST", "url": url, "body": body}  # noqa: E731
    lines = [line(f"r{i}", "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0})
             for i, p in enumerate(prompts)]  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "top_p": 7}
    lines.append(line("chat", "/v1/chat/completions", chat))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    args = ["run-batch", str(ckpt), "-i", str(src), "-o", str(out), "--cache-dir", cache, *FLAGS]
    assert main(args) == 0
    recs = list(read_jsonl(out))
    assert [r["custom_id"] for r in recs] == [r["custom_id"] for r in lines]
    tok = tokenizer_for(ckpt)
    ref = AutoModelForSampling.from_pretrained(ckpt, batch_size=1, n_positions=64, compile_cache=cache)
    for p, r in zip(prompts, recs, strict=False):
        ids = tok(p)["input_ids"]
        want = ref.sample(np.array([ids]), max_new_tokens=6)[0, len(ids) :]
        assert r["response"]["status_code"] == 200
        assert r["response"]["body"]["choices"][0]["text"] == tok.decode(want.tolist())
    assert (
        recs[-1]["response"]["status_code"] == 400
        and recs[-1]["response"]["body"]["error"]["param"] == "top_p"
    )
    assert "6 requests" in capsys.readouterr().err
    out.write_text("".join(json.dumps(r) + "\n" for r in recs[:2]))  # an earlier run stopped after two
    assert main(args) == 0
    again = list(read_jsonl(out))
    assert [r["custom_id"] for r in again] == [r["custom_id"] for r in lines] and again[:2] == recs[:2]
    assert [r["response"]["body"]["choices"][0]["text"] for r in again[2:5]] == [
        r["response"]["body"]["choices"][0]["text"] for r in recs[2:5]
    ]
    assert main(args) == 0 and "all 6 requests are in" in capsys.readouterr().err


def test_a_bad_batch_file_is_named_before_the_model_loads(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/audio/speech", "body": {}}\n')
    assert (
        main(["run-batch", str(tmp_path / "no-model"), "-i", str(src), "-o", str(tmp_path / "o.jsonl")]) == 2
    )
    err = capsys.readouterr().err
    assert "in.jsonl line 1: 'url' must be one of" in err and "Traceback" not in err
    assert main(["run-batch", "x", "-i", str(src), "-o", str(src)]) == 2
    assert "--output-file is the input file" in capsys.readouterr().err
