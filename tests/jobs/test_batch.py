"""Batch jobs driven as a user would, through ``python -m aotlm.cli`` subprocesses.

batch-generate (JSONL): order, grouping (counted model loads), pre-flight errors, soft errors,
kill + --resume, --shard + batch-merge. run-h5 (Cerebras HDF5): predictions files, dummy rows,
start tokens (list, outside the vocabulary), stop sequences, max_tokens, loop_dim 0,
--inference-steps, resume, kill, shards, --compile-only. compile --output-artifacts + run:
zero compilations (counted) and a refused mismatched checkpoint.
"""

import functools
import json
import os
import re
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


def bg(env, path, out, *extra, check=True):
    """batch-generate with the tests' defaults (model m1, batch 2, 6 new tokens)."""
    args = ("--input", path, "--output", out, "--model", env["m1"], "--batch-size", 2, "--max-new-tokens", 6)
    return aot(env, "batch-generate", *args, *extra, check=check)


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
        {"prompt": "def fib", "generation": {"do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 7}},
        {
            "prompt": "if n",
            "generation": {"greedy": False, "top_p": 0.9, "seed": 11, "repetition_penalty": 1.3},
        },
    ]


@pytest.fixture(scope="module")
def jsonl(env):
    path = env["root"] / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records(env)))
    out = env["root"] / "out.jsonl"
    return path, out, bg(env, path, out)


@functools.cache
def ref_model(ckpt, cache):
    from transformers import AutoTokenizer

    from aotlm import AutoModelForSampling

    model = AutoModelForSampling.from_pretrained(ckpt, batch_size=2, n_positions=32, compile_cache=cache)
    return AutoTokenizer.from_pretrained(str(ckpt)), model


def reference(ckpt, prompt, new, cache, **sampling):
    """One prompt alone through the Python API, stopping at the checkpoint's eos as generate does."""
    tok, model = ref_model(ckpt, cache)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    eos = model.hf_config.eos_token_id
    out = model.sample([ids], max_new_tokens=new, eos_token_id=eos, **sampling)[0, len(ids) :].tolist()
    out = out[: out.index(eos) + 1] if eos in out else out
    return tok.decode(out, skip_special_tokens=True)


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
    for k in (9, 10):  # sampled rows (seeded) sharing batches with greedy rows, vs one row alone
        g = recs[k]["generation"]
        kw = {key: g[key] for key in ("temperature", "top_k", "top_p", "repetition_penalty", "seed")}
        assert recs[k]["completion"] == reference(
            env["m1"], recs[k]["prompt"], 6, cache, do_sample=True, **kw
        )
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
    p = bg(env, path, tmp_path / "o.jsonl", "--dry-run", check=False)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr  # one line, no traceback
    assert "line 3" in err[0] and msg in err[0]
    assert not loads(p.stderr) and not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("kind", ["missing", "directory", "binary"])
def test_an_unreadable_input_is_one_line_naming_it(env, kind, tmp_path):
    path = tmp_path / "in.jsonl"
    if kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b'{"prompt": "a"}\n\xff\xfe\x00')
    p = bg(env, path, tmp_path / "o.jsonl", "--dry-run", check=False)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert str(path) in err[0] and ("cannot read the input" in err[0] or "not UTF-8" in err[0]), err[0]


