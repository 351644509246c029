"""Child process for compile-cache tests: load, compile, sample; print counts and tokens as JSON.

usage: python cache_child.py CHECKPOINT CACHE_DIR [--amp f32] [--n-positions 32,64] [--load DIR] [--save DIR]
"""

import argparse
import json
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
from compile_counter import count_compiles  # noqa: E402

from aotlm import AutoModelForSampling

ap = argparse.ArgumentParser()
ap.add_argument("checkpoint")
ap.add_argument("cache_dir")
ap.add_argument("--amp", default="f32")
ap.add_argument("--quant", default=None)
ap.add_argument("--n-positions", default="32,64")
ap.add_argument("--context", default="16", help="context_length_estimate buckets (comma-separated)")
ap.add_argument("--targets", action="store_true", help="also report the aotlm FFI targets the graphs call")
ap.add_argument("--load", default=None)
ap.add_argument("--save", default=None)
a = ap.parse_args()

cache = False if a.cache_dir == "none" else a.cache_dir


def kernel_targets(exe) -> set[str]:
    """The aotlm FFI targets an executable calls (empty if its HLO text is not available)."""
    try:
        return set(re.findall(r"aotlm_[a-z0-9_]+", exe.as_text()))
    except Exception:  # a deserialized executable may not keep its text
        return set()


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = AutoModelForSampling.from_pretrained(
        a.checkpoint,
        batch_size=2,
        n_positions=[int(x) for x in a.n_positions.split(",")],
        context_length_estimate=[int(x) for x in a.context.split(",")],
        amp=a.amp,
        quant=a.quant,
        compile_cache=cache,
    )
    with count_compiles() as c:
        if a.load:
            model.load(a.load)
        model.compile()
        ids = np.arange(1, 21).reshape(2, 10) % 101
        tokens = model.sample(ids, max_new_tokens=30)
    if a.save:
        model.save(a.save)
print(
    json.dumps(
        {
            "counts": c,
            "tokens": tokens.tolist(),
            "hits": [r["hit"] for r in model.compile_report],
            "entries": [r["entry"] for r in model.compile_report],
            "graphs": [[r["graph"], *r["bucket"]] for r in model.compile_report],
            "warnings": [str(w.message) for w in caught],
            "targets": sorted({t for e in model._executables.values() for t in kernel_targets(e)})
            if a.targets
            else [],
        }
    )
)
