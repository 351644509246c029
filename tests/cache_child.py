"""Child process for compile-cache tests: load, compile, sample; print counts and tokens as JSON.

usage: python cache_child.py CHECKPOINT CACHE_DIR [--amp f32] [--n-positions 32,64] [--load DIR] [--save DIR]
"""

import argparse
import json
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
ap.add_argument("--load", default=None)
ap.add_argument("--save", default=None)
a = ap.parse_args()

cache = False if a.cache_dir == "none" else a.cache_dir
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = AutoModelForSampling.from_pretrained(
        a.checkpoint,
        batch_size=2,
        n_positions=[int(x) for x in a.n_positions.split(",")],
        context_length_estimate=[16],
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
        }
    )
)
