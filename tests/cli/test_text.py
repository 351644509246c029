"""``aotlm generate`` as a user runs it: a subprocess, JSON lines out, one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from textkit import shared_text_checkpoint


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return shared_text_checkpoint(tmp_path_factory)


def run(args, env=None, cwd=None, **kw) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "aotlm.cli", "generate", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=600,
        **kw,
    )


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_prompts_file_order_fields_output_file_and_run_dir(shared, tmp_path):
    ckpt, cache = shared
    prompts = [
        "def fibonacci(n):",
        "x",
        "class Point:\n    def __init__(self, x, y):",
        "naïve café",
        "import os",
    ]
    pf = tmp_path / "prompts.jsonl"
    pf.write_text(
        "\n".join(json.dumps({"id": i, "prompt": p, "meta": {"k": [i]}}) for i, p in enumerate(prompts))
        + "\n\n"
    )
    common = [
        "--model",
        str(ckpt),
        "--prompts-file",
        str(pf),
        "--max-new-tokens",
        "6",
        "--cache-dir",
        str(cache),
    ]
    out = run([*common, "--quiet"])
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # --quiet: no bars, no logs, no third-party warnings
    recs = records(out.stdout)
    assert [r["id"] for r in recs] == list(range(5)) and [r["prompt"] for r in recs] == prompts
    assert all(r["meta"] == {"k": [r["id"]]} for r in recs)
    assert all(isinstance(r["completion"], str) and r["completion"] for r in recs)
    r = recs[0]
    assert r["generation"]["model"] == str(ckpt) and r["generation"]["dtype"] == "f32"
    assert r["generation"]["max_new_tokens"] == 6 and r["generation"]["do_sample"] is False
    assert r["finish_reason"] in ("eos", "length") and r["timing"]["new_tokens"] <= 6
    assert r["timing"]["tokens_per_s"] > 0 and r["timing"]["prompt_tokens"] > 0

    # the same prompts from a training run (latest checkpoint in numeric order, tokenizer at the run
    # root) named through $VARS and ~, written with --output: nothing on stdout, the same records
    home = tmp_path / "home"
    run_dir = home / "runs" / "r1"
    shutil.copytree(ckpt, run_dir / "checkpoints" / "checkpoint-10")
    os.makedirs(run_dir / "checkpoints" / "checkpoint-9")  # lexically after 10, numerically before
    for f in (run_dir / "checkpoints" / "checkpoint-10").glob("*token*"):
        shutil.move(str(f), run_dir / f.name)
    shutil.move(str(pf), home / "p.jsonl")
    out2 = run(
        ["--model", "$RUNS/r1", "--prompts-file", "~/p.jsonl", "--output", "${OUT}/out.jsonl"]
        + ["--max-new-tokens", "6", "--cache-dir", str(cache), "--return-full-text"],
        env={"RUNS": str(home / "runs"), "HOME": str(home), "OUT": str(tmp_path)},
    )
    assert out2.returncode == 0, out2.stderr
    assert out2.stdout == "" and "3 graphs ready" in out2.stderr  # short prompts: no chunked-prefill graph
    assert "Traceback" not in out2.stderr and "PyTorch" not in out2.stderr
    recs2 = records((tmp_path / "out.jsonl").read_text())
    assert [r2["completion"] for r2 in recs2] == [r["prompt"] + r["completion"] for r in recs]
    assert recs2[0]["generation"]["model"] == str(run_dir / "checkpoints" / "checkpoint-10")
    assert recs2[0]["generation"]["tokenizer"] == str(run_dir)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temp file left


@pytest.mark.parametrize(
    "case",
    [
        *("missing model", "no tokenizer", "empty prompt", "invalid json", "no prompt field", "two sources"),
        *("bad temperature", "empty stop", "bad schema"),  # refused before the weights load (one line)
        "output is the input",
        "prompt too long",
    ],
)
def test_bad_input_is_one_line_exit_2(shared, tmp_path, case):
    ckpt, _ = shared
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("*token*", "vocab*", "merges*"))
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",\n')
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "objec"}')
    pf2 = tmp_path / "q.jsonl"
    pf2.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    args, want = {
        "missing model": (["--model", str(tmp_path / "nope"), "--prompt", "hi"], "does not exist"),
        "no tokenizer": (["--model", str(bare), "--prompt", "hi"], "no tokenizer found in"),
        "empty prompt": (
            ["--model", str(ckpt), "--prompt", "hi", "--prompt", ""],
            "--prompt number 2 is empty",
        ),
        "invalid json": (["--model", str(ckpt), "--prompts-file", str(pf)], "p.jsonl line 3: invalid JSON"),
        "no prompt field": (["--model", str(ckpt), "--prompts-file", str(pf2)], 'line 2: no "prompt" field'),
        "two sources": (["--prompt", "a", "--prompts-file", str(pf2)], "not both"),
        "bad temperature": (
            ["--model", str(ckpt), "--prompt", "a", "--temperature", "-1"],
            "temperature=-1.0",
        ),
        "empty stop": (["--model", str(ckpt), "--prompt", "a", "--stop", ""], "a stop string is empty"),
        "output is the input": (
            ["--model", str(ckpt), "--prompts-file", str(pf2), "--output", str(pf2)],
            "--prompts-file and --output name the same file",
        ),
        "prompt too long": (
            ["--model", str(ckpt), "--prompt", "a", "--prompt", "a b c d e f g h i j"]
            + ["--n-positions", "8", "--max-new-tokens", "2"],
            "prompt 2 has ",
        ),
        "bad schema": (
            ["--model", str(ckpt), "--prompt", "a", "--json-schema", str(schema)],
            "Invalid type: objec",
        ),
    }[case]
    out = run(args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0] and lines[0].startswith("aotlm generate: error:"), out.stderr


def test_a_warper_flag_without_sampling_warns_and_decodes_greedily(shared):
    ckpt, cache = shared
    common = [
        "--model",
        str(ckpt),
        "--prompt",
        "def f(x):",
        "--max-new-tokens",
        "6",
        "--cache-dir",
        str(cache),
    ]
    warned = run([*common, "--temperature", "0.7", "--top-p", "0.5"])
    greedy = run(common)
    assert warned.returncode == 0 and greedy.returncode == 0, warned.stderr + greedy.stderr
    assert (
        "--temperature, --top-p apply only when sampling" in warned.stderr and "--do-sample" in warned.stderr
    )
    assert "apply only when sampling" not in greedy.stderr
    assert records(warned.stdout)[0]["completion"] == records(greedy.stdout)[0]["completion"]
    sampled = run([*common, "--temperature", "0.7", "--do-sample", "--seed", "1"])
    assert sampled.returncode == 0 and "apply only when sampling" not in sampled.stderr


def test_prompts_file_may_be_a_pipe_not_a_directory(tmp_path):
    """``--prompts-file <(...)`` (a pipe, not a regular file) is read; a directory or a missing path is a
    one-line error naming it."""
    import argparse
    import threading

    from aotlm.cli.text import read_prompts

    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    text = '{"prompt": "a"}\n{"prompt": "b"}\n'
    writer = threading.Thread(target=lambda: fifo.write_text(text), daemon=True)
    writer.start()
    assert read_prompts(argparse.Namespace(prompt=None, prompts_file=str(fifo))) == [
        {"prompt": "a"},
        {"prompt": "b"},
    ]
    writer.join()
    for path, want in ((tmp_path, "is a directory; give a file"), (tmp_path / "nope", "does not exist")):
        with pytest.raises(ValueError, match=want):
            read_prompts(argparse.Namespace(prompt=None, prompts_file=str(path)))


def test_stream_prints_incrementally_with_sampling_flags(shared, tmp_path):
    """The text reaches stdout piece by piece while generating; the record goes to --output."""
    ckpt, cache = shared
    args = ["--model", str(ckpt), "--prompt", "def f(x):", "--max-new-tokens", "40", "--stream"]
    args += ["--do-sample", "--seed", "3", "--top-p", "0.9", "--temperature", "0.8", "--top-k", "30"]
    args += ["--output", str(tmp_path / "o.jsonl"), "--cache-dir", str(cache), "--quiet", "--batch-size", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "aotlm.cli", "generate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    chunks = []
    while data := os.read(proc.stdout.fileno(), 1 << 16):
        chunks.append(data)
    assert proc.wait(timeout=600) == 0, proc.stderr.read().decode()
    streamed = b"".join(chunks).decode()
    (rec,) = records((tmp_path / "o.jsonl").read_text())
    assert streamed == rec["completion"] + "\n"
    gen = rec["generation"]
    assert gen["do_sample"] is True and gen["seed"] == 3 and gen["top_p"] == 0.9 and gen["top_k"] == 30
    assert rec["timing"]["time_to_first_token_s"] > 0
    # separate writes arrived: the first read held only part of the text (decode runs 4 tokens a call)
    assert 0 < len(chunks[0]) < len(rec["completion"].encode()), chunks


def test_bad_words_and_suppressed_tokens_are_never_generated(shared):
    import aotlm
    from aotlm.text.tokens import bad_word_ids

    ckpt, cache = shared
    base = [
        "--model",
        str(ckpt),
        "--cache-dir",
        str(cache),
        "--prompt",
        "def fibonacci(n):",
        "--max-new-tokens",
        "8",
    ]
    pipe = aotlm.pipeline(
        model=str(ckpt), batch_size=1, n_positions=128, compile_cache=str(cache), progress=False
    )
    (free,) = pipe.generate(["def fibonacci(n):"], max_new_tokens=8, do_sample=False)
    first = free.tokens[0]
    r = run([*base, "--suppress-tokens", str(first)])
    (rec,) = records(r.stdout)
    (want,) = pipe.generate(["def fibonacci(n):"], max_new_tokens=8, do_sample=False, suppress_tokens=[first])
    assert r.returncode == 0 and rec["completion"] == want.text != free.text, r.stderr
    assert rec["generation"]["suppress_tokens"] == [first]
    word = pipe.tokenizer.decode(free.tokens[:2]).strip() or "x"
    r = run([*base, "--bad-words", word])
    (rec,) = records(r.stdout)
    ids = bad_word_ids(pipe.tokenizer, [word])
    (want,) = pipe.generate(["def fibonacci(n):"], max_new_tokens=8, do_sample=False, bad_words_ids=ids)
    assert r.returncode == 0 and rec["completion"] == want.text and rec["generation"]["bad_words_ids"] == ids
    for flags, why in [
        (["--bad-words", " "], "--bad-words word is empty"),
        (["--suppress-tokens", "-1"], ">= 0"),
    ]:
        r = run([*base, *flags])
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, flags
