"""Kernel ISA levels (``aotlm.kernels.isa``): detection, the forced level, the build and cache keys.

The in-process suite (test_kernels, test_dense, test_prefill_kernels) runs the level this CPU picks;
here every lower level the CPU has runs the NumPy checks of the kernels it changes (GEMMs, W8A8,
prompt attention, the int8 row kernels) in a subprocess with ``AOTLM_KERNEL_ISA`` set; levels the
CPU lacks are skipped with the reason. A model compiled under a forced ``avx2`` gives the default
level's tokens, its compile-cache entries are not those of the other level (no hits across
levels), and a warm start under the forced level compiles nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from builders import peaked_checkpoint

from aotlm import kernels
from aotlm.kernels import build, isa
from aotlm.models import packing
from aotlm.tiny import make_tiny_gpt2

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="aotlm kernels unavailable on this machine")
TESTS = Path(__file__).resolve().parents[1]
ZEN2 = frozenset("sse4_2 avx avx2 fma f16c bmi2".split())
SKX = ZEN2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ICL = SKX | {"avx512_vnni", "avx512ifma"}  # Ice Lake: VNNI without AVX512-BF16
ZEN4 = ICL | {"avx512_bf16"}
SPR = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}  # Sapphire Rapids: AMX tiles


def _env(**kw) -> dict:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "AOTLM_KERNELS": "1", **kw}


def test_level_choice_from_cpu_flags():
    assert isa.supported_levels(ZEN2) == ["avx2"]
    assert isa.supported_levels(SKX) == ["avx2", "avx512"]
    assert isa.supported_levels(ICL) == ["avx2", "avx512", "avx512vnni"]
    assert isa.supported_levels(ZEN4) == ["avx2", "avx512", "avx512vnni", "avx512bf16"]
    assert isa.supported_levels(SPR)[-2:] == ["avx512bf16", "amx"]
    assert isa.supported_levels(ICL | {"amx_tile", "amx_int8"}) == isa.supported_levels(ICL)
    assert isa.supported_levels(SPR - {"amx_bf16"})[-1] == "avx512bf16"  # amx: int8 and bf16 tiles
    assert isa.supported_levels(ZEN4 - {"avx512bw"}) == ["avx2"]  # a level needs all of its features
    assert isa.supported_levels(SKX | {"avx512_bf16"}) == ["avx2", "avx512"]  # and every lower level's
    choices = [isa.choose(None, f) for f in (ZEN2, SKX, ICL, ZEN4, SPR)]
    assert choices == ["avx2", "avx512", "avx512vnni", "avx512bf16", "amx"]
    assert isa.choose("avx2", ZEN4) == "avx2" and isa.choose("avx512", ZEN4) == "avx512"
    assert isa.flags_for("avx2") == ("-mavx2", "-mfma", "-mf16c")
    assert isa.flags_for("avx512vnni")[-1] == "-mavx512vnni" and "-mavx512bw" in isa.flags_for("avx512vnni")
    assert isa.flags_for("avx512bf16")[-2:] == ("-mavx512vnni", "-mavx512bf16")


@pytest.mark.parametrize(
    "value, flags, words",
    [
        ("avx9", ZEN4, ["is not a kernel ISA level", "avx2, avx512, avx512vnni"]),
        ("avx512", ZEN2, ["this CPU lacks avx512f avx512bw avx512vl avx512dq", "use one of avx2"]),
        ("avx512vnni", SKX, ["this CPU lacks avx512_vnni", "use one of avx2, avx512 or unset"]),
    ],
)
def test_unknown_or_unsupported_level_is_one_clear_error(value, flags, words):
    with pytest.raises(kernels.KernelIsaError) as e:
        isa.choose(value, flags)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith((f"AOTLM_KERNEL_ISA={value}:", f"AOTLM_KERNEL_ISA='{value}' "))
    assert all(w in msg for w in words), msg


def test_cli_names_a_bad_level_in_one_line(tmp_path):
    """``aotlm compile`` under ``AOTLM_KERNEL_ISA=avx9``: exit 2, one line, no fallback to XLA."""
    ckpt = make_tiny_gpt2(tmp_path / "ckpt", vocab_size=97, n_embd=32, n_layer=1)
    args = [
        "compile",
        str(ckpt),
        "--batch-size",
        "1",
        "--n-positions",
        "16",
        "--cache-dir",
        str(tmp_path / "cc"),
    ]
    p = subprocess.run(
        [sys.executable, "-m", "aotlm.cli", *args],
        capture_output=True,
        text=True,
        env=_env(AOTLM_KERNEL_ISA="avx9"),
    )
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert "AOTLM_KERNEL_ISA='avx9' is not a kernel ISA level" in err[0]


def test_level_keys_the_binary_and_the_compile_cache():
    level = kernels.isa_level()
    assert level == isa.supported_levels()[-1] or os.environ.get(isa.ENV) == level
    hashes = {lv: build.build_hash(lv) for lv in isa.LEVELS}
    assert len(set(hashes.values())) == len(isa.LEVELS)  # each level: another binary
    assert kernels.cache_tag() == f"wmatmul-{level}-{hashes[level]}"
    assert build.flags(level)[: 1 + len(isa.flags_for(level))] == ("-O3", *isa.flags_for(level))


def test_w8a8_gemm_is_exact_for_every_k_mod_4():
    """This level's W8A8 GEMM (``vpdpbusd`` under avx512vnni: 4 rows of K per lane, the last group
    padded) equals the int64 product scaled in f32 bit for bit, with K % 4 of 0 and 2, rows past
    one 12-row tile, |x| and |w| at 127 (the sign offset's extreme), and N of several panels."""
    rng = np.random.default_rng(7)
    g = jax.jit(lambda x, w, s, sx: kernels.matmul(x, w, s, packed_k=1, sx=sx))
    for m, k, n in ((17, 64, 32), (30, 36, 16), (100, 770, 48), (25, 4, 16), (300, 770, 48)):  # 300: 2 passes
        xq = rng.integers(-127, 128, (m, k)).astype(np.int8)
        xq[0] = 127
        xq[1] = -127
        wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
        wq[:, 0] = -127
        s = (rng.random(n) / 50).astype(np.float32)
        sx = (rng.random(m) / 50 + 1e-3).astype(np.float32)
        exact = (xq.astype(np.int64) @ wq).astype(np.float32) * sx[:, None] * s
        np.testing.assert_array_equal(
            np.asarray(g(xq, packing.pack(wq, (0,)), s, sx)), exact, err_msg=str((m, k, n))
        )


# Tests of the kernels each level changes: GEMMs (f32 micro-kernel, W8A8, bf16 x), the packed int8 row
# kernel (512 bits in the avx512 levels, vpdpwssd from avx512vnni; W8A8 rows on vpdpbusd there), the
# 4-bit kernel (vpmaddubsw on 8 columns, 16 on avx512, vpdpbusd on avx512vnni), prompt attention (the
# GEMM's micro-kernel), the row-major int8 row kernels.
VARIANT_TESTS = [
    "tests/kernels/test_isa.py::test_w8a8_gemm_is_exact_for_every_k_mod_4",
    "tests/kernels/test_dense.py::test_f32_gemm_matches_numpy_on_odd_shapes",
    "tests/kernels/test_dense.py::test_packed_gemm_matches_numpy_and_w8a8_is_exact",
    "tests/kernels/test_dense.py::test_w8a8_decode_rows_round_x_to_int8_whatever_the_batch",
    "tests/models/test_lowp_bf16a.py::test_bf16a_products_match_numpy_on_every_path",
    "tests/kernels/test_kernels.py::test_packed_kernel_matches_numpy",
    "tests/kernels/test_kernels.py::test_packed_int8_rows_equal_the_exact_product_of_int16_rounded_x",
    "tests/kernels/test_q4.py::test_kernel_matches_numpy_on_odd_shapes",
    "tests/kernels/test_q4.py::test_prefill_rows_get_the_bits_of_decode_rows",
    "tests/kernels/test_group8.py::test_kernel_matches_numpy_on_odd_shapes",
    "tests/kernels/test_prefill_kernels.py::test_causal_attention_matches_numpy",
    "tests/kernels/test_prefill_kernels.py::test_row_kernels_apply_bias_and_activation",
    "tests/kernels/test_kernels.py::test_kernel_matches_numpy_on_odd_shapes",
    "tests/kernels/test_attention.py::test_decode_attention_matches_numpy",  # avx2: bdot.h's dots only
]


# avx512vnni's kernels are avx512bf16's but bf16 x, which avx2 and avx512 widen the same way: on a CPU
# whose level is avx512bf16 the subprocess adds no code the others miss (kept for `-m slow`). On an
# amx CPU avx512bf16 runs too: its W8A8 prefill GEMM is vpdpbusd's, which amx gives to tiles.
@pytest.mark.parametrize(
    "level", [pytest.param(lv, marks=pytest.mark.slow) if lv == "avx512vnni" else lv for lv in isa.LEVELS]
)
def test_each_level_matches_numpy(level):
    """Each level's binary against the NumPy references, in a subprocess with the level forced
    (the level this CPU picks already runs them in this process)."""
    if level not in isa.supported_levels():
        pytest.skip(f"this CPU lacks {' '.join(isa.lacking(level))} (the {level} kernels)")
    if level == kernels.isa_level():
        pytest.skip(f"{level} is this process's level: the kernel tests run it in process")
    sel = VARIANT_TESTS if level == "avx2" else VARIANT_TESTS[:10]  # avx512: GEMMs, packed rows, groups
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",  # the selection is small: no worker processes
        *sel,
        "-k",
        "not bfloat16 and not float16",
    ]
    p = subprocess.run(
        cmd, capture_output=True, text=True, env=_env(AOTLM_KERNEL_ISA=level), cwd=TESTS.parent
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and " skipped" not in p.stdout.splitlines()[-1], p.stdout[-500:]


def test_forced_avx2_gives_identical_tokens_and_its_own_cache_entries(ckpt_dir, tmp_path):
    """W8A8 with a 48-token bucket (the VNNI GEMM and the 16-lane attention under the default level)
    on the peaked checkpoint: the default level fills the cache; under ``avx2`` nothing of it is
    loaded (every graph compiles again) and the tokens are identical; a second ``avx2`` process
    loads every graph and compiles nothing."""
    if kernels.isa_level() == "avx2":
        pytest.skip("this CPU's level is avx2: there is no lower level to force")
    path = peaked_checkpoint(ckpt_dir)
    opts = [str(path), str(tmp_path / "cc"), "--quant", "w8a8", "--context", "48", "--n-positions", "64"]

    def run(**env):
        p = subprocess.run(
            [sys.executable, str(TESTS / "support" / "cache_child.py"), *opts, "--targets"],
            capture_output=True,
            text=True,
            env=_env(**env),
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    best, low, warm = run(), run(AOTLM_KERNEL_ISA="avx2"), run(AOTLM_KERNEL_ISA="avx2")
    assert {"aotlm_gemm_pk", "aotlm_attn"} <= set(best["targets"]), best["targets"]
    assert not any(best["hits"]) and not any(low["hits"]) and all(warm["hits"])
    assert not set(best["entries"]) & set(low["entries"])
    assert warm["counts"] == {"backend": 0, "lowering": 0, "tracing": 0}
    assert low["tokens"] == best["tokens"] == warm["tokens"]
    tags = {
        json.loads(m.read_text())["fields"]["env"]["kernels"]
        for m in (tmp_path / "cc").glob("*/manifest.json")
    }
    assert tags == {kernels.cache_tag(), f"wmatmul-avx2-{build.build_hash('avx2')}"}
