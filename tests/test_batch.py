"""Batch jobs driven as a user would, through ``python -m aotlm.cli`` subprocesses.

batch-generate (JSONL): order, grouping (counted model loads), pre-flight errors, soft errors,
kill + --resume, --shard + batch-merge. run-h5 (Cerebras HDF5): predictions files, dummy rows,
start tokens (list, outside the vocabulary), stop sequences, max_tokens, loop_dim 0,
--inference-steps, resume, kill, shards, --compile-only. compile --output-artifacts + run:
zero compilations (counted) and a refused mismatched checkpoint.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

VOCAB = 320
TEXT = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"] * 20


def make_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        TEXT, trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, special_tokens=["<|eos|>"])
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>").save_pretrained(str(path))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from aotlm.tiny import make_tiny_gpt2

    root = tmp_path_factory.mktemp("batch")
    m1 = make_tiny_gpt2(root / "m1", seed=1, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    m2 = make_tiny_gpt2(root / "m2", seed=2, vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    for m in (m1, m2):
        make_tokenizer(m)
    bad = root / "bad"
    shutil.copytree(m1, bad)
    (bad / "model.safetensors").write_bytes((m1 / "model.safetensors").read_bytes()[:100])  # truncated
    e = dict(os.environ, AOTLM_CACHE_DIR=str(root / "cache"), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    e.update(HOME=str(root), M2=str(m2))  # "~/m1" and "$M2" inside the JSONL
    return {"root": root, "m1": m1, "m2": m2, "bad": bad, "env": e}


def aot(env, *args, check=True):
    p = subprocess.run(
        [sys.executable, "-m", "aotlm.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env["env"],
        cwd=env["root"],
        timeout=300,
    )
    if check:
        assert p.returncode == 0, p.stderr
    return p


def loads(stderr):
    return [line for line in stderr.splitlines() if "loading model" in line]


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------ batch-generate
def records(env):
    m1, m2 = str(env["m1"]), str(env["m2"])
    return [
        {"id": "r1", "prompt": "def fib"},
        {"prompt": "return n if", "model": {"checkpoint": "$M2"}, "generation": {"max_new_tokens": 5}},
        {"prompt": "fibonacci(n - 1)", "generation": {"max_new_tokens": 7, "return_full_text": True}},
        {"prompt": "else", "model": {"checkpoint": m1, "dtype": "bfloat16"}},
        {"prompt": "n < 2", "model": {"checkpoint": str(env["bad"])}},
        {"id": 6, "prompt": "def", "generation": {"stop_sequences": ["n"], "max_new_tokens": 9}},
        {"prompt": "(n - 2)", "model": m2, "metadata": {"k": 1}},
        {"prompt": "return", "generation": {"greedy": True}},
        {"prompt": "fibonacci", "model": {"checkpoint": "~/m1"}},
    ]


@pytest.fixture(scope="module")
def jsonl(env):
    path = env["root"] / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records(env)))
    out = env["root"] / "out.jsonl"
    p = aot(env, "batch-generate", "--input", path, "--output", out, "--model", env["m1"], "--batch-size", 2,
            "--max-new-tokens", 6)  # fmt: skip
    return path, out, p


def reference(ckpt, prompt, new, cache):
    from transformers import AutoTokenizer

    from aotlm import AutoModelForSampling

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    model = AutoModelForSampling.from_pretrained(ckpt, batch_size=2, n_positions=32, compile_cache=cache)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    return tok.decode(model.sample([ids], max_new_tokens=new)[0, len(ids) :].tolist(), skip_special_tokens=True)


def test_jsonl_order_grouping_soft_error(env, jsonl):
    path, out, p = jsonl
    recs = read(out)
    inputs = records(env)
    assert [r["input_line"] for r in recs] == list(range(1, len(inputs) + 1))  # input order
    for r, i in zip(recs, inputs, strict=True):
        assert r["prompt"] == i["prompt"] and r.get("id") == i.get("id")
    assert recs[6]["metadata"] == {"k": 1}
    # one load per (checkpoint, dtype, tokenizer): m1 f32, m2 f32, m1 bf16, bad
    lines = loads(p.stderr)
    assert len(lines) == 4, p.stderr
    assert sum("m1 (dtype f32)" in x for x in lines) == 1 and sum("m1 (dtype bf16)" in x for x in lines) == 1
    # soft error: the corrupt checkpoint's record has an error, everything else completed
    assert "error" in recs[4] and "could not be loaded" in recs[4]["error"] and "completion" not in recs[4]
    assert all("completion" in r and "error" not in r for k, r in enumerate(recs) if k != 4)
    assert recs[3]["generation"]["dtype"] == "bf16" and recs[0]["generation"]["dtype"] == "f32"
    assert [r["generation"]["max_new_tokens"] for r in recs[:3]] == [6, 5, 7]
    assert recs[2]["completion"].startswith("fibonacci(n - 1)")  # return_full_text
    cache = env["root"] / "cache"
    for k in (0, 1, 6, 8):  # f32 records vs the Python API, one prompt at a time
        r = recs[k]
        ckpt = env["m2"] if r["generation"]["model"].endswith("m2") else env["m1"]
        assert r["completion"] == reference(ckpt, r["prompt"], r["generation"]["max_new_tokens"], cache)
    full = reference(env["m1"], "def", 9, cache)  # stop string kept, rest cut
    assert recs[5]["completion"] == (full[: full.index("n") + 1] if "n" in full else full)


BAD = {
    "json": ('{"prompt": "x",', "invalid JSON"),
    "prompt": ('{"id": 3}', "missing or empty 'prompt'"),
    "range": ('{"prompt": "x", "generation": {"top_p": 1.5}}', "top_p=1.5 is out of range"),
    "field": ('{"prompt": "x", "temprature": 0.5}', "unknown field(s) ['temprature']"),
    "gen_field": ('{"prompt": "x", "generation": {"topk": 3}}', "unknown field(s) ['topk']"),
    "checkpoint": ('{"prompt": "x", "model": "/nonexistent/ckpt"}', "/nonexistent/ckpt"),
    "tokenizer": ('{"prompt": "x", "model": {"checkpoint": "$M2", "tokenizer": "/no/tok"}}', "/no/tok"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_preflight_errors_name_the_line_and_load_nothing(env, kind, tmp_path):
    line, msg = BAD[kind]
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n' + line + "\n")
    p = aot(env, "batch-generate", "--input", path, "--output", tmp_path / "o.jsonl", "--model", env["m1"],
            "--dry-run", check=False)  # fmt: skip
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr  # one line, no traceback
    assert "line 3" in err[0] and msg in err[0]
    assert not loads(p.stderr) and not (tmp_path / "o.jsonl").exists()


def test_dry_run_plan_sees_the_compile_cache(env, jsonl, tmp_path):
    path, _, _ = jsonl
    args = ("batch-generate", "--input", path, "--model", env["m1"], "--batch-size", 2, "--max-new-tokens", 6)
    p = aot(env, *args, "--output", tmp_path / "o.jsonl", "--dry-run")
    assert not loads(p.stderr) and "dry run: 9 records" in p.stdout
    rows = [r for r in p.stdout.splitlines() if "/m1 " in r or "/m2 " in r]
    assert len(rows) == 3 and all("2 cached" in r or "3 cached" in r for r in rows), p.stdout  # used graphs
    q = aot(env, *args, "--output", tmp_path / "o.jsonl", "--dry-run", "--batch-size", 3)  # a new shape
    assert "0 cached" in q.stdout and "MiB" in q.stdout


def test_resume_after_kill_no_duplicates_or_partial_lines(env, jsonl):
    path, expected, _ = jsonl
    out = env["root"] / "killed.jsonl"
    cmd = [sys.executable, "-m", "aotlm.cli", "batch-generate", "--input", str(path), "--output", str(out),
           "--model", str(env["m1"]), "--batch-size", "2", "--max-new-tokens", "6"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env["env"], cwd=env["root"], stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out.exists() and out.read_bytes().count(b"\n") >= 1):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = out.read_bytes()
    assert data.endswith(b"\n") and 1 <= data.count(b"\n") < 9  # killed mid-run, whole lines only
    with open(out, "ab") as f:
        f.write(b'{"prompt": "torn wri')  # a write cut short (power loss) must not survive a resume
    p = aot(env, "batch-generate", "--input", path, "--output", out, "--model", env["m1"], "--batch-size", 2,
            "--max-new-tokens", 6, "--resume")  # fmt: skip
    assert read(out) == read(expected)
    assert aot(env, "batch-generate", "--input", path, "--output", out, check=False).returncode == 2  # exists


def test_shards_recombine_to_the_unsharded_output(env, jsonl):
    path, expected, _ = jsonl
    outs, n_loads = [], 0
    for i in range(2):
        o = env["root"] / f"shard{i}.jsonl"
        p = aot(env, "batch-generate", "--input", path, "--output", o, "--model", env["m1"], "--batch-size", 2,
                "--max-new-tokens", 6, "--shard", f"{i}/2")  # fmt: skip
        n_loads += len(loads(p.stderr))
        outs.append(o)
    assert n_loads == 4  # no checkpoint loaded by two shards
    merged = env["root"] / "merged.jsonl"
    aot(env, "batch-merge", "--output", merged, *outs)
    assert read(merged) == read(expected)
