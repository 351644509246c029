"""``aotlm.core.heap``: freed heap pages go back to the OS (glibc), in a child process of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aotlm.core import heap

CHILD = """
import threading
from aotlm.core import heap

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def churn(keep):
    blocks = [bytearray(4000) for _ in range(40_000)]  # ~160 MB of malloc'ed blocks in this thread's arena
    keep.append(bytearray(4000))  # allocated last: the arena's top stays in use, no automatic trim
    del blocks

keep = []
threads = [threading.Thread(target=churn, args=(keep,)) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
before = rss()
released = heap.release()
print(released, before - rss())
"""


@pytest.mark.skipif(not heap.release(), reason="no glibc malloc_trim here: release() does nothing")
def test_release_returns_freed_arena_pages():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    released, freed = out.stdout.split()
    assert released == "True" and int(freed) > 100e6, out.stdout
