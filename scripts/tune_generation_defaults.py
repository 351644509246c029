"""Pick the bundled model's generation defaults: measure candidate settings on held-out prompts.

    python scripts/tune_generation_defaults.py              # the table (~8 min on 2 busy cores)
    python scripts/tune_generation_defaults.py --write engine/data/tiny-py   # + generation_config.json
    python scripts/tune_generation_defaults.py --prompts 40 --new 64          # a quick look (~2 min)

Prompts: ``--prompts`` windows of the files ``aotlm/tiny-py`` never saw in training (the
``heldout_files`` of its ``training.json``, read from the running Python's stdlib), each the first
``--prompt-tokens`` tokens from a random (seeded) non-blank line start, with the true continuation
of ``--new`` tokens. Every candidate setting (greedy, greedy + repetition_penalty, greedy +
no_repeat_ngram_size, sampling over temperature x top_p, with and without repetition_penalty)
generates ``--new`` tokens for every prompt, ``--samples`` times with different seeds when it
samples; all settings run together in batches (per-row parameters, one set of compiled graphs).

Metrics, per setting, means over its samples:

- ``rep4``: fraction of a sample's 4-grams (of tokens) that repeat an earlier 4-gram of the same
  sample. The headline repetition figure; the true continuations' value is printed as reference.
- ``zip``: bytes of a sample's text / bytes of it zlib-compressed: repetition at the character
  level, which token n-gram bans cannot hide (a sample spelling ``S_SOS_S_TTT`` has no repeated
  4-gram of tokens but compresses well).
- ``loop``: fraction of samples whose last 32 tokens are one unit of <= 16 tokens repeated.
- ``lnrun``: longest run of one non-blank line repeated back to back (lines).
- ``dist3``: distinct token 3-grams / all 3-grams, over all samples of the setting.
- ``nll``: the model's own mean negative log-likelihood (nats/token) of the generated tokens,
  teacher-forced under plain float32 logits (no temperature, no penalties; transformers
  ``LlamaForCausalLM`` on the same checkpoint). Low = plausible to the model, but loops score low
  too, hence paired with ``rep4``. The reference is the same figure for the true continuations.

Rule (printed with the table): among the settings that repeat no more than real code does
(``rep4`` and ``zip`` both at most the true continuations'), take the one whose samples the model
finds most plausible (lowest ``nll``). Repetition is brought down to the level of real held-out code,
not to zero: code does repeat itself (``self.``, indentation, ``assertEqual``), and the settings
that drive ``rep4`` to zero do it by picking less likely tokens, which ``nll`` charges for.
Greedy + ``no_repeat_ngram_size`` zeroes ``rep4`` by construction; ``zip`` is what judges it.

Noise: the rule lands where repetition meets the reference, so the pick moves with the prompt
sample: 40 or 80 prompts chose ``repetition_penalty`` 1.3, 1.4 or 1.5 depending on the seed; the
default 160 prompts (seed 0) chose 1.5, which also passed on both 80-prompt draws tried.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sysconfig
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from aotlm import CausalLMForSampling

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "aotlm/tiny-py"
README_PROMPT = "def fibonacci(n):"
GREEDY = {"do_sample": False}
# 1.25, 1.4 and 1.5 bracket where the rule's repetition limit is crossed; nll only grows with the
# penalty, so a higher value could not win
GREEDY_RP = (1.1, 1.2, 1.25, 1.3, 1.4, 1.5)


@dataclass
class Prompt:
    """One held-out window: ``ids`` (the prompt) and ``truth`` (the tokens that really follow)."""

    file: str
    line: int
    ids: list[int]
    truth: list[int]


@dataclass
class Setting:
    """A candidate: ``aotlm`` ``sample()`` keyword arguments under a short name."""

    name: str
    kwargs: dict = field(default_factory=dict)

    @property
    def sampled(self) -> bool:
        return bool(self.kwargs.get("do_sample", False))


def candidates() -> list[Setting]:
    """Greedy, greedy + penalties, and sampling over temperature x top_p (x repetition_penalty)."""
    out = [Setting("greedy", dict(GREEDY))]
    out += [Setting(f"greedy rp={rp}", {**GREEDY, "repetition_penalty": rp}) for rp in GREEDY_RP]
    out += [Setting(f"greedy ngram={n}", {**GREEDY, "no_repeat_ngram_size": n}) for n in (3, 4)]
    for rp in (1.0, 1.1, 1.2):
        for t in (0.6, 0.8, 1.0):
            for p in (0.9, 0.95, 1.0):
                kw = {"do_sample": True, "temperature": t, "top_p": p, "top_k": 0, "repetition_penalty": rp}
                out.append(Setting(f"T={t} p={p}" + (f" rp={rp}" if rp != 1.0 else ""), kw))
        kw = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "repetition_penalty": rp}
        out.append(Setting("T=0.8 p=0.95 k=40" + (f" rp={rp}" if rp != 1.0 else ""), kw))
    return out


# ---------------------------------------------------------------- prompts
def heldout_prompts(
    tokenizer: Any, model_dir: Path, n: int, prompt_tokens: int, new: int, seed: int
) -> list[Prompt]:
    """``n`` windows from the held-out stdlib files, one file per prompt while files last."""
    meta = json.loads((model_dir / "training.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    rng = np.random.default_rng(seed)
    files = [root / f for f in meta["heldout_files"] if (root / f).is_file()]
    if not files:
        raise SystemExit(f"none of the held-out files of {model_dir / 'training.json'} is under {root}")
    order = list(rng.permutation(len(files)))
    out: list[Prompt] = []
    need = prompt_tokens + new
    for k in range(20 * n):  # files without a long-enough window are skipped
        if len(out) == n:
            break
        f = files[order[k % len(files)]]
        text = f.read_text(encoding="utf-8", errors="replace")
        starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        starts = [s for s in starts if text[s : s + 1].strip() and s < len(text) - 8 * need]
        if not starts:
            continue
        s = starts[int(rng.integers(len(starts)))]
        ids = tokenizer(text[s : s + 16 * need])["input_ids"]
        if len(ids) < need:
            continue
        line = text.count("\n", 0, s) + 1
        out.append(Prompt(str(f.relative_to(root)), line, ids[:prompt_tokens], ids[prompt_tokens:need]))
    return out


# ---------------------------------------------------------------- repetition metrics
def rep_n(tokens: Sequence[int], n: int = 4) -> float:
    """Fraction of the n-grams of ``tokens`` that repeat an earlier n-gram of the same sequence."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def zip_ratio(text: str) -> float:
    """Bytes of ``text`` over bytes of it zlib-compressed (1 = incompressible; loops score high)."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw, 9)) if raw else 1.0


def loops(tokens: Sequence[int], window: int = 32, max_period: int = 16) -> bool:
    """Whether the last ``window`` tokens are one unit of at most ``max_period`` tokens, repeated."""
    t = list(tokens[-window:])
    if len(t) < window:
        return False
    return any(all(t[i] == t[i - p] for i in range(p, window)) for p in range(1, max_period + 1))


def line_run(text: str) -> int:
    """Longest run of one non-blank line repeated back to back."""
    best = run = 0
    prev = None
    for ln in text.splitlines():
        if not ln.strip():
            continue
        run = run + 1 if ln == prev else 1
        prev = ln
        best = max(best, run)
    return best


def distinct_n(samples: Sequence[Sequence[int]], n: int = 3) -> float:
    """Distinct n-grams over all n-grams of all ``samples``."""
    grams = [tuple(s[i : i + n]) for s in samples for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


# ---------------------------------------------------------------- generation and scoring
def generate(
    model: CausalLMForSampling,
    prompts: Sequence[Prompt],
    rows: Sequence[tuple[int, Setting, int]],
    new: int,
    eos: int,
) -> list[list[int]]:
    """The generated tokens (up to and including an eos) of every ``(prompt index, setting, seed)`` row.

    Rows run in batches of the compiled batch size, each row with its own sampling values.
    """
    keys = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "no_repeat_ngram_size")
    base = {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    base.update(repetition_penalty=1.0, no_repeat_ngram_size=0)
    out: list[list[int]] = []
    b = model.batch_size
    for s in range(0, len(rows), b):
        chunk = rows[s : s + b]
        ids = np.array([prompts[i].ids for i, _, _ in chunk], np.int32)
        kw = {k: [st.kwargs.get(k, base[k]) for _, st, _ in chunk] for k in keys}
        res = model.sample(
            ids,
            max_new_tokens=new,
            eos_token_id=eos,
            pad_token_id=eos,
            seed=[seed for _, _, seed in chunk],
            return_dict=True,
            **kw,
        )
        p = ids.shape[1]
        for r in range(len(chunk)):
            out.append([int(t) for t in res.sequences[r, p : p + int(res.num_generated[r])]])
    return out


def nll(model_dir: Path, contexts: Sequence[Sequence[int]], conts: Sequence[Sequence[int]]) -> np.ndarray:
    """Mean negative log-likelihood (nats/token) of each continuation given its context.

    Teacher-forced with transformers ``LlamaForCausalLM`` in float32: plain logits, no processors.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = np.zeros(len(conts))
    width = max(len(c) + len(x) for c, x in zip(contexts, conts, strict=True))
    for s in range(0, len(conts), 64):
        ids = np.zeros((min(64, len(conts) - s), width), np.int64)
        tgt = np.full(ids.shape, -1, np.int64)
        for r in range(ids.shape[0]):
            c, x = list(contexts[s + r]), list(conts[s + r])
            ids[r, : len(c) + len(x)] = c + x
            tgt[r, len(c) - 1 : len(c) + len(x) - 1] = x  # position i predicts token i + 1
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor(ids)).logits.float(), -1).numpy()
        for r in range(ids.shape[0]):
            pos = np.nonzero(tgt[r] >= 0)[0]
            out[s + r] = -logp[r, pos, tgt[r, pos]].mean() if len(pos) else np.nan
    return out


# ---------------------------------------------------------------- the table and the rule
def summarize(samples: Sequence[list[int]], scores: np.ndarray, texts: Sequence[str], eos: int) -> dict:
    """The metrics of the module docstring over one setting's samples (token ids, nll, text)."""
    body = [[t for t in s if t != eos] for s in samples]
    return {
        "rep4": float(np.mean([rep_n(s, 4) for s in body])),
        "zip": float(np.mean([zip_ratio(t) for t in texts])),
        "loop": float(np.mean([loops(s) for s in body])),
        "lnrun": float(np.mean([line_run(t) for t in texts])),
        "dist3": distinct_n(body, 3),
        "nll": float(np.nanmean(scores)),
        "tokens": float(np.mean([len(s) for s in samples])),
    }


def choose(rows: Sequence[dict], ref: dict) -> dict:
    """The rule of the module docstring: rep4 and zip <= the reference's, then lowest nll.

    With no setting that low, the lowest rep4.
    """
    ok = [r for r in rows if r["rep4"] <= ref["rep4"] and r["zip"] <= ref["zip"]]
    return min(ok, key=lambda r: r["nll"]) if ok else min(rows, key=lambda r: r["rep4"])


COLUMNS = (
    ("rep4", "{:.3f}"),
    ("zip", "{:.2f}"),
    ("loop", "{:.2f}"),
    ("lnrun", "{:.2f}"),
    ("dist3", "{:.3f}"),
    ("nll", "{:.3f}"),
)


def format_table(table: Sequence[dict], ref: dict, pick: dict | None = None) -> str:
    """The markdown table: the true continuations first, the chosen row marked."""
    lines = ["| setting | " + " | ".join(c for c, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for r in [{"setting": "true continuation (ref.)", **ref}, *table]:
        name = f"**{r['setting']}** (chosen)" if r is pick else r["setting"]
        lines.append(f"| {name} | " + " | ".join(f.format(r[c]) for c, f in COLUMNS) + " |")
    return "\n".join(lines)


def generation_config(setting: Setting, max_new_tokens: int, eos: int) -> dict:
    """transformers ``GenerationConfig`` fields of ``setting`` (what ``save_pretrained`` writes)."""
    kw = {k: v for k, v in setting.kwargs.items() if k != "no_repeat_ngram_size" or v}
    if not kw.get("do_sample"):
        kw = {k: v for k, v in kw.items() if k not in ("temperature", "top_p", "top_k")}
    kw = {k: v for k, v in kw.items() if not (k == "repetition_penalty" and v == 1.0)}
    if kw.get("do_sample"):
        kw.setdefault("top_k", 0)  # transformers' own default is 50; 0 = off, as measured
    kw.update(max_new_tokens=max_new_tokens, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    return kw


def write_config(directory: Path, setting: Setting, max_new_tokens: int, eos: int) -> Path:
    """``directory/generation_config.json`` via transformers (validated strictly first)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(**generation_config(setting, max_new_tokens, eos))
    cfg.validate(strict=True)
    cfg.save_pretrained(str(directory))
    return directory / "generation_config.json"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=160, help="held-out prompts")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new", type=int, default=128, help="new tokens per sample")
    ap.add_argument("--samples", type=int, default=1, help="seeds per prompt for sampled settings")
    ap.add_argument("--batch", type=int, default=64, help="compiled batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the table, examples and the choice here")
    ap.add_argument("--show", type=int, default=4, help="examples per setting in the --json file")
    ap.add_argument("--write", default=None, help="write the chosen generation_config.json to this dir")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from aotlm import AutoModelForSampling, bundled_path
    from aotlm.tiny import cpu_model

    model_dir = bundled_path(MODEL)
    assert model_dir is not None, f"{MODEL} is not installed"
    meta = json.loads((model_dir / "training.json").read_text())
    print(f"CPU: {cpu_model()}")
    print(f"Python {platform.python_version()} (model trained on {meta['python']}'s stdlib); model {MODEL}")
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eos = int(meta["eos_id"])
    prompts = heldout_prompts(tok, model_dir, args.prompts, args.prompt_tokens, args.new, args.seed)
    settings = candidates()
    rows = [
        (i, st, args.seed * 100003 + 1000 * j + i)
        for st in settings
        for j in range(args.samples if st.sampled else 1)
        for i in range(len(prompts))
    ]
    print(
        f"{len(prompts)} prompts of {args.prompt_tokens} tokens from {len({p.file for p in prompts})} "
        f"held-out files, {args.new} new tokens; {len(settings)} settings, {len(rows)} samples "
        f"({args.samples} per prompt when sampling, each its own seed), batch {args.batch}",
        flush=True,
    )
    model = AutoModelForSampling.from_pretrained(
        model_dir,
        batch_size=args.batch,
        n_positions=[args.prompt_tokens + args.new],
        context_length_estimate=[args.prompt_tokens],
        compile_cache=False,
    )
    t1 = time.time()
    gen = generate(model, prompts, rows, args.new, eos)
    t_gen = time.time() - t1
    t1 = time.time()
    scores = nll(
        model_dir,
        [prompts[i].ids for i, _, _ in rows] + [p.ids for p in prompts],
        gen + [p.truth for p in prompts],
    )
    t_nll = time.time() - t1
    ref_scores = scores[len(rows) :]
    texts = [tok.decode(g, skip_special_tokens=True) for g in gen]
    truth = [p.truth for p in prompts]
    ref = summarize(truth, ref_scores, [tok.decode(t) for t in truth], eos)
    table = []
    for st in settings:
        idx = [k for k, r in enumerate(rows) if r[1] is st]
        s = summarize([gen[k] for k in idx], scores[idx], [texts[k] for k in idx], eos)
        shown = [texts[k] for k in idx[: args.show]]
        table.append({"setting": st.name, "kwargs": st.kwargs, **s, "examples": shown})
    pick = choose(table, ref)
    chosen = next(st for st in settings if st.name == pick["setting"])

    print(f"generation {t_gen:.1f} s, scoring {t_nll:.1f} s, total {time.time() - t0:.1f} s\n")
    print(format_table(table, ref, pick))
    print(
        f"\nrule: among settings with rep4 <= {ref['rep4']:.3f} and zip <= {ref['zip']:.2f} (the true "
        "continuations'), the lowest nll"
    )
    gcfg = generation_config(chosen, args.new, eos)
    print(f"chosen: {chosen.name}: {json.dumps(gcfg)}")

    ex = tok(README_PROMPT)["input_ids"]
    demo = AutoModelForSampling.from_pretrained(model_dir, batch_size=1, n_positions=256, compile_cache=False)
    run_kw = {k: v for k, v in gcfg.items() if k not in ("bos_token_id",)}
    for label, kw in (
        ("greedy", {"max_new_tokens": args.new, "eos_token_id": eos}),
        ("chosen, seed 0", run_kw),
    ):
        seq = demo.sample(np.array([ex]), seed=0, **kw)[0, len(ex) :]
        print(
            f"\n{README_PROMPT!r} with {label}:\n{README_PROMPT}{tok.decode(seq, skip_special_tokens=True)}"
        )

    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"reference": ref, "table": table, "chosen": pick["setting"], "config": gcfg}, indent=1
            )
        )
    if args.write:
        print(f"\nwrote {write_config(Path(args.write), chosen, args.new, eos)}")


if __name__ == "__main__":
    main()
