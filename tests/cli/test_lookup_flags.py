"""``--prompt-lookup-num-tokens`` on ``aotlm generate`` and ``aotlm chat``: the same text as without it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from textkit import chat_checkpoint, shared_text_checkpoint

import aotlm


def _cli(*args, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    cmd = [sys.executable, "-m", "aotlm.cli", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=600)


def test_generate_with_prompt_lookup_writes_the_plain_completions(tmp_path_factory):
    ckpt, cache = shared_text_checkpoint(tmp_path_factory)
    prompts = ["for i in range(10):\n    print(i, 'h", "def fibonacci(n):"]
    pipe = aotlm.pipeline(
        model=str(ckpt), batch_size=2, n_positions=128, compile_cache=str(cache), progress=False
    )
    want = pipe.generate(prompts, max_new_tokens=16, do_sample=False)
    stop = want[0].text[8:10]
    want = pipe.generate(prompts, max_new_tokens=16, do_sample=False, stop=[stop])
    args = [
        "generate",
        "--model",
        str(ckpt),
        "--cache-dir",
        str(cache),
        "--batch-size",
        "2",
        "--n-positions",
        "128",
    ]
    for p in prompts:
        args += ["--prompt", p]
    r = _cli(*args, "--max-new-tokens", "16", "--stop", stop, "--prompt-lookup-num-tokens", "3")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["completion"], x["finish_reason"]) for x in recs] == [(g.text, g.finish_reason) for g in want]
    assert recs[0]["generation"]["prompt_lookup_num_tokens"] == 3
    for flags, why in [
        (["--prompt-lookup-num-tokens", "0"], "--prompt-lookup-num-tokens must be >= 1, got 0"),
        (["--max-matching-ngram-size", "2"], "give --prompt-lookup-num-tokens too"),
        (
            ["--prompt-lookup-num-tokens", "2", "--repetition-penalty", "1.3"],
            "['repetition_penalty'] not supported with --prompt-lookup-num-tokens",
        ),
    ]:
        r = _cli(*args, *flags)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and why in lines[0], (flags, r.stderr)


def test_chat_with_prompt_lookup_streams_the_plain_answer(tmp_path_factory):
    path, cache = chat_checkpoint(tmp_path_factory)
    base = ["chat", "--model", str(path), "--cache-dir", str(cache), "--greedy", "--max-new-tokens", "12"]
    plain = _cli(*base, "def fibonacci(n):")
    looked = _cli(*base, "--prompt-lookup-num-tokens", "4", "def fibonacci(n):")
    assert plain.returncode == 0 and looked.returncode == 0, looked.stderr
    assert looked.stdout == plain.stdout and plain.stdout.strip()
    ready = [int(re.search(r"aotlm: (\d+) graphs? ready", r.stderr).group(1)) for r in (plain, looked)]
    assert ready[1] > ready[0], ready  # the rounds' graphs are made before the answer, not inside it
