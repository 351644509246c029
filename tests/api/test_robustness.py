"""Hostile inputs: every one gives one line naming the problem and the fix (or works correctly).

Never a bare traceback, a hang or a silently wrong answer. Covered here: broken checkpoints
(directory, config.json, weights, shapes, shards), odd paths (spaces, non-ASCII, symlinks),
bad ``sample()`` arguments, a process killed mid-compile, damaged or unusable compile caches,
and the CLI (bad flag types and values, bad ``--config`` files: exit code 2, one line).
``tests/api/test_causal_lm_errors.py`` checks the *problem* half of the basic ``sample()`` errors; this file
adds the *fix* half and the single-line rule for them. ``tests/core/test_compile_cache.py`` covers a
truncated executable and a path under a regular file.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from aotlm import AutoModelForSampling
from aotlm.cli.app import main
from aotlm.core.compile_cache import CacheWarning, CompileCache
from aotlm.core.graphs import MAX_EOS
from aotlm.models.checkpoint import SAFE_INDEX, CheckpointError

SHAPE = dict(n_positions=32, context_length_estimate=32)  # one bucket: prefill 32, decode 32 (+ select)
PROMPT = [[5, 17, 42, 9, 3]]


def one_line(text: str) -> str:
    assert text and "\n" not in text.strip(), f"not one line: {text!r}"
    return text


def expect_error(fn, problem: str, fix: str, exc=(ValueError, TypeError)):
    with pytest.raises(exc) as info:
        fn()
    msg = one_line(str(info.value))
    assert re.search(problem, msg), f"problem {problem!r} not in {msg!r}"
    assert re.search(fix, msg), f"fix {fix!r} not in {msg!r}"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("robust-cache")


@pytest.fixture(scope="module")
def model(gpt2_path, cache_dir):
    return AutoModelForSampling.from_pretrained(gpt2_path, compile_cache=cache_dir, **SHAPE).compile()


@pytest.fixture(scope="module")
def reference(model):
    return model.sample(PROMPT, max_new_tokens=8)


def load(path, **kw):
    return AutoModelForSampling.from_pretrained(path, **{"compile_cache": False, **SHAPE, **kw})


def copy_ckpt(src, dst, mutate=None):
    shutil.copytree(src, dst)
    if mutate is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        save_file(mutate(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------------------------- checkpoints
def _config(d, text):
    (d / "config.json").write_text(text)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    return _config(d, json.dumps({k: v for k, v in {**cfg, **changes}.items() if v is not None}))


CHECKPOINT_CASES = {
    "missing dir": (lambda d: d / "nope", "does not exist", "check the path"),
    "a file": (lambda d: d / "config.json", "is a file", "give the checkpoint directory"),
    "no config.json": (lambda d: (d / "config.json").unlink() or d, "no config.json", "holds config.json"),
    "invalid JSON": (lambda d: _config(d, "{not json"), "not valid JSON", "re-save"),
    "no model_type": (lambda d: _edit_config(d, model_type=None), "model_type", "fix config.json"),
    "unknown model_type": (lambda d: _edit_config(d, model_type="foo"), "`foo`", "fix config.json"),
    "zero heads": (lambda d: _edit_config(d, n_head=0), "unusable values .*ZeroDivision", "fix config.json"),
    "truncated weights": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]) and d,
        "is corrupt or not safetensors",
        "re-download or re-save",
    ),
    "no weights": (
        lambda d: (d / "model.safetensors").unlink() or d,
        "no weights in",
        "copy the weight files",
    ),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_broken_checkpoint(gpt2_path, tmp_path, case):
    make, problem, fix = CHECKPOINT_CASES[case]
    d = make(copy_ckpt(gpt2_path, tmp_path / "ckpt"))
    expect_error(lambda: load(d), problem, fix, CheckpointError)


WEIGHT_CASES = {
    # a 100-row vocabulary table for vocab_size 101 used to load and clamp the gather: silent
    "short vocab": ("transformer.wte.weight", lambda a: a[:100], "vocab size 100 where config.json says 101"),
    "short positions": ("transformer.wpe.weight", lambda a: a[:10], "10 position rows"),
    "wrong layer shape": ("transformer.h.1.attn.c_attn.weight", lambda a: a[:32], "embed size 32"),
    "scalar norm": ("transformer.ln_f.weight", lambda a: a[0], "scalar where a vector"),
    "wrong norm size": ("transformer.h.0.ln_1.weight", lambda a: a[:32], r"shape \(32,\)"),
    "one-element norm": (
        "transformer.ln_f.weight",
        lambda a: a[:1],
        r"shape \(1,\) where config.json says \(64,\)",
    ),
    "missing tensor": ("transformer.h.1.mlp.c_fc.weight", None, "is missing from the checkpoint"),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_tensor_missing_or_of_wrong_shape(gpt2_path, tmp_path, case):
    name, change, problem = WEIGHT_CASES[case]

    def mutate(t):
        if change is None:
            return {k: v for k, v in t.items() if k != name}
        return {**t, name: np.array(change(t[name]))}

    d = copy_ckpt(gpt2_path, tmp_path / "ckpt", mutate)
    expect_error(lambda: load(d), problem, "config.json|incomplete", CheckpointError)


def test_sharded_index_naming_a_missing_shard(gpt2_path, tmp_path):
    d = copy_ckpt(gpt2_path, tmp_path / "ckpt")
    names = list(load_file(str(d / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    index["weight_map"][names[-1]] = "model-00002-of-00002.safetensors"
    (d / SAFE_INDEX).write_text(json.dumps(index))
    expect_error(
        lambda: load(d), "model-00002-of-00002.safetensors is missing", "copy every shard", CheckpointError
    )
    (d / SAFE_INDEX).write_text("{")
    expect_error(lambda: load(d), "not a valid safetensors index", "re-download", CheckpointError)


def test_spaces_non_ascii_and_symlinks(gpt2_path, model, reference, cache_dir, tmp_path, capsys):
    """Odd paths load, hit the same compile-cache entries (keys hold no paths) and give equal tokens."""
    odd = copy_ckpt(gpt2_path, tmp_path / "my models" / "modèle é 模型")
    linked = tmp_path / "link to ckpt"
    linked.symlink_to(odd, target_is_directory=True)
    hub = tmp_path / "hub snapshot"  # the Hugging Face cache layout: every file a symlink to a blob
    hub.mkdir()
    for f in odd.iterdir():
        (hub / f.name).symlink_to(f)
    odd_cache = tmp_path / "cache dir é"
    shutil.copytree(cache_dir, odd_cache)
    for path in (odd, linked, hub):
        m = AutoModelForSampling.from_pretrained(path, compile_cache=odd_cache, **SHAPE).compile()
        assert all(r["hit"] for r in m.compile_report)
        np.testing.assert_array_equal(m.sample(PROMPT, max_new_tokens=8), reference)
    argv = ["sample", str(linked), "--n-positions", "32", "--context-length-estimate", "32"]
    assert (
        main([*argv, "--cache-dir", str(odd_cache), "--prompt-ids", "5,17,42,9,3", "--max-new-tokens", "8"])
        == 0
    )
    assert capsys.readouterr().out.strip() == ",".join(map(str, reference[0]))


# ---------------------------------------------------------------------------------- sample()
SAMPLE_CASES = {
    "id >= vocab": (dict(input_ids=[[1, 101]]), r"input_ids\[0, 1\] = 101", r"in \[0, 100\]"),
    "negative id": (dict(input_ids=[[-1, 2]]), r"= -1 is not a valid token id", r"in \[0, 100\]"),
    "float ids": (dict(input_ids=[[1.0, 2.5]]), "must hold integers", "integer token ids"),
    "3-D ids": (dict(input_ids=np.ones((1, 2, 3), int)), "rank 3", "one row of token ids per prompt"),
    "empty prompt": (dict(input_ids=[[]]), "prompt is empty", "at least one token"),
    "all-zero mask row": (
        dict(attention_mask=[[0] * 5]),
        "row 0 of attention_mask is all zeros",
        "at least one",
    ),
    "mask shape": (
        dict(attention_mask=[[1, 1, 1]]),
        r"shape \(1, 3\) differs",
        "one 0/1 mask entry per token",
    ),
    "right padding": (
        dict(attention_mask=[[1, 1, 1, 1, 0]]),
        "padding at the end",
        "pad prompts on the left",
    ),
    "too many eos ids": (dict(eos_token_id=list(range(MAX_EOS + 1))), f"at most {MAX_EOS} eos", "pass the"),
    "float eos id": (dict(eos_token_id=2.5), "eos_token_id must be an integer", "pass an int"),
    "negative eos id": (dict(eos_token_id=-3), "eos_token_id must be >= 0", "real token ids"),
    "float max_new_tokens": (dict(max_new_tokens=2.5), "max_new_tokens must be an integer", "got 2.5"),
    "str max_new_tokens": (dict(max_new_tokens="3"), "max_new_tokens must be an integer", "got '3'"),
    "float sequence_length": (
        dict(max_new_tokens=None, sequence_length=9.5),
        "sequence_length must be an",
        "int",
    ),
    "float pad id": (dict(pad_token_id=1.5), "pad_token_id must be an integer", "pass an int"),
    "float start_ids": (dict(start_ids=[0.5]), "start_ids must hold integers", "integer indices"),
}


@pytest.mark.parametrize("case", list(SAMPLE_CASES))
def test_bad_sample_arguments(model, case):
    kwargs, problem, fix = SAMPLE_CASES[case]
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    expect_error(lambda: model.sample(**kwargs), problem, fix)


def test_as_many_eos_ids_as_supported_stop_like_one(model, reference):
    first = int(reference[0, len(PROMPT[0]) + 2])  # the third new token
    eos = [t for t in range(101) if t not in reference][: MAX_EOS - 1] + [first]  # decoys never produced
    got = model.sample(PROMPT, max_new_tokens=8, eos_token_id=eos)
    want = model.sample(PROMPT, max_new_tokens=8, eos_token_id=first)
    np.testing.assert_array_equal(got, want)
    assert got.shape[1] <= len(PROMPT[0]) + 3 and got[0, -1] == first


# ---------------------------------------------------------------------------------- compile cache
KILL_CHILD = """
import os, signal, sys
from pathlib import Path
from aotlm import AutoModelForSampling
orig, seen = Path.write_text, []
def write_text(self, data, *a, **k):  # SIGKILL while writing a manifest, half written
    if self.name == "manifest.json":
        seen.append(self)
        if len(seen) == 1:
            with open(self, "w") as f:
                f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
    return orig(self, data, *a, **k)
