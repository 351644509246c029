"""``--ray`` for batch-generate / run-h5 and the Ray Data processor, on a local 2-CPU Ray.

The CLI runs in-process (``aotlm.cli.app.main``); its Ray actors are real worker processes.
Proved here: ``--ray`` output byte-identical to the plain run (greedy and seeded rows, a soft
error, input order), the second actor compiles nothing (counted with ``jax.monitoring`` in each
actor), ``--resume`` after a kill completes a partial output with each record once, an actor
killed mid-job (test hook) is restarted and the output is still complete, run-h5 ``--ray`` writes
the plain run's predictions, the ``Generator`` works in a user's own ``ray.data`` pipeline,
``--ray`` without Ray exits 2 with the install hint, and ``--dry-run`` / pre-flight errors start
no actor.
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from textkit import make_text_checkpoint  # noqa: E402

from aotlm.cli.app import main  # noqa: E402
from aotlm.jobs import ray_jobs  # noqa: E402
from aotlm.jobs.ray_data import CRASH_ENV, Generator  # noqa: E402

RECORDS = [
    {"id": "a", "prompt": "def fibonacci(n):"},
    {"prompt": "import os", "generation": {"max_new_tokens": 5, "stop_sequences": ["\n"]}},
    {"prompt": "class Point:", "generation": {"do_sample": True, "temperature": 0.9, "seed": 3}},
    {"prompt": "for i in range(10):", "metadata": {"k": 1}},
    {"prompt": "value = {'key'", "generation": {"do_sample": True, "top_k": 20, "seed": 11}},
    {"prompt": "n < 2", "model": "$BAD"},  # corrupt weights: a soft error in its own line
    {"id": 7, "prompt": "return fibonacci(n - 1)", "generation": {"return_full_text": True}},
    {"prompt": "print(i,", "generation": {"do_sample": True, "top_p": 0.9, "seed": 5, "min_new_tokens": 3}},
    {"prompt": "self.x = x"},
    {"prompt": "import sys", "generation": {"do_sample": True, "temperature": 0.7, "seed": 8}},
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    ckpt = make_text_checkpoint(root / "m", family="gpt2")
    bad = root / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:100])
    path = root / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    mp = pytest.MonkeyPatch()
    mp.setenv("BAD", str(bad))
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False
    )  # never a running cluster
    yield {"root": root, "ckpt": ckpt, "input": path, "cache": root / "cache"}
    ray.shutdown()
    mp.undo()


def bg(env, out, *extra) -> int:
    args = ["batch-generate", "--input", env["input"], "--output", out, "--model", env["ckpt"]]
    args += ["--batch-size", 2, "--max-new-tokens", 6, "--cache-dir", env["cache"], "--quiet", *extra]
    return main([str(a) for a in args])


def counted_ray_run(env, out, *extra) -> dict:
    """``bg --ray`` returning the per-process compile counts of its actors."""
    seen = {}
    real = ray_jobs.run_pool

    def spy(*a, **k):
        seen.update(real(*a, **k))
        return seen

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray_jobs, "run_pool", spy)
        assert bg(env, out, "--ray", *extra) == 0
    return seen


@pytest.fixture(scope="module")
def runs(env):
    """A --ray run on a cold compile cache, then the plain run (in-process) on the same input."""
    stats = counted_ray_run(env, env["root"] / "ray.jsonl")
    assert bg(env, env["root"] / "plain.jsonl") == 0
    return {"stats": stats, "ray": env["root"] / "ray.jsonl", "plain": env["root"] / "plain.jsonl"}


def read(path):
    return [json.loads(line) for line in open(path)]


def test_ray_output_byte_identical_and_second_actor_compiles_nothing(env, runs):
    expected = runs["plain"].read_bytes()
    assert runs["ray"].read_bytes() == expected  # greedy + seeded rows, soft error, input order
    recs = read(runs["plain"])
    assert [r["input_line"] for r in recs] == list(range(1, len(RECORDS) + 1))
    assert "could not be loaded" in recs[5]["error"]
    assert all("completion" in r for k, r in enumerate(recs) if k != 5)
    assert {r["generation"]["seed"] for r in recs} >= {3, 11, 5, 8}
    stats = runs["stats"]  # one process per actor; both ran batches; only one compiled
    assert len(stats) == 2 and {s["worker"] for s in stats.values()} == {0, 1}, stats
    compiles = sorted(s["compiles"] for s in stats.values())
    assert compiles[0] == 0 and compiles[1] > 0, stats
    assert sorted(s["traces"] for s in stats.values())[0] == 0, stats


def test_ray_resume_after_kill_completes_each_record_once(env, runs):
    lines = runs["plain"].read_bytes().splitlines(keepends=True)
    out = env["root"] / "partial.jsonl"
    # what a kill leaves: some batches appended in completion order, and a torn last line
    out.write_bytes(lines[6] + lines[1] + lines[2] + b'{"prompt": "torn wri')
    assert bg(env, out, "--ray", "--resume", "--ray-workers", "1") == 0
    assert out.read_bytes() == runs["plain"].read_bytes()


def test_actor_killed_mid_job_is_retried_and_output_complete(env, runs, monkeypatch):
    marker = env["root"] / "crashed"
    monkeypatch.setenv(CRASH_ENV, f"4:{marker}")  # the batch holding input line 4 kills its actor once
    out = env["root"] / "crash.jsonl"
    stats = counted_ray_run(env, out, "--ray-workers", "1")
    assert marker.exists()
    assert len(stats) == 2, stats  # the actor, then its restart (a new process) that finished the job
    assert all(s["compiles"] == 0 for s in stats.values()), stats  # restarted from the warm cache
    assert out.read_bytes() == runs["plain"].read_bytes()


def test_processor_in_a_user_ray_data_pipeline(env, runs):
    plain = read(runs["plain"])
    keep = [0, 1, 2, 3, 4, 6, 7, 8, 9]
    items = [{"id": str(k), **{f: RECORDS[k][f] for f in ("prompt", "generation") if f in RECORDS[k]}}
             for k in keep]  # fmt: skip
    items.append({"id": "bad", "prompt": "x", "generation": {"top_p": 1.5}})
    ds = ray.data.from_items(items).map_batches(
        Generator,
        fn_constructor_kwargs={
            "model": str(env["ckpt"]),
            "batch_size": 2,
            "n_positions": 32,
            "max_new_tokens": 6,
            "cache_dir": str(env["cache"]),
        },
        batch_size=4,
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=1,
    )
    rows = {r["id"]: r for r in ds.take_all()}
    assert len(rows) == len(items)
    assert "top_p=1.5 is out of range" in rows["bad"]["error"] and rows["bad"]["completion"] is None
    for k in keep:
        r = rows[str(k)]
        assert r["error"] is None and r["prompt"] == RECORDS[k]["prompt"]
        assert r["completion"] == plain[k]["completion"], k  # rows do not depend on their batch-mates
        assert r["finish_reason"] == plain[k]["finish_reason"]
        assert r["generation"]["seed"] == plain[k]["generation"]["seed"]


def test_ray_missing_is_exit_2_with_install_hint(env, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert bg(env, env["root"] / "never.jsonl", "--ray") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install -e '.[ray]'" in err[0], err
    assert not (env["root"] / "never.jsonl").exists()


def test_dry_run_and_preflight_errors_start_no_actor(env, capsys, monkeypatch, tmp_path):
    def refuse(*a, **k):
        raise AssertionError("a Ray actor pool was started")

    monkeypatch.setattr(ray_jobs, "connect", refuse)
    monkeypatch.setattr(ray_jobs, "run_pool", refuse)
    assert bg(env, tmp_path / "o.jsonl", "--ray", "--dry-run") == 0
    assert f"dry run: {len(RECORDS)} records to generate" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "b", "generation": {"top_p": 1.5}}\n')
    args = ["batch-generate", "--input", str(bad), "--output", str(tmp_path / "o.jsonl"), "--ray"]
    assert main(args) == 2
    assert "line 2: top_p=1.5 is out of range" in capsys.readouterr().err
    assert main(args[:-1] + ["--ray-workers", "2"]) == 2  # a Ray flag without --ray
    assert not (tmp_path / "o.jsonl").exists()


def test_run_h5_ray_writes_the_plain_predictions(env, tmp_path):
    import h5py
    import yaml

    rng = np.random.default_rng(0)
    data = np.full((5, 16), 500, np.int32)  # start token outside the vocabulary
    for i, n in enumerate([6, 4, 7, 3, 5]):
        data[i, :n] = rng.integers(1, 300, n)
    (tmp_path / "h5").mkdir()
    with h5py.File(tmp_path / "h5" / "data.h5", "w") as f:
        f["data"] = data
    params = tmp_path / "p.yaml"
    doc = {
        "inference_input": {"data_dir": str(tmp_path / "h5"), "batch_size": 2},
        "model": {"start_token": 500},
    }
    params.write_text(yaml.safe_dump(doc))
    base = ["run-h5", "--params", str(params), "--checkpoint", str(env["ckpt"]), "--quiet"]
    base += ["--cache-dir", str(env["cache"])]
    assert main(base + ["--model-dir", str(tmp_path / "plain")]) == 0
    assert main(base + ["--model-dir", str(tmp_path / "ray"), "--ray"]) == 0
    for step in (1, 2, 3):
        a = np.load(tmp_path / "plain" / "predictions" / f"predictions_{step}.npz")
        b = np.load(tmp_path / "ray" / "predictions" / f"predictions_{step}.npz")
        assert int(b["global_step"]) == step and (a["predictions"] == b["predictions"]).all()
        assert a["predictions"].dtype == b["predictions"].dtype
