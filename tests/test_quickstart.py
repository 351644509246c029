"""The README's commands work on a fresh machine: a new virtual environment holding only what the
commands themselves install, a clean copy of the project, no test extras.

The quick start (install, real model, one chat answer) runs exactly as the README writes it; the
other user-facing commands the README gives (generate, compile + run, batch-generate, serve with its
own extra) then run in that same environment, so a dependency only the test extras bring in (jinja2
came in through torch) fails here instead of on a user's machine. Skips only when the package index
cannot be reached.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def section_commands(heading: str) -> list[str]:
    """The ```bash blocks of the README section under ``heading`` (a ``## `` title), in order."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end > 0 else None]
    return re.findall(r"```bash\n(.*?)```", body, flags=re.S)


def clean_copy(dest: Path) -> Path:
    """The project's files as a clean checkout has them (tracked, or new and not ignored), or the
    source tree less build outputs."""
    if (ROOT / ".git").exists():
        files = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.split(b"\0")
        for name in filter(None, files):
            src = ROOT / name.decode()
            if src.is_file():
                (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name.decode())
        return dest
    skip = shutil.ignore_patterns(".venv", "compile_cache", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(ROOT, dest, ignore=skip, dirs_exist_ok=True)
    return dest


def index_unreachable(tmp: Path) -> str | None:
    """Why the package index cannot be used here, or None."""
    probe = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q", "-d", str(tmp)]
    try:
        r = subprocess.run([*probe, "six"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "the package index did not answer in 120 s"
    if r.returncode != 0:
        return "the package index is unreachable: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return None


class FreshEnv:
    """A virtual environment with nothing installed, and a shell that runs commands in it."""

    def __init__(self, root: Path):
        self.src = clean_copy(root / "aotlm")
        self.venv = root / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")}
        env.update(PATH=f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(self.venv))
        env.update(PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_COMPILE="1")
        # XLA's own flags, as a user's shell has (the rest of the suite compiles cheaply: conftest), so the
        # README's commands also run on the code generation users get (+5 s for the chat command)
        self.env = env

    def run(self, command: str, timeout: float = 1200) -> str:
        """``command`` in bash (``set -e``) from the project copy; its stdout. Fails with the output."""
        r = subprocess.run(
            ["bash", "-c", "set -eo pipefail\n" + command],
            cwd=self.src, env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert r.returncode == 0, (
            f"`{command.strip()}` exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
        return r.stdout

    def popen(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            args, cwd=self.src, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> FreshEnv:
    tmp = tmp_path_factory.mktemp("fresh")
    reason = index_unreachable(tmp / "probe")
    if reason:
        pytest.skip(reason)
    return FreshEnv(tmp)


def test_quick_start_answers_from_a_fresh_environment(fresh):
    quick = section_commands("Quick start")
    assert "aotlm chat --model smollm2" in quick[0], "the README's first command is the chat quick start"
    out = fresh.run(quick[0])
    assert "paris" in out.lower(), out
    # the README's second command (no download): the bundled model, one JSON line per prompt
    assert "aotlm generate" in quick[1]
    line = json.loads(fresh.run(quick[1]).strip().splitlines()[-1])
    assert line["completion"] and line["finish_reason"] in ("eos", "length", "stop_sequence")


def test_compile_run_and_batch_commands_from_a_fresh_environment(fresh, tmp_path):
    fresh.run("pip install -q -e .")  # the commands below need only the base install
    model = "--model aotlm/tiny-py"
    art = tmp_path / "artifacts"
    fresh.run(f"aotlm compile aotlm/tiny-py --batch-size 1 --n-positions 64 --output-artifacts {art}")
    out = fresh.run(f"aotlm run --artifacts {art} --checkpoint aotlm/tiny-py --prompt 'def f(x):'")
    assert "def f(x):" in out or out.strip(), out
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": "a", "prompt": "import os"}\n{"id": "b", "prompt": "def add(a, b):"}\n')
    fresh.run(f"aotlm batch-generate --input {src} --output {dst} {model} --max-new-tokens 8")
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"] and all("completion" in r for r in rows), rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_from_a_fresh_environment(fresh):
    serving = section_commands("Serving")[0]
    install = next(x for x in serving.splitlines() if x.startswith("pip install"))
    fresh.run(install.split("#")[0])
    port = free_port()
    proc = fresh.popen(["aotlm", "serve", "--port", str(port), "--batch-size", "2", "--quiet"])
    try:
        body = json.dumps({"model": "tiny-py", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        deadline, answer = time.monotonic() + 600, None
        while answer is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
            except OSError:
                time.sleep(1)
        assert answer is not None, f"the server never answered (exit {proc.poll()})"
        assert answer["choices"][0]["text"], answer
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    assert "Traceback" not in out, out[-3000:]
