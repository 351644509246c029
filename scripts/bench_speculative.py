"""Beam search and speculative decoding, side by side in one run (medians of ``--repeat`` runs).

* beam search (``--beams`` beams, one prompt): aotlm's on-device loop vs transformers
  ``generate(num_beams=...)``, new tokens per second;
* speculative greedy decoding at batch 1: plain target greedy vs ``SpeculativeGenerator`` with
  (a) draft == target (the upper bound: every proposal accepted), (b) a small random draft and
  (c) the bundled trained pair ``aotlm/tiny-py`` + ``aotlm/tiny-py-draft`` on code prompts.

Random-init checkpoints (GPT-2 family) are made in ``--dir``: for (b) the acceptance of a random
draft against a random target is meaningless (near 0); it shows the cost of a rejected round.

    python scripts/bench_speculative.py [--new 64] [--k 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from aotlm.tiny import cpu_model

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def checkpoint(root: Path, name: str, **cfg) -> Path:
    import torch
    import transformers

    path = root / name
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=4096, n_positions=256, **cfg)
        transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(str(path))
    return path


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CODE_PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef main(", "class Parser:\n    def __init__(self"]


def bundled_pair(args, cache: str, median_time) -> list[tuple]:
    """The trained pair shipped with aotlm (same data, same tokenizer): per prompt, plain target
    greedy vs speculative. Both are tiny (1.8M / 0.3M), so a step costs mostly fixed per-op
    overhead, not weight reads: the draft step is only ~3-4x cheaper than the target's."""
    from transformers import PreTrainedTokenizerFast

    from aotlm import AutoModelForSampling, SpeculativeGenerator
    from aotlm.models.checkpoint.bundled import DEFAULT_MODEL, DRAFT_MODEL

    kw = dict(batch_size=1, n_positions=512, context_length_estimate=32, compile_cache=cache)
    target = AutoModelForSampling.from_pretrained(DEFAULT_MODEL, **kw).compile()
    draft = AutoModelForSampling.from_pretrained(DRAFT_MODEL, **kw).compile()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(target.path) / "tokenizer.json"))
    gen = SpeculativeGenerator(draft, target, args.k).compile()
    new, t_plain, t_spec, accepted, proposed, exact = 200, 0.0, 0.0, 0, 0, True
    for text in CODE_PROMPTS:
        ids = np.array([tok.encode(text)])
        want = target.sample(ids, max_new_tokens=new)
        exact &= np.array_equal(gen.generate(ids, max_new_tokens=new), want)
        accepted, proposed = accepted + gen.stats["accepted"], proposed + gen.stats["proposed"]
        t_plain += median_time(lambda ids=ids: target.sample(ids, max_new_tokens=new), args.repeat)
        t_spec += median_time(lambda ids=ids: gen.generate(ids, max_new_tokens=new), args.repeat)
    n = new * len(CODE_PROMPTS)
    return [
        ("bundled tiny-py, 3 code prompts", "aotlm target alone", f"{n / t_plain:.1f}", "1.00x"),
        (
            f"speculative k={args.k}, tiny-py-draft",
            f"acceptance {accepted / proposed:.0%}, exact {exact}",
            f"{n / t_spec:.1f}",
            f"{t_plain / t_spec:.2f}x",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "aotlm-bench-spec"))
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import torch
    import transformers

    from aotlm import AutoModelForSampling, SpeculativeGenerator

    root = Path(args.dir)
    big = checkpoint(root, "target", n_embd=512, n_layer=8, n_head=8)
    small = checkpoint(root, "draft", n_embd=128, n_layer=2, n_head=4)
    n_pos = max(128, args.prompt + args.new + args.k)
    kw = dict(n_positions=n_pos, context_length_estimate=args.prompt, compile_cache=str(root / "cache"))
    ids = np.random.default_rng(0).integers(0, 4096, (1, args.prompt))
    new = args.new
    print(f"CPU: {cpu_model()}; prompt {args.prompt}, {new} new tokens, fp32")
    n_params = lambda p: sum(
        x.numel() for x in transformers.AutoModelForCausalLM.from_pretrained(p).parameters()
    )
    pt, pd = n_params(big), n_params(small)
    print(f"target {pt / 1e6:.1f}M params, draft {pd / 1e6:.1f}M params ({pt / pd:.1f}x smaller)")

    # ---------------------------------------------------------------- beam search
    nb = args.beams
    beam_model = AutoModelForSampling.from_pretrained(big, batch_size=nb, num_beams=nb, **kw).compile()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(big), dtype="float32").eval()
    run_aot = lambda: beam_model.sample(ids, max_new_tokens=new, num_beams=nb)
    t_ids = torch.tensor(ids)

    def run_hf():
        with torch.no_grad():
            return hf.generate(
                t_ids,
                max_new_tokens=new,
                num_beams=nb,
                do_sample=False,
                pad_token_id=0,
                attention_mask=torch.ones_like(t_ids),
            )

    same = np.array_equal(run_aot(), run_hf().numpy())
    ta, th = median_time(run_aot, args.repeat), median_time(run_hf, args.repeat)
    rows = [
        (f"beam search, {nb} beams", "transformers generate", f"{new / th:.1f}", "1.00x"),
        (f"beam search, {nb} beams", "aotlm", f"{new / ta:.1f}", f"{th / ta:.2f}x"),
    ]
    print(f"beam outputs identical to transformers: {same}")

    # ---------------------------------------------------------------- speculative
    target = AutoModelForSampling.from_pretrained(
        big, batch_size=1, speculation_length=args.k, **kw
    ).compile()
    twin = AutoModelForSampling.from_pretrained(big, batch_size=1, **kw)
    draft = AutoModelForSampling.from_pretrained(small, batch_size=1, **kw)
    plain = lambda: target.sample(ids, max_new_tokens=new)
    want = plain()
    tp = median_time(plain, args.repeat)
    rows.append(("greedy, batch 1", "aotlm target alone", f"{new / tp:.1f}", "1.00x"))
    for label, d in (("draft == target", twin), ("small random draft", draft)):
        gen = SpeculativeGenerator(d, target, args.k).compile()
        out = gen.generate(ids, max_new_tokens=new)
        ts = median_time(lambda gen=gen: gen.generate(ids, max_new_tokens=new), args.repeat)
        acc = gen.stats["acceptance"]
        rows.append(
            (
                f"speculative k={args.k}, {label}",
                f"acceptance {acc:.0%}, exact {np.array_equal(out, want)}",
                f"{new / ts:.1f}",
                f"{tp / ts:.2f}x",
            )
        )
    rows += bundled_pair(args, kw["compile_cache"], median_time)
    widths = [max(len(r[i]) for r in rows + [("case", "engine", "tok/s", "speed-up")]) for i in range(4)]
    fmt = " | ".join("{:<" + str(w) + "}" for w in widths)
    print(fmt.format("case", "engine", "tok/s", "speed-up"))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(fmt.format(*r))


if __name__ == "__main__":
    main()
