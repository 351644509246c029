"""Train aotlm's bundled default model: a small Llama on the Python standard library's own sources.

No model hub is reachable here, so the model that ships with aotlm is trained from data every
machine has: the ``.py`` files of the running interpreter's stdlib. One run trains a byte-level
BPE tokenizer and a Llama-architecture LM in JAX (hand-written AdamW + warmup/cosine; optax is not
a dependency), optionally a much smaller sibling for speculative decoding on the same tokenizer,
and writes each as a normal Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer files, README.md model card, training.json with the numbers).

    nice -n 10 python scripts/train_default_model.py --out engine/data/tiny-py \\
        --draft-out engine/data/tiny-py-draft --minutes 30 --draft-minutes 6
    python scripts/train_default_model.py --tiny --steps 20 --out /tmp/t   # seconds, for the tests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from llama_jax import Arch, forward, hf_state, init_params, make_step, n_params, token_nll

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

EOS = "<|endoftext|>"
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n"]


# name -> (d, layers, heads, kv_heads, ffn); the draft is ~7x smaller than the main model
# Sized for a 2-core machine shared with other jobs (~5 GFLOP/s of training throughput measured):
# a 4M-parameter model with 4096 BPE tokens reached only unigram-level loss in that budget.
ARCHS = {"main": (192, 4, 3, 1, 512), "draft": (96, 2, 2, 1, 256), "tiny": (32, 2, 2, 1, 64)}


def stdlib_files(tiny: bool) -> list[Path]:
    """Sorted stdlib ``.py`` files (site-packages excluded) for a deterministic corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    if tiny:  # a few small top-level modules: the test run must take seconds
        files = [p for p in files if p.parent == root and p.stat().st_size < 20000][:40]
    return files


def read_texts(files: list[Path]) -> tuple[list[str], list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    names, texts = [], []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
            names.append(str(p.relative_to(root)))
        except (UnicodeDecodeError, OSError):
            continue
    return names, texts


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE (GPT-2 style pre-tokenization), wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=EOS, model_max_length=512
    )


def encode(tok, texts: list[str]) -> np.ndarray:
    """All files as one stream, each followed by ``<|endoftext|>``."""
    eos = tok.convert_tokens_to_ids(EOS)
    out = []
    for enc in tok.backend_tokenizer.encode_batch(texts):
        out.append(np.asarray(enc.ids, np.int32))
        out.append(np.asarray([eos], np.int32))
    return np.concatenate(out)


# ---------------------------------------------------------------- evaluation
def eval_windows(stream: np.ndarray, seq: int, n: int) -> np.ndarray:
    """The first ``n`` non-overlapping [seq+1] windows of the held-out stream (fixed, deterministic)."""
    n = min(n, (len(stream) - 1) // seq)
    return np.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)])


def eval_loss(a: Arch, p: dict, windows: np.ndarray, nll_fn, bs: int = 16) -> float:
    tot = 0.0
    for i in range(0, len(windows), bs):
        chunk = windows[i : i + bs]
        tot += float(nll_fn(p, chunk)) * len(chunk)
    return tot / len(windows)


def bigram_loss(train: np.ndarray, windows: np.ndarray, vocab: int) -> tuple[float, float]:
    """Add-k bigram over BPE tokens, counted on the training stream, scored on the model's pairs.

    k is the best of a small grid on the held-out pairs themselves, which favours the baseline.
    """
    counts = np.zeros((vocab, vocab), np.float64)
    np.add.at(counts, (train[:-1], train[1:]), 1.0)
    prev, nxt = windows[:, :-1].ravel(), windows[:, 1:].ravel()
    best = (float("inf"), 0.0)
    for k in (1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001):
        row = counts[prev].sum(1) + k * vocab
        nll = -np.mean(np.log((counts[prev, nxt] + k) / row))
        best = min(best, (float(nll), k))
    return best


def greedy(a: Arch, p: dict, tok, prompt: str, new: int, fwd) -> str:
    """Greedy completion with a fixed-length buffer (one compiled forward)."""
    ids = tok(prompt)["input_ids"]
    n = len(ids)
    buf = np.zeros((1, 128), np.int32)
    buf[0, :n] = ids
    for _ in range(min(new, 128 - n)):
        nxt = int(np.argmax(np.asarray(fwd(p, buf))[0, n - 1]))
        buf[0, n] = nxt
        n += 1
    return tok.decode(buf[0, len(ids) : n].tolist())


