"""Servers and load for ``scripts/bench_serve.py``: server subprocesses, streamed requests, and the
two workloads (``random``: independent requests; ``chat``: multi-turn conversations).

A chat client holds a conversation: a system prompt shared by every client, then turns; each turn
sends the whole history (system + every earlier user message and reply) plus a new user message.
The reply's token ids come from re-tokenizing its streamed text with the checkpoint's tokenizer
(``add_special_tokens=False``), as a chat client does; they are capped at the reply's token count
(``usage.completion_tokens``) so every conversation stays within the length checked up front.
Different engines write different replies, so their later prompts differ in content (not in length
budget); the system prompt, user messages and output lengths are the same for every engine.
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
from bench import model_path
from bench_peers import Skip, _byte_symbols, write_bpe

from aotlm.models.checkpoint import CheckpointError
from aotlm.tiny import make_tiny_gpt2
from aotlm.tune.lengths import LengthDist, from_counts, load_lengths

NAN = float("nan")


def fail(msg: str) -> None:
    """Bad input: one line and exit code 2."""
    print(f"bench_serve.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


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


# ------------------------------------------------------------------ one request
@dataclass
class Result:
    ttft: float = NAN
    itl: list[float] = field(default_factory=list)
    tpot: float = NAN  # time per output token after the first (vLLM's TPOT): the decode rate seen
    tokens: int = 0
    events: int = 0  # streamed events with text (a real tokenizer may hold a piece back)
    text: str = ""
    prompt_tokens: int = 0
    cached: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    turn: int = 0  # chat: 0 for a conversation's first turn
    error: str | None = None


def one_request(port: int, prompt: list[int], n_out: int, timeout: float) -> Result:
    """A streamed greedy ``/v1/completions`` of ``n_out`` tokens (``ignore_eos``); tokens are counted
    from ``usage`` (stream events only time the first token and the gaps)."""
    req = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True, "stream": True}
    req |= {"model": "bench", "stream_options": {"include_usage": True}}
    r, usage, text = Result(), None, []
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
            pieces = [ch["text"] for ch in ev.get("choices") or [] if ch.get("text")]
            if pieces:
                now = time.perf_counter()
                if r.events:
                    r.itl.append(now - last)
                else:
                    r.ttft = now - t0
                last, r.events = now, r.events + 1
                text += pieces
        c.close()
    except (OSError, ValueError, http.client.HTTPException) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.text = "".join(text)
    r.tokens = int(usage["completion_tokens"]) if usage else r.events
    if r.tokens > 1 and r.events:
        r.tpot = (last - t0 - r.ttft) / (r.tokens - 1)  # first text event to the last one
    if usage:
        r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        r.cached = details.get("cached_tokens")
    if r.tokens != n_out:
        r.error = f"asked for {n_out} tokens, got {r.tokens}"
    return r


# ------------------------------------------------------------------ levels
def closed_loop(clients: int, jobs: list, work) -> tuple[list[Result], float]:
    """``clients`` threads, each taking the next job when its previous one ended; ``work(job)``
    returns a list of results. Returns (every result, wall seconds)."""
    todo, results, lock = list(reversed(jobs)), [], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                job = todo.pop()
            res = work(job)
            with lock:
                results.extend(res)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q)) if xs else NAN


def level_stats(results: list[Result], wall: float, chat: bool) -> dict:
    """Throughput and latency of a level (raises ``Skip`` if a request failed)."""
    errors = [r.error for r in results if r.error]
    if errors:
        raise Skip(f"{len(errors)}/{len(results)} requests failed, e.g. {errors[0]}")
    itl = [g for r in results for g in r.itl]
    out = {"requests": len(results), "out tok/s": sum(r.tokens for r in results) / wall}
    out["req/s"] = len(results) / wall
    if chat:
        later, first = [r.ttft for r in results if r.turn], [r.ttft for r in results if not r.turn]
        out |= {"TTFT≥2 p50 ms": pct(later, 50), "TTFT≥2 p99 ms": pct(later, 99)}
        out |= {"TTFT1 p50 ms": pct(first, 50), "TTFT1 p99 ms": pct(first, 99)}
        out["prompt tok"] = sum(r.prompt_tokens for r in results)
        reported = [r.cached for r in results if r.cached is not None]
        out["cached tok"] = sum(reported) if reported else None
    else:
        ttft = [r.ttft for r in results]
        out |= {"TTFT p50 ms": pct(ttft, 50), "TTFT p99 ms": pct(ttft, 99)}
    out |= {"ITL p50 ms": pct(itl, 50), "ITL p99 ms": pct(itl, 99)}
    out["TPOT p50 ms"] = pct([r.tpot for r in results if r.tpot == r.tpot], 50)
    if short := sum(r.events != r.tokens for r in results):
        out["note"] = f"{short} replies streamed not one event per token (ITL per event)"
    return out


def run_level(port: int, reqs: list[tuple[list[int], int]], clients: int, timeout: float) -> dict:
    """The random workload: closed-loop clients over independent (prompt ids, output length) requests."""
    results, wall = closed_loop(clients, reqs, lambda job: [one_request(port, job[0], job[1], timeout)])
    return level_stats(results, wall, chat=False)


# ------------------------------------------------------------------ chat
@dataclass
class Conversation:
    users: list[list[int]]  # each turn's new user message (token ids)
    max_tokens: list[int]  # each turn's reply length


def draw_ids(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    """``n`` token ids uniform over ``allowed`` (the vocabulary without its special tokens)."""
    return allowed[rng.integers(0, len(allowed), n)].tolist()


def conversations(n: int, turns: int, seed: int, allowed: np.ndarray) -> list[Conversation]:
    """``n`` seeded conversations: user messages of 16-64 ids, replies of 32-64 tokens per turn."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        users = [draw_ids(rng, allowed, int(rng.integers(16, 65))) for _ in range(turns)]
        out.append(Conversation(users, rng.integers(32, 65, turns).tolist()))
    return out