def test_output_naming_the_input_is_refused_and_the_input_kept(env, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n')
    (tmp_path / "link.jsonl").symlink_to(path)
    for out in (path, tmp_path / "." / "in.jsonl", tmp_path / "link.jsonl"):
        p = bg(env, path, out, "--overwrite", check=False)
        assert p.returncode == 2 and "--input and --output name the same file" in p.stderr, p.stderr
    p = aot(env, "batch-merge", "--output", path, path, check=False)
    assert p.returncode == 2 and "an input and --output name the same file" in p.stderr, p.stderr
    assert path.read_text() == '{"prompt": "a"}\n'


def test_dry_run_plan_sees_the_compile_cache(env, jsonl, tmp_path):
    path, _, _ = jsonl
    p = bg(env, path, tmp_path / "o.jsonl", "--dry-run")
    assert not loads(p.stderr) and "dry run: 11 records" in p.stdout
    rows = [r for r in p.stdout.splitlines() if "/m1 " in r or "/m2 " in r]
    assert len(rows) == 3 and all("2 cached" in r or "3 cached" in r for r in rows), p.stdout  # used graphs
    assert "MiB" in p.stdout


def test_shards_kill_resume_recombine_to_the_unsharded_output(env, jsonl):
    """Shard 0 is killed mid-run and resumed; shard 1 runs whole; merged = the unsharded output."""
    path, expected, _ = jsonl
    s0, s1 = env["root"] / "shard0.jsonl", env["root"] / "shard1.jsonl"
    args = ("--input", path, "--output", s0, "--model", env["m1"], "--batch-size", 2, "--max-new-tokens", 6)
    cmd = [sys.executable, "-m", "aotlm.cli", "batch-generate", *map(str, args), "--shard", "0/2"]
    proc = subprocess.Popen(cmd, env=env["env"], cwd=env["root"], stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (s0.exists() and s0.read_bytes().count(b"\n") >= 1):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = s0.read_bytes()
    assert data.endswith(b"\n") and 1 <= data.count(b"\n") < 8  # killed mid-run (8 records), whole lines
    with open(s0, "ab") as f:
        f.write(b'{"prompt": "torn wri')  # a write cut short (power loss) must not survive a resume
    p0 = bg(env, path, s0, "--shard", "0/2", "--resume")
    p1 = bg(env, path, s1, "--shard", "1/2")
    load0, load1 = loads(p0.stderr), loads(p1.stderr)
    assert len(load1) == 2 and all("/m2 " in x or "/bad " in x for x in load1)  # groups 1 and 3
    assert load0 and all("/m1 " in x for x in load0)  # groups 0 and 2: no checkpoint in both shards
    assert aot(env, "batch-generate", "--input", path, "--output", s1, check=False).returncode == 2  # exists
    merged = env["root"] / "merged.jsonl"
    aot(env, "batch-merge", "--output", merged, s0, s1)
    assert read(merged) == read(expected)  # no duplicates, no gaps, input order, same completions


def test_shards_of_a_job_with_fewer_models_than_shards_split_the_records():
    """With fewer model groups than shards every shard gets work and loads one checkpoint: shard I
    serves group I % G, whose records are dealt out among its shards; with as many groups as shards
    or more, whole groups (the test above)."""
    from aotlm.jobs.plan import Group, select_shard

    def share(groups, n):  # per shard: (model, record) pairs
        return [[(g.key[0], r) for g in select_shard(groups, (i, n)) for r in g.records] for i in range(n)]

    one = [Group(("m1", "f32", "m1"), list(range(7)))]
    assert share(one, 3) == [
        [("m1", 0), ("m1", 3), ("m1", 6)],
        [("m1", 1), ("m1", 4)],
        [("m1", 2), ("m1", 5)],
    ]
    two = [Group((m, "f32", m), list(range(5))) for m in ("a", "b")]
    a, b = [("a", r) for r in range(5)], [("b", r) for r in range(5)]
    assert share(two, 4) == [a[0::2], b[0::2], a[1::2], b[1::2]]
    three = [Group((m, "f32", m), [0]) for m in ("a", "b", "c")]
    assert share(three, 2) == [[("a", 0), ("c", 0)], [("b", 0)]]  # whole groups
    assert share([Group(("m1", "f32", "m1"), [0, 1])], 4) == [[("m1", 0)], [("m1", 1)], [], []]
    assert one[0].records == list(range(7))  # the groups themselves are left whole


# ------------------------------------------------------------------------ run-h5
L, START = 20, [500, 501]  # start tokens outside the vocabulary (320)


def write_h5(directory, data):
    import h5py

    directory.mkdir(parents=True, exist_ok=True)
    with h5py.File(directory / "data.h5", "w") as f:
        f["data"] = data


def write_params(path, data_dir, batch_size, start, **model):
    import yaml

    doc = {
        "inference_input": {
            "data_processor": "GptHDF5MapDataProcessor",
            "data_dir": str(data_dir),
            "batch_size": batch_size,
        },
        "model": {"start_token": start, **model},
        "runconfig": {"mode": "inference"},  # other sections of a Cerebras params file are ignored
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def predictions(model_dir):
    files = sorted(
        (model_dir / "predictions").glob("predictions_*.npz"), key=lambda f: int(f.stem.split("_")[1])
    )
    out = {}
    for f in files:
        z = np.load(f)
        out[int(z["global_step"])] = z["predictions"]
    return out


@pytest.fixture(scope="module")
def h5(env):
    from aotlm import AutoModelForSampling

    rng = np.random.default_rng(0)
    data = np.full((7, L), START[0], np.int32)
    for i, n in enumerate([8, 7, 5, 5, 8, 5, 7]):
        data[i, :n] = rng.integers(0, VOCAB, n)
    data[2, 5:7] = [501, 3]  # a prompt ended by the second start token (what follows is ignored)
    model = AutoModelForSampling.from_pretrained(
        env["m1"], n_positions=32, compile_cache=env["root"] / "cache"
    )
    plens = [8, 7, 5, 5, 8, 5, 7]

    def ref(max_tokens, stops):
        rows = np.full((7, L), START[0], np.int64)
        for i, n in enumerate(plens):
            new = min(max_tokens or L, L - n)
            gen = model.sample(data[i : i + 1, :n], max_new_tokens=new)[0, n:].tolist()
            for t in range(len(gen)):
                if any(t + 1 >= len(s) and gen[t + 1 - len(s) : t + 1] == s for s in stops):
                    gen = gen[: t + 1]
                    break
            rows[i, : n + len(gen)] = data[i, :n].tolist() + gen
        return rows

    free = ref(10, [])
    stop = free[0, 8 + 3 : 8 + 5].tolist()  # two tokens sample 0 generates: a real stop sequence
    write_h5(env["root"] / "h5", data)
    params = write_params(
        env["root"] / "p.yaml", env["root"] / "h5", 3, START, max_tokens=10, stop_sequences=[stop, [999, 998]]
    )
    expected = ref(10, [stop, [999, 998]])
    assert (expected != free).any()  # the stop sequence changes something
    return {"data": data, "params": params, "expected": expected, "ref": ref, "stop": stop}


def test_h5_predictions_dummies_stop_and_max_tokens(env, h5):
    md = env["root"] / "md_main"
    p = aot(env, "run-h5", "--params", h5["params"], "--checkpoint", env["m1"], "--model-dir", md)
    preds = predictions(md)
    assert sorted(preds) == [1, 2, 3] and all(a.shape == (3, L) for a in preds.values())
    got = np.concatenate([preds[s] for s in (1, 2, 3)])
    assert (got[:7] == h5["expected"]).all()
    assert (got[7:] == START[0]).all()  # two dummy rows of start_token
    assert len(loads(p.stderr)) == 1
    assert not list((md / "predictions").glob(".*"))  # no temporary files left


def test_h5_loop_dim0_int_start_token_inference_steps(env, h5):
    write_h5(env["root"] / "h5_t", np.where(h5["data"] == 501, 500, h5["data"]).T.copy())  # [L, samples]
    params = write_params(
        env["root"] / "p0.yaml",
        env["root"] / "h5_t",
        3,
        500,
        max_tokens=10,
        stop_sequences=[h5["stop"]],
        loop_dim=0,
    )
    md = env["root"] / "md_t"
    args = ("run-h5", "--params", params, "--checkpoint", env["m1"], "--model-dir", md)
    aot(env, *args, "--inference-steps", "2")
    first = predictions(md)
    assert sorted(first) == [1, 2]
    expected = np.concatenate([predictions(env["root"] / "md_main")[s] for s in (1, 2, 3)])
    assert (np.concatenate([first[1], first[2]]) == expected[:6]).all()


def test_h5_kill_resume_shards_and_compile_only(env, h5):
    params = write_params(env["root"] / "p1.yaml", env["root"] / "h5", 1, START)  # no max_tokens: up to L
    md = env["root"] / "md_kill"
    args = ["run-h5", "--params", str(params), "--checkpoint", str(env["m1"]), "--model-dir", str(md)]
    p = aot(env, *args, "--compile-only")
    assert "compile only" in p.stdout and not (md / "predictions").exists()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aotlm.cli", *args, "--shard", "1/2"],
        env=env["env"],
        cwd=env["root"],
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list((md / "predictions").glob("predictions_*.npz")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = predictions(md)  # every file present loads: no partial .npz
    assert 1 <= len(killed) < 3 and all(s % 2 == 0 for s in killed)
    stamps = {f: f.stat().st_mtime_ns for f in (md / "predictions").glob("predictions_*")}
    aot(env, *args, "--shard", "1/2")  # resume shard 1 (steps 2, 4, 6)
    assert {f: f.stat().st_mtime_ns for f in stamps} == stamps  # finished batches skipped, untouched
    aot(env, *args, "--shard", "0/2")  # then shard 0 (steps 1, 3, 5, 7)
    preds = predictions(md)
    assert sorted(preds) == list(range(1, 8))
    got = np.concatenate([preds[s] for s in sorted(preds)])  # concatenated by step = input order
    assert (got == h5["ref"](None, [])).all()


# ------------------------------------------------------------------------ compile / run split
def test_run_prompt_errors_come_before_the_executables_load(env):
    """``aotlm run`` checks its prompts first (a missing artifacts dir would be the later error)."""
    bad = env["root"] / "bad_run.jsonl"
    bad.write_text('{"prompt_ids": [1, 2], "id": 7}\n{"prompt_ids": ["a"]}\n')
    base = ("run", "--artifacts", env["root"] / "no-artifacts", "--checkpoint", env["m1"])
    for flags, want in [
        (("--prompts-file", env["root"] / "missing.jsonl"), "cannot read the input .*missing.jsonl"),
        (("--prompts-file", bad), "bad_run.jsonl line 2: 'prompt_ids' must be a non-empty list"),
        (("--prompt", "a", "--prompt", ""), "--prompt number 2 is empty"),
    ]:
        q = aot(env, *base, *flags, check=False)
        err = q.stderr.strip().splitlines()
        assert q.returncode == 2 and len(err) == 1 and re.search(want, err[0]), q.stderr


def test_compile_artifacts_then_run_compiles_nothing(env):
    from aotlm import AutoModelForSampling

    art = env["root"] / "art"
    shape = ("--batch-size", 2, "--n-positions", 32)  # the shape batch-generate used: partly cached
    aot(env, "compile", env["m1"], *shape, "--output-artifacts", art)
    assert json.loads((art / "aotlm_args.json").read_text())["model_kwargs"]["batch_size"] == 2
    moved = env["root"] / "art_moved"
    art.rename(moved)  # relocatable
    ids = ("--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8,9,10,11,12,13")
    p = aot(
        env,
        "run",
        "--artifacts",
        moved,
        "--checkpoint",
        env["m1"],
        *ids,
        "--prompt",
        "def fib",
        "--max-new-tokens",
        6,
    )
    assert "this process: 0 compiles, 0 lowerings, 0 traces" in p.stderr
    cache = env["root"] / "cache"
    model = AutoModelForSampling.from_pretrained(env["m1"], batch_size=2, n_positions=32, compile_cache=cache)
    lines = p.stdout.splitlines()
    for line, ids in zip(lines, ([1, 2, 3], list(range(4, 14))), strict=False):
        assert line == ",".join(map(str, model.sample([ids], max_new_tokens=6)[0].tolist()))
    assert json.loads(lines[2])["completion"] == reference(env["m1"], "def fib", 6, cache)  # text, eos
    q = aot(env, "run", "--artifacts", moved, "--checkpoint", env["m1"], "--prompt-ids", "1,2",
            "--max-new-tokens", 40, check=False)  # fmt: skip
    assert q.returncode == 2 and "recompile with aotlm compile --n-positions 42" in q.stderr, q.stderr
    q = aot(env, "run", "--artifacts", moved, "--checkpoint", env["m2"], "--prompt-ids", "1,2", check=False)
    err = q.stderr.strip().splitlines()
    assert q.returncode == 2 and "does not match the architecture" in err[-1] and "n_layers 2 vs 1" in err[-1]
    assert len([e for e in err if "error" in e]) == 1 and "Traceback" not in q.stderr
