"""Reproduce the bundled model's held-out loss with ``aotlm score``, and score the held-out files.

The model card's loss (``engine/data/tiny-py/training.json``: ``heldout_loss``) is the mean
next-token loss over the first ``eval_tokens / 256`` non-overlapping 257-token windows of the
held-out stream (each held-out stdlib file tokenized, followed by ``<|endoftext|>``, concatenated;
``scripts/train_default_model.py``). This script rebuilds that stream from this Python's standard
library, writes the windows as ``{"input_ids": [...]}`` records (the first id is context only, as
in training) and runs ``aotlm score`` on them; then it scores every held-out file as a
``{"text": ...}`` record (rolling windows, the first token conditioned on ``<|endoftext|>``).

    python scripts/score_heldout.py [--out DIR] [--skip-texts] [--quant w8a8]

Needs the Python (3.11.7) whose standard library the model was trained on: other versions ship
other file contents.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from aotlm.models.checkpoint.bundled import DEFAULT_MODEL, bundled_path

SEQ = 256  # the training windows: 256 predictions from 257 tokens


def card() -> dict:
    return json.loads((bundled_path(DEFAULT_MODEL) / "training.json").read_text())


def heldout_texts(info: dict) -> list[str]:
    """The held-out files' texts from this Python's standard library (ValueError if they differ)."""
    if platform.python_version() != info["python"]:
        raise ValueError(
            f"the model was trained on Python {info['python']}'s stdlib; this is {platform.python_version()}"
        )
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in info["heldout_files"]]


def windows(texts: list[str], n: int) -> np.ndarray:
    """The first ``n`` windows of the held-out stream, as training built them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_path(DEFAULT_MODEL)))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    stream = []
    for t in texts:
        stream += tok(t, add_special_tokens=False)["input_ids"] + [eos]
        if len(stream) > n * SEQ:
            break
    return np.stack([stream[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)])


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_score(inp: Path, out: Path, *flags: str) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "aotlm.cli",
        "score",
        "--input",
        str(inp),
        "--output",
        str(out),
        "--overwrite",
    ]
    subprocess.run([*cmd, *flags], check=True)
    return [json.loads(line) for line in out.read_text().splitlines()], time.perf_counter() - t0


def mean_nats(records: list[dict]) -> float:
    return -sum(r["logprob"] for r in records) / sum(r["tokens"] for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="where the JSONL files go (default: a temp dir)")
    ap.add_argument("--skip-texts", action="store_true", help="only the model card's windows")
    ap.add_argument("--quant", default=None, help="weight option for aotlm score (int8, w8a8, bf16)")
    args = ap.parse_args()
    quant = ("--quant", args.quant) if args.quant else ()
    out = Path(args.out or tempfile.mkdtemp(prefix="aotlm-heldout-"))
    out.mkdir(parents=True, exist_ok=True)
    info = card()
    texts = heldout_texts(info)
    w = windows(texts, info["eval_tokens"] // SEQ)
    recs, dt = run_score(write_jsonl(out / "windows.jsonl", [{"input_ids": x.tolist()} for x in w]),
                         out / "windows.scores.jsonl", "--batch-size", "8", *quant)  # fmt: skip
    rows = [("model card windows", len(recs), sum(r["tokens"] for r in recs), mean_nats(recs), dt)]
    if not args.skip_texts:
        inp = write_jsonl(out / "files.jsonl", [{"text": t} for t in texts])
        flags = ("--batch-size", "8", "--max-length", str(SEQ), *quant)
        recs, dt = run_score(inp, out / "files.scores.jsonl", *flags)
        rows.append(
            ("whole files, rolling 256", len(recs), sum(r["tokens"] for r in recs), mean_nats(recs), dt)
        )
    print(
        f"model card held-out loss: {info['heldout_loss']:.4f} nats/token over {info['eval_tokens']} tokens\n"
    )
    print("| input | records | tokens | nats/token | perplexity | seconds |\n|---|---|---|---|---|---|")
    for name, n, toks, nats, secs in rows:
        print(f"| {name} | {n} | {toks:,} | {nats:.5f} | {np.exp(nats):.2f} | {secs:.1f} |")


if __name__ == "__main__":
    main()
