"""Decode/prefill speed of aotlm (f32 / bf16 / int8) against its peers, one run, same checkpoint.

    python scripts/bench.py                       # GPT-2-small (124M, random init), batch 1 and 8
    python scripts/bench.py --batch 8 32 --modes int8 int8+kvbf16 --peers ct2-int8 llama-q8_0
    python scripts/bench.py --batch 1 --runs 5 --modes f32 int8
    python scripts/bench.py --tp 2 --peers        # aotlm only, 2 forced CPU devices
    python scripts/bench.py --only amp            # batch 1: every amp / weight mode + streamed vs plain
    python scripts/bench.py --checkpoint smollm2 --modes int8  # a real GGUF model vs llama.cpp on its file
    python scripts/bench.py --peers ov-int8 ov-int4 ov-default  # OpenVINO GenAI (bench_openvino)
    pip install -e '.[bench]'                     # peers: CTranslate2, llama-cpp-python, OpenVINO GenAI

Rows: aotlm modes, transformers eager fp32, CTranslate2 float32/int8, llama.cpp f32/f16/q8_0,
OpenVINO GenAI int8/int4/default (optimum-intel's export, ``bench_openvino``; scripts/README.md)
(a peer that is not installed is skipped with the reason). Decode tokens/s =
batch * (new - 1) / (generate time - prefill time), medians over runs, all engines called
round-robin so machine noise hits them alike. Roofline: a decode step reads every weight once
and the KV cache of the positions written so far, so it cannot beat (bytes read per step) /
(read bandwidth); "roofline %" is the row's share of that. The bandwidth is measured before each
batch and once per round (it drifts on a shared machine), the median in "bw GB/s". "weights MB"
counts the weights, "KV MB" the mean cache read over the run (prompt + (new - 1) / 2 positions
per row, at the engine's cache dtype: aotlm and transformers the model dtype, CTranslate2 float32,
llama.cpp f16, their defaults; "+kvbf16" modes: ``kv_cache_dtype="bf16"``). Any batch size works
(1 8 16 32 64: the peers run the same batch, CTranslate2 through ``generate_batch``, llama.cpp through
its batched API, ``bench_peers``); the last table puts each batch's fastest aotlm mode beside each
peer's fastest. The machine is shared and noisy: compare rows of one run.

"aotlm f32 streamed" (batch 1, with ``--stream``, the default): the f32 model's ``sample()`` with a
streamer whose ``put`` records when each call arrives, in the same round robin; its "vs aotlm f32"
is streamed / plain, and a second table gives the median gap between consecutive new tokens as
the streamer sees them (tokens of one ``put`` arrive together: gap 0) and the tokens per ``put``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from aotlm.tiny import cpu_model

MODES = {  # aotlm mode -> from_pretrained kwargs (every mode also gets fuse_qkv=True, see aotlm_engine)
    "f32": {},
    "bf16": {"amp": "bf16"},  # CPU with the kernels: bf16 weights, f32 activations (aotlm.core.precision)
    "f16": {"amp": "f16"},
    "bf16w": {"quant": "bf16"},  # bf16 weights, amp f32
    # bf16 weights and, in prefill, activations rounded to bf16 (vdpbf16ps with AVX512-BF16: models/lowp.py)
    "bf16a": {"quant": "bf16a"},
    "int8": {"quant": "int8"},
    # transformers-neuronx's int8 example: QuantizationConfig(quant_dtype="s8", dequant_dtype="bf16")
    "int8+bf16": {"quant": ("s8", "bf16"), "amp": "bf16"},
    # a bf16 KV cache (aotlm.core.precision): at batch 8 the f32 cache is ~half of a decode step's bytes
    "int8+kvbf16": {"quant": "int8", "kv_cache_dtype": "bf16"},
    "f32+kvbf16": {"kv_cache_dtype": "bf16"},
    # int8 weights and, in prefill, int8 activations (per-row dynamic scales, int32 sums: gemm.h)
    "w8a8": {"quant": "w8a8"},
    "w8a8+kvbf16": {"quant": "w8a8", "kv_cache_dtype": "bf16"},
    # 4-bit weights in groups of 32 / 64 / 128 with f16 scales (+ minimums: asym), aotlm.models.quant4
    "int4": {"quant": "int4"},
    "int4-g64": {"quant": "int4-g64"},
    "int4-g128": {"quant": "int4-g128"},
    "int4-asym": {"quant": "int4-asym"},
}
PEERS = ["hf", "ct2-float32", "ct2-int8", "llama-f32", "llama-f16", "llama-q8_0"]
# a GGUF model (--checkpoint smollm2 / FILE.gguf): llama.cpp on the file as shipped and re-quantized
GGUF_PEERS = ["llama-gguf", "llama-gguf-q8_0", "llama-gguf-q4_0"]
OV_PEERS = ["ov-int8", "ov-int4", "ov-default"]  # OpenVINO GenAI on either kind of checkpoint
ONLY = {"amp": {"batch": [1], "modes": list(MODES), "peers": [], "stream": True}}  # --only NAME
DEFAULT_MODES = [m for m in MODES if not m.startswith("int4-")]  # the int4 variants: ask by name


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="HF checkpoint dir, FILE.gguf or a model name (aotlm models); default: random GPT-2-small",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    ap.add_argument(
        "--peers", nargs="*", default=None, choices=PEERS + GGUF_PEERS + OV_PEERS, help="none: aotlm only"
    )
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/tmp/aotlm-bench", help="converted peer models, compile cache")
    ap.add_argument("--plot", default=None, help="PNG path: tokens/s vs batch per engine (matplotlib)")
    ap.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batch 1 with f32: also the f32 model with a timing streamer (streamed vs plain)",
    )
    ap.add_argument(
        "--only", choices=list(ONLY), help="amp: batch 1, every aotlm mode and streamed vs plain, no peers"
    )
    args = ap.parse_args()
    for k, v in ONLY.get(args.only, {}).items():
        setattr(args, k, v)
    return args


def read_bandwidth(gib: float = 0.5, runs: int = 7) -> tuple[float, str]:
    """GB/s of a streaming read over ``gib`` GiB, median of runs, and how it was read: by the
    kernels' threads (all cores, as the one-row kernels read weights) when they are built, else
    by XLA's ``jnp.sum`` (which ran on one thread and varied 16-34 GB/s between runs here)."""
    from aotlm import kernels

    gbps = kernels.read_gbps(int(gib * 1024), runs)
    if gbps:
        return gbps, f"{kernels.threads()} kernel threads"
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2**28),), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return x.nbytes / statistics.median(ts) / 1e9, "XLA jnp.sum"


