"""The CPU matmul kernels (``aotlm.kernels``): NumPy reference, tp shards, fallback, warm start.

Shapes are deliberately odd (K, N not multiples of the 8-lane vector or the 32-column tile) and
cover every row count 1..8 plus one above the 8-row register block. The reference is float64
NumPy on the same (rounded) inputs, so the only error left is f32 accumulation and the rounding
of the output to x's dtype.
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
from builders import PROMPTS, peaked_checkpoint, run_with_kernels

from aotlm import kernels
from aotlm.kernels import build as kernel_build
from aotlm.models import packing

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="aotlm kernels unavailable on this machine")
TESTS = Path(__file__).resolve().parents[1]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}  # relative to max|y|
# int8 weights: the kernel rounds each row of x to int16 (step max|x| / 32767) for integer dot
# products, measured <= 2.5e-5 of max|y| on these shapes
TOL_INT8 = 1e-4


def _weights(rng, shape, wdt):
    if wdt == jnp.int8:
        return rng.integers(-127, 128, shape).astype(np.int8)
    return np.asarray(jnp.asarray(rng.standard_normal(shape), wdt))


def _check(y, x, w, s, nt: bool, axes: int, xdt):
    k = int(np.prod(w.shape[1:] if nt else w.shape[:axes]))
    x64 = np.asarray(x, np.float64).reshape(-1, k)
    w64 = np.asarray(w, np.float64)
    w64 = w64.reshape(-1, k).T if nt else w64.reshape(k, -1)
    ref = x64 @ w64
    if s is not None:
        ref = ref * np.asarray(s, np.float64).reshape(-1)
    got = np.asarray(y, np.float64).reshape(ref.shape)
    assert y.dtype == xdt
    err = np.abs(got - ref).max() / np.abs(ref).max()
    tol = max(TOL[xdt], TOL_INT8) if np.asarray(w).dtype == np.int8 else TOL[xdt]
    assert err <= tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("wdt", [jnp.int8, jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("nt", [False, True], ids=["KxN", "NxK"])
def test_kernel_matches_numpy_on_odd_shapes(wdt, nt):
    rng = np.random.default_rng(0)
    f = jax.jit(kernels.matmul, static_argnames=("axes", "name", "nt"))
    # one row with K >= 128: K split over threads (parts of odd length, a tail of < 4 rows)
    for m, kk, n in [
        (1, 37, 29),
        (1, 301, 45),
        (1, 130, 17),
        (2, 100, 77),
        (3, 13, 1000),
        (4, 768, 45),
        (5, 9, 8),
        (6, 65, 131),
    ] + [
        (7, 40, 33),
        (8, 33, 300),
        (13, 24, 70),
    ]:
        for xdt in (jnp.float32, jnp.bfloat16):
            x = jnp.asarray(rng.standard_normal((m, kk)), xdt)
            w = _weights(rng, (n, kk) if nt else (kk, n), wdt)
            s = rng.random(n).astype(np.float32) / 100 if wdt == jnp.int8 else None
            _check(f(x, w, s, nt=nt), x, w, s, nt, 1, xdt)


def test_kernel_multi_dim_contraction_and_outputs():
    """``dense_in``: x [B,T,H,Dh] . w [H,Dh,D]; fused qkv: w [D,K,G+2,Dh] with a [K,G+2,Dh] scale."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 1, 3, 7)), jnp.float32)
    w = _weights(rng, (3, 7, 19), jnp.int8)
    s = rng.random(19).astype(np.float32)
    y = jax.jit(lambda x, w, s: kernels.matmul(x, w, s, axes=2))(x, w, s)
    assert y.shape == (2, 1, 19)
    _check(y, x, w, s, False, 2, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 1, 11)), jnp.bfloat16)
    w = _weights(rng, (11, 2, 5, 3), jnp.int8)
    s = rng.random((2, 5, 3)).astype(np.float32)
    y = jax.jit(lambda x, w, s: kernels.matmul(x, w, s))(x, w, s)
    assert y.shape == (3, 1, 2, 5, 3)
    _check(y, x, w, s, False, 1, jnp.bfloat16)


