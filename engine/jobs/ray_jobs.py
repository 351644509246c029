"""``--ray`` for ``batch-generate`` and ``run-h5``: the same batches, on a pool of Ray actors.

The driver does everything a plain run does before loading a model (pre-flight, plan, resume
filter) and cuts the work exactly as the plain run does: batch-generate's batches
(``batch.batches``, per model group) and run-h5's global steps. Each unit is one actor task,
so every row shares its batch with the same rows as in the plain run and the outputs are
byte-identical (greedy or seeded: the sampler's per-row seeds do not depend on batch-mates
anyway, but padding and bucket choice do depend on them, so the batches are kept).

* Workers: ``workers`` actors (1 CPU each, spread over nodes), ``max_restarts`` /
  ``max_task_retries`` so a killed actor is restarted and its tasks re-run.
* Cache: an actor compiles a model's graphs under a lock in the shared compile cache
  (``ray_data.warm``); the first compiles, the others load (0 compiles). Per-process compile
  counts come back with every result and are logged.
* Output: the driver appends each finished batch (``JsonlAppender``, whole lines) skipping input
  lines already written (a retried task may deliver twice), then rewrites the file in input order
  (atomically); run-h5 actors write their ``predictions_{k}.npz`` atomically themselves.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.durable import JsonlAppender
from aotlm.jobs import batch, plan, ray_data
from aotlm.jobs import h5 as h5job
from aotlm.jobs.model_refs import load_tokenizer
from aotlm.text.tokens import eos_ids

log = logging.getLogger("aotlm.jobs.ray")
IN_FLIGHT = 2  # tasks queued per actor: the next batch is ready when one finishes
RETRIES = 3  # actor restarts, and re-runs of a task whose actor died


class RayJobError(RuntimeError):
    """A task failed even after Ray's retries (the output so far is kept: ``--resume``)."""


class BatchWorker:
    """A Ray actor of ``batch-generate --ray``: one model at a time, the plain run's batch code."""

    def __init__(self, opts: dict, crash: str | None = None):
        ray_data.compile_counts()
        if crash:
            os.environ[ray_data.CRASH_ENV] = crash
        self.opts, self.key, self.model, self.tok, self.eos, self.failed = opts, None, None, None, [], {}
        self.ready: dict = {}  # when the first model was ready, and its load + warm-up seconds

    def _load(self, g: plan.Group) -> str | None:
        """Make ``g``'s model current (releasing the previous); its load error, if any."""
        if g.key in self.failed or g.key == self.key:
            return self.failed.get(g.key)
        self.model, self.key = None, None
        gc.collect()  # one model in memory at a time
        self.tok = load_tokenizer(g.key[2])
        t0 = time.perf_counter()
        try:
            model = batch.load_group_model(g, self.opts)
            ray_data.warm(model)
        except batch.SOFT_ERRORS as e:
            self.failed[g.key] = batch.load_error(g, e)
            log.warning("%s", self.failed[g.key])
            return self.failed[g.key]
        self.model, self.key, self.eos = model, g.key, eos_ids(g.key[0], model.hf_config, self.tok)
        self.ready = self.ready or {"ready_at": time.time(), "load_s": time.perf_counter() - t0}
        return None

    def stats(self) -> dict:
        return {**ray_data.compile_counts(), **self.ready}

    def run(self, g: plan.Group, records: list[plan.Record]) -> dict:
        ray_data.crash_once([r.line for r in records])
        error = self._load(g)
        if error is not None:
            outs = [batch.output_record(r, g, self.tok, None, error) for r in records]
            return {"outs": outs, "errors": len(outs), "stats": self.stats()}
        outs, errors = [], 0
        for chunk in batch.batches(records, self.model.batch_size):  # the same single batch
            done, n_err = batch.batch_outputs(self.model, g, self.tok, self.eos, chunk)
            outs += done
            errors += n_err
        return {"outs": outs, "errors": errors, "stats": self.stats()}


class H5Worker:
    """A Ray actor of ``run-h5 --ray``: the model built as the plain run builds it, one step per task."""

    def __init__(self, job: h5job.H5Job, ckpt: str, kw: dict, out_dir: str, crash: str | None = None):
        ray_data.compile_counts()
        if crash:
            os.environ[ray_data.CRASH_ENV] = crash
        self.job, self.ckpt, self.kw, self.out_dir = job, ckpt, kw, Path(out_dir)
        self.model = self.file = self.ds = None
        self.ready: dict = {}

    def run(self, step: int) -> dict:
        ray_data.crash_once([step])
        if self.model is None:
            t0 = time.perf_counter()
            self.model = AutoModelForSampling.from_pretrained(self.ckpt, **self.kw)
            ray_data.warm(self.model)
            self.file, self.ds = h5job.open_data(self.job)
            self.ready = {"ready_at": time.time(), "load_s": time.perf_counter() - t0}
        path = h5job.run_step(self.model, self.job, self.ds, step, self.out_dir)
        return {"step": step, "path": str(path), "stats": {**ray_data.compile_counts(), **self.ready}}


def connect(address: str | None, workers: int, quiet: bool = False):
    """(ray, started): join ``address``'s cluster, or start a local Ray sized for ``workers``."""
    ray = ray_data.import_ray()
    if ray.is_initialized():  # e.g. a notebook or a test that started Ray itself
        return ray, False
    if address:
        ray.init(address=address, log_to_driver=not quiet, logging_level=logging.WARNING)
    else:
        cpus = max(workers, os.cpu_count() or 1)
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            log_to_driver=not quiet,
            logging_level=logging.WARNING,
        )
    return ray, True