def step_bytes(params) -> int:
    """Weight bytes one decode step reads: all params but the rows-only lookups (positions; the
    embedding itself when the logits read its int8 copy)."""
    import jax

    skip = {"pos_embed"} | ({"embed"} if "embed_q" in params else set())
    leaves = [v for k, v in params.items() if k not in skip and k != "layers"]
    return sum(a.nbytes for a in jax.tree.leaves([leaves, params["layers"]]))


def kv_bytes(path, b: int, args, elem: int) -> float:
    """Mean KV-cache bytes one decode step reads: keys and values of every layer for the
    positions written so far (prompt + (new - 1) / 2 on average), ``elem`` bytes per value."""
    import transformers

    c = transformers.AutoConfig.from_pretrained(path)
    heads = c.num_attention_heads
    width = getattr(c, "num_key_value_heads", None) or heads
    width *= getattr(c, "head_dim", None) or c.hidden_size // heads
    return b * c.num_hidden_layers * 2 * (args.prompt + (args.new - 1) / 2) * width * elem


class TimingStreamer:
    """A streamer (``put(tokens)`` / ``end()``) that records when each ``put`` arrives and how
    many new tokens per row it carries; the first ``put`` is the prompt."""

    def __init__(self):
        self.puts: list[tuple[float, int]] = []

    def put(self, tokens) -> None:
        import numpy as np

        t = np.asarray(tokens)
        self.puts.append((time.perf_counter(), t.shape[-1] if t.ndim > 1 else 1))

    def end(self) -> None:
        pass

    def token_gaps(self) -> list[float]:
        """Seconds between consecutive new tokens as they arrive (tokens of one put: 0 apart)."""
        arrivals = [t for t, n in self.puts[1:] for _ in range(n)]
        return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def mode_kwargs(mode: str) -> dict:
    from aotlm.models.quant import QuantizationConfig

    kw = dict(MODES[mode])
    kw.setdefault("quant", "none")  # float weights as the mode says, also for a GGUF model (default: int8)
    if isinstance(kw.get("quant"), tuple):
        quant, dequant = kw["quant"]
        kw["quant"] = QuantizationConfig(quant_dtype=quant, dequant_dtype=dequant)
    return kw