# ---------------------------------------------------------------- training
def train(a: Arch, train_ids, held, args, budget_s: float | None, steps: int | None, seed: int, log):
    """Train until ``steps`` or ``budget_s`` (warmup, then cosine over the fraction used up)."""
    import jax
    import jax.numpy as jnp

    p = init_params(a, seed)
    m = jax.tree.map(jnp.zeros_like, p)
    v = jax.tree.map(jnp.zeros_like, p)
    step_fn = make_step(a)
    nll_fn = jax.jit(lambda q, x: token_nll(a, q, x))
    rng = np.random.default_rng(seed)
    curve_w = held[: args.curve_windows]
    warm = 5 if args.tiny else 20
    curve, t0, step, seen, train_s = [], time.time(), 0, 0, 0.0
    next_eval, ema = 0.0, None

    def progress() -> float:
        fr = [step / steps] if steps else []
        return max(fr + ([train_s / budget_s] if budget_s else []))

    while progress() < 1.0:
        frac = progress()
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = rng.integers(0, len(train_ids) - a.seq - 1, args.batch)
        x = np.stack([train_ids[s : s + a.seq + 1] for s in starts])
        ts = time.time()
        p, m, v, loss, gn = step_fn(p, m, v, jnp.float32(step + 1), x, jnp.float32(lr))
        loss = float(loss)
        if step == 0:  # the first call compiles: keep it out of the training-time budget
            compile_s = time.time() - ts
        else:
            train_s += time.time() - ts
        step += 1
        seen += x[:, :-1].size
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        if progress() >= next_eval or progress() >= 1.0:
            ev = eval_loss(a, p, curve_w, nll_fn)
            curve.append(
                {"step": step, "tokens": seen, "train_loss": round(ema, 4), "heldout_loss": round(ev, 4)}
            )
            log(f"  step {step:5d}  {train_s:7.1f}s  lr {lr:.2e}  train {ema:.3f}  held-out {ev:.3f}")
            next_eval = progress() + 0.1
    return (
        p,
        {
            "steps": step,
            "tokens_seen": seen,
            "train_seconds": round(train_s, 1),
            "compile_seconds": round(compile_s, 1),
            "wall_seconds": round(time.time() - t0, 1),
            "curve": curve,
        },
        nll_fn,
    )


def save(out: Path, a: Arch, p: dict, tok, eos: int, meta: dict) -> None:
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.d,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.hd,
        max_position_embeddings=a.max_pos,
        rms_norm_eps=a.eps,
        rope_theta=a.theta,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        attention_bias=False,
        mlp_bias=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(out))
    save_file(hf_state(a, p), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "README.md").write_text(model_card(meta))


def model_card(m: dict) -> str:
    rows = "\n".join(
        f"| {r['step']} | {r['tokens']:,} | {r['train_loss']:.3f} | {r['heldout_loss']:.3f} |"
        for r in m["curve"]
    )
    samples = "\n\n".join(
        f"Prompt `{s['prompt']!r}` →\n```python\n{s['prompt']}{s['completion']}\n```" for s in m["samples"]
    )
    a = m["arch"]
    return f"""# {m["name"]}

A small Llama-architecture causal LM trained from scratch by `scripts/train_default_model.py` on the
Python {m["python"]} standard library's own `.py` sources, for aotlm's offline demos and tests.
It writes plausible-looking Python, not correct programs.

- Command: `{m["command"]}`
- Data: {m["files_train"]} training / {m["files_heldout"]} held-out files (split by file, seed {m["seed"]}),
  {m["tokens_train"]:,} / {m["tokens_heldout"]:,} tokens.
- Tokenizer: byte-level BPE, vocabulary {a["vocab"]}, `<|endoftext|>` = id {m["eos_id"]}
  (bos/eos/pad; it ends every file).
- Architecture: d={a["d"]}, layers={a["layers"]}, heads={a["heads"]} (kv {a["kv_heads"]}), ffn={a["ffn"]},
  tied embeddings, trained on {a["seq"]}-token windows; **{m["params"]:,} parameters** (float32).
- Training: {m["steps"]} steps of batch {m["batch"]}x{a["seq"]} ({m["tokens_seen"]:,} tokens seen), AdamW
  (lr {m["lr"]}, warmup + cosine, wd 0.1, clip 1.0): {m["train_seconds"]:.0f} s of training steps
  (+{m["compile_seconds"]:.0f} s compile), {m["wall_seconds"]:.0f} s wall with evaluations, on {m["machine"]}
  shared with other jobs.

## Held-out loss (nats/token, {m["eval_tokens"]:,} held-out tokens)

| model | loss | perplexity |
|---|---|---|
| this model | {m["heldout_loss"]:.3f} | {math.exp(m["heldout_loss"]):.1f} |
| add-k bigram (k={m["bigram_k"]}), same tokens | {m["bigram_loss"]:.3f} | {math.exp(m["bigram_loss"]):.1f} |

## Training curve (held-out loss on the first {m["curve_tokens"]:,} held-out tokens)

| step | tokens | train loss (EMA) | held-out loss |
|---|---|---|---|
{rows}

## Greedy samples

{samples}
"""


