"""aotlm on a GPU against transformers, one run, same random checkpoint (Llama-3.2-1B or -3.1-8B shape).

    python scripts/bench_gpu.py                                  # 1B shape: B 1 / 16 / 64, prefill 128 / 1024
    python scripts/bench_gpu.py --shape 8b --batch 1 16          # fits one H100 in bf16
    python scripts/bench_gpu.py --modes bf16 int8 --peers hf-eager hf-compile
    python scripts/bench_gpu.py --variants default no-cmdbuf     # XLA compile-option sets side by side
    python scripts/bench_gpu.py --modes bf16 int8 --variants default g8-pallas   # decode on the Pallas kernel
    python scripts/bench_gpu.py --profile /tmp/prof --batch 1    # a trace of batch-1 decode, summarized

Rows: aotlm modes (``bf16``: ``amp="bf16"``; ``int8``: int8 weights, bf16 compute; ``fp8``: e4m3 weights and
products' rows, bf16 compute; ``f32``), the
plain-JAX floor (``--floor``: a minimal Llama decode loop of fixed trip count, greedy, no sampler, the
same shapes: what XLA alone gives), transformers eager (``hf-eager``) and with a static cache and
``torch.compile`` (``hf-compile``), all bf16 on the same checkpoint. Decode tokens/s = batch x
(new - 1) / (generate time - prefill time), medians of ``--runs``. "HBM %": the bytes a decode step
reads (every weight once, plus the KV cache of the positions written so far, mean over the run) times
the steps per second, over the read bandwidth measured in the same run (a ``jnp.sum`` over 4 GiB).
Load + compile seconds: from ``from_pretrained`` to a compiled model (cold compile cache).
Random weights (bf16 bit patterns of magnitude ~0.01): speed only, no text.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B (transformers' config names)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, vocab_size=512),  # smoke test
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip
COMMON = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000,
    eos_token_id=128001,
    rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
)  # fmt: skip
MODES = {"bf16": {"amp": "bf16"}, "int8": {"amp": "bf16", "quant": "int8"}, "f32": {"amp": "f32"},
         "fp8": {"amp": "bf16", "quant": "fp8"}}  # fmt: skip
CB = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"  # XLA's default command-buffer kinds
# named variants for --variants: environment for the model's graphs (aotlm.core.backend): the decode
# loop's group (AOTLM_DECODE_GROUP; unset: the backend's default) and XLA compile options merged over
# aotlm's defaults (AOTLM_XLA_OPTIONS); decode products on XLA's dots or the Pallas kernel (AOTLM_GPU_MATMUL),
# decode attention on XLA's ops or the Pallas kernel (AOTLM_GPU_ATTENTION)
VARIANTS = {
    "default": {},
    "g0": {"group": 0},  # a round trip to the host every step (the CPU loop)
    "g1": {"group": 1},
    "g8": {"group": 8},
    "g32": {"group": 32},
    "g0-nocb": {"group": 0, "options": {"xla_gpu_enable_command_buffer": ""}},
    "g0-cbwhile": {"group": 0, "options": {"xla_gpu_enable_command_buffer": CB + ",WHILE,CONDITIONAL"}},
    "g8-cbwhile": {"group": 8, "options": {"xla_gpu_enable_command_buffer": CB + ",WHILE,CONDITIONAL"}},
    "g8-nocb": {"group": 8, "options": {"xla_gpu_enable_command_buffer": ""}},
    # XLA's own Triton GEMM for every dot it can take (an int8 weight's convert fused into it), not cuBLAS
    "g8-tritongemm": {"group": 8, "options": {"xla_gpu_triton_gemm_any": True}},
    # decode products (bf16, int8 weights) on the Pallas kernel (aotlm.kernels.gpu_matmul): tiles per shape,
    # or fixed ones (a shape they do not divide keeps XLA's dot)
    "g8-pallas": {"group": 8, "gpu_matmul": "pallas"},
    "g8-pallas-s1": {"group": 8, "gpu_matmul": "pallas:bn=64,bk=128,splits=1"},
    "g8-pallas-bn128": {"group": 8, "gpu_matmul": "pallas:bn=128,bk=256,splits=1,warps=8,stages=3"},
    "g8-pallas-bn32": {"group": 8, "gpu_matmul": "pallas:bn=32,bk=256,splits=2,warps=4,stages=4"},
    # decode attention in one Pallas kernel a layer (aotlm.kernels.gpu_attention), alone / with the products'
    "g8-pallas-attn": {"group": 8, "gpu_attention": "pallas"},
    "g8-pallas-all": {"group": 8, "gpu_matmul": "pallas", "gpu_attention": "pallas"},
}


def use_variant(name: str) -> None:
    v = VARIANTS[name]
    os.environ.pop("AOTLM_DECODE_GROUP", None)
    if "group" in v:
        os.environ["AOTLM_DECODE_GROUP"] = str(v["group"])
    os.environ["AOTLM_XLA_OPTIONS"] = json.dumps(v.get("options", {}))
    os.environ["AOTLM_GPU_MATMUL"] = v.get("gpu_matmul", "xla")
    os.environ["AOTLM_GPU_ATTENTION"] = v.get("gpu_attention", "xla")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=1024, help="second prefill length (0: none)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", nargs="*", default=["bf16", "int8"], choices=list(MODES))
    ap.add_argument(
        "--variants", nargs="*", default=["default"], help=f"compile-option sets: {list(VARIANTS)}"
    )
    ap.add_argument(
        "--peers", nargs="*", default=["hf-eager", "hf-compile"], choices=["hf-eager", "hf-compile"]
    )
    ap.add_argument("--floor", action="store_true", help="add the plain-JAX decode loop row")
    ap.add_argument("--profile", help="write a trace of batch-1 decode here and print its kernel summary")
    ap.add_argument("--dump", help="write the optimized HLO of the batch-1 decode graphs here")
    ap.add_argument("--work", default="/tmp/aotlm-bench-gpu")
    ap.add_argument("--json", help="write the rows here as JSON")
    return ap.parse_args()


def device_line() -> str:
    import jax

    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except OSError:
        smi = "no nvidia-smi"
    return f"{jax.devices()[0].device_kind} ({smi}); jax {jax.__version__}"


def write_checkpoint(shape: str, root: Path) -> Path:
    """A random Llama checkpoint of ``shape`` in bf16 (safetensors shards of <= 4 GB), written once,
    a tensor at a time, with an ASCII BPE tokenizer of its vocabulary's size (``serve_load``)."""
    import numpy as np
    from serve_load import write_ascii_vocab  # local: scripts/ (on the path of a script run), numpy

    out, cfg = root / f"llama-{shape}", {**COMMON, **SHAPES[shape]}
    if not (out / "vocab.json").exists():  # for aotlm serve (bench_serve.py --checkpoint this dir)
        out.mkdir(parents=True, exist_ok=True)
        write_ascii_vocab(out, cfg["vocab_size"])
    if (out / "config.json").exists():
        return out
    d, f, nl = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    h, k, dh, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i in range(nl):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (h * dh, d), p + "self_attn.k_proj.weight": (k * dh, d),
                       p + "self_attn.v_proj.weight": (k * dh, d), p + "self_attn.o_proj.weight": (d, h * dh),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})  # fmt: skip
    shards: list[dict] = [{}]
    for name, s in shapes.items():
        if sum(2 * int(np.prod(x)) for x in shards[-1].values()) > 4e9:
            shards.append({})
        shards[-1][name] = s
    rng, index = np.random.default_rng(0), {}
    for j, shard in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        write_bf16(out / fname, shard, rng)
        index.update(dict.fromkeys(shard, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def write_bf16(path: Path, shapes: dict, rng) -> None:
    """A safetensors file of random bf16 tensors (norm weights 1.0; others random sign and mantissa at
    exponent 2^-7: no zeros, no infs), written a tensor at a time."""
    import numpy as np

    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, s in shapes.items():
        n = 2 * int(np.prod(s))
        header[name] = {"dtype": "BF16", "shape": list(s), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head)
        for name, s in shapes.items():
            if name.endswith("norm.weight"):
                bits = np.full(s, 0x3F80, np.uint16)
            else:
                bits = (rng.integers(0, 1 << 16, s, dtype=np.uint16) & np.uint16(0x807F)) | np.uint16(0x3C00)
            fh.write(bits.tobytes())


def read_bandwidth(gib: float = 4.0, runs: int = 9) -> float:
    """GB/s of a streaming read through XLA on the device: the faster of a whole sum and row sums
    (``[N, 8192] -> [N]``) over ``gib`` GiB of bf16, median of ``runs`` each."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2**29) // 8192, 8192), jnp.bfloat16)
    best = 0.0
    for f in (
        jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)),
        jax.jit(lambda a: jnp.sum(a, 1, jnp.float32)),
    ):
        f(x).block_until_ready()
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t0)
        best = max(best, x.nbytes / statistics.median(ts) / 1e9)
    del x
    return best


def step_bytes(cfg: dict, b: int, args, kv_elem: int, weight_bytes: int) -> float:
    """Bytes a decode step reads: the weights once and the mean KV cache over the run."""
    kv_width = cfg["num_key_value_heads"] * cfg["head_dim"]
    kv = b * cfg["num_hidden_layers"] * 2 * (args.prompt + (args.new - 1) / 2) * kv_width * kv_elem
    return weight_bytes + kv


def timed(fn, runs: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def aotlm_rows(path: Path, b: int, mode: str, variant: str, args, ids, long_ids) -> dict:
    import jax
    import numpy as np

    from aotlm import AutoModelForSampling

    use_variant(variant)
    t0 = time.perf_counter()
    ctx = [args.prompt] + ([args.long_prompt] if args.long_prompt else [])
    model = AutoModelForSampling.from_pretrained(
        path, batch_size=b, n_positions=max(ctx) + args.new, context_length_estimate=ctx,
        compile_cache=str(Path(args.work) / "compile_cache"), **MODES[mode],
    )  # fmt: skip
    t_load = time.perf_counter() - t0
    gen = lambda: model.sample(ids, max_new_tokens=args.new, min_new_tokens=args.new)
    pre = lambda: model.forward(ids)
    gen(), pre()  # compiles what the timed calls use
    t_compile = time.perf_counter() - t0 - t_load
    out = np.asarray(gen())
    assert out.shape == (b, args.prompt + args.new), out.shape
    t_pre, t_gen = timed(pre, args.runs), timed(gen, args.runs)
    t_long = timed(lambda: model.forward(long_ids), args.runs) if long_ids is not None else float("nan")
    weights = sum(a.nbytes for a in jax.tree.leaves(model.params))
    if "embed_q" in model.params:  # the logits read the tied table's int8 / fp8 copy; the table: B rows
        weights -= model.params["embed"].nbytes
    row = dict(engine=f"aotlm {mode}" + ("" if variant == "default" else f" [{variant}]"), batch=b,
               t_pre=t_pre, t_gen=t_gen, t_long=t_long, load_s=t_load, compile_s=t_compile,
               weights=weights, kv_elem=model.cache["k"][0].dtype.itemsize)  # fmt: skip
    if args.profile and b == 1 and mode == args.modes[0]:
        profile(gen, Path(args.profile) / variant, 2 * (args.new - 1))
    if args.dump and b == 1:  # the optimized HLO of the decode graphs used
        for r in model.compile_report:
            if r["graph"] == "decode":
                key = ("decode", *r["bucket"])
                name = f"{mode}-{variant}-{'-'.join(map(str, key))}.hlo.txt"
                (Path(args.dump) / name).write_text(model.executable(key).as_text())
    return row


def hf_rows(path: Path, b: int, peer: str, args, ids, long_ids) -> dict:
    import torch
    import transformers

    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    x = torch.tensor(ids, device="cuda")
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    if peer == "hf-compile":
        kw["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward)
    sync = torch.cuda.synchronize

    def run(fn):
        def go():
            with torch.inference_mode():
                fn()
            sync()

        return go

    gen = run(lambda: model.generate(x, **kw))
    pre = run(lambda: model.generate(x, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1}))
    gen(), pre()
    t_load = time.perf_counter() - t0
    lx = torch.tensor(long_ids, device="cuda") if long_ids is not None else None
    long = run(lambda: model(lx)) if lx is not None else None
    row = dict(engine=f"transformers {peer[3:]}", batch=b, t_pre=timed(pre, args.runs),
               t_gen=timed(gen, args.runs), t_long=timed(long, args.runs) if long else float("nan"),
               load_s=t_load, compile_s=float("nan"), weights=sum(p.nbytes for p in model.parameters()),
               kv_elem=2)  # fmt: skip
    model = None
    torch.cuda.empty_cache()
    return row


def finish(row: dict, cfg: dict, args, bw: float) -> dict:
    b = row["batch"]
    dec = b * (args.new - 1) / (row["t_gen"] - row["t_pre"])
    per_step = step_bytes(cfg, b, args, row["kv_elem"], row["weights"])
    return {
        "engine": row["engine"], "batch": b, "prefill ms": 1e3 * row["t_pre"],
        f"prefill {args.long_prompt} ms": 1e3 * row["t_long"], "decode tok/s": dec,
        "ms/step": 1e3 * b / dec, "HBM %": 100 * per_step * dec / b / (bw * 1e9),
        "load s": row["load_s"], "compile s": row["compile_s"],
    }  # fmt: skip


def profile(gen, out: Path, steps: int) -> None:
    """A device trace of two batch-1 generations; prints the kernels that took the most time."""
    import jax

    jax.profiler.start_trace(str(out), create_perfetto_trace=True)
    gen(), gen()
    jax.profiler.stop_trace()
    from gpu_trace import summarize  # scripts/

    traces = sorted(out.rglob("perfetto_trace.json.gz"))
    if traces:
        print(f"== profile {out.name}", summarize(traces[-1], steps), sep="\n", flush=True)


def table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


def main() -> int:
    args = parse()
    sys.path.insert(0, str(Path(__file__).parent))
    import numpy as np

    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"bench_gpu: unknown --variants {unknown}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    work = Path(args.work)
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
    path = write_checkpoint(args.shape, work)
    cfg = json.loads((path / "config.json").read_text())
    bw = read_bandwidth()
    print(f"device: {device_line()}; read bandwidth {bw:.0f} GB/s (XLA sums over 4 GiB)", flush=True)
    print(f"checkpoint: Llama-{args.shape} shape, random bf16; prompt {args.prompt}, {args.new} new, greedy")
    rows, rng = [], np.random.default_rng(0)
    for b in args.batch:
        ids = rng.integers(0, min(32000, cfg["vocab_size"]), (b, args.prompt))
        long_ids = (
            rng.integers(0, min(32000, cfg["vocab_size"]), (b, args.long_prompt))
            if args.long_prompt
            else None
        )
        runs = [
            partial(aotlm_rows, path, b, m, v, args, ids, long_ids) for m in args.modes for v in args.variants
        ]
        if args.floor:
            from gpu_floor import floor_row

            runs.append(partial(floor_row, cfg, b, args))
        runs += [partial(hf_rows, path, b, p, args, ids, long_ids) for p in args.peers]
        for run in runs:
            try:
                raw = run()
            except (
                Exception
            ) as e:  # a row failing (torch.compile on this stack, a variant) is reported, not fatal
                print(
                    f"[batch {b}] row skipped: {type(e).__name__}: {str(e)[:400]}",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            rows.append(finish(raw, cfg, args, bw))
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
            if args.json:  # as each row finishes: a run cut short still reports
                Path(args.json).write_text(json.dumps(rows, indent=1))
    if rows:
        table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