_models: dict = {}  # (batch, mode) -> compiled model: the streamed row reuses the f32 one


def aotlm_engine(path, b: int, mode: str, args, ids, streamers: list | None = None):
    """(prefill, generate, weight bytes, KV bytes per step); ``streamers``: generate with a fresh
    ``TimingStreamer`` each call, appended to that list."""
    model = _models.get((b, mode)) or load_model(path, b, mode, args)
    _models[b, mode] = model

    def gen():
        if streamers is None:
            return model.sample(ids, max_new_tokens=args.new)
        streamers.append(TimingStreamer())
        return model.sample(ids, max_new_tokens=args.new, streamer=streamers[-1])

    kv = kv_bytes(path, b, args, model.cache["k"][0].dtype.itemsize)  # the cache's own dtype
    return (lambda: model.forward(ids)), gen, step_bytes(model.params), kv


def load_model(path, b: int, mode: str, args):
    from aotlm import AutoModelForSampling

    model = AutoModelForSampling.from_pretrained(
        path,
        batch_size=b,
        n_positions=args.prompt + args.new,
        context_length_estimate=args.prompt,
        tp_degree=args.tp,
        compile_cache=str(Path(args.work) / "compile_cache"),
        fuse_qkv=True,  # one q/k/v matmul per layer instead of three (transformers-neuronx's option)
        **mode_kwargs(mode),
    ).compile()
    print(f"aotlm {mode} (batch {b}): {model.precision.describe()}", flush=True)
    return model


def model_path(checkpoint: str | None, work: Path) -> tuple[Path, Path | None]:
    """(checkpoint dir aotlm loads, the GGUF file it came from or None); default: GPT-2-small."""
    from aotlm.models.checkpoint import named
    from aotlm.models.checkpoint.resolve import expand, resolve
    from aotlm.tiny import make_gpt2_small

    if checkpoint is None:
        return make_gpt2_small(work / "gpt2-small"), None
    gguf = named.locate(checkpoint) if named.is_named(checkpoint) else expand(checkpoint)
    return resolve(checkpoint), gguf if gguf.suffix == ".gguf" else None


def hf_engine(path, ids, args):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor(ids)
    mask = torch.ones_like(x)
    new = args.new
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=mask, pad_token_id=0)

    def prefill():
        with torch.inference_mode():
            model(x, attention_mask=mask)

    def generate():
        with torch.inference_mode():
            return model.generate(x, **kw)

    weights = sum(p.numel() * 4 for n, p in model.named_parameters() if "wpe" not in n)
    return prefill, generate, weights, kv_bytes(path, len(ids), args, 4)


