"""The short soak: ``scripts/soak_serve.py`` against a real ``aotlm serve`` subprocess (a tiny
random GPT-2, 2 slots, 6 clients for 10 s of greedy, abandoned, timed-out and malformed requests).
It fails unless no request got a 5xx, no slot leaked, nothing compiled after start, RSS stayed
flat and the completed requests replayed alone give the same text (the full soak: engine/serve/README.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_short_soak_of_the_server(tmp_path):
    args = ["--clients", "6", "--seconds", "10", "--batch-size", "2", "--n-positions", "64"]
    args += ["--context-length-estimate", "16,32", "--max-prompt", "40", "--max-tokens", "16"]
    args += ["--replay", "15", "--work", str(tmp_path)]
    cmd = [sys.executable, str(SCRIPTS / "soak_serve.py"), *args]
    out = subprocess.run(cmd, cwd=SCRIPTS, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "FAIL" not in out.stdout and out.stdout.count("PASS") == 5, out.stdout
    assert "'completed'" in out.stdout and "'bad'" in out.stdout, out.stdout