def chat_budget(system: int, turns: int) -> int:
    """The most positions a conversation can use: system, every user message and reply at their max."""
    return system + turns * (64 + 64)


def run_chat_level(port: int, system: list[int], convs: list[Conversation], clients: int,
                   tokenizer, timeout: float) -> dict:  # fmt: skip
    """The chat workload: closed-loop clients, each running whole conversations (turns in order)."""
    lock = threading.Lock()

    def converse(conv: Conversation) -> list[Result]:
        history, results = list(system), []
        for turn, (user, n) in enumerate(zip(conv.users, conv.max_tokens, strict=True)):
            prompt = history + user
            res = one_request(port, prompt, n, timeout)
            res.turn = turn
            results.append(res)
            if res.error:
                break
            with lock:  # one tokenizer shared by the client threads
                reply = tokenizer(res.text, add_special_tokens=False)["input_ids"]
            history = prompt + list(reply)[: res.tokens]
        return results

    results, wall = closed_loop(clients, convs, converse)
    return level_stats(results, wall, chat=True)


# ------------------------------------------------------------------ the checkpoint and the load
TINY = dict(vocab_size=50257, n_positions=1024, n_embd=64, n_layer=2, n_head=2)  # --tiny


def checkpoint(args: argparse.Namespace) -> tuple[Path, Path | None, object]:
    """(the checkpoint dir, its GGUF file or None, its tokenizer or None if it has none); the random
    GPT-2s get the ASCII vocabulary."""
    from transformers import AutoTokenizer

    work = Path(args.work)
    if args.tiny and args.checkpoint:
        fail("--tiny and --checkpoint exclude each other: pass one")
    if args.tiny:
        ckpt, gguf = make_tiny_gpt2(work / "gpt2-tiny", **TINY), None
    else:
        try:
            ckpt, gguf = model_path(args.checkpoint, work)
        except (OSError, ValueError, CheckpointError) as e:
            fail(f"--checkpoint {args.checkpoint}: {e}")
    if args.tiny or not args.checkpoint:
        write_ascii_vocab(ckpt, 50257)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    except (OSError, ValueError):
        tokenizer = None
    return Path(ckpt), gguf, tokenizer


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