def peer_engine(peer: str, path: Path, ids, args, f32_bytes: int):
    """(prefill, generate, weight bytes, KV bytes per step) of one peer; ``Skip`` when it cannot run."""
    from bench_peers import (
        Skip,
        converted_gguf,
        ctranslate2_runner,
        hf_checkpoint,
        llama_cpp_runner,
        requantized_gguf,
    )

    work = Path(args.work)
    if not peer.startswith("llama-gguf"):  # a GGUF model's peers that read a checkpoint: its float32 weights
        path = hf_checkpoint(path, work)
    if peer == "hf":
        return hf_engine(path, ids, args)
    kind, dt = peer.split("-", 1)
    if kind == "ov":  # the runner knows the IR's weight bytes and the KV-cache element size
        from bench_peers import openvino_runner

        pre, gen, nbytes, kv_elem = openvino_runner(path, work, dt, ids, args.new)
        return pre, gen, nbytes, kv_bytes(path, len(ids), args, kv_elem)
    kv = kv_bytes(path, len(ids), args, 4 if kind == "ct2" else 2)  # ct2: float32 cache; llama.cpp: f16
    if dt.startswith("gguf"):  # the real model's GGUF file as shipped, or re-quantized by llama.cpp
        if args.gguf is None:
            raise Skip("llama-gguf peers need a GGUF model: --checkpoint NAME or FILE.gguf")
        gguf = args.gguf if dt == "gguf" else requantized_gguf(args.gguf, work, dt.split("-")[1])
        return (*llama_cpp_runner(gguf, ids, args.new), gguf.stat().st_size, kv)
    per_weight = {"float32": 4, "f32": 4, "f16": 2, "int8": 1, "q8_0": 34 / 32}[dt]
    if kind == "ct2":
        pre, gen = ctranslate2_runner(path, work, dt, ids, args.new)
    else:
        pre, gen = llama_cpp_runner(converted_gguf(path, work, dt), ids, args.new)
    return pre, gen, int(f32_bytes / 4 * per_weight), kv


def bench_batch(path, b: int, args, ids, bw: float, stream: list) -> list[dict]:
    """Rows of one batch size; ``stream`` gets the streamed-vs-plain summary when measured."""
    engines, skipped, streamers = {}, [], []
    for mode in args.modes:
        engines[f"aotlm {mode}"] = aotlm_engine(path, b, mode, args, ids)
    if args.stream and b == 1 and "f32" in args.modes:  # the same f32 model, with a streamer
        engines["aotlm f32 streamed"] = aotlm_engine(path, b, "f32", args, ids, streamers)
    f32_bytes = engines["aotlm f32"][2] if "aotlm f32" in engines else 4 * 124_000_000
    for peer in args.peers:
        try:
            engines[peer] = peer_engine(peer, Path(path), ids, args, f32_bytes)
        except Exception as e:  # bench_peers.Skip, or a peer failing to convert/load
            skipped.append(f"{peer}: {e}")
    for s in skipped:
        print(f"[batch {b}] skipped {s}", file=sys.stderr, flush=True)
    for pre, *_ in engines.values():  # warm-up (graphs are compiled already; keep it short)
        pre()
    times = {k: ([], []) for k in engines}
    bws = [bw]
    for _ in range(args.runs):
        bws.append(read_bandwidth(runs=3)[0])  # bandwidth drifts on a shared machine: sample it each round
        for k, (pre, gen, *_) in engines.items():
            for i, fn in enumerate((pre, gen)):
                t0 = time.perf_counter()
                fn()
                times[k][i].append(time.perf_counter() - t0)
    rows, bw = [], statistics.median(bws)
    print(f"[batch {b}] read bandwidth per round: {', '.join(f'{x:.1f}' for x in bws)} GB/s", file=sys.stderr)
    for k, (_, _, nbytes, kv) in engines.items():
        t_pre, t_gen = (statistics.median(t) for t in times[k])
        dec = b * (args.new - 1) / (t_gen - t_pre)
        roof = bw * 1e9 / (nbytes + kv) * b
        rows.append(
            {
                "engine": k,
                "batch": b,
                "bw GB/s": bw,
                "prefill ms": t_pre * 1e3,
                "decode tok/s": dec,
                "weights MB": nbytes / 1e6,
                "KV MB": kv / 1e6,
                "roofline tok/s": roof,
                "roofline %": 100 * dec / roof,
            }
        )
    base = next((r["decode tok/s"] for r in rows if r["engine"] == "aotlm f32"), None)
    for r in rows:
        r["vs aotlm f32"] = r["decode tok/s"] / base if base else float("nan")
    if streamers:
        streamed = next(r for r in rows if r["engine"] == "aotlm f32 streamed")
        gaps = [g for s in streamers for g in s.token_gaps()]  # every timed run
        per_put = [n for s in streamers for _, n in s.puts[1:]]
        stream.append(
            {
                "batch": b,
                "plain tok/s": base,
                "streamed tok/s": streamed["decode tok/s"],
                "streamed/plain": streamed["vs aotlm f32"],
                "median token gap ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
                "tokens per put": statistics.mean(per_put) if per_put else float("nan"),
            }
        )
    return rows


