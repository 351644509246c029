"""The on-disk compile cache: warm starts in new processes compile nothing; it survives damage."""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CHILD = str(Path(__file__).parents[1] / "support" / "cache_child.py")


def run_child(*args, check=True):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run(
        [sys.executable, CHILD, *map(str, args)], capture_output=True, text=True, env=env, timeout=600
    )
    if not check:
        return p
    if p.returncode != 0:
        raise AssertionError(f"child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


NO_WORK = {"backend": 0, "lowering": 0, "tracing": 0}


@pytest.fixture(scope="module")
def warm(llama_path, tmp_path_factory):
    """One cold run filling a cache; returns (cache dir, result)."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, run_child(llama_path, cache)


def test_new_process_warm_start_compiles_and_lowers_nothing(warm, llama_path, tmp_path):
    cache, cold = warm
    n = len(cold["graphs"])
    assert cold["counts"]["backend"] == n and not any(cold["hits"])
    hot = run_child(llama_path, cache)
    assert hot["counts"] == NO_WORK, hot["counts"]
    assert all(hot["hits"]) and hot["tokens"] == cold["tokens"]
    moved = tmp_path / "elsewhere" / "ckpt"  # same checkpoint in another directory: still a hit
    shutil.copytree(llama_path, moved)
    again = run_child(moved, cache)
    assert again["counts"] == NO_WORK and again["tokens"] == cold["tokens"]


def test_changed_bucket_or_amp_recompiles_only_affected(warm, llama_path):
    cache, cold = warm
    r = run_child(llama_path, cache, "--n-positions", "48,64")  # bucket 32 -> 48; 64 stays the largest
    changed = {tuple(g) for g, hit in zip(r["graphs"], r["hits"], strict=True) if not hit}
    assert changed == {("decode", 48), ("prefill", 16, 48)}, changed
    r = run_child(llama_path, cache, "--amp", "bf16")
    assert not any(r["hits"])


def test_corrupt_entry_warns_recompiles_and_stays_correct(warm, llama_path, tmp_path):
    cache, cold = warm
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    entries = [copy / digest for digest in cold["entries"]]  # entries this configuration uses
    blob = entries[0] / "executable.bin"
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])  # truncate one entry
    (entries[1] / "executable.bin").write_bytes(b"garbage")
    r = run_child(llama_path, copy)
    assert r["tokens"] == cold["tokens"]
    assert sum(not h for h in r["hits"]) == 2
    assert sum("corrupt entry" in w for w in r["warnings"]) == 2
    fixed = run_child(llama_path, copy)  # the bad entries were replaced by fresh ones
    assert all(fixed["hits"]) and fixed["counts"] == NO_WORK


def test_concurrent_compiles_of_same_key_both_succeed(llama_path, tmp_path):
    cache = tmp_path / "shared"
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: run_child(llama_path, cache), range(2))
    assert a["tokens"] == b["tokens"]
    entries = [e for e in cache.iterdir() if not e.name.startswith(".")]
    assert len(entries) == len(a["graphs"])
    assert not [e for e in cache.iterdir() if e.name.startswith(".tmp")]
    r = run_child(llama_path, cache)
    assert all(r["hits"]) and r["counts"] == NO_WORK


def test_save_move_load_compiles_nothing(llama_path, tmp_path):
    saved = tmp_path / "a" / "compiled"
    first = run_child(llama_path, "none", "--save", saved)
    moved = tmp_path / "b" / "moved"
    moved.parent.mkdir()
    shutil.move(saved, moved)
    r = run_child(llama_path, "none", "--load", moved)
    assert r["counts"] == NO_WORK and r["tokens"] == first["tokens"]
    bad = run_child(llama_path, "none", "--load", moved, "--amp", "bf16", check=False)
    assert bad.returncode != 0
    assert (
        "built for another configuration" in bad.stderr
        and "amp: saved 'f32', this model 'bf16'" in bad.stderr
    )


def test_unwritable_cache_dir_falls_back_to_memory(llama_path, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = run_child(llama_path, blocker / "cache")
    assert any("not writable" in w for w in r["warnings"])
    assert len(r["tokens"]) == 2


def test_lru_eviction_and_refused_executable_fall_back(gpt2_path, tmp_path, monkeypatch):
    """Size limit evicts least-recently-used entries; an executable the platform refuses recompiles."""
    import warnings

    import numpy as np

    from aotlm import AutoModelForSampling
    from aotlm.core import compile_cache

    kw = dict(n_positions=32, context_length_estimate=[8, 16], compile_cache=str(tmp_path / "c"))
    model = AutoModelForSampling.from_pretrained(gpt2_path, **kw).compile()
    want = model.sample(np.arange(1, 6)[None], max_new_tokens=4)
    cache = model.compile_cache
    entries = cache.entries()
    assert len(entries) == len(model.graph_keys())
    oldest = entries[-1]["key"]
    cache.max_bytes = sum(e["bytes"] for e in entries) - 1
    assert cache.evict() == 1 and oldest not in {e["key"] for e in cache.entries()}

    def refuse(*args, **kwargs):
        raise RuntimeError("executable built for another CPU")  # what jax#38445 looks like

    monkeypatch.setattr("jax.experimental.serialize_executable.deserialize_and_load", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = AutoModelForSampling.from_pretrained(gpt2_path, **kw).compile()
    assert not any(r["hit"] for r in again.compile_report)
    assert any(
        issubclass(w.category, compile_cache.CacheWarning) and "refused" in str(w.message) for w in caught
    )
    np.testing.assert_array_equal(again.sample(np.arange(1, 6)[None], max_new_tokens=4), want)


def test_source_hash_ignores_where_code_lives_but_not_what_it_does(tmp_path):
    """Cache keys carry no module paths: moving modules into another folder and rewriting the
    imports that name them keeps ``source_hash`` (so a reorganised package still hits a cache
    written before); any changed statement, a docstring aside, changes it."""
    from aotlm.core import compile_cache

    files = compile_cache.graph_code()
    assert len(files) > 20 and all(f.suffix == ".py" for f in files)
    before = compile_cache.source_hash(files)
    assert before == compile_cache.source_hash()
    moved = []
    for i, f in enumerate(files):
        text = f.read_text()
        # another folder, other import paths (top-level and function-local), another docstring
        text = text.replace("from aotlm.models import", "from aotlm.elsewhere.models import")
        text = text.replace("from aotlm import", "from aotlm.sub import")
        text = text.replace('"""', '"""Reworded. ', 1)
        dest = tmp_path / f"pkg{i}" / f.name  # a folder each: two lookup.py files must not collide
        dest.parent.mkdir(exist_ok=True)
        dest.write_text(text + "\n\n# a trailing comment\n")
        moved.append(dest)
    assert compile_cache.source_hash(moved) == before
    decoder = next(f for f in moved if f.name == "decoder.py")
    decoder.write_text(decoder.read_text().replace("cfg.norm_eps", "cfg.norm_eps * 2", 1))
    assert compile_cache.source_hash(moved) != before


def test_save_refuses_a_file_or_a_folder_of_other_files_before_compiling(gpt2_path, tmp_path):
    """A save replaces its directory whole, so it may replace only nothing, an empty directory or an
    earlier save; anything else is a ValueError before a graph compiles, and stays as it was."""
    import numpy as np

    from aotlm import AutoModelForSampling

    kw = dict(n_positions=16, context_length_estimate=[8], compile_cache=False)
    model = AutoModelForSampling.from_pretrained(gpt2_path, **kw)
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("keep me too")
    with pytest.raises(ValueError, match="it is a file; give a directory path"):
        model.save(notes)
    with pytest.raises(ValueError, match="holds other files .* give a new or empty directory"):
        model.save(home)
    assert model.compile_report == []  # refused before compiling
    assert notes.read_text() == "keep me" and [p.name for p in home.iterdir()] == ["thesis.tex"]
    empty = tmp_path / "empty"
    empty.mkdir()
    model.save(empty)
    model.save(empty)  # an earlier save is replaced
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    again = AutoModelForSampling.from_pretrained(gpt2_path, **kw).load(empty)
    ids = np.arange(1, 5)[None]
    assert (again.sample(ids, max_new_tokens=3) == model.sample(ids, max_new_tokens=3)).all()