def run_pool(ray, cls, init_args: tuple, tasks: list[tuple], on_result: Callable[[dict], None], workers: int):
    """Run ``cls(*init_args).run(*task)`` for every task on ``workers`` actors, ``IN_FLIGHT`` per
    actor, calling ``on_result`` in completion order; returns the compile counts per worker process."""
    remote = ray.remote(cls).options(
        num_cpus=1,
        max_restarts=RETRIES,
        max_task_retries=RETRIES,
        scheduling_strategy="SPREAD",
    )
    n = max(1, min(workers, len(tasks)))
    created = [time.time()] * n
    actors = [remote.remote(*init_args) for _ in range(n)]
    todo, pending, stats = list(reversed(tasks)), {}, {}
    try:
        while todo or pending:
            for k, actor in enumerate(actors):
                while todo and sum(a == k for a in pending.values()) < IN_FLIGHT:
                    pending[actor.run.remote(*todo.pop())] = k
            ready, _ = ray.wait(list(pending), num_returns=1)
            k = pending.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except ray.exceptions.RayError as e:
                raise RayJobError(
                    f"a Ray task failed after {RETRIES} retries: {str(e).splitlines()[0]}"
                ) from e
            s = result["stats"]
            stats[s["pid"]] = {"worker": k, **{n: s[n] for n in ("compiles", "lowerings", "traces")}}
            if "ready_at" in s:  # actor created -> first model ready (process, imports, load, compile)
                stats[s["pid"]].update(startup_s=s["ready_at"] - created[k], load_s=s["load_s"])
            on_result(result)
    finally:
        for actor in actors:
            ray.kill(actor)
    return stats


def _log_stats(stats: dict) -> None:
    per = "; ".join(
        f"worker {s['worker']} pid {pid}: {s['compiles']} compiles"
        + (
            f", ready {s['startup_s']:.1f}s after start (load + warm-up {s['load_s']:.1f}s)"
            if "load_s" in s
            else ""
        )
        for pid, s in sorted(stats.items())
    )
    log.info("ray: %d worker processes; %s", len(stats), per)


def run_batch_generate(
    groups: list[plan.Group],
    opts: dict,
    output: str,
    resume: bool,
    workers: int,
    address: str | None = None,
    quiet: bool = False,
) -> tuple[int, int, dict]:
    """batch-generate's ``run`` on Ray; returns (records written, errors, compile counts per process)."""
    opts = {**opts, "cache_dir": ray_data.cache_path(opts.get("cache_dir"))}
    lines, ids = batch.done_keys(output) if resume else (set(), set())
    tasks = []
    for g in groups:
        todo = [r for r in g.records if not batch.is_done(r, lines, ids)]
        if len(todo) < len(g.records):
            log.info("resume: %d records of %s already in %s", len(g.records) - len(todo), g.key[0], output)
        small = ray_data.strip_group(g)
        tasks += [(small, b) for b in batch.batches(todo, opts["batch_size"])]
    written_lines = {r.line for g in groups for r in g.records if batch.is_done(r, lines, ids)}
    counts = {"written": 0, "errors": 0}
    stats: dict = {}
    if tasks:
        ray, started = connect(address, workers, quiet)  # before the output is touched
        sink = JsonlAppender(output)

        def on_result(result: dict) -> None:
            fresh = [o for o in result["outs"] if o["input_line"] not in written_lines]
            written_lines.update(o["input_line"] for o in fresh)
            sink.write(fresh)
            counts["written"] += len(fresh)
            counts["errors"] += sum("error" in o for o in fresh)

        log.info("ray: %d batches on %d workers", len(tasks), workers)
        try:
            crash = os.environ.get(ray_data.CRASH_ENV)
            stats = run_pool(ray, BatchWorker, (opts, crash), tasks, on_result, workers)
        finally:
            sink.close()
            if started:
                ray.shutdown()
        _log_stats(stats)
    batch.rewrite_in_order(output)
    return counts["written"], counts["errors"], stats


def run_h5(
    job: h5job.H5Job,
    ckpt: str,
    kw: dict,
    cache_dir: str | None,
    out_dir: Path,
    steps: list[int],
    workers: int,
    address: str | None = None,
    quiet: bool = False,
) -> tuple[list[str], dict]:
    """run-h5's steps on Ray; returns (files written, compile counts per process)."""
    h5job.clean_stale(out_dir, steps)
    kw = {**kw, "compile_cache": ray_data.cache_path(cache_dir)}
    written: list[str] = []

    def on_result(result: dict) -> None:
        written.append(result["path"])
        log.info("[%d/%d] wrote %s", len(written), len(steps), result["path"])

    ray, started = connect(address, workers, quiet)
    t0 = time.perf_counter()
    try:
        init = (job, ckpt, kw, str(out_dir.resolve()), os.environ.get(ray_data.CRASH_ENV))
        stats = run_pool(ray, H5Worker, init, [(s,) for s in steps], on_result, workers)
    finally:
        if started:
            ray.shutdown()
    log.info("ray: %d steps in %.2fs", len(steps), time.perf_counter() - t0)
    _log_stats(stats)
    return written, stats
