"""``scripts/bench_serve.py`` starts each engine with the weights its name says (a mode with a dash,
``int4-g64``, once ran as ``int4`` with an f32 KV cache: its tables compared other weights)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_serve  # noqa: E402
from serve_load import Result, level_stats  # noqa: E402


def test_aotlm_engine_names_give_their_modes_flags():
    names = [e for e in bench_serve.ENGINES if e.startswith("aotlm")]
    assert "aotlm-int4-g64+kvbf16-noprefix" in names and "aotlm1-int4-g64" in names
    for name in names:
        mode = name.split("-", 1)[1].removesuffix("-noprefix")
        flags = bench_serve.aotlm_flags(name)
        quant, amp = flags[flags.index("--quant") + 1], "bf16" if mode.startswith("bf16") else None
        want = {"f32": "none", "bf16": "none", "bf16-int8": "int8"}.get(mode, mode.removesuffix("+kvbf16"))
        assert quant == want and (amp is None or flags[flags.index("--amp") + 1] == amp), (name, flags)
        assert bench_serve.OFFLINE_KW[mode].get("amp") == amp  # offline-MODE: the same compute
        assert ("--kv-cache-dtype" in flags) == mode.endswith("+kvbf16"), (name, flags)
        assert ("--no-prefix-cache" in flags) == name.endswith("-noprefix"), (name, flags)
        assert bench_serve.OFFLINE_KW[mode].get("quant", "none") == quant  # offline-MODE: the same weights


def test_tpot_is_each_requests_decode_time_per_token_and_is_set_against_batch_1_decode():
    rs = [Result(ttft=0.1, tokens=11, events=3, tpot=t) for t in (0.004, 0.005, 0.006)]
    stats = level_stats(rs, wall=2.0, chat=False)
    assert abs(stats["TPOT p50 ms"] - 5.0) < 1e-9 and stats["out tok/s"] == 16.5
    rows = [
        {"engine": "aotlm-int4-g64+kvbf16", "clients": 1, **stats},
        {"engine": "offline1-int4-g64+kvbf16 decode@1", "clients": "-", "out tok/s": 250.0},
    ]
    assert "aotlm-int4-g64+kvbf16@1 decode (1000 / TPOT p50) / offline batch-1 decode: 0.80x" in (
        bench_serve.ratios(rows, 1)
    )
