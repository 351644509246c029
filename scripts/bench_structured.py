"""Structured-output overhead of continuous batching: the same 8-slot load with and without a
JSON-schema constraint on every request (``python scripts/bench_serve.py --structured`` runs it).

    python scripts/bench_structured.py [--checkpoint DIR] [--rounds 3] [--max-tokens 128]

In-process (no HTTP, so the difference is the mask work): ``aotlm.batching.engine.Engine`` over a
random-init GPT-2-small (50257 tokens; bench_serve's byte-level BPE, loaded as an HF fast
tokenizer) with 8 slots, ``--rounds`` waves of 8 concurrent greedy requests (32-token prompts,
``--max-tokens`` each, ``ignore_eos``), free and constrained runs alternated ``--repeats`` times
(best of each). Constrained requests use a schema whose free string keeps a random model
writing inside it (the mask of an open string is the common case). Reports output tokens/s of
both runs, the overhead, the host time per decode step spent filling masks
(``SlotBatch.constrain``: llguidance computes each row's mask, then one copy to the device),
llguidance's tokenizer build and the schema compile time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "text": {"type": "string"},
    },
    "required": ["id", "tags", "text"],
    "additionalProperties": False,
}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--checkpoint", default=None, help="HF checkpoint dir with a tokenizer (default: GPT-2-small)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="alternated runs of each load (best counts)")
    ap.add_argument("--work", default="/tmp/aotlm-bench-structured")
    return ap.parse_args(argv)


def checkpoint(args) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    from serve_load import write_ascii_vocab

    from aotlm.tiny import make_gpt2_small

    ckpt = Path(args.work) / "gpt2-small"
    if not (ckpt / "config.json").is_file():
        make_gpt2_small(ckpt)
    write_ascii_vocab(ckpt, 50257)
    return ckpt


def run_load(engine, prompts, args, make) -> tuple[float, int]:
    """Wall seconds and output tokens of ``--rounds`` waves of ``--slots`` concurrent requests."""
    from aotlm.batching.types import SamplingParams, Token

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t0, n = time.perf_counter(), 0
    for r in range(args.rounds):
        reqs = [engine.submit(p, sp, matcher=make()) for p in prompts[r * args.slots : (r + 1) * args.slots]]
        n += sum(isinstance(t, Token) for req in reqs for t in req)
    return time.perf_counter() - t0, n


def main(argv=None) -> dict:
    args = parse(argv)
    from aotlm.api.causal_lm import AutoModelForSampling
    from aotlm.batching.engine import Engine
    from aotlm.generate.constraints import Constraint, Grammars
    from aotlm.text.tokens import load_tokenizer
    from aotlm.tiny import cpu_model

    ckpt = checkpoint(args)
    tok = load_tokenizer(str(ckpt))
    model = AutoModelForSampling.from_pretrained(
        ckpt, continuous_batching=True, batch_size=args.slots, n_positions=256,
        context_length_estimate=[32], compile_cache=str(Path(args.work) / "cc"),
    )  # fmt: skip
    model.compile()
    eos = [tok.eos_token_id]
    engine = Engine(model, eos_token_id=eos).start()
    spent = []
    constrain = engine.batch.constrain

    def timed(matchers):
        t0 = time.perf_counter()
        constrain(matchers)
        if matchers:
            spent.append(time.perf_counter() - t0)

    engine.batch.constrain = timed
    t0 = time.perf_counter()
    grammars = Grammars(tok, model.cfg.vocab_size, eos)
    t_tok, t0 = time.perf_counter() - t0, time.perf_counter()
    grammars.compile(Constraint.json_schema(SCHEMA))
    t_schema = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50000, 32).tolist() for _ in range(args.rounds * args.slots)]
    run_load(engine, prompts[: args.slots], argparse.Namespace(**{**vars(args), "rounds": 1}), lambda: None)
    free = con = 0.0
    for _ in range(args.repeats):  # alternated, best of each: a shared machine drifts
        free_s, free_n = run_load(engine, prompts, args, lambda: None)
        con_s, con_n = run_load(
            engine, prompts, args, lambda: grammars.matcher(Constraint.json_schema(SCHEMA))
        )
        free, con = max(free, free_n / free_s), max(con, con_n / con_s)
        print(f"free {free_n} tokens in {free_s:.1f} s, constrained {con_n} in {con_s:.1f} s", flush=True)
    engine.shutdown()
    row = {
        "cpu": cpu_model(), "slots": args.slots, "tokens": free_n,
        "free_tok_s": round(free, 1), "constrained_tok_s": round(con, 1),
        "overhead_pct": round(100 * (free - con) / free, 1),
        "mask_ms_per_step_p50": round(1e3 * float(np.median(spent)), 3),
        "mask_ms_per_step_p99": round(1e3 * float(np.percentile(spent, 99)), 3),
        "llguidance_tokenizer_s": round(t_tok, 2), "schema_compile_ms": round(1e3 * t_schema, 1),
    }  # fmt: skip
    print(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
