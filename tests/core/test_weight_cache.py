"""Converted weights cached on disk (``aotlm.core.weight_cache``): a warm load reads them back instead of
converting the checkpoint again, bit for bit, without opening it; options that change a stored leaf
get their own entry; a damaged entry is converted again; ``AOTLM_WEIGHT_CACHE=0`` turns it off."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_builders import VOCAB, tiny_config, write_gguf

from aotlm import AutoModelForSampling
from aotlm.core import weight_cache
from aotlm.models.checkpoint import gguf

KW = dict(batch_size=1, n_positions=32, context_length_estimate=16, compile_cache=False)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("weight_cache")
    ckpt = make_checkpoint(root / "hf", tiny_config("llama"), scale=3.0)
    return write_gguf(ckpt, "llama", T.Q8_0, root / "tiny-Q8_0.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTLM_WEIGHT_CACHE", str(tmp_path / "weights"))
    monkeypatch.setenv("AOTLM_GGUF_CACHE", str(tmp_path / "gguf"))
    return tmp_path / "weights"


def leaves(m) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(m.params)]


def test_a_warm_load_reads_the_stored_form_back(q8_file, cache, monkeypatch):
    before = dict(weight_cache.stats)
    cold = AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    assert weight_cache.stats["writes"] == before["writes"] + 1 and len(list(cache.iterdir())) == 1

    def no_file(*a, **k):
        raise AssertionError("the warm load opened the checkpoint")

    monkeypatch.setattr(gguf, "open_weights", no_file)
    warm = AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    assert weight_cache.stats["hits"] == before["hits"] + 1
    assert jax.tree.structure(warm.params) == jax.tree.structure(cold.params)
    for a, b in zip(leaves(warm), leaves(cold), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, 10))
    np.testing.assert_array_equal(warm.sample(ids, max_new_tokens=6), cold.sample(ids, max_new_tokens=6))


def _mapped(directory: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files under ``directory`` (``/proc/self/maps``)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(str(directory)):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            spans.append((lo, hi))
    return spans


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
@pytest.mark.parametrize("load", ["warm", "cold"])
def test_loads_map_the_cached_files_instead_of_copying(q8_file, cache, load):
    """On one CPU device the loads' arrays are the cache files' mapped pages themselves (JAX takes the
    memory-mapped ``.npy`` data without a copy): every big leaf's buffer lies in a mapping of a file of
    the entry, none in anonymous memory -- a warm load's, and a converting one's (each leaf written,
    then placed from its file), so neither holds the weights twice."""
    m = AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    if load == "warm":
        m = AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    spans = _mapped(cache.resolve())
    big = [a for a in jax.tree.leaves(m.params) if a.nbytes >= 4096]
    assert big and spans
    for a in big:
        ptr = a.addressable_data(0).unsafe_buffer_pointer()
        assert any(lo <= ptr < hi for lo, hi in spans), f"a {a.dtype} {a.shape} leaf was copied"


def test_other_options_get_their_own_entry_and_float_loads_none(q8_file, cache):
    AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    AutoModelForSampling.from_pretrained(str(q8_file), quant="int4", **KW)
    AutoModelForSampling.from_pretrained(str(q8_file), fuse_qkv=True, **KW)
    assert len(list(cache.iterdir())) == 3
    AutoModelForSampling.from_pretrained(str(q8_file), quant="none", **KW)  # float32: 4x the file, not kept
    assert len(list(cache.iterdir())) == 3


def test_a_damaged_entry_is_converted_again(q8_file, cache, caplog):
    cold = [np.array(a) for a in leaves(AutoModelForSampling.from_pretrained(str(q8_file), **KW))]
    (entry,) = list(cache.iterdir())
    damaged = next(entry.glob("*.npy"))
    damaged.unlink()  # a new file, not the one the cold model maps (entries are never changed in place)
    damaged.write_bytes(b"not an array")
    again = AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    assert any("weight cache entry" in r.getMessage() for r in caplog.records)
    for a, b in zip(leaves(again), cold, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (cache / entry.name / weight_cache.MANIFEST).is_file()  # rewritten whole


def test_off_writes_nothing(q8_file, cache, monkeypatch):
    monkeypatch.setenv("AOTLM_WEIGHT_CACHE", "0")
    AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    assert not cache.exists()


def test_a_failed_write_publishes_nothing_and_the_load_goes_on(q8_file, cache, monkeypatch, caplog):
    """The files are written by a thread beside the conversion: a write that fails (a full disk) stops
    the writing, the load still returns its weights, no entry is published (none half-written) and
    one warning says why; the next load converts and writes it again."""
    real, calls = np.save, []

    def failing_save(file, arr, **kw):
        calls.append(file)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(file, arr, **kw)

    monkeypatch.setattr(weight_cache.np, "save", failing_save)
    model = AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    assert model.params and not list(cache.iterdir())  # no entry, no temporary directory left
    assert any("No space left on device" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(weight_cache.np, "save", real)
    AutoModelForSampling.from_pretrained(str(q8_file), **KW)
    assert len(list(cache.iterdir())) == 1


def _entry(base: Path, name: str, size: int) -> Path:
    d = base / name
    d.mkdir()
    (d / "00000.npy").write_bytes(b"\0" * size)
    (d / weight_cache.MANIFEST).write_text("{}")
    return d


def test_eviction_is_lru_and_safe_beside_other_processes(tmp_path, monkeypatch):
    """Over the cap the least recently used entries go; an entry being written (hidden) stays; entries
    that other processes publish and remove while the scan runs never make it fail (a suite run hit
    ``FileNotFoundError`` there: a manifest listed, then gone before its time was read)."""
    base = tmp_path / "weights"
    base.mkdir()
    old, new = _entry(base, "old", 600), _entry(base, "new", 600)
    os.utime(old / weight_cache.MANIFEST, (1, 1))
    writing = _entry(base, ".new-abc", 600)
    monkeypatch.setenv(weight_cache.MAX_ENV, str(1000 / 1e9))
    weight_cache.evict(base)
    assert not old.exists() and new.exists() and writing.exists()

    monkeypatch.setenv(weight_cache.MAX_ENV, "40")
    stop, errors = threading.Event(), []

    def churn():  # publish and drop entries as other processes' loads and evictions do
        i = 0
        while not stop.is_set():
            tmp = _entry(base, f".e{i}-tmp", 10)
            os.replace(tmp, base / f"e{i}")
            shutil.rmtree(base / f"e{i}")
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(300):
            try:
                weight_cache.evict(base)
            except OSError as e:  # the old scan's failure
                errors.append(e)
    finally:
        stop.set()
        t.join()
    assert errors == []
