"""Prefill GEMM kernels (``engine/kernels/gemm.h``) and W8A8 (``quant="w8a8"``).

NumPy references on odd shapes (rows 1..100 across the row-kernel / GEMM lines, K and N not
multiples of the 8-lane vector or the 16-column panel), the kernels inside compiled model graphs,
W8A8 against f32 (logits error, greedy agreement), the forced fallback (``AOTLM_KERNELS=0``: the
same W8A8 math in XLA, identical tokens), tp=2 shards in a subprocess and a warm start from the
compile cache that compiles nothing (``test_kernels.test_warm_start_with_kernels_compiles_nothing[w8a8]``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import peaked_checkpoint, rel_error, run_with_kernels

from aotlm import kernels
from aotlm.core import precision
from aotlm.models import layers, lowp, packing
from aotlm.models.quant import QuantizationConfig, quant_config

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="aotlm kernels unavailable on this machine")
TESTS = Path(__file__).resolve().parents[1]
ROWS = (1, 5, 16, 17, 33, 64, 65, 100)  # row kernels up to 16 (f32) / 64 (int8); more: the GEMMs


def test_f32_gemm_matches_numpy_on_odd_shapes():
    rng = np.random.default_rng(0)
    f = jax.jit(lambda x, w: kernels.matmul(x, w))
    for m in ROWS:
        for k, n in ((37, 19), (300, 70), (520, 33)):  # K past one 256-row block; N tails of 3, 6, 1
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = rng.standard_normal((k, n)).astype(np.float32)
            err = rel_error(f(x, w), x.astype(np.float64) @ w)
            assert err <= 1e-5, (m, k, n, err)


def test_packed_gemm_matches_numpy_and_w8a8_is_exact():
    """Packed int8 / bf16 / f16 / f32 W with f32 x past the row kernels (widened to f32 in the GEMM) within
    1e-5 of the float64 product of the stored values; int8 x with its row scales (W8A8) equal to the int64
    product scaled in f32, bit for bit, and to ``lowp.w8a8``'s XLA path; so is f32 x that the GEMM
    rounds to int8 itself (``quant_x``); with the bias and gelu in its output pass, within 1e-6."""
    rng = np.random.default_rng(1)
    f = jax.jit(lambda x, w, s: kernels.matmul(x, w, s, packed_k=1))
    g = jax.jit(lambda x, w, s, sx: kernels.matmul(x, w, s, packed_k=1, sx=sx))
    fused = jax.jit(lambda x, w, s: lowp.w8a8(x, w, s, 1, None, 1))
    biased = lambda x, w, s, b, act: lowp.dense("s8", x, w, s, 1, None, 1, b, act)
    with_bias = jax.jit(biased, static_argnums=4)
    for m in ROWS:
        for k, n in ((38, 16), (1030, 48)):  # K/2 odd; K past several 256-row blocks
            x = rng.standard_normal((m, k)).astype(np.float32)
            wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
            s = (rng.random(n) / 50).astype(np.float32)
            wp = packing.pack(wq, (0,))
            ref = (x.astype(np.float64) @ wq) * s
            tol = 1e-5 if m > kernels.row_limit(wp, 1) else 1e-4  # the int8 row kernels round x to int16
            assert rel_error(f(x, wp, s), ref) <= tol, (m, k, n)
            for dt in (jnp.bfloat16, np.float16, np.float32):
                wf = rng.standard_normal((k, n)).astype(dt)
                y = kernels.matmul(x, packing.pack(wf, (0,)), None, packed_k=1)
                assert rel_error(y, x.astype(np.float64) @ wf.astype(np.float64)) <= 1e-5, (m, k, n, dt)
            if m <= kernels.MAX_ROWS:
                continue
            xq, sx = (np.asarray(a) for a in lowp.quantize_rows(x))
            exact = (xq.astype(np.int64) @ wq).astype(np.float32) * sx[:, None] * s
            got = np.asarray(g(xq, wp, s, sx))
            np.testing.assert_array_equal(got, exact)
            # f32 x rounded by the GEMM itself (quant_x): the graph's quantization bit for bit, also on
            # a zero row and on ties (row 1: max 127, so its scale is 1 and halves round to even)
            xt = x.copy()
            xt[0], xt[1], xt[1, 0] = 0.0, rng.integers(-254, 255, k) / 2, 127.0
            tq, ts = (np.asarray(a) for a in jax.jit(lowp.quantize_rows)(xt))  # as a graph computes it
            want = (tq.astype(np.int64) @ wq).astype(np.float32) * ts[:, None] * s
            np.testing.assert_array_equal(np.asarray(fused(xt, wp, s)), want, err_msg=str((m, k, n)))
            # bias and gelu in the GEMM's output pass (the bias add may be fused with the scale: 1 ulp)
            b = rng.standard_normal(n).astype(np.float32)
            y, was = with_bias(xt, wp, s, b, None)
            assert was and rel_error(y, want.astype(np.float64) + b) <= 1e-6, (m, k, n)
            y, was = with_bias(xt, wp, s, b, "gelu_tanh")
            u = (want + b).astype(np.float64)
            gelu = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
            assert was and rel_error(y, gelu) <= 1e-6, (m, k, n)
            if m in (17, 65):
                xla = jax.jit(lambda x, w, s: lowp.w8a8(x, w, s, 1, None, None))
                os.environ["AOTLM_KERNELS"] = "0"  # lowp.w8a8 on XLA's integer dot
                try:
                    np.testing.assert_array_equal(np.asarray(xla(x, wq, s)), exact)
                finally:
                    os.environ.pop("AOTLM_KERNELS")


def test_w8a8_decode_rows_round_x_to_int8_whatever_the_batch():
    """W8A8 decode rows (<= MAX_ROWS): the row kernel rounds f32 x to int8 as the graph does and its
    result equals the int64 product scaled in f32, bit for bit (``vpdpbusd`` on avx512vnni, int16 lanes
    elsewhere), each row the same alone as among 16; ``layers.dense`` under W8A8 calls it (``a8``) and,
    with the kernels off, forms the same sums on XLA's integer dot."""
    rng = np.random.default_rng(5)
    f = jax.jit(lambda x, w, s: kernels.matmul(x, w, s, packed_k=1, a8=True))
    for k, n in ((38, 16), (1030, 48)):  # K/2 odd: the last 4-row group half padded
        x = rng.standard_normal((16, k)).astype(np.float32)
        x[2], x[3, 0] = 0.0, 50.0  # a zero row; a row whose scale one element sets
        wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
        wq[:, 0] = -127
        s = (rng.random(n) / 50).astype(np.float32)
        wp = packing.pack(wq, (0,))
        tq, ts = (np.asarray(a) for a in jax.jit(lowp.quantize_rows)(x))
        want = (tq.astype(np.int64) @ wq).astype(np.float32) * (s[None, :] * ts[:, None])
        alone = np.concatenate([np.asarray(f(x[i : i + 1], wp, s)) for i in range(16)])
        np.testing.assert_array_equal(alone, want, err_msg=str((k, n)))
        for m in (2, 5, 9, 16):
            np.testing.assert_array_equal(np.asarray(f(x[:m], wp, s)), want[:m], err_msg=str((m, k, n)))
    dense = jax.jit(lambda x, w, s: layers.dense(x, w, scale=s, name="w_up"))
    with lowp.activations("s8"):
        assert "a8 = 1" in dense.lower(x[:4], wp, s).as_text()
        os.environ["AOTLM_KERNELS"] = "0"
        try:
            off = dense.lower(x[:4], wq, s).compile()
            assert "aotlm_" not in off.as_text()
            assert rel_error(off(x[:4], wq, s), want[:4].astype(np.float64)) <= 1e-6
        finally:
            os.environ.pop("AOTLM_KERNELS")


