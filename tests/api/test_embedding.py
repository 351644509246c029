"""Safe to embed in other programs: one import name (``aotlm``) and thread-safe model objects.

* A program whose directory holds its own ``models.py`` and ``engine.py`` (both raising on import)
  still generates with aotlm, and neither ``engine`` nor ``models`` is importable from aotlm's
  installation.
* Concurrent ``sample()`` calls on one model return exactly the sequential results (the model's
  lock serializes requests, a streamed one until its last token), and a second model object is
  not blocked by the first one's lock.
"""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from aotlm import AutoModelForSampling

SHAPE = dict(n_positions=32, context_length_estimate=32)  # 2 graphs: prefill 32, decode 32


def _python(cwd, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what pip installed
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TRANSFORMERS_VERBOSITY="error")
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("embed-cache")


@pytest.fixture(scope="module")
def model(gpt2_path, cache_dir):
    return AutoModelForSampling.from_pretrained(
        gpt2_path, batch_size=1, compile_cache=cache_dir, **SHAPE
    ).compile()


def test_user_models_py_and_engine_py_do_not_shadow_aotlm(gpt2_path, model, cache_dir, tmp_path):
    (tmp_path / "models.py").write_text("raise ImportError('the user models.py was imported')\n")
    (tmp_path / "engine.py").write_text("raise RuntimeError('the user engine.py was imported')\n")
    (tmp_path / "app.py").write_text(
        "import json, sys\n"
        "from aotlm import AutoModelForSampling\n"
        "from aotlm.models import supported_model_types\n"
        f"m = AutoModelForSampling.from_pretrained(sys.argv[1], compile_cache=sys.argv[2], **{SHAPE!r})\n"
        "out = m.sample([[5, 17, 42, 9]], max_new_tokens=6)\n"
        "print(json.dumps(out.tolist()))\n"
    )
    p = _python(tmp_path, "app.py", str(gpt2_path), str(cache_dir))  # its directory is sys.path[0]
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == model.sample([[5, 17, 42, 9]], max_new_tokens=6).tolist()


@pytest.mark.parametrize("name", ["engine", "models"])
def test_no_top_level_engine_or_models_module(tmp_path, name):
    p = _python(tmp_path, "-c", f"import {name}")
    assert p.returncode == 1 and f"ModuleNotFoundError: No module named '{name}'" in p.stderr, p.stderr
    p = _python(tmp_path, "-c", "import aotlm, aotlm.models; print(aotlm.models.__name__)")
    assert p.returncode == 0 and p.stdout.strip() == "aotlm.models", p.stderr


# ---------------------------------------------------------------------------------- threads
PROMPTS = [list(np.random.default_rng(i).integers(0, 101, 3 + i % 10)) for i in range(20)]
NEW = [4 + (7 * i) % 12 for i in range(20)]  # 4..15 new tokens: several decode calls, both buckets


@pytest.fixture(scope="module")
def sequential(model):
    return [model.sample([p], max_new_tokens=n) for p, n in zip(PROMPTS, NEW, strict=True)]


def test_four_threads_share_one_model(model, sequential):
    """4 threads x 5 calls, started together: every result equals the sequential one."""
    start = threading.Barrier(4)

    def worker(t):
        start.wait()
        return [(i, model.sample([PROMPTS[i]], max_new_tokens=NEW[i])) for i in range(t, 20, 4)]

    with ThreadPoolExecutor(4) as pool:
        results = [r for rows in pool.map(worker, range(4)) for r in rows]
    assert sorted(i for i, _ in results) == list(range(20))
    for i, out in results:
        np.testing.assert_array_equal(out, sequential[i], err_msg=f"prompt {i} differs under threads")


def test_second_model_is_not_blocked_by_the_first(model, sequential, gpt2_path):
    """While model 1's lock is held, a call on model 1 waits and one on model 2 completes."""
    other = AutoModelForSampling.from_pretrained(
        gpt2_path, batch_size=2, compile_cache=False, **SHAPE
    ).compile()
    want2 = other.sample([PROMPTS[1], PROMPTS[1]], max_new_tokens=NEW[1])
    held, release = threading.Event(), threading.Event()

    def hold():
        with model.lock:  # stands in for a long request (e.g. a slow streamed one) on model 1
            held.set()
            release.wait(120)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    try:
        with ThreadPoolExecutor(2) as pool:
            blocked = pool.submit(model.sample, [PROMPTS[0]], max_new_tokens=NEW[0])
            free = pool.submit(other.sample, [PROMPTS[1], PROMPTS[1]], max_new_tokens=NEW[1])
            np.testing.assert_array_equal(free.result(timeout=120), want2)
            assert not blocked.done(), "model 1 ran a request while its lock was held"
            release.set()
            np.testing.assert_array_equal(blocked.result(timeout=120), sequential[0])
    finally:
        release.set()
        holder.join()
    np.testing.assert_array_equal(want2[0], sequential[1][0])  # batch 2 agrees with batch 1


class SlowStreamer:
    """A transformers-style streamer that takes its time, as one writing to a slow client would."""

    def __init__(self):
        self.puts, self.started, self.ended_at = [], threading.Event(), None

    def put(self, value):
        self.puts.append(np.asarray(value))
        self.started.set()
        time.sleep(0.05)

    def end(self):
        self.ended_at = time.perf_counter()


def test_streamed_and_plain_requests_in_two_threads(model, sequential):
    """The plain request waits for the whole streamed one; both come out right."""
    streamer = SlowStreamer()
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(model.sample, [PROMPTS[2]], max_new_tokens=NEW[2], streamer=streamer)
        assert streamer.started.wait(120)
        plain = pool.submit(lambda: (model.sample([PROMPTS[3]], max_new_tokens=NEW[3]), time.perf_counter()))
        np.testing.assert_array_equal(streamed.result(timeout=120), sequential[2])
        out, finished_at = plain.result(timeout=120)
    np.testing.assert_array_equal(out, sequential[3])
    assert finished_at > streamer.ended_at  # the lock was held until the stream's end()
    np.testing.assert_array_equal(streamer.puts[0], [PROMPTS[2]])  # the prompt, then the new tokens
    new = np.concatenate([p.reshape(-1) for p in streamer.puts[1:]])
    np.testing.assert_array_equal(new, sequential[2][0, len(PROMPTS[2]) :])
