"""``aotlm run-h5``: Cerebras-style autoregressive inference over an HDF5 file (see h5job.py)."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.cli.common import bucket_list, positive_int, setup_logging, shard_arg
from aotlm.cli.jsonl import add_ray_args, check_ray_args
from aotlm.core.memory import check_fits, format_plan, plan_for_checkpoint
from aotlm.jobs import h5 as h5job
from aotlm.jobs import ray_jobs
from aotlm.jobs.model_refs import resolve
from aotlm.models import family_for
from aotlm.models.checkpoint import load_hf_config

log = logging.getLogger("aotlm.h5")


def _round_up(n: int, to: int = 32) -> int:
    return -(-n // to) * to


def cmd_run_h5(args) -> int:
    setup_logging(args.quiet)
    check_ray_args(args)

    job = h5job.read_params(args.params)
    ckpt, _ = resolve(args.checkpoint, need_tokenizer=False)
    hf = load_hf_config(ckpt)
    vocab = family_for(hf.model_type).arch_config(hf).vocab_size
    h5job.scan(job, vocab)
    need = job.needed_positions()
    if args.n_positions:
        if max(args.n_positions) < need:
            raise ValueError(f"--n-positions {max(args.n_positions)} is too small: the data needs {need}")
        n_positions = args.n_positions if len(args.n_positions) > 1 else args.n_positions[0]
    else:
        n_positions = _round_up(need)
    kw = dict(
        batch_size=job.batch_size,
        n_positions=n_positions,
        context_length_estimate=args.context_length_estimate,
        tp_degree=args.tp_degree,
        pp_degree=args.pp_degree,
        amp=args.amp,
    )
    log.info(
        "%s: %d samples x %d tokens, batch_size %d -> %d steps; n_positions %s",
        job.data_file,
        job.num_samples,
        job.max_seq_len,
        job.batch_size,
        job.num_batches,
        n_positions,
    )
    if args.compile_only or args.device_memory_gb is not None:
        plan = plan_for_checkpoint(ckpt, **kw)
        log.info("memory: %s", format_plan(plan))
        if args.device_memory_gb is not None:
            check_fits(plan, args.device_memory_gb)
    out_dir = Path(args.model_dir) / "predictions"
    steps = [] if args.compile_only else h5job.steps_to_run(job, out_dir, args.inference_steps, args.shard)
    if not args.compile_only and not steps:
        log.info("nothing to do: every step of this run already has its predictions file in %s", out_dir)
        return 0

    if args.ray and not args.compile_only:  # --compile-only stays here: it warms the shared cache
        t0 = time.perf_counter()
        try:
            written, _ = ray_jobs.run_h5(
                job, ckpt, kw, args.cache_dir, out_dir, steps, args.ray_workers, args.ray_address, args.quiet
            )
        except ray_jobs.RayJobError as e:
            print(f"aotlm run-h5: error: {e}; re-run to finish the missing steps", file=sys.stderr)
            return 1
        print(f"wrote {len(written)} predictions files to {out_dir} in {time.perf_counter() - t0:.2f}s")
        return 0
    t0 = time.perf_counter()
    log.info("loading model %s", ckpt)
    model = AutoModelForSampling.from_pretrained(ckpt, compile_cache=args.cache_dir, **kw)
    model.compile()
    hits = sum(r["hit"] for r in model.compile_report)
    log.info(
        "%d graphs ready (%d from the cache) in %.2fs",
        len(model.compile_report),
        hits,
        time.perf_counter() - t0,
    )
    if args.compile_only:
        print(f"compile only: {len(model.graph_keys())} graphs for batch_size {job.batch_size} ready")
        return 0
    done = len(list(out_dir.glob("predictions_*.npz"))) if out_dir.is_dir() else 0
    if done:
        log.info("resuming: %d predictions files already in %s", done, out_dir)
    t0 = time.perf_counter()
    written = h5job.run(model, job, out_dir, steps)
    print(f"wrote {len(written)} predictions files to {out_dir} in {time.perf_counter() - t0:.2f}s")
    return 0


def register(sub) -> None:
    p = sub.add_parser("run-h5", help="Cerebras-style inference: HDF5 token ids -> predictions_N.npz")
    p.add_argument("--params", required=True, help="params.yaml (inference_input + model sections)")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or run directory)")
    p.add_argument("--model-dir", required=True, help="outputs go to MODEL_DIR/predictions/")
    p.add_argument("--compile-only", action="store_true", help="compile and check memory, then exit")
    p.add_argument(
        "--inference-steps", type=positive_int, default=None, help="run at most the first N global steps"
    )
    p.add_argument("--shard", type=shard_arg, default=(0, 1), help="I/N: only steps with (step-1) %% N == I")
    p.add_argument(
        "--n-positions", type=bucket_list, default=None, help="KV-cache buckets (default: from the data)"
    )
    p.add_argument("--context-length-estimate", type=bucket_list, default=None, help="context buckets")
    p.add_argument("--tp-degree", type=positive_int, default=1)
    p.add_argument("--pp-degree", type=positive_int, default=1, help="pipeline stages (pp x tp devices)")
    p.add_argument("--amp", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument(
        "--cache-dir", default=None, help="compile cache (default $AOTLM_CACHE_DIR or ./compile_cache)"
    )
    p.add_argument("--device-memory-gb", type=float, default=None, help="fail if the model does not fit")
    add_ray_args(p)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_run_h5)