def test_quant_option_and_config():
    q = quant_config("w8a8")
    assert q == QuantizationConfig(quant_dtype="s8", activations="s8") and q.w8a8
    assert not quant_config("int8").w8a8
    with pytest.raises(ValueError, match="activations"):
        QuantizationConfig(quant_dtype="bf16", activations="s8")
    # the compile-cache fingerprint carries precision.describe(): w8a8 and int8 never share entries
    assert precision.resolve("f32", "w8a8").describe() != precision.resolve("f32", "int8").describe()


@pytest.fixture(scope="module")
def runs(ckpt_dir):
    """f32, w8a8 and w8a8 with the kernels forced off, on the peaked checkpoint of
    test_quant (top-1 margins >= 20% of max|logit|): (logits, tokens, used, model) each."""
    path = peaked_checkpoint(ckpt_dir)
    with pytest.MonkeyPatch.context() as mp:
        return {
            "f32": run_with_kernels(path, mp, True),
            "w8a8": run_with_kernels(path, mp, True, quant="w8a8"),
            "w8a8 off": run_with_kernels(path, mp, False, quant="w8a8"),
        }


def test_prefill_graphs_call_the_gemms(runs):
    """f32 (weights in the panel layout) and w8a8 prefill graphs (2 x 32 rows) call the GEMM, decode
    graphs do not; W8A8 logits stay within the int8 bound of f32 and greedy tokens agree."""
    for mode, on in (("f32", True), ("w8a8", True)):
        texts = {str(k): exe.as_text() for k, exe in runs[mode][3]._executables.items()}
        assert any("aotlm_gemm" in t for k, t in texts.items() if "prefill" in k) == on, mode
        assert not any("aotlm_gemm" in t for k, t in texts.items() if "decode" in k)
    lg32, tok32 = runs["f32"][:2]
    lg8, tok8 = runs["w8a8"][:2]
    err = np.abs(lg8 - lg32).max() / np.abs(lg32).max()
    assert err <= 1.5e-2, err  # int8 weights alone: 1e-2 (test_quant)
    np.testing.assert_array_equal(tok8, tok32)