def test_kernel_inside_while_loop_and_layers_dense():
    from aotlm.models import layers as L

    rng = np.random.default_rng(2)
    w = _weights(rng, (24, 24), jnp.int8)
    s = rng.random(24).astype(np.float32) / 50

    def loop(x):
        return jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(L.dense(x, w, None, s, name="w_up")), x)

    x = rng.standard_normal((2, 24)).astype(np.float32)
    compiled = jax.jit(loop).lower(x).compile()
    assert "aotlm_wmm_nn" in compiled.as_text()
    ref = x.astype(np.float64)
    for _ in range(3):
        ref = np.tanh(ref @ (w.astype(np.float64) * s))
    # atol: x is rounded to int16 per row for the int8 dot products (step max|x| / 32767)
    np.testing.assert_allclose(np.asarray(compiled(x)), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wdt", [jnp.int8, jnp.bfloat16, jnp.float16, jnp.float32])
def test_packed_kernel_matches_numpy(wdt):
    """int8 / bf16 / f16 / f32 weights in the panel layout (``aotlm.models.packing``): rows 1..16, K even,
    N % 16 == 0, multi-dim contractions (``wo``) and outputs (``wqkv``), the tied lm_head's
    ``embed_q [V, D]``."""
    rng = np.random.default_rng(5)
    f = jax.jit(kernels.matmul, static_argnames=("axes", "name", "nt", "packed_k"))
    cases = [  # (leaf, x shape, logical w shape, axes, nt)
        ("w_up", (1, 38), (38, 16), 1, False),
        ("w_up", (1, 3072), (3072, 160), 1, False),  # > KB_PAIRS pairs: several int32 flushes
        ("w_up", (1, 262), (262, 32), 1, False),  # a flush, then an odd tail of 3 pairs
        ("w_down", (2, 100), (100, 48), 1, False),
        ("w_up", (3, 14), (14, 1008), 1, False),
        ("w_gate", (5, 258), (258, 32), 1, False),
        ("w_up", (7, 40), (40, 64), 1, False),
        ("w_down", (8, 34), (34, 304), 1, False),
        ("w_up", (13, 24), (24, 80), 1, False),
        ("w_up", (16, 130), (130, 48), 1, False),
        ("wo", (2, 1, 4, 10), (4, 10, 32), 2, False),
        ("wqkv", (3, 1, 22), (22, 2, 5, 16), 1, False),
        ("embed_q", (4, 34), (96, 34), 1, True),
    ]
    for name, xs, ws, axes, nt in cases:
        contract = packing.PACK_CONTRACT[name]
        w = _weights(rng, ws, wdt)
        wp = packing.pack_if(name, w, (False,) * w.ndim, 1)
        assert packing.is_packed(name, wp.ndim) and wp.size == w.size and wp.dtype == w.dtype, name
        n_out = ws[:1] if nt else ws[axes:]
        s = rng.random(n_out).astype(np.float32) / 100 if wdt == jnp.int8 else None
        for xdt in (jnp.float32, jnp.bfloat16):
            x = jnp.asarray(rng.standard_normal(xs), xdt)
            y = f(x, jnp.asarray(wp), s, axes=axes, name=name, nt=nt, packed_k=len(contract))
            assert y.shape == (*xs[: len(xs) - axes], *n_out), name
            _check(y, x, w, s, nt, axes, xdt)
        # prefill: the kernel unpacks to the logical [*K, *N] layout; jnp's unpack agrees
        logical = np.moveaxis(w, contract, tuple(range(len(contract))))
        conv = jax.jit(kernels.convert, static_argnames=("dtype", "name", "packed_k"))
        got = conv(jnp.asarray(wp), jnp.float32, name, packed_k=len(contract))
        np.testing.assert_array_equal(np.asarray(got), logical.astype(np.float32))
        unpacked = np.asarray(packing.unpack(jnp.asarray(wp), name))
        np.testing.assert_array_equal(unpacked.astype(np.float32), logical.astype(np.float32))


def test_packed_int8_rows_equal_the_exact_product_of_int16_rounded_x():
    """The int8 row kernel's x rounding (8 lanes with a scalar tail: K = 38, 200, 250 off the 16-wide loop)
    bit for bit: y = f32(sum_k q[k] w[k]) * (scale * sx) with q = rint(x / sx), sx = max|x| / 32767 in
    f32 (one int32 block of K, so the sum is exact). A row holding inf or NaN gives NaN in its own
    outputs only; an all-zero row gives 0."""
    rng = np.random.default_rng(11)
    f = jax.jit(lambda a, b, s: kernels.matmul(a, b, s, packed_k=1))
    for k, m in ((38, 3), (200, 16), (250, 9)):
        w = rng.integers(-127, 128, (k, 32)).astype(np.int8)
        s = (rng.random(32) / 100).astype(np.float32)
        x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
        x[1] = 0.0
        sx = np.where(np.abs(x).max(1) > 0, np.abs(x).max(1) / np.float32(32767), 1).astype(np.float32)
        inv = (np.float32(1) / sx).astype(np.float32)
        q = np.rint((x * inv[:, None]).astype(np.float32)).astype(np.int64)
        ref = (q @ w.astype(np.int64)).astype(np.float32) * (s[None, :] * sx[:, None]).astype(np.float32)
        wp = jnp.asarray(packing.pack_if("w_up", w, (False, False), 1))
        got = np.asarray(f(jnp.asarray(x), wp, s))
        np.testing.assert_array_equal(got, ref)
        bad = x.copy()
        bad[0, k - 1], bad[2, 3] = np.inf, np.nan  # one in the scalar tail, one in the vector part
        got = np.asarray(f(jnp.asarray(bad), wp, s))
        assert np.isnan(got[[0, 2]]).all() and np.array_equal(got[3:], ref[3:]) and (got[1] == 0).all()


def test_pack_if_keeps_row_major_what_it_cannot_pack():
    rng = np.random.default_rng(6)
    w = rng.integers(-127, 128, (40, 64)).astype(np.int8)
    assert packing.pack_if("w_up", w, (False, True), 2).shape == (4, 20, 16, 2)  # 2 panels per device
    assert packing.pack_if("w_up", w, (False, True), 8).shape == w.shape  # 4 panels over 8 devices: no
    assert packing.pack_if("w_down", w, (True, False), 4).shape == (4, 20, 16, 2)  # 5 pairs of rows each
    assert packing.pack_if("w_down", w, (True, False), 8).shape == w.shape  # 20 pairs over 8 devices: no
    assert packing.pack_if("w_up", w[:39], (False, False), 1).shape == (39, 64)  # odd K
    assert packing.pack_if("w_up", w[:, :40], (False, False), 1).shape == (40, 40)  # N % 16
    assert packing.pack_if("w_up", w.astype(np.float32), (False, False), 1).shape == (4, 20, 16, 2)
    assert packing.pack_if("w_up", w.astype(jnp.bfloat16), (False, False), 1).shape == (4, 20, 16, 2)
    assert packing.pack_if("w_up", w.astype(np.float16), (False, False), 1).shape == (4, 20, 16, 2)
    assert packing.pack_if("router", w, (False, False), 1).shape == w.shape  # not a packed leaf


def test_tensor_parallel_shards_in_subprocess(tmp_path):
    """Column-, row- and vocab-parallel weights on 2 forced devices: each device runs its shard."""
    flags = "--xla_force_host_platform_device_count=2 " + os.environ.get("AOTLM_TEST_XLA_FLAGS", "")
    env = dict(os.environ, XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run(
        [sys.executable, str(TESTS / "support" / "kernels_tp_child.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2
    for case, (err, in_hlo) in out["cases"].items():
        assert in_hlo, f"{case}: no kernel call in the compiled graph"
        assert err <= TOL_INT8, f"{case}: relative error {err:.2e}"  # int8 weights


# f16 panels on 2 devices (``kernels_tp_child.py`` covers int8 and bf16): each device multiplies
# and unpacks its packed shard; prints {case: [relative error, kernel call in the compiled HLO]}
_F16_TP_CHILD = """
import json
import jax
import numpy as np
from aotlm import kernels
from aotlm.core import sharding
from aotlm.models import packing

mesh = sharding.make_mesh(2)
rules = sharding.rules("shard-over-heads", 2)
rng = np.random.default_rng(0)
put = lambda a, leaf: sharding.put(a, sharding.param_sharding(mesh, (leaf,), a.ndim, rules))
out = {"devices": jax.device_count()}
cases = {  # name: (leaf, x shape, logical w shape, axes, nt)
    "column w_up": ("w_up", (1, 1, 40), (40, 64), 1, False),  # 2 panels per device
    "row w_down": ("w_down", (3, 1, 64), (64, 48), 1, False),  # 16 pairs of rows per device: psum
    "row wo": ("wo", (2, 1, 4, 10), (4, 10, 32), 2, False),
    "vocab embed_q": ("embed_q", (5, 34), (96, 34), 1, True),
}
for case, (name, xs, ws, axes, nt) in cases.items():
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal(ws).astype(np.float16)
    wp = packing.prepare(name, w, sharding.param_spec((name,), w.ndim, rules), 2)
    assert packing.is_packed(name, wp.ndim) and wp.dtype == np.float16, case
    pk = packing.packed_k(name, wp.ndim)
    wd, xd = put(wp, name), sharding.put(x, sharding.replicated(mesh))
    fn = jax.jit(lambda x, w: kernels.matmul(x, w, None, axes, name, nt, packed_k=pk))
    with kernels.mesh_context(mesh, sharding.spec_of(rules)):
        compiled = fn.lower(xd, wd).compile()
    y = np.asarray(sharding.fetch(compiled(xd, wd)), np.float64)
    k = int(np.prod(w.shape[1:] if nt else w.shape[:axes]))
    w64 = np.asarray(w, np.float64)
    w64 = w64.reshape(w.shape[0], k).T if nt else w64.reshape(k, -1)
    ref = np.asarray(x, np.float64).reshape(-1, k) @ w64
    err = float(np.abs(y.reshape(ref.shape) - ref).max() / np.abs(ref).max())
    out[case] = [err, "aotlm_wmm_pk" in compiled.as_text()]
    if not nt:  # prefill: each device unpacks its shard to the logical layout, exactly
        conv = jax.jit(lambda w: kernels.convert(w, np.float32, name, packed_k=pk))
        with kernels.mesh_context(mesh, sharding.spec_of(rules)):
            compiled = conv.lower(wd).compile()
        got = np.asarray(sharding.fetch(compiled(wd)))
        bad = float(np.abs(got - np.asarray(w, np.float32)).max())
        out["unpack " + case] = [bad, "aotlm_unpack" in compiled.as_text()]
print(json.dumps(out))
"""


def test_tensor_parallel_f16_panels_in_subprocess():
    """f16 weights in the panel layout on 2 forced devices: column-, row- and vocab-parallel
    matmuls equal float64 NumPy, and each device unpacks its shard to the exact logical f32."""
    flags = "--xla_force_host_platform_device_count=2 " + os.environ.get("AOTLM_TEST_XLA_FLAGS", "")
    env = dict(os.environ, XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run(
        [sys.executable, "-c", _F16_TP_CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out.pop("devices") == 2
    assert len(out) == 7
    for case, (err, in_hlo) in out.items():
        assert in_hlo, f"{case}: no kernel call in the compiled graph"
        if case.startswith("unpack"):
            assert err == 0, f"{case}: max |error| {err}"
        else:
            assert err <= TOL[jnp.float32], f"{case}: relative error {err:.2e}"


@pytest.mark.parametrize("wdt", [jnp.int8, jnp.bfloat16, jnp.float16])
def test_convert_equals_astype(wdt):
    """``convert`` (prefill's whole-matrix conversion) == ``astype`` bit for bit, odd sizes, inf/NaN."""
    rng = np.random.default_rng(4)
    f = jax.jit(kernels.convert, static_argnames=("dtype",))
    for shape in [(1,), (7,), (13, 29), (3, 5, 67), (70001,)]:
        w = np.array(_weights(rng, shape, wdt))
        if wdt != jnp.int8 and w.size > 3:
            w.reshape(-1)[:3] = np.array([np.inf, -np.inf, np.nan], w.dtype)
        for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
            if jnp.dtype(dt) == jnp.dtype(wdt):
                continue
            got = f(jnp.asarray(w), dtype=dt)
            want = jnp.asarray(w).astype(dt)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("bdt", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_attention_bdot_matches_numpy_and_reads_only_the_leading_block(bdt):
    """``bdot``: a [I, M, L] . b[:, :n, :L]^T with b a bigger (cache-like) array, odd sizes."""
    rng = np.random.default_rng(3)
    f = jax.jit(kernels.bdot, static_argnames=("n",))
    shapes = [  # (I, M, L, NB, LB, n): rows of 32..128 elements take the one-row-at-a-time path
        (1, 1, 64, 256, 64, 130),
        (3, 5, 9, 11, 13, 7),
        (24, 2, 37, 40, 37, 40),
        (2, 1, 1, 3, 1, 1),
        (2, 3, 117, 6, 120, 5),  # 96 in blocks of 32, 16 by 8, 5 single; l_limit 39: 32 + 7 single
        (3, 3, 197, 70, 256, 67),  # rows of > 128 (values): 8 blocks of 8 rows + 3 single; n_limit 33
    ]
    for i, m, ll, nb, lb, n in shapes:
        for adt in (jnp.float32, jnp.bfloat16):
            a = jnp.asarray(rng.standard_normal((i, m, ll)), adt)
            b = np.array(jnp.asarray(rng.standard_normal((i, nb, lb)), bdt))
            b[:, n:] = np.nan  # slots past n and columns past L must never be read
            b[:, :, ll:] = np.nan
            c = f(a, jnp.asarray(b), n=n)
            ref = np.einsum("iml,inl->imn", np.asarray(a, np.float64), np.asarray(b[:, :n, :ll], np.float64))
            assert c.shape == (i, m, n) and c.dtype == jnp.float32
            got = np.asarray(c, np.float64)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
            # traced limits: rows j >= n_limit give 0, columns l >= l_limit are never read
            nl, lc = max(1, n // 2), max(1, ll // 3)
            b2 = b.copy()
            b2[:, nl:] = np.nan
            c2 = jax.jit(kernels.bdot, static_argnames=("n",))(a, jnp.asarray(b2), n=n, n_limit=nl)
            want = ref.copy()
            want[:, :, nl:] = 0
            np.testing.assert_allclose(
                np.asarray(c2, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
            )
            b3 = b.copy()
            b3[:, :, lc:] = np.nan
            c3 = f(a, jnp.asarray(b3), n=n, l_limit=jnp.int32(lc))
            a64, b64 = np.asarray(a, np.float64)[..., :lc], np.asarray(b[:, :n, :lc], np.float64)
            np.testing.assert_allclose(
                np.asarray(c3, np.float64), np.einsum("iml,inl->imn", a64, b64), rtol=1e-5, atol=1e-4
            )
            # one limit per row i (serving rows of different lengths): nothing past a row's own is read
            nr, lr = rng.integers(0, n + 1, i), rng.integers(0, ll + 1, i)
            b4 = b.copy()
            for r in range(i):
                b4[r, nr[r] :], b4[r, :, lr[r] :] = np.nan, np.nan
            c4 = f(a, jnp.asarray(b4), n=n, n_limit=jnp.int32(nr), l_limit=jnp.int32(lr))
            for r in range(i):
                a64 = np.asarray(a, np.float64)[r, :, : lr[r]]
                b64 = np.asarray(b[r, : nr[r], : lr[r]], np.float64)
                want = np.zeros((m, n))
                want[:, : nr[r]] = a64 @ b64.T
                np.testing.assert_allclose(np.asarray(c4[r], np.float64), want, rtol=1e-5, atol=1e-4)


def test_decode_graphs_attend_with_the_kernel(llama_path, monkeypatch):
    """Decode graphs attend in one ``aotlm_dattn`` call per layer (prefill keeps XLA's einsum or
    ``aotlm_attn``) and call the sampler's ``aotlm_argmax``; tokens equal the fallback's."""
    _, tok_on, _, m = run_with_kernels(llama_path, monkeypatch, True)
    texts = {k: exe.as_text() for k, exe in m._executables.items()}
    decode = [t for k, t in texts.items() if k[0] == "decode"]
    assert decode and all("aotlm_dattn" in t and "aotlm_argmax" in t for t in decode)
    assert all("aotlm_dattn" not in t for k, t in texts.items() if "prefill" in str(k) and "32" in str(k))
    _, tok_off, _, _ = run_with_kernels(llama_path, monkeypatch, False)
    np.testing.assert_array_equal(tok_on, tok_off)


# ------------------------------------------------------------------ model level
@pytest.mark.parametrize("kw", [{}, {"quant": "int8"}, {"amp": "bf16"}, {"quant": "int8", "amp": "bf16"}])
def test_forced_fallback_gives_identical_greedy_tokens(ckpt_dir, monkeypatch, kw):
    """The peaked checkpoint of test_quant (top-1 margins >= 20% of max|logit|)."""
    path = peaked_checkpoint(ckpt_dir)
    lg_on, tok_on, used_on, m_on = run_with_kernels(path, monkeypatch, True, **kw)
    lg_off, tok_off, used_off, _ = run_with_kernels(path, monkeypatch, False, **kw)
    assert used_on and not used_off
    if kw.get("quant") == "int8":  # prefill reads the packed int8 matrices in a kernel, never unpacked:
        # the row kernel up to ROW_KERNEL_ROWS rows, the GEMM past it
        prefill = [exe.as_text() for k, exe in m_on._executables.items() if "prefill" in str(k)]
        assert prefill and all("aotlm_gemm_pk" in t or "aotlm_wmm_pk" in t for t in prefill)
        assert not any("aotlm_unpack" in t for t in prefill)
    np.testing.assert_array_equal(tok_on, tok_off)
    assert np.abs(lg_on - lg_off).max() <= 1e-2 * np.abs(lg_off).max()


def test_packed_weights_traced_without_kernels_give_identical_tokens(ckpt_dir, monkeypatch):
    """int8 weights packed at load, graphs then traced with the kernels off: XLA's dot reads
    ``packing.unpack``'s logical matrix and the greedy tokens equal the kernels'."""
    path = peaked_checkpoint(ckpt_dir)
    _, tok_on, _, m = run_with_kernels(path, monkeypatch, True, quant="int8")
    layer = m.params["layers"][0]
    assert all(packing.is_packed(k, w.ndim) for k, w in layer.items() if k in packing.PACK_CONTRACT)
    monkeypatch.setenv("AOTLM_KERNELS", "0")
    m._executables.clear()
    m.compile()
    assert not any("aotlm_" in exe.as_text() for exe in m._executables.values())
    np.testing.assert_array_equal(m.sample(PROMPTS, max_new_tokens=16), tok_on)


def test_tied_int8_lm_head_view(gpt2_path, monkeypatch):
    """GPT-2 ties lm_head to the embedding: under int8 the logits read an int8 copy of it."""
    lg32 = run_with_kernels(gpt2_path, monkeypatch, False)[0]
    lg8, _, used, m = run_with_kernels(gpt2_path, monkeypatch, True, quant="int8")
    assert used and m.params["embed_q"].dtype == np.int8 and m.params["embed_q_scale"].shape == (112,)
    assert packing.is_packed("embed_q", m.params["embed_q"].ndim)  # vocab 101 padded to 7 panels of 16
    assert np.abs(lg8 - lg32).max() <= 1e-2 * np.abs(lg32).max()
    lg_off, _, _, m_off = run_with_kernels(gpt2_path, monkeypatch, False, quant="int8")
    assert "embed_q" not in m_off.params  # no kernels: no copy (XLA reads the embedding itself)


@pytest.mark.parametrize(
    "opts",
    [
        pytest.param(["--amp", "bf16"], marks=pytest.mark.slow),  # default run: w8a8 and int8
        ["--quant", "w8a8"],
        ["--quant", "int8", "--context", "48", "--targets"],
    ],
    ids=["bf16", "w8a8", "int8-prefill-kernels"],
)
def test_warm_start_with_kernels_compiles_nothing(llama_path, tmp_path, opts):
    """bf16 weights put kernel calls in every graph, W8A8 GEMM calls in prefill (``gemm.h``), a
    48-token prompt bucket the packed GEMM (96 rows) and the prompt attention (``attn.h``); a new
    process loads them from the cache."""
    args = [str(llama_path), str(tmp_path / "cc"), *opts, "--n-positions", "64"]
    run = lambda: subprocess.run(
        [sys.executable, str(TESTS / "support" / "cache_child.py"), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", AOTLM_KERNELS="1"),
        timeout=600,
    )
    cold, warm = run(), run()
    assert cold.returncode == 0 and warm.returncode == 0, (cold.stderr + warm.stderr)[-3000:]
    cold, warm = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (cold, warm))
    assert not any(cold["hits"]) and all(warm["hits"])
    assert warm["counts"] == {"backend": 0, "lowering": 0, "tracing": 0}
    assert warm["tokens"] == cold["tokens"]
    if "--context" in opts:
        gemm = {"aotlm_gemm_pk", "aotlm_wmm_pk"} & set(cold["targets"])  # int8 rows: VNNI CPUs' row kernel
        assert "aotlm_attn" in cold["targets"] and gemm, cold["targets"]
    manifest = json.loads(next((tmp_path / "cc").glob("*/manifest.json")).read_text())
    assert manifest["fields"]["env"]["kernels"] == kernels.cache_tag() != "off"


def test_argmax_kernel_matches_jnp_argmax():
    """``kernels.argmax`` equals ``jnp.argmax`` on odd widths (1..9, a vocab of 50257), ties (the first
    index wins), all ``-inf`` rows, and NaNs (the first NaN wins, in the vector part or the tail)."""
    rng = np.random.default_rng(6)
    f = jax.jit(kernels.argmax)
    cases = [rng.standard_normal(s).astype(np.float32) for s in ((8, 50257), (3, 1), (2, 7), (5, 8), (4, 9))]
    x = np.full((5, 37), -np.inf, np.float32)
    x[1, [5, 20]] = np.nan  # first NaN in the vector part
    x[2, 36] = np.nan  # in the tail (after 32)
    x[3, [3, 30]] = 1.0  # a tie across lanes and blocks
    x[4, [33, 9]] = 2.0  # a tie between the tail and the vector part
    cases += [x, np.round(rng.standard_normal((6, 300)) * 2).astype(np.float32)]  # many ties
    for x in cases:
        assert kernels.argmax_ok(x)
        got = f(x)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, -1)), err_msg=str(x.shape))


def test_build_hash_covers_every_included_source():
    """A header the build includes but the hash skips would let a stale binary survive its edit
    (epilogue.h and argmax.h once were): every quoted #include, followed from wmatmul.cc, is hashed."""
    src, seen, todo = Path(kernel_build.__file__).parent, set(), ["wmatmul.cc"]
    while todo:
        name = todo.pop()
        if name in seen or not (src / name).exists():  # jaxlib's xla/ffi headers live elsewhere
            continue
        seen.add(name)
        text = (src / name).read_text()
        todo += [line.split('"')[1] for line in text.splitlines() if line.startswith('#include "')]
    assert {"wmatmul.cc", "epilogue.h", "argmax.h", "gemm.h"} <= seen
    assert seen <= set(kernel_build.SOURCES), sorted(seen - set(kernel_build.SOURCES))