Path.write_text = write_text
AutoModelForSampling.from_pretrained(sys.argv[1], compile_cache=sys.argv[2], {shape}).compile()
"""


def _entry(model, graph: str) -> str:
    return next(r["entry"] for r in model.compile_report if r["graph"] == graph)


def test_process_killed_mid_compile_then_rerun(gpt2_path, model, reference, cache_dir, tmp_path):
    """The child finds every graph cached but the prefill one, compiles it and dies writing it."""
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    shutil.rmtree(cache / _entry(model, "prefill"))  # prefill: the cheapest graph to compile
    p = subprocess.run(
        [sys.executable, "-c", KILL_CHILD.format(shape=", ".join(f"{k}={v!r}" for k, v in SHAPE.items()))]
        + [str(gpt2_path), str(cache)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    partial = [d for d in cache.iterdir() if d.name.startswith(".tmp-")]
    n = len(model.graph_keys())
    assert len(partial) == 1 and len(CompileCache(cache).entries()) == n - 1  # the half entry is invisible
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # nothing corrupt is ever read
        m = AutoModelForSampling.from_pretrained(gpt2_path, compile_cache=cache, **SHAPE).compile()
    assert [r["graph"] for r in m.compile_report if not r["hit"]] == ["prefill"]
    np.testing.assert_array_equal(m.sample(PROMPT, max_new_tokens=8), reference)
    assert len(m.compile_cache.entries()) == n
    old = 1e9  # 2001: leftovers of killed processes are swept by `cache clear`
    os.utime(partial[0], (old, old))
    assert m.compile_cache.clear(older_than_days=10**5) == 0 and not partial[0].exists()


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _other_hex_digit(path):  # still valid JSON, but the checksum no longer matches
    data = bytearray(path.read_bytes())
    i = data.index(b'"sha256": "') + 20
    data[i] = ord("0") if data[i] != ord("0") else ord("1")
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped byte in executable": lambda e: _flip(
        e / "executable.bin", e.joinpath("executable.bin").stat().st_size // 2
    ),
    "changed manifest checksum": lambda e: _other_hex_digit(e / "manifest.json"),
    "flipped byte in manifest": lambda e: _flip(e / "manifest.json", 0),  # not UTF-8, not JSON
    "deleted manifest": lambda e: (e / "manifest.json").unlink(),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_cache_entry_recompiles_and_heals(gpt2_path, model, reference, cache_dir, tmp_path, case):
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    victim = cache / _entry(model, "prefill")  # prefill: the cheapest graph to recompile
    DAMAGE[case](victim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = AutoModelForSampling.from_pretrained(gpt2_path, compile_cache=cache, **SHAPE).compile()
    assert [r["graph"] for r in m.compile_report if not r["hit"]] == ["prefill"]
    assert [one_line(str(w.message)) for w in caught if w.category is CacheWarning]
    np.testing.assert_array_equal(m.sample(PROMPT, max_new_tokens=8), reference)
    again = AutoModelForSampling.from_pretrained(gpt2_path, compile_cache=cache, **SHAPE).compile()
    assert all(r["hit"] for r in again.compile_report)  # the damaged entry was replaced


def test_cache_tools_survive_a_damaged_manifest(model, cache_dir, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    _flip(cache / model.compile_report[0]["entry"] / "manifest.json", 0)
    cache = str(cache)
    assert main(["cache", "list", "--cache-dir", cache]) == 0
    n = len(model.graph_keys())
    assert f"{n} entries" in capsys.readouterr().out
    assert main(["cache", "verify", "--cache-dir", cache]) == 1
    assert f"{n} entries checked, 1 corrupt" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache-dir", cache]) == 0
    assert f"removed {n} entries" in capsys.readouterr().out and not os.listdir(cache)


@pytest.mark.parametrize("where", ["regular file", "under /proc", "/proc/self"])
def test_unusable_cache_dir_warns_and_compiles_in_memory(tmp_path, where):
    """Tests run as root, for whom chmod blocks nothing: use places no one can write."""
    (tmp_path / "file").write_text("x")
    path = {"regular file": tmp_path / "file", "under /proc": "/proc/aotlm-cache", "/proc/self": "/proc/self"}
    with pytest.warns(CacheWarning, match="not writable.*compiling in memory only"):
        cache = CompileCache(path[where])
    assert cache.dir is None and cache.lookup({}, ("decode", 32), None) is None


# ---------------------------------------------------------------------------------- CLI
def cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse usage errors
        code = e.code
    return code, capsys.readouterr().err.strip()


def _cli_cases(ckpt, tmp):
    bad_json, not_obj, bad_type, unknown = (
        tmp / n for n in ("bad.json", "list.json", "type.json", "unk.json")
    )
    bad_json.write_text("{oops")
    not_obj.write_text("[1, 2]")
    bad_type.write_text(json.dumps({"batch_size": "2"}))
    unknown.write_text(json.dumps({"batch": 2}))
    (tmp / "keep").mkdir()
    (tmp / "keep" / "notes.txt").write_text("mine")
    model = ["compile", ckpt, "--cache-dir", tmp / "c"]
    sample = ["sample", ckpt, "--cache-dir", tmp / "c", "--n-positions", "32", "--prompt-ids"]
    one = tmp / "one.jsonl"
    one.write_text('{"prompt": "def f(x):"}\n')
    lone = tmp / "lone.jsonl"
    lone.write_text('{"prompt": "ok"}\n{"prompt": "a\\ud800b"}\n')
    bg = ["batch-generate", "--input", one, "--output", tmp / "o.jsonl"]
    h5 = ["run-h5", "--params", bad_json, "--checkpoint", ckpt, "--model-dir", tmp]
    many_tp = 2 * jax.device_count() if 4 % (2 * jax.device_count()) == 0 else None
    return [
        ([*model, "--batch-size", "x"], "invalid int value: 'x'"),
        ([*model, "--batch-size", "0"], "batch_size must be >= 1"),
        ([*model, "--dry-run", "--batch-size", "0"], "batch_size must be >= 1"),  # the plan checks too
        ([*model, "--dry-run", "--n-positions", "100000"], "exceeds this model's 256 learned positions"),
        ([*model, "--dry-run", "--tp-degree", "3"], r"4 attention heads cannot be split over tp=3"),
        (
            [*model, "--n-positions", "0"],
            "--n-positions: expected comma-separated bucket lengths >= 1, got '0'",
        ),
        ([*model, "--n-positions", "x"], "expected comma-separated bucket lengths"),
        ([*model, "--context-length-estimate", "16,-2"], "bucket lengths >= 1, got '16,-2'"),
        (
            ["batch-generate", "--input", bad_json, "--output", tmp / "o.jsonl", "--n-positions", "0"],
            "got '0'",
        ),
        (
            ["batch-generate", "--input", bad_json, "--output", tmp / "o.jsonl", "--tp-degree", "0"],
            ">= 1, got '0'",
        ),
        ([*model, "--tp-degree", "3"], r"4 attention heads cannot be split over tp=3; use tp in"),
        ([*model, "--tp-degree", many_tp], f"tp_degree={many_tp} needs {many_tp} devices"),
        ([*model, "--gqa", "bogus"], "unknown gqa strategy 'bogus'; choose one of"),
        ([*model, "--amp", "f8"], "invalid choice: 'f8'"),
        ([*model, "--device-memory-gb", "lots"], "invalid float value"),
        ([*model, "--config", tmp / "missing.json"], "cannot read --config .*missing.json"),
        ([*model, "--config", bad_json], "cannot read --config .*bad.json"),
        ([*model, "--config", not_obj], "must hold a JSON object"),
        ([*model, "--config", bad_type], "batch_size='2' has the wrong type; expected int"),
        ([*model, "--config", unknown], r"unknown keys in .*\['batch'\]; allowed"),
        (["compile", tmp / "no-ckpt"], "does not exist; check the path, or give a model name: .*smollm2"),
        ([*sample, "a,b"], "expected comma-separated integers, got 'a,b'"),
        ([*sample, ""], "the prompt is empty"),
        ([*sample, "1,2", "--prompt-ids", "3"], "ragged"),
        ([*sample, "1,200"], r"not a valid token id .*in \[0, 100\]"),
        ([*sample, "1,2", "--max-new-tokens", "x"], "invalid int value: 'x'"),
        ([*sample, "1,2", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        ([*sample, "1,2", "--eos-token-id", "1.5"], "invalid int value: '1.5'"),
        (["sample", ckpt], "the following arguments are required: --prompt-ids"),
        (["demo", "--dir", tmp / "keep"], "exists and is not a tiny checkpoint; choose a new"),
        ([*model, "--output-artifacts", tmp / "keep"], "holds other files and a save replaces"),
        ([*model, "--output-artifacts", one], "it is a file; give a directory path"),
        (
            ["batch-generate", "--input", lone, "--output", tmp / "o.jsonl"],
            r"lone.jsonl line 2: 'prompt' holds a lone UTF-16 surrogate",
        ),
        (["generate", "--prompt", "a\udcffb"], "prompt 0 holds a lone UTF-16 surrogate"),
        (["make-tiny", tmp / "bad.json"], "exists and is not a tiny checkpoint"),
        (["make-tiny", "/proc/aotlm-tiny"], "aotlm-tiny"),
        (["cache", "clear", "--older-than", "abc"], "expected a number of days >= 0, got 'abc'"),
        (["cache", "clear", "--older-than", "-1"], "expected a number of days >= 0, got '-1'"),
        (["cache", "clear", "--older-than", "nan"], "got 'nan'"),
        (["cache", "list", "--cache-dir", bad_json], "not writable.*pass --cache-dir with a writable"),
        (["cache", "verify", "--cache-dir", "/proc/self"], "not writable"),
        (
            ["cache", "list", "--cache-dir", tmp / "typo"],
            "no compile cache at .*typo: the directory does not exist",
        ),
        (["cache", "verify", "--cache-dir", tmp / "typo"], "no compile cache at .*typo"),
        (["cache", "frobnicate"], "invalid choice: 'frobnicate'"),
        (["score", "--input", bad_json, "--output", bad_json], "--input and --output name the same file"),
        (
            ["serve", ckpt, "--port", "0", "--api-key", ""],
            "--api-key is empty; give the key, or leave the flag",
        ),
        (["serve", ckpt, "--port", "70000"], r"--port must be in 0\.\.65535 \(0: any free port\), got 70000"),
        (["serve", ckpt, "--port", "0", "--max-queue", "0"], "--max-queue must be >= 1, got 0"),
        ([*model, "--max-loras", "-1"], r"max_loras \(adapter slots\) must be >= 0, got -1"),
        ([*model, "--max-loras", "2", "--max-lora-rank", "0"], "max_lora_rank must be >= 1, got 0"),
        ([*bg, "--n-positions", "4"], "the --n-positions of 4; raise --n-positions to"),
        ([*h5, "--inference-steps", "0"], "--inference-steps: expected an integer >= 1, got '0'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: command"),
    ]


def test_cli_user_errors_exit_2_with_one_line(gpt2_path, tmp_path, capsys):
    failures = []
    for argv, problem in _cli_cases(gpt2_path, tmp_path):
        if None in argv:
            continue  # enough devices for any tp that divides the heads: nothing to test
        code, err = cli(capsys, *argv)
        lines = err.splitlines()
        ok = code == 2 and len(lines) == 1 and lines[0].startswith("aotlm") and re.search(problem, err)
        if not ok:
            failures.append(f"{argv}: exit {code}, stderr {err!r}")
    assert not failures, "\n".join(failures)
    assert (tmp_path / "keep" / "notes.txt").read_text() == "mine"  # demo/make-tiny never delete a user's dir
    assert not (tmp_path / "typo").exists()  # cache list / verify do not create the directory they look in
    assert (tmp_path / "one.jsonl").is_file()  # --output-artifacts never replaces a file


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["cache", "clear", "--older-than", "abc"], "got 'abc'"),
        (["compile", "CKPT", "--batch-size", "x"], "invalid int value"),
        (["compile", "CKPT", "--config", "missing.json"], "cannot read --config"),
    ],
)
def test_cli_real_exit_code(gpt2_path, tmp_path, argv, problem):
    argv = [str(gpt2_path) if a == "CKPT" else a for a in argv]
    p = subprocess.run(
        [sys.executable, "-m", "aotlm.cli", *argv, "--cache-dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert p.returncode == 2 and problem in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr
