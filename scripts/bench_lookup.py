"""Prompt lookup decoding against plain greedy decoding, on a real model, in one run.

    python scripts/bench_lookup.py [--checkpoint smollm2] [--new 64] [--k 3 5 10] [--reps 7] [--peers hf]

Batch 1, chat prompts of three kinds: an output that copies its input (``repeat``), one that edits it
(``edit``) and one that does not read it (``story``). Per prompt and engine: plain greedy decoding and
``prompt_lookup_num_tokens=k`` (transformers' ``max_matching_ngram_size`` default, 2). Decode tok/s =
(new - 1) tokens over (a whole request - a request of one token: the prefill), medians of ``--reps``
interleaved runs (this machine is shared and noisy: compare ratios). aotlm's rows also show the share of
proposals kept and whether the tokens equal plain decoding's; ``--peers hf`` adds transformers on the same
weights (float32, as its GGUF loading gives them) with and without its ``prompt_lookup_num_tokens``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century. It changed how goods "
    "were made, moving production from homes and small workshops into large factories powered by water and "
    "later by steam. New machines for spinning and weaving cotton made cloth cheaper, and railways carried "
    "coal, iron and people across the country."
)
TASKS = {
    "repeat": f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    "edit": f"Rewrite the following text in the present tense:\n\n{TEXT}",
    "story": "Write a short story about a dragon who learns to bake bread.",
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="smollm2")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--k", type=int, nargs="+", default=[3, 5, 10])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--peers", nargs="*", default=[], choices=["hf"])
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "aotlm-bench-lookup"))
    return p.parse_args(argv)


def aotlm_runner(model, ids, new: int, k: int | None):
    kw = {} if k is None else dict(prompt_lookup_num_tokens=k)
    return lambda n=new: model.sample(ids, max_new_tokens=n, **kw)


def hf_runner(model, ids, new: int, k: int | None):
    import torch

    x = torch.tensor(ids)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(x), pad_token_id=0)  # eos ends rows, as aotlm's
    if k is not None:
        kw["prompt_lookup_num_tokens"] = k

    def run(n=new):
        with torch.inference_mode():
            return model.generate(x, max_new_tokens=n, **kw).numpy()

    return run


def measure(runners: dict, reps: int, new: int, plen: int) -> dict:
    """Decode tok/s per runner: interleaved reps, each request less its engine's one-token request
    (the tokens after the first one, counted: a row may end at eos)."""
    times = {name: ([], []) for name in runners}
    made = {name: fn().shape[1] - plen for name, fn in runners.items()}  # compile / warm
    for fn in runners.values():
        fn(1)
    for _ in range(reps):
        for name, fn in runners.items():
            for n, out in ((new, times[name][0]), (1, times[name][1])):
                t0 = time.perf_counter()
                fn(n)
                out.append(time.perf_counter() - t0)
    return {
        name: (made[name] - 1) / (statistics.median(a) - statistics.median(b))
        for name, (a, b) in times.items()
    }


def main(argv=None) -> None:
    args = parse(argv)
    from transformers import AutoTokenizer

    from aotlm import AutoModelForSampling
    from aotlm.tiny import cpu_model

    model = AutoModelForSampling.from_pretrained(args.checkpoint, batch_size=1, n_positions=[512, 1024])
    tok = AutoTokenizer.from_pretrained(model.path)
    hf = None
    if "hf" in args.peers:
        import torch
        import transformers
        from bench_peers import hf_checkpoint

        path = hf_checkpoint(Path(model.path), Path(args.work))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    print(f"{cpu_model()}; {args.checkpoint}, batch 1, greedy, {args.new} new tokens, median of {args.reps}")
    print("| prompt | engine | plain tok/s | " + " | ".join(f"k={k}" for k in args.k) + " |")
    print("|---|---|---|" + "---|" * len(args.k))
    for name, question in TASKS.items():
        chat = [{"role": "user", "content": question}]
        ids = np.asarray(
            tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="np")["input_ids"]
        )
        engines = [("aotlm", model, aotlm_runner)] + (
            [("transformers", hf, hf_runner)] if hf is not None else []
        )
        for engine, m, runner in engines:
            ks = [None, *args.k]
            runners = {k: runner(m, ids, args.new, k) for k in ks}
            speed = measure(runners, args.reps, args.new, ids.shape[1])
            cells = []
            for k in args.k:
                cell = f"{speed[k]:.1f} ({speed[k] / speed[None]:.2f}x"
                if engine == "aotlm":
                    got = runners[k]()
                    kept = model.last_speculative_stats["acceptance"]
                    exact = np.array_equal(got, runners[None]())
                    cell += f", {kept:.0%} kept" + ("" if exact else ", TOKENS DIFFER")
                cells.append(cell + ")")
            print(
                f"| {name} ({ids.shape[1]} tokens) | {engine} | {speed[None]:.1f} | "
                + " | ".join(cells)
                + " |"
            )


if __name__ == "__main__":
    main()