def test_forced_fallback_w8a8_gives_identical_tokens(runs):
    """``AOTLM_KERNELS=0``: the graphs quantize x and multiply in XLA's int8 dot, no kernel call."""
    lg_on, tok_on = runs["w8a8"][:2]
    lg_off, tok_off, used, m = runs["w8a8 off"]
    assert not used and not any("aotlm_" in e.as_text() for e in m._executables.values())
    np.testing.assert_array_equal(tok_on, tok_off)
    assert np.abs(lg_on - lg_off).max() <= 1e-2 * np.abs(lg_off).max()


_TP_CHILD = """
import json
import jax
import numpy as np
from aotlm import kernels
from aotlm.kernels import build
from aotlm.core import precision
from aotlm.core import sharding
from aotlm.models import lowp, packing

mesh = sharding.make_mesh(2)
rules = sharding.rules("shard-over-heads", 2)
rng = np.random.default_rng(0)
put = lambda a, leaf: sharding.put(a, sharding.param_sharding(mesh, (leaf,), a.ndim, rules))
rep = lambda a: sharding.put(a, sharding.replicated(mesh))
out = {"devices": jax.device_count()}
for name, ws in (("w_up", (40, 64)), ("w_down", (64, 48))):  # column / row-parallel (psum)
    x = rng.standard_normal((3, 23, ws[0])).astype(np.float32)  # 69 rows: the GEMMs
    w = rng.standard_normal(ws).astype(np.float32)
    with kernels.mesh_context(mesh, sharding.spec_of(rules)):
        c = jax.jit(lambda x, w: kernels.matmul(x, w, None, 1, name)).lower(rep(x), put(w, name)).compile()
    y = np.asarray(sharding.fetch(c(rep(x), put(w, name))), np.float64)
    ref = x.astype(np.float64) @ w
    out["f32 " + name] = [float(np.abs(y - ref).max() / np.abs(ref).max()), "aotlm_gemm" in c.as_text()]
    wq = rng.integers(-127, 128, ws).astype(np.int8)
    s = (rng.random(ws[1]) / 50).astype(np.float32)
    wp = packing.prepare(name, wq, sharding.param_spec((name,), 2, rules), 2)
    assert packing.is_packed(name, wp.ndim)
    pk = packing.packed_k(name, wp.ndim)
    with kernels.mesh_context(mesh, sharding.spec_of(rules)):
        fi = lambda x, w, s: kernels.matmul(x, w, s, 1, name, packed_k=pk)
        c = jax.jit(fi).lower(rep(x), put(wp, name), put(s, name + "_scale")).compile()
    y = np.asarray(sharding.fetch(c(rep(x), put(wp, name), put(s, name + "_scale"))), np.float64)
    ref = (x.astype(np.float64) @ wq) * s
    target = "aotlm_wmm_pk" if kernels.row_limit(wp, pk) >= 69 else "aotlm_gemm_pk"  # VNNI: the row kernel
    out["int8 " + name] = [float(np.abs(y - ref).max() / np.abs(ref).max()), target in c.as_text()]
    fn = lambda x, w, s: lowp.w8a8(x, w, s, 1, name, pk)
    with kernels.mesh_context(mesh, sharding.spec_of(rules)):
        c = jax.jit(fn).lower(rep(x), put(wp, name), put(s, name + "_scale")).compile()
    y = np.asarray(sharding.fetch(c(rep(x), put(wp, name), put(s, name + "_scale"))))
    xq, sx = (np.asarray(a) for a in jax.jit(lowp.quantize_rows)(x))
    exact = (xq.astype(np.int64) @ wq).astype(np.float32) * sx[..., None] * s
    err = float(np.abs(y - exact).max() / np.abs(exact).max())
    out["w8a8 " + name] = [err, "aotlm_gemm_pk" in c.as_text()]
print(json.dumps(out))
"""


def test_tensor_parallel_gemms_in_subprocess():
    """f32, int8 and W8A8 GEMMs on 2 forced devices: column- and row-parallel (psum) shards."""
    flags = "--xla_force_host_platform_device_count=2 " + os.environ.get("AOTLM_TEST_XLA_FLAGS", "")
    env = dict(os.environ, XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-c", _TP_CHILD]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out.pop("devices") == 2 and len(out) == 6
    for case, (err, in_hlo) in out.items():
        assert in_hlo, f"{case}: no kernel call in the compiled graph"
        tol = 1e-6 if case.startswith("w8a8") else 1e-4 if case.startswith("int8") else 1e-5  # int8: int16 x
        assert err <= tol, f"{case}: relative error {err:.2e}"