def requests_for(dist: LengthDist, n: int, seed: int, allowed: np.ndarray) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output length) pairs, ids drawn from ``allowed``."""
    rng = np.random.default_rng(seed)
    return [(draw_ids(rng, allowed, p), new) for p, new in dist.sample(n, seed)]


def allowed_ids(cfg: dict, tokenizer) -> np.ndarray:
    """The vocabulary ids prompts draw from: every id but the special ones (eos, chat markers; without
    a tokenizer: but the last id)."""
    special = tokenizer.all_special_ids if tokenizer else [cfg["vocab_size"] - 1]
    return np.setdiff1d(np.arange(cfg["vocab_size"]), special)


def max_positions(cfg: dict) -> int:
    return int(cfg.get("n_positions") or cfg.get("max_position_embeddings") or 0)


def workload(args: argparse.Namespace, cfg: dict, tokenizer) -> tuple[dict, list, object, str]:
    """(load per client level, warm-up requests, ``run(port, load, clients)``, a description); sets
    ``args.n_positions`` when not given and checks it fits the load and the model."""
    allowed, chat, dist = allowed_ids(cfg, tokenizer), args.workload == "chat", length_dist(args)
    if chat and min(args.turns, args.conversations_per_client) < 1 or args.system_tokens < 0:
        fail("--turns and --conversations-per-client must be >= 1, --system-tokens >= 0")
    if chat and tokenizer is None:
        fail("the chat workload re-tokenizes replies: give a checkpoint with its tokenizer files")
    need = chat_budget(args.system_tokens, args.turns) if chat else dist.max_total
    args.n_positions = args.n_positions or (-(-need // 256) * 256 if chat else 512)
    if need > args.n_positions:
        fail(f"the {args.workload} load needs {need} positions > --n-positions {args.n_positions}")
    if max_positions(cfg) and args.n_positions > max_positions(cfg):
        fail(f"--n-positions {args.n_positions} (the load needs {need}) > the model's {max_positions(cfg)} "
             "positions: pass fewer --system-tokens / --turns or shorter lengths")  # fmt: skip
    rng = np.random.default_rng(args.seed + 10**6)  # warm-up prompts: no prefix of the load's
    longest = need - 64 if chat else dist.max_prompt  # the longest prompt, then the shortest
    warm = [(draw_ids(rng, allowed, n), 4) for n in (longest, 16 if chat else int(dist.prompt_len.min()))]
    warm = (warm * args.warmup)[: args.warmup]
    if chat:
        system = draw_ids(np.random.default_rng(args.seed), allowed, args.system_tokens)
        n = args.conversations_per_client
        levels = {c: conversations(c * n, args.turns, args.seed + c, allowed) for c in args.clients}
        run = lambda port, convs, c: run_chat_level(port, system, convs, c, tokenizer, args.timeout)
        what = (f"chat: system prompt {args.system_tokens} tokens, {args.turns} turns of 16-64 user tokens "
                f"and 32-64 reply tokens, {n} conversation(s) per client")  # fmt: skip
        return levels, warm, run, what
    levels = {c: requests_for(dist, args.requests or c * args.requests_per_client, args.seed + c, allowed)
              for c in args.clients}  # fmt: skip
    run = lambda port, reqs, c: run_level(port, reqs, c, args.timeout)
    what = (
        f"prompts {dist.mean(dist.prompt_len):.0f} tokens mean (max {dist.max_prompt}), outputs "
        f"{dist.mean(dist.new_tokens):.0f} mean, requests per level {[len(r) for r in levels.values()]}"
    )
    return levels, warm, run, what
