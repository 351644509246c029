"""Measure generated tokens/s and latency at candidate batch sizes; recommend one.

    python scripts/explore_batch.py --model CKPT --lengths lengths.json --memory-gb 2 \
        --bucket-config buckets.json --max-latency-ms 8000

Same flags as ``aotlm explore-batch`` (this script calls it): candidates are the powers of two and
the largest batch whose weights + KV cache fit --memory-gb per ``aotlm.core.memory``.
"""

from __future__ import annotations

import sys

from aotlm.cli.app import main

if __name__ == "__main__":
    sys.exit(main(["explore-batch", *sys.argv[1:]]))
