"""Choose context and token buckets for a length distribution, measured on this machine.

    python scripts/tune_buckets.py --model CKPT --lengths lengths.json --out buckets.json
    python scripts/tune_buckets.py --model CKPT --lengths normal:300:60:1:512 --new-tokens 64

Same flags as ``aotlm tune`` (this script calls it): measures a few prefill / decode graphs, fits
a cost model, picks the buckets exactly (dynamic programming) under --max-graphs /
--compile-budget-s / --memory-gb, writes a bucket config for ``aotlm compile --config`` and
``from_pretrained(bucket_config=...)``, then replays the distribution with default and tuned buckets.
"""

from __future__ import annotations

import sys

from aotlm.cli.app import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
