"""Ray Data processor: batch-generate's per-record generation inside a user's ``ray.data`` pipeline.

    import ray
    from aotlm.jobs.ray_data import Generator

    ds = ray.data.read_json("prompts.jsonl")          # {"prompt": ..., "generation": {...}} rows
    ds = ds.map_batches(Generator, fn_constructor_kwargs={"model": "CKPT", "max_new_tokens": 32},
                        batch_size=64, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)
    ds.write_json("out/")                             # + completion, finish_reason, generation, error

Each Ray actor builds one ``Generator``: it loads the model once and compiles every graph from the
shared on-disk compile cache. Actors that start together would all compile the same graphs, so
compiling happens under a file lock in the cache directory (``warm``): the first actor compiles
and stores, the others wait and then load the executables (0 compiles; each actor's counts are in
``Generator.stats``). Records are checked as batch-generate checks them (jobs/plan.py) and run
through its generation code (jobs/batch.py); a bad record is an ``error`` in its own row.
``run_pipeline`` is the whole read -> map_batches -> write job for users who write no Ray code.
Ray is imported only where it is used: ``import aotlm`` never needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path

import numpy as np

from aotlm.core import sampler_params
from aotlm.core.compile_cache import DEFAULT_DIR, CompileCounter
from aotlm.jobs import batch, plan
from aotlm.jobs.model_refs import load_tokenizer, resolve
from aotlm.text.tokens import eos_ids

log = logging.getLogger("aotlm.jobs.ray")
INSTALL_HINT = "pip install -e '.[ray]'"
CRASH_ENV = "AOTLM_TEST_CRASH_ONCE"  # test-only: "INPUT_LINE:/marker/path" (see crash_once)
OUT_FIELDS = ("completion", "finish_reason", "generation", "error")


def import_ray():
    """The ``ray`` module, or a one-line ValueError (CLI exit 2) saying how to install it."""
    try:
        import ray  # local: optional extra

    except ImportError as e:
        raise ValueError(
            f"--ray needs Ray, which is not installed ({e}); install it with {INSTALL_HINT}"
        ) from e
    return ray


# ---------------------------------------------------------------- compile counting and warm-up
_counter: CompileCounter | None = None


def compile_counts() -> dict:
    """This process's traces / lowerings / XLA compiles since its first call (``jax.monitoring``)."""
    global _counter
    if _counter is None:
        _counter = CompileCounter()
    return {"pid": os.getpid(), **_counter.counts}


def cache_path(cache_dir: str | os.PathLike | None) -> str:
    """The compile cache directory a model would use, absolute, so every Ray worker (whatever its
    working directory) shares the driver's."""
    return os.path.abspath(cache_dir or os.environ.get("AOTLM_CACHE_DIR", DEFAULT_DIR))


