"""Soak test of ``aotlm serve``: many clients for a while, then checks that nothing leaked or drifted.

    python scripts/soak_serve.py                         # 32 clients, 180 s, a tiny random GPT-2
    python scripts/soak_serve.py --clients 8 --seconds 20 --batch-size 4     # the suite's short run
    python scripts/soak_serve.py --checkpoint DIR --batch-size 16 --seconds 600

The server runs as a subprocess on a loopback port (``aotlm serve``, prefix reuse on). Each client
loops until the time is up, drawing at random: a greedy request (token-id prompt, random lengths,
streamed or not, some starting with a recent prompt, so prefix reuse is exercised), a
request it abandons after a few streamed tokens (a disconnect), a request it cancels by a short
timeout, or a malformed request (bad JSON, bad field values, a prompt past the context). Then it
checks, and exits 1 if any fails:

* every malformed request got a 4xx with an error body, no request got a 5xx;
* every completed greedy request's text equals the same request sent alone afterwards (a
  request's tokens do not depend on what shared the batch, its row or whether its prefix was
  reused);
* no slot leaked: ``/metrics`` shows 0 active slots and an empty queue once the clients stop;
* the server compiled nothing after start (``aotlm_xla_compilations``);
* its resident memory (less the bytes its prefix store holds, bounded by ``--prefix-cache-mb``)
  at the end is within ``--rss-slack`` of what it was a third into the load (the warm-up: every
  graph's first run allocates its buffers).

It stops by itself (``--seconds``, then at most ``--timeout`` s per request), kills the server
on any exit, and prints the counts, the checks and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from serve_load import write_ascii_vocab

from aotlm.tiny import cpu_model, make_tiny_gpt2


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="default: a tiny random GPT-2 in --work")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=180.0, help="how long the clients send requests")
    ap.add_argument("--batch-size", type=int, default=16, help="the server's slots")
    ap.add_argument("--n-positions", type=int, default=256)
    ap.add_argument("--context-length-estimate", default="16,32,64,128", help="the server's prompt buckets")
    ap.add_argument("--max-prompt", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--replay", type=int, default=60, help="completed requests re-sent alone and compared")
    ap.add_argument(
        "--rss-slack", type=float, default=0.10, help="allowed RSS growth after a third of the load"
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="checkpoint + compile cache (default: a temp dir)")
    return ap.parse_args()


def start_server(
    args: argparse.Namespace, ckpt: Path, cache: Path, log: Path
) -> tuple[subprocess.Popen, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "aotlm.cli", "serve", str(ckpt), "--port", str(port), "--quiet"]
    cmd += ["--batch-size", str(args.batch_size), "--n-positions", str(args.n_positions)]
    cmd += ["--cache-dir", str(cache), "--context-length-estimate", args.context_length_estimate]
    with open(log, "w") as err:  # the server's log: its tail is printed when a check fails
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()
    if not line.startswith("aotlm serve: http://"):
        proc.kill()
        raise SystemExit(f"the server did not start: {line.strip()} {log.read_text()[-2000:]}")
    return proc, f"http://127.0.0.1:{port}"


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + " "))


class Load:
    """What the clients did: counts by outcome, completed greedy requests, failures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.done: list[tuple[dict, str]] = []
        self.failures: list[str] = []
        self.prompts: list[list[int]] = []

    def note(self, what: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[what] += 1
            if failure:
                self.failures.append(failure)


def completion(client: httpx.Client, url: str, body: dict, timeout: float) -> tuple[int, str]:
    """Status and text of a request (streamed bodies are read to their end)."""
    if not body.get("stream"):
        r = client.post(url + "/v1/completions", json=body, timeout=timeout)
        return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
    text = []
    with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:  # the server failed after the 200 went out
                    return 500, json.dumps(event)
                text += [c["text"] for c in event["choices"]]
    return 200, "".join(text)


VOCAB = 256 + 95 * 95 + 1  # bench_serve's ASCII BPE: the bytes, the printable pairs, <|endoftext|>
BAD = [
    b"{not json",
    json.dumps({"prompt": [1, 2], "max_tokens": -3}).encode(),
    json.dumps({"prompt": [1, 2], "temperature": "hot"}).encode(),
    json.dumps({"prompt": [], "max_tokens": 2}).encode(),
    json.dumps({"prompt": [1], "max_tokens": 100000}).encode(),
    json.dumps({"max_tokens": 2}).encode(),
]


def client_loop(args, url: str, vocab: int, deadline: float, seed: int, load: Load) -> None:
    rng = random.Random(seed)
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            kind = rng.choices(["greedy", "abandon", "timeout", "bad"], [0.75, 0.1, 0.05, 0.1])[0]
            try:
                run_one(args, url, vocab, kind, rng, client, load)
            except httpx.TimeoutException:
                load.note("timeout" if kind == "timeout" else "error", None if kind == "timeout" else kind)
            except httpx.HTTPError as e:
                load.note("error", f"{kind}: {type(e).__name__}: {e}")


def draw_prompt(args, vocab: int, rng: random.Random, load: Load) -> list[int]:
    with load.lock:
        recent = load.prompts[-args.batch_size :]  # what free rows may still hold
        old = rng.choice(recent) if recent and rng.random() < 0.4 else None
    n = rng.randint(1, args.max_prompt)
    fresh = [rng.randrange(vocab) for _ in range(n)]
    prompt = (old[: rng.randint(1, len(old))] + fresh)[: args.max_prompt] if old else fresh
    with load.lock:
        load.prompts.append(prompt)
    return prompt


def run_one(args, url: str, vocab: int, kind: str, rng: random.Random, client: httpx.Client, load: Load):
    if kind == "bad":
        r = client.post(url + "/v1/completions", content=rng.choice(BAD), timeout=args.timeout)
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        load.note("bad", None if ok else f"malformed request answered {r.status_code}: {r.text[:200]}")
        return
    body = {"prompt": draw_prompt(args, vocab, rng, load), "max_tokens": rng.randint(1, args.max_tokens)}
    body |= {"temperature": 0, "ignore_eos": True, "stream": kind == "abandon" or rng.random() < 0.5}
    if kind == "abandon":
        leave_after = rng.randint(1, 6)
        with client.stream("POST", url + "/v1/completions", json=body, timeout=args.timeout) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= leave_after:
                    break
        load.note("abandoned")
        return
    timeout = rng.uniform(0.01, 0.2) if kind == "timeout" else args.timeout
    status, text = completion(client, url, body, timeout)
    if status != 200:
        load.note("error", f"status {status}: {text[:200]}")
        return
    with load.lock:
        load.done.append((body, text))
    load.note("completed" if kind == "greedy" else "timeout-completed")


def main() -> int:
    args = parse()
    work = Path(args.work or tempfile.mkdtemp(prefix="aotlm-soak-"))
    ckpt = Path(
        args.checkpoint or make_tiny_gpt2(work / "gpt2", vocab_size=VOCAB, n_positions=args.n_positions)
    )
    if not args.checkpoint and not (ckpt / "vocab.json").is_file():
        write_ascii_vocab(ckpt, VOCAB)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    print(f"CPU: {cpu_model()}\nsoak: {args.clients} clients, {args.seconds:.0f} s, {args.batch_size} slots")
    t0 = time.monotonic()
    log = work / "server.log"
    proc, url = start_server(args, ckpt, work / "compile_cache", log)
    try:
        failed = soak(args, proc, url, vocab, time.monotonic() - t0)
        if failed:
            lines = log.read_text().splitlines()
            first = next((i for i, x in enumerate(lines) if x.startswith("Traceback")), None)
            part = lines[-30:] if first is None else lines[max(0, first - 2) :][:40]
            what = "last lines" if first is None else "its first traceback"
            print(f"server log ({log}), {what}:\n" + "\n".join(part))
        return failed
    finally:
        proc.kill()
        proc.wait(10)


def soak(args, proc: subprocess.Popen, url: str, vocab: int, start_s: float) -> int:
    warm = Load()
    for i in range(2 * args.batch_size):  # every ladder graph and prompt bucket seen once
        run_one(args, url, vocab, "greedy", random.Random(10_000 + i), httpx.Client(), warm)
    store = lambda: metric(url, "aotlm_prefix_store_bytes") / 1024  # bounded by --prefix-cache-mb
    compiles0 = metric(url, "aotlm_xla_compilations")
    load = Load()
    t0 = time.monotonic()
    deadline = t0 + args.seconds
    threads = [
        threading.Thread(target=client_loop, args=(args, url, vocab, deadline, args.seed + i, load))
        for i in range(args.clients)
    ]
    for t in threads:
        t.start()
    # the first third of the load is its warm-up (every graph's first run allocates its buffers)
    time.sleep(max(0.0, t0 + args.seconds / 3 - time.monotonic()))
    rss0 = rss_kb(proc.pid) - store()
    for t in threads:
        t.join()
    time.sleep(0.5)  # abandoned streams are noticed at the next scheduling round
    checks = {
        "no 5xx, malformed -> 4xx": not load.failures,
        "no slot leaked": metric(url, "aotlm_active_slots") == 0 and metric(url, "aotlm_queue_depth") == 0,
        "zero compilations": metric(url, "aotlm_xla_compilations") == compiles0 == 0,
    }
    rss1 = rss_kb(proc.pid) - store()
    what = f"RSS less the prefix store {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MB (slack {args.rss_slack:.0%})"
    checks[what] = rss1 <= rss0 * (1 + args.rss_slack)
    sample = random.Random(args.seed).sample(load.done, min(args.replay, len(load.done)))
    with httpx.Client() as client:
        again = [completion(client, url, body, args.timeout) for body, _ in sample]
    differ = [
        (body, text, got) for (body, text), got in zip(sample, again, strict=True) if got != (200, text)
    ]
    same = len(sample) - len(differ)
    for body, text, got in differ[:3]:
        load.failures.append(f"replay of {body} gave {got!r}, under load {text!r}")
    checks[f"replayed alone: {same}/{len(sample)} identical"] = same == len(sample) and len(sample) > 0
    hits = metric(url, "aotlm_prefix_cache_hit_rate")
    print(f"server start {start_s:.0f} s; requests: {dict(load.counts)}; prefix hit rate {hits:.2f}")
    for msg in load.failures[:10]:
        print(f"  failure: {msg}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