def run_one(name, arch, out, tok, eos, data, args, budget_s, steps, seed, log):
    import jax

    train_ids, held_ids, info = data
    held = eval_windows(held_ids, arch.seq, args.eval_windows)
    log(f"{name}: {n_params(init_params(arch, seed)):,} params, budget {budget_s}s, steps {steps}")
    bi, k = bigram_loss(train_ids, held, arch.vocab)
    log(f"{name}: add-k bigram baseline on the held-out windows: {bi:.4f} (k={k})")
    p, stats, nll_fn = train(arch, train_ids, held, args, budget_s, steps, seed, log)
    final = eval_loss(arch, p, held, nll_fn)
    fwd = jax.jit(lambda q, x: forward(arch, q, x))
    samples = [{"prompt": s, "completion": greedy(arch, p, tok, s, args.sample_tokens, fwd)} for s in PROMPTS]
    meta = {
        "name": name,
        "python": platform.python_version(),
        "seed": seed,
        "params": n_params(p),
        "arch": asdict(arch),
        "batch": args.batch,
        "lr": args.lr,
        "eos_id": eos,
        **info,
        **stats,
        "heldout_loss": round(final, 4),
        "bigram_loss": round(bi, 4),
        "bigram_k": k,
        "eval_tokens": int(held[:, 1:].size),
        "curve_tokens": int(held[: args.curve_windows, 1:].size),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), jax {jax.__version__}",
        "command": args.command,
        "samples": samples,
    }
    save(out, arch, p, tok, eos, meta)
    log(f"{name}: held-out {final:.4f} vs bigram {bi:.4f} (k={k}); saved to {out}")
    return meta


def _arch(flag: str | None, default: tuple) -> tuple:
    return default if not flag else tuple(int(x) for x in flag.split(","))


def main(argv: list[str] | None = None) -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory of the main model")
    ap.add_argument("--draft-out", default=None, help="also train the small sibling (draft) model here")
    ap.add_argument("--steps", type=int, default=None, help="stop after N steps (each model)")
    ap.add_argument("--minutes", type=float, default=None, help="training-time budget of the main model")
    ap.add_argument(
        "--draft-minutes", type=float, default=None, help="budget of the draft (default minutes/5)"
    )
    ap.add_argument("--tiny", action="store_true", help="a very small config and corpus (for tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=None, help="BPE vocabulary (default 1024, tiny 512)")
    ap.add_argument(
        "--arch", default=None, help="main model d,layers,heads,kv_heads,ffn (e.g. 256,6,4,2,704)"
    )
    ap.add_argument("--draft-arch", default=None, help="draft model d,layers,heads,kv_heads,ffn")
    ap.add_argument("--tokenizer", default=None, help="load this tokenizer instead of training one")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--heldout-fraction", type=float, default=0.03)
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows for the final loss")
    ap.add_argument("--curve-windows", type=int, default=None, help="held-out windows for the curve")
    ap.add_argument("--sample-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None:
        ap.error("give --steps and/or --minutes")
    args.command = "python scripts/train_default_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    t = args.tiny
    args.vocab = args.vocab or (512 if t else 1024)
    args.batch = args.batch or (4 if t else 8)
    args.lr = args.lr or 3e-3
    args.eval_windows = args.eval_windows or (8 if t else 128)
    args.curve_windows = args.curve_windows or (4 if t else 32)
    if t:
        args.sample_tokens = min(args.sample_tokens, 8)
    log = lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", flush=True)

    names, texts = read_texts(stdlib_files(t))
    order = np.random.default_rng(args.seed).permutation(len(names))
    n_held = max(2, int(round(args.heldout_fraction * len(names))))
    held_idx, train_idx = sorted(order[:n_held]), sorted(order[n_held:])
    tr_texts = [texts[i] for i in train_idx]
    log(f"{len(names)} stdlib files: {len(train_idx)} train / {n_held} held-out; training the tokenizer")
    if args.tokenizer:  # reuse one trained before on the same split (it is deterministic)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tok = train_tokenizer(tr_texts, args.vocab)
    eos = tok.convert_tokens_to_ids(EOS)
    train_ids, held_ids = encode(tok, tr_texts), encode(tok, [texts[i] for i in held_idx])
    info = {
        "files_train": len(train_idx),
        "files_heldout": n_held,
        "heldout_files": [names[i] for i in held_idx],
        "tokens_train": int(len(train_ids)),
        "tokens_heldout": int(len(held_ids)),
        "vocab": len(tok),
    }
    log(f"tokens: {len(train_ids):,} train / {len(held_ids):,} held-out, vocab {len(tok)}")
    data = (train_ids, held_ids, info)
    seq = 32 if t else 256
    main_arch = Arch(
        len(tok), *_arch(args.arch, ARCHS["tiny" if t else "main"]), seq=seq, max_pos=64 if t else 512
    )
    budget = None if args.minutes is None else args.minutes * 60
    run_one(
        "aotlm/tiny-py", main_arch, Path(args.out), tok, eos, data, args, budget, args.steps, args.seed, log
    )
    if args.draft_out:
        d_arch = Arch(
            len(tok),
            *_arch(args.draft_arch, ARCHS["tiny" if t else "draft"]),
            seq=seq,
            max_pos=64 if t else 512,
        )
        dm = args.draft_minutes if args.draft_minutes is not None else (args.minutes or 0) / 5 or None
        d_budget = None if dm is None else dm * 60
        run_one(
            "aotlm/tiny-py-draft",
            d_arch,
            Path(args.draft_out),
            tok,
            eos,
            data,
            args,
            d_budget,
            args.steps,
            args.seed + 1,
            log,
        )


if __name__ == "__main__":
    main()