def plot(rows: list[dict], out: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for eng in dict.fromkeys(r["engine"] for r in rows):
        pts = sorted((r["batch"], r["decode tok/s"]) for r in rows if r["engine"] == eng)
        ax.plot(*zip(*pts, strict=True), marker="o", label=eng)
    ax.set(xlabel="batch", ylabel="decode tokens/s", title=title, xscale="log", yscale="log")
    ax.set_xticks(sorted({r["batch"] for r in rows}), labels=sorted({str(r["batch"]) for r in rows}))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


def main() -> int:
    args = parse()
    if args.tp > 1:
        flag = f" --xla_force_host_platform_device_count={args.tp}"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + flag
    sys.path.insert(0, str(Path(__file__).parent))
    import numpy as np

    from aotlm import kernels

    Path(args.work).mkdir(parents=True, exist_ok=True)
    path, args.gguf = model_path(args.checkpoint, Path(args.work))
    if args.peers is None:
        args.peers = (GGUF_PEERS if args.gguf else PEERS) + OV_PEERS
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    bw, bw_how = read_bandwidth()
    print(f"CPU: {cpu_model()}")
    if kernels.enabled():  # the level (AOTLM_KERNEL_ISA forces a lower one) and its measured limits
        fma, i8, b16 = kernels.fma_peak(3), kernels.int8_peak(3), kernels.bf16_peak(3)
        bf = f", bf16 {b16:.0f} GFLOP/s" if b16 else ""
        tiles = " (AMX tiles)" if kernels.amx_tiles() else ""
        peaks = f"f32 FMA {fma:.0f} GFLOP/s, int8 {i8:.0f} Gop/s{bf}"
        print(f"kernel ISA: {kernels.isa_level()}{tiles}; peaks: {peaks}")
    print(
        f"checkpoint {path}; prompt {args.prompt}, {args.new} new tokens, greedy, tp={args.tp}, median of "
        f"{args.runs}; aotlm kernels: {kernels.cache_tag()} ({kernels.threads()} threads); "
        f"read bandwidth {bw:.1f} GB/s ({bw_how})",
        flush=True,
    )
    rows, stream = [], []
    rng = np.random.default_rng(0)
    for b in args.batch:
        new = bench_batch(path, b, args, rng.integers(0, min(vocab, 50000), (b, args.prompt)), bw, stream)
        _models.clear()  # free this batch's models before the next batch loads its own
        for r in new:  # as each batch finishes: a long run cut short still reports
            print(
                {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()},
                file=sys.stderr,
                flush=True,
            )
        rows += new
    table(rows)
    from bench_peers import best_by_batch  # local: main() puts scripts/ on sys.path first

    if best := best_by_batch(rows):
        print("\nfastest aotlm mode vs each peer's fastest, per batch (decode tok/s):")
        table(best)
    if stream:
        print("\nstreamed vs plain (f32, same round robin):")
        table(stream)
    if args.plot:
        bw_med = statistics.median(r["bw GB/s"] for r in rows)  # the tables' per-batch medians
        name = args.checkpoint or "GPT-2-small"
        plot(rows, args.plot, f"{name} decode, {cpu_model().split(',')[0]}, median bw {bw_med:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