@contextlib.contextmanager
def _cache_lock(model):
    """An exclusive ``flock`` in the model's cache directory (none without a disk cache). Released
    by the kernel if its holder dies, so a killed actor never blocks the others."""
    directory = model.compile_cache.dir
    if directory is None:
        yield
        return
    import fcntl  # local: POSIX only, and only Ray workers serialize their warm-up

    with open(Path(directory) / ".aotlm-warm.lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def warm(model) -> None:
    """Compile every graph of ``model``, one process at a time per cache directory: the first
    compiles and stores; the next find everything in the cache and compile nothing."""
    with _cache_lock(model):
        model.compile()


def crash_once(lines: list[int]) -> None:
    """Test-only hook (``$AOTLM_TEST_CRASH_ONCE=LINE:MARKER``): the worker whose batch holds input
    line LINE dies (``os._exit``) once, creating MARKER first so its retry goes through."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    line, _, marker = spec.partition(":")
    if int(line) in lines and not os.path.exists(marker):
        Path(marker).touch()
        os._exit(1)


# ---------------------------------------------------------------- rows in and out of Ray batches
def _py(v):
    """Plain Python values from what Ray hands over (numpy scalars/arrays, nested)."""
    if isinstance(v, np.ndarray):
        return [_py(x) for x in v.tolist()]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {k: _py(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_py(x) for x in v]
    return v


INT_FIELDS = {"max_new_tokens"} | {p.hf for p in sampler_params.TABLE if p.hf and p.integer}


def _missing(v) -> bool:
    """A field absent from this row: Arrow fills a struct's missing keys with nulls (NaN in pandas)."""
    return v is None or (isinstance(v, float) and v != v)


def _int_back(key: str, v):
    """Arrow turns an integer column with nulls into floats (5 -> 5.0): undo that for integer fields."""
    return int(v) if key in INT_FIELDS and isinstance(v, float) and v.is_integer() else v


def _to_rows(data) -> tuple[list[dict], str]:
    """(rows, format) of a batch given as numpy columns (Ray's default), pandas or pyarrow."""
    if isinstance(data, dict):
        n = len(next(iter(data.values()))) if data else 0
        return [{k: _py(col[i]) for k, col in data.items()} for i in range(n)], "numpy"
    if hasattr(data, "to_pylist"):
        return [_py(r) for r in data.to_pylist()], "pyarrow"
    if hasattr(data, "to_dict"):
        return [_py(r) for r in data.to_dict("records")], "pandas"
    raise TypeError(f"Generator takes numpy, pandas or pyarrow batches, got {type(data).__name__}")


def _from_rows(rows: list[dict], fmt: str):
    if fmt == "pyarrow":
        import pyarrow as pa  # local: Ray Data's dependency, needed only for pyarrow batches

        return pa.Table.from_pylist(rows)
    if fmt == "pandas":
        import pandas as pd  # local: Ray Data's dependency, needed only for pandas batches

        return pd.DataFrame(rows)
    out = {}
    for k in rows[0] if rows else ():
        col = np.empty(len(rows), dtype=object)
        col[:] = [r.get(k) for r in rows]
        out[k] = col
    return out


class Generator:
    """A ``map_batches`` callable class: one compiled model per Ray actor.

    Arguments are batch-generate's: ``model`` (checkpoint, run dir or bundled name; default the
    bundled model), ``tokenizer``, ``dtype``, ``batch_size`` (the compiled batch), ``n_positions``
    (KV-cache buckets; default the model's), ``context_length_estimate``, ``tp_degree``,
    ``cache_dir``, and any generation field as a default (``max_new_tokens=32``, ``temperature``,
    ``seed``, ``stop_sequences``, ...). Each input row needs ``prompt``; an optional ``generation``
    column (a dict per row; null entries count as not given) overrides the defaults. Other columns
    are passed through. Output rows add ``completion``, ``finish_reason``, ``generation`` (the
    parameters used) and ``error`` (null unless the row was refused or failed). Batches may be
    numpy (Ray's default), pandas or pyarrow; the output has the input's format.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str | None = None,
        batch_size: int = 4,
        n_positions: int | list[int] | None = None,
        context_length_estimate: int | list[int] | None = None,
        tp_degree: int = 1,
        cache_dir: str | None = None,
        **generation,
    ):
        compile_counts()  # start counting before anything compiles
        defaults = plan.merged_generation(generation, {}, "Generator arguments")
        self.defaults = {k: v for k, v in defaults.items() if k in generation}
        spec = plan.model_spec({}, {"model": model, "tokenizer": tokenizer, "dtype": dtype}, "Generator")
        ckpt, tok_dir = resolve(spec[0], spec[1])
        self.group = plan.Group((ckpt, spec[2], tok_dir), [], n_positions=n_positions)
        self.opts = {
            "batch_size": batch_size,
            "context_length_estimate": context_length_estimate,
            "tp_degree": tp_degree,
            "cache_dir": cache_path(cache_dir),
        }
        self.tok = load_tokenizer(tok_dir)
        self.model = batch.load_group_model(self.group, self.opts)
        warm(self.model)
        self.eos = eos_ids(ckpt, self.model.hf_config, self.tok)
        self.stats = compile_counts()
        log.info("Generator ready: %s, %s", ckpt, self.stats)

    def _record(self, i: int, row: dict) -> plan.Record:
        where = f"row {i}"
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: missing or empty 'prompt' (a non-empty string is required)")
        if row.get("model") is not None:
            raise ValueError(
                f"{where}: this Generator serves {self.group.key[0]}; use one Generator per model"
            )
        block = row.get("generation")
        if isinstance(block, dict):
            block = {k: _int_back(k, v) for k, v in block.items() if not _missing(v)}
        gen = plan.merged_generation(self.defaults, block, where)
        r = plan.Record(i, row, prompt, gen, self.group.key)
        plan.tokenize(r, self.tok, self.model.cfg.vocab_size, where)
        need = len(r.prompt_ids) + gen["max_new_tokens"]
        if need > self.model.n_positions:
            raise ValueError(
                f"{where}: prompt + max_new_tokens = {need} tokens exceeds n_positions="
                f"{self.model.n_positions}; shorten it or build the Generator with a larger n_positions"
            )
        return r

    def __call__(self, data):
        rows, fmt = _to_rows(data)
        outs: list[dict | None] = [None] * len(rows)
        records = []
        for i, row in enumerate(rows):
            try:
                records.append(self._record(i, row))
            except (ValueError, TypeError) as e:
                outs[i] = {**row, "error": str(e)}
        for chunk in batch.batches(records, self.model.batch_size):
            done, _ = batch.batch_outputs(self.model, self.group, self.tok, self.eos, chunk)
            for o in done:
                outs[o.pop("input_line")] = o
        full = [{**o, **{k: o.get(k) for k in OUT_FIELDS}} for o in outs]
        return _from_rows(full, fmt)


def run_pipeline(
    input_path: str,
    output_dir: str,
    *,
    workers: int = 2,
    rows_per_call: int | None = None,
    cpus_per_worker: float = 1,
    **generator_kwargs,
):
    """read_json(input) -> map_batches(Generator, ``workers`` actors) -> write_json(output_dir).

    Joins the Ray cluster ``ray.init()`` finds (or starts a local one). Ray retries a batch whose
    actor died (restarted actors load from the warm cache). Rows come out in files under
    ``output_dir`` in no fixed order: keep an ``id`` in each record to join them back.
    """
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    kw = {**generator_kwargs, "cache_dir": cache_path(generator_kwargs.get("cache_dir"))}
    bs = generator_kwargs.get("batch_size", 4)
    # reading and writing JSON take no CPU reservation: the actors may hold every CPU of a small
    # cluster, and read/write tasks waiting for one would stall the pipeline
    ds = ray.data.read_json(input_path, num_cpus=0)
    ds = ds.map_batches(
        Generator,
        fn_constructor_kwargs=kw,
        batch_size=rows_per_call or bs * 16,
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=cpus_per_worker,
    )  # Ray Data's defaults restart a dead actor and re-run its batch
    ds.write_json(output_dir, ray_remote_args={"num_cpus": 0})
    return output_dir


def strip_group(g: plan.Group) -> plan.Group:
    """A group without its records: what a Ray task needs to know about it (small to ship)."""
    return dataclasses.replace(g, records=[])
