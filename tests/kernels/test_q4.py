"""4-bit weights (``quant="int4"``, ``aotlm.models.quant4``, ``aotlm/kernels/int4.h``): quantization,
the kernel against NumPy on odd shapes (at every ISA level: ``test_isa.VARIANT_TESTS``),
tensor-parallel shards, forced fallback, warm start."""

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
from builders import llama_config, peaked_checkpoint, run_with_kernels, save_checkpoint

from aotlm import kernels
from aotlm.models import k6scales, kscales, lowp, packing, q5scales, quant4
from aotlm.models.quant import INT4_NAMES, QuantizationConfig, quant_config

TESTS = Path(__file__).resolve().parents[1]
needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason="CPU kernels unavailable")


def quantized(rng, k: int, n: int, group: int, asym: bool):
    """Random W [k, n] padded to whole groups / panels -> (packed codes, panel-major scales, dequantized W
    [Kp, Np])."""
    kp, np_ = -(-k // group) * group, -(-n // 16) * 16
    w = np.zeros((kp, np_), np.float32)
    w[:k, :n] = rng.standard_normal((k, n)) * rng.uniform(0.2, 2.0, (1, n))
    codes, sm = quant4.quantize_int4(w, (0,), group, asym)
    s = sm[:, 0].astype(np.float32)[:, None, :]
    m = sm[:, 1].astype(np.float32)[:, None, :] if asym else -8.0 * s
    deq = (codes.reshape(kp // group, group, np_) * s + m).reshape(kp, np_)
    return packing.pack_q4(codes, (0,)), packing.pack_scales(sm), deq


def quantized_k(rng, k: int, n: int):
    """Random Q4_K-style W [k, n] (k: whole blocks of 256) in the K form (``models.kscales``): its
    codes, uint8 scales (panel-major) and the dequantized W [k, Np], exactly as gguf-py computes Q4_K
    values."""
    np_ = -(-n // 16) * 16
    codes = rng.integers(0, 16, (k, np_)).astype(np.uint8)
    sc, mb = (rng.integers(0, 64, (k // 32, np_)).astype(np.uint8) for _ in range(2))
    d, dmin = ((rng.standard_normal((k // 256, np_)) * 0.01).astype(np.float16) for _ in range(2))
    s = np.repeat(d.astype(np.float32), 8, 0) * sc
    m = -(np.repeat(dmin.astype(np.float32), 8, 0) * mb)
    deq = codes * np.repeat(s, 32, 0) + np.repeat(m, 32, 0)
    deq[:, n:] = 0.0  # padded columns: zero scales
    sc[:, n:], mb[:, n:] = 0, 0
    return packing.pack_q4(codes, (0,)), packing.pack_scales(kscales.pack(sc, mb, d, dmin)), deq


def quantized_k5(rng, k: int, n: int):
    """Random Q5_K-style W [k, n]: ``quantized_k``'s scales with 5-bit codes (``kscales.pack5``)."""
    np_ = -(-n // 16) * 16
    codes = rng.integers(0, 32, (k, np_)).astype(np.uint8)
    sc, mb = (rng.integers(0, 64, (k // 32, np_)).astype(np.uint8) for _ in range(2))
    d, dmin = ((rng.standard_normal((k // 256, np_)) * 0.01).astype(np.float16) for _ in range(2))
    sc[:, n:], mb[:, n:] = 0, 0
    s = np.repeat(d.astype(np.float32), 8, 0) * sc
    m = -(np.repeat(dmin.astype(np.float32), 8, 0) * mb)
    deq = codes * np.repeat(s, 32, 0) + np.repeat(m, 32, 0)
    low, leaf = kscales.pack5(codes, kscales.pack(sc, mb, d, dmin))
    return packing.pack_q4(low, (0,)), packing.pack_scales(leaf), deq


def quantized_k6(rng, k: int, n: int):
    """Random Q6_K-style W [k, n] (k: whole blocks of 256) in the K6 form (``models.k6scales``): its low
    codes packed, its uint8 scale leaf (panel-major) and the dequantized W [k, Np], as gguf-py computes
    Q6_K values."""
    np_ = -(-n // 16) * 16
    codes = rng.integers(0, 64, (k, np_)).astype(np.uint8)
    sc = rng.integers(-128, 128, (k // 16, np_)).astype(np.int8)
    d = (rng.standard_normal((k // 256, np_)) * 0.01).astype(np.float16)
    sc[:, n:] = 0  # padded columns: zero scales
    s = np.repeat(d.astype(np.float32), 16, 0) * sc.astype(np.float32)
    deq = (codes.astype(np.float32) - 32) * np.repeat(s, 16, 0)
    low, leaf = k6scales.pack(codes, sc, d)
    return packing.pack_q4(low, (0,)), packing.pack_scales(leaf), deq


def quantized_q5(rng, k: int, n: int, asym: bool):
    """Random Q5_0 / Q5_1-style W [k, n] (k: whole groups of 32) in the Q5 form (``models.q5scales``): f16
    ``d`` (and ``m``) per 32 rows, 5-bit codes, as gguf-py computes Q5_0 / Q5_1 values."""
    np_ = -(-n // 16) * 16
    codes = rng.integers(0, 32, (k, np_)).astype(np.uint8)
    d = (rng.standard_normal((k // 32, np_)) * 0.01).astype(np.float16)
    m = (rng.standard_normal((k // 32, np_)) * 0.1).astype(np.float16) if asym else None
    d[:, n:] = 0  # padded columns: zero scales
    if m is not None:
        m[:, n:] = 0
    low_m = -16.0 * d.astype(np.float32) if m is None else m.astype(np.float32)
    deq = codes * np.repeat(d.astype(np.float32), 32, 0) + np.repeat(low_m, 32, 0)
    low, leaf = q5scales.pack(codes, d, m)
    return packing.pack_q4(low, (0,)), packing.pack_scales(leaf), deq


def round_x(x: np.ndarray, group: int, top: int = 127) -> np.ndarray:
    """NumPy reference of the kernel's activations: int8 per row and group, scale max|x| / 127 (``top``
    32639: the int16 value two int8 digits hold)."""
    m, k = x.shape
    kp = -(-k // group) * group
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    xg = xp.reshape(m, -1, group)
    s = np.abs(xg).max(-1, keepdims=True) / np.float32(top)
    inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s > 0)
    return (np.rint(xg * inv) * s).reshape(m, kp)


def round_parts(x: np.ndarray, group: int, parts: int) -> np.ndarray:
    """The kernel's activations in ``parts``: ``round_x``, plus what the parts before left rounded the same
    way (each product ``s * q`` rounded to f32 first, as the kernel and XLA do); 2: two int8 digits of one
    int16 value per entry instead."""
    if parts == 2:
        return round_x(x, group, 32639)
    xr = round_x(x, group)
    left, part = np.pad(x, ((0, 0), (0, xr.shape[1] - x.shape[1]))), xr
    for _ in range(parts - 1):
        left = left - part
        part = round_x(left, group)
        xr = xr + part
    return xr


def kernel(x, w, sm, n: int, group: int, parts: int = 1):
    kernels.ensure_registered()
    out = jax.ShapeDtypeStruct((x.shape[0], n), x.dtype)
    call = jax.ffi.ffi_call("aotlm_wmm_q4", out)
    none, every = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int8)  # no bias; every row live
    attrs = dict(group=np.int32(group), act=np.int32(0), parts=np.int32(parts))
    return jax.jit(lambda a, b, c: call(a, b, c, none, every, **attrs))(x, w, sm)


def check_odd_shapes(seed: int = 0) -> float:
    """Largest relative error of the kernel against NumPy over odd shapes, rows 1..100, every group
    size, symmetric and asymmetric, x in one int8 part and in three (``parts``; also run in a child
    process per ISA level)."""
    rng, worst = np.random.default_rng(seed), 0.0
    cases = [(100, 37, 32, False), (72, 16, 32, True), (200, 50, 64, True), (130, 129, 128, False)]
    cases += [(8, 5, 32, True), (512, 37, "K", True), (256, 50, "K", True)]  # K: Q4_K's own scales
    cases += [(32, 5125, 32, True), (256, 5125, "K", True)]  # wide N: long panel ranges per thread
    cases += [(512, 37, "K6", False), (256, 5125, "K6", False)]  # Q6_K's 6-bit codes and own scales
    cases += [(512, 37, "K5", True), (256, 5125, "K5", True)]  # Q5_K's 5-bit codes, Q4_K's scales
    cases += [(160, 37, "Q5", False), (96, 5125, "Q5", True), (640, 50, "Q5", True)]  # Q5_0 / Q5_1's own
    made = {"K": quantized_k, "K5": quantized_k5, "K6": quantized_k6}
    for k, n, group, asym in cases:
        if group == "Q5":
            w, sm, deq = quantized_q5(rng, k, n, asym)
        else:
            w, sm, deq = made[group](rng, k, n) if group in made else quantized(rng, k, n, group, asym)
        group = {"K": 32, "K5": 32, "K6": 16, "Q5": 32}.get(group, group)
        for m, parts in [(m, r) for m in (1, 2, 3, 7, 9, 16, 17, 64, 100) for r in (1, 2, 3)]:
            x = rng.standard_normal((m, k)).astype(np.float32)
            ref = round_parts(x, group, parts).astype(np.float64) @ deq.astype(np.float64)
            y = np.asarray(
                kernel(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sm), n, group, parts), np.float64
            )
            worst = max(worst, float(np.abs(y - ref[:, :n]).max() / np.abs(ref).max()))
    return worst


# ------------------------------------------------------------------ quantization
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", quant4.GROUPS)
def test_round_to_nearest_within_half_a_step(group, asym):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 48)).astype(np.float32)
    w[:group, 0] = 0.0  # an all-zero group: scale 0, every code the zero point
    codes, sm = quant4.quantize_int4(w, (0,), group, asym)
    assert codes.dtype == np.uint8 and codes.shape == w.shape and codes.max() <= 15
    assert sm.dtype == np.float16 and sm.shape == (256 // group, 2 if asym else 1, 48)
    s = sm[:, 0].astype(np.float32)[:, None, :]
    m = sm[:, 1].astype(np.float32)[:, None, :] if asym else -8.0 * s
    deq = codes.reshape(-1, group, 48) * s + m
    err, step = np.abs(deq - w.reshape(-1, group, 48)), np.abs(s) * (1 + 1e-3) + 1e-6
    # round to nearest of the stored f16 scale; symmetric: -a (a the largest magnitude) clips to 7 s
    clipped = (codes.reshape(-1, group, 48) == 15) & (not asym)
    assert (err <= np.where(clipped, step, 0.5 * step)).all()
    assert (deq[0, :, 0] == 0).all() and (sm[0, 0, 0] == 0)


def test_config_names_and_refusals():
    assert quant_config("int4") == QuantizationConfig("int4", group_size=32, asymmetric=False)
    assert quant_config("int4-g128-asym").label == "int4-g128-asym" and len(INT4_NAMES) == 24
    assert quant_config("int4-asym-a16") == QuantizationConfig("int4", asymmetric=True, activations="s16")
    assert quant_config("int4-g64-a16").label == "int4-g64-a16"
    assert quant_config("int4-asym-f32a") == QuantizationConfig("int4", asymmetric=True, activations="f32")
    assert quant_config("int4-g64-f32a").label == "int4-g64-f32a"
    for x in ("s16", "f32"):
        with pytest.raises(ValueError, match="'s16' or 'f32' with int4"):
            QuantizationConfig("s8", activations=x)
    assert quant_config("int4-g32") == quant_config("int4")
    with pytest.raises(ValueError, match="group_size=48"):
        QuantizationConfig("int4", group_size=48)
    with pytest.raises(ValueError, match="int4"):
        quant_config("int4-g16")


def test_packed_layout_round_trips_through_the_xla_unpack():
    """``pack_q4`` then ``quant4.codes`` (the fallback's unpack) gives the logical codes back, for a
    multi-dim contraction ([H, Dh, D], as ``wo``)."""
    codes = np.random.default_rng(2).integers(0, 16, (4, 16, 32), dtype=np.uint8)
    packed = packing.pack_q4(codes, (0, 1))
    assert packed.shape == (2, 4, 2, 16, 4) and packing.is_packed("wo", packed.ndim)
    back = np.asarray(quant4.codes(jnp.asarray(packed), "wo"))
    np.testing.assert_array_equal(back, codes.astype(np.float32))


def test_scales_pack_panel_major_and_round_trip():
    """``pack_scales``: ``[G, S, *Nd]`` -> ``[*Nd[:-1], Nd[-1] / 16, G, S, 16]`` (each panel's scales in a
    row), its inverse for numpy and jnp, and the logical axes a packed leaf shards by (``wq``: Nd = [H,
    Dh])."""
    sm = np.random.default_rng(6).standard_normal((4, 2, 3, 32)).astype(np.float16)
    packed = packing.pack_scales(sm)
    assert packed.shape == (3, 2, 4, 2, 16)
    np.testing.assert_array_equal(packed[1, 1, 2, 0], sm[2, 0, 1, 16:])
    np.testing.assert_array_equal(packing.unpack_scales(packed, 2), sm)
    np.testing.assert_array_equal(np.asarray(packing.unpack_scales(jnp.asarray(packed), 2)), sm)
    assert packing.unpack_scales(sm, 2) is sm  # logical: as it is
    logical = packing.logical_axes(("wq_scale",), sm.ndim)
    assert packing.logical_axes(("wq_scale",), packed.ndim) == (*logical[2:], logical[0], None, None)


# ------------------------------------------------------------------ kernel
@needs_kernels
def test_kernel_matches_numpy_on_odd_shapes():
    assert check_odd_shapes() < 2e-6


@needs_kernels
def test_prefill_rows_get_the_bits_of_decode_rows():
    """A call of more than 16 rows (prefill: the prompt tiles of AVX-512 builds) gives every row exactly
    what calls of at most 7 rows (decode) give it: exact int32 group sums and the same f32 flush per
    group, so how many rows share a call never changes a token. Also for the GGUF K forms (Q4_K's own
    scales, Q5_K's and Q6_K's high bits) and Q5_0's / Q5_1's own scales and high bits."""
    rng = np.random.default_rng(5)
    q5 = lambda asym: lambda *a: quantized_q5(*a, asym)  # noqa: E731
    made = {"K": (quantized_k, 32), "K5": (quantized_k5, 32), "K6": (quantized_k6, 16)}
    made |= {"Q50": (q5(False), 32), "Q51": (q5(True), 32)}
    for k, n, group, asym in [
        (100, 37, 32, False),
        (200, 50, 64, True),
        (130, 129, 128, False),
        (32, 5125, 32, True),
        (40, 37, 8, False),  # a group the tiles do not take: the row kernels at every count
        (512, 37, "K", True),
        (256, 50, "K5", True),
        (512, 40, "K6", False),
        (160, 37, "Q50", False),
        (96, 50, "Q51", True),
    ]:
        if group in made:
            fn, group = made[group]
            w, sm, _ = fn(rng, k, n)
        else:
            w, sm, _ = quantized(rng, k, n, group, asym)
        w, sm = jnp.asarray(w), jnp.asarray(sm)
        for m, r in [(m, r) for m in (17, 40, 100) for r in (1, 2, 3)]:
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            whole = np.asarray(kernel(x, w, sm, n, group, r))
            parts = [kernel(x[i : i + 7], w, sm, n, group, r) for i in range(0, m, 7)]
            err = str((k, n, group, asym, m, r))
            np.testing.assert_array_equal(whole, np.concatenate(parts), err_msg=err)


@needs_kernels
def test_three_parts_of_x_give_f32_precision_on_the_kernel_and_xla(monkeypatch):
    """x in three int8 parts (``quant="int4-f32a"``): the product within f32-like error of the exact one,
    where x rounded to int8 once (llama.cpp's) is ~1000x further and int16 in two digits (``"int4-a16"``)
    ~100x; so is XLA's path (``dense4`` under ``lowp.activations``, kernels off; its scales ``max|x| *
    (1 / 127)`` can flip a rounding against the kernel's)."""
    rng = np.random.default_rng(8)
    w, sm, deq = quantized(rng, 256, 96, 32, True)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    exact = x.astype(np.float64) @ deq.astype(np.float64)
    err = {}
    for r in (1, 2, 3):
        y = np.asarray(kernel(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sm), 96, 32, r), np.float64)
        err[r] = np.abs(y - exact).max() / np.abs(exact).max()
    assert err[3] < 2e-6 and err[2] > 10 * err[3] and err[1] > 50 * err[2], err
    wl, supported = jnp.asarray(w.reshape(6, 32, 16, 4)), kernels.q4_supported
    for kind, r in (("s16", 2), ("f32", 3)):
        monkeypatch.setattr(kernels, "q4_supported", supported)
        with lowp.activations(kind):
            on = np.asarray(quant4.dense4(jnp.asarray(x), wl, jnp.asarray(sm), 1, "w_up"), np.float64)
            monkeypatch.setattr(kernels, "q4_supported", lambda *a: False)
            off = np.asarray(quant4.dense4(jnp.asarray(x), wl, jnp.asarray(sm), 1, "w_up"), np.float64)
        for y in (on, off):
            assert np.abs(y - exact).max() < (2 * err[r] + 2e-6) * np.abs(exact).max(), (kind, err)
        assert np.abs(on - off).max() < 2e-6 * np.abs(exact).max(), kind  # the same rounding of x


@needs_kernels
def test_kernel_rows_with_inf_or_nan_give_nan_only_in_their_own_outputs():
    """x's int8 rounding per group (8 lanes and a scalar tail): a row holding inf / NaN (in either part)
    comes out all NaN, the other rows as without it."""
    rng = np.random.default_rng(4)
    w, sm, _ = quantized(rng, 100, 37, 32, False)
    x = rng.standard_normal((4, 100)).astype(np.float32)
    clean = np.asarray(kernel(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sm), 37, 32))
    x[1, 99], x[2, 5] = np.inf, np.nan
    got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sm), 37, 32))
    assert np.isnan(got[1:3]).all() and np.array_equal(got[[0, 3]], clean[[0, 3]])


@needs_kernels
def test_unpack_kernel_gives_the_dequantized_matrix():
    w, sm, deq = quantized(np.random.default_rng(3), 96, 40, 32, True)
    y = kernels.unpack_q4(jnp.asarray(w.reshape(3, 12, 16, 4)), jnp.asarray(sm), jnp.float32, 1)
    np.testing.assert_array_equal(np.asarray(y), deq)
    q50, q51 = (lambda r, k, n, a=a: quantized_q5(r, k, n, a) for a in (False, True))
    for made in (quantized_k, quantized_k5, quantized_k6, q50, q51):  # the K / Q5 forms: exact too
        w, sm, deq = made(np.random.default_rng(4), 512, 40)
        y = kernels.unpack_q4(jnp.asarray(w.reshape(3, 64, 16, 4)), jnp.asarray(sm), jnp.float32, 1)
        np.testing.assert_array_equal(np.asarray(y), deq, err_msg=made.__name__)
        xla = quant4.dequantize(jnp.asarray(w.reshape(3, 64, 16, 4)), jnp.asarray(sm), "w_up")  # XLA's path
        np.testing.assert_array_equal(np.asarray(xla), deq, err_msg=made.__name__)


def test_q4k_scales_round_trip():
    """``kscales``: the XLA path's scales are the file's ``d * sc`` / ``-dmin * mb`` exactly, the f16 form
    (a tp shard that splits a block) rounds them, and a shape that does not fit is refused."""
    w, sm, deq = quantized_k(np.random.default_rng(5), 512, 32)
    xla = np.asarray(quant4.dequantize(jnp.asarray(w.reshape(2, 64, 16, 4)), jnp.asarray(sm), "w_up"))
    np.testing.assert_array_equal(xla, deq)
    sm = np.asarray(packing.unpack_scales(sm, 1))  # the logical [K / 256, 20, N]
    s, m = (np.asarray(a) for a in kscales.parts(jnp.asarray(sm)))
    f16 = kscales.to_groups(sm)
    assert f16.shape == (16, 2, 32) and f16.dtype == np.float16
    np.testing.assert_array_equal(f16[:, 0], s.astype(np.float16))
    np.testing.assert_array_equal(f16[:, 1], m.astype(np.float16))
    with pytest.raises(ValueError, match="do not fit"):
        kscales.pack(
            np.zeros((8, 4), np.uint8), np.zeros((8, 4), np.uint8), np.zeros((2, 4)), np.zeros((2, 4))
        )
    with pytest.raises(ValueError, match="split a block"):
        kernels.q4_group(384, sm[:1], 1)


# ------------------------------------------------------------------ models
@needs_kernels
@pytest.mark.parametrize("quant", [pytest.param("int4", marks=pytest.mark.slow), "int4-g64-asym"])
def test_forced_fallback_gives_identical_greedy_tokens(ckpt_dir, monkeypatch, quant):
    """The peaked Llama: the kernel's tokens equal the XLA fallback's (dequantized W, x rounded per
    group); under g64 its MLP's 96-row down projection does not fit whole groups and stays int8."""
    path = peaked_checkpoint(ckpt_dir)
    lg_on, tok_on, _, m_on = run_with_kernels(path, monkeypatch, True, quant=quant)
    lg_off, tok_off, _, m_off = run_with_kernels(path, monkeypatch, False, quant=quant)
    layer = m_on.params["layers"][0]
    assert layer["wq"].dtype == np.uint8 and m_off.params["layers"][0]["wq"].shape == layer["wq"].shape
    assert layer["w_down"].dtype == (np.int8 if quant == "int4-g64-asym" else np.uint8)
    texts = [exe.as_text() for k, exe in m_on._executables.items() if k[0] in ("prefill", "decode")]
    assert texts and all("aotlm_wmm_q4" in t for t in texts)
    assert not any("aotlm_wmm_q4" in exe.as_text() for exe in m_off._executables.values())
    np.testing.assert_array_equal(tok_on, tok_off)
    tol = 1e-4 if quant == "int4" else 1e-2  # the int8 down projection: x as int16 in the kernel only
    assert np.abs(lg_on - lg_off).max() <= tol * np.abs(lg_off).max()
    lg32 = run_with_kernels(path, monkeypatch, True)[0]
    assert np.abs(lg_on - lg32).max() <= 0.15 * np.abs(lg32).max()


@needs_kernels
def test_tied_lm_head_copy_is_int4_with_a_padded_vocab(gpt2_path, monkeypatch):
    lg, _, _, m = run_with_kernels(gpt2_path, monkeypatch, True, quant="int4")
    assert m.params["embed_q"].dtype == np.uint8 and m.params["embed_q_scale"].shape == (7, 2, 1, 16)
    assert m.params["embed_q_scale"].dtype == np.float16
    lg_off = run_with_kernels(gpt2_path, monkeypatch, False, quant="int4")[0]
    assert np.abs(lg - lg_off).max() <= 1e-4 * np.abs(lg_off).max()


TP_CHILD = """
import json, sys
import numpy as np
from aotlm import AutoModelForSampling
from builders import PROMPTS
out = {}
for tp in (1, 2):
    m = AutoModelForSampling.from_pretrained(sys.argv[1], batch_size=2, n_positions=32,
        context_length_estimate=32, compile_cache=False, quant="int4", tp_degree=tp)
    m.compile()
    out[tp] = {"tokens": np.asarray(m.sample(PROMPTS, max_new_tokens=12)).tolist(),
               "logits": np.asarray(m.forward(PROMPTS)).tolist(),
               "q4": all("aotlm_wmm_q4" in e.as_text() for k, e in m._executables.items()
                         if k[0] != "select")}
try:
    AutoModelForSampling.from_pretrained(sys.argv[2], batch_size=1, n_positions=32, compile_cache=False,
                                         quant="int4", tp_degree=2)
except ValueError as e:
    out["refusal"] = str(e)
print(json.dumps(out))
"""


@needs_kernels
def test_tensor_parallel_shards_in_subprocess(ckpt_dir):
    """tp=2 (row- and column-parallel 4-bit shards, scales split with their groups) gives tp=1's
    tokens; an MLP of 96 units (3 groups of 32) cannot split over 2 devices: one clear line."""
    path = save_checkpoint(ckpt_dir / "q4_tp", llama_config(intermediate_size=128), seed=0, peaked=True)
    odd = peaked_checkpoint(ckpt_dir)
    flags = "--xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=str(TESTS / "support"))
    cmd = [sys.executable, "-c", TP_CHILD, str(path), str(odd)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["1"]["q4"] and out["2"]["q4"]
    assert out["1"]["tokens"] == out["2"]["tokens"]
    a, b = np.asarray(out["1"]["logits"]), np.asarray(out["2"]["logits"])
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    assert "groups of weights do not split over tp=2" in out["refusal"]


@needs_kernels
def test_warm_start_compiles_nothing(llama_path, tmp_path):
    args = [str(llama_path), str(tmp_path / "cc"), "--quant", "int4", "--n-positions", "64"]
    args += ["--context", "48"]
    run = lambda: subprocess.run(
        [sys.executable, str(TESTS / "support" / "cache_child.py"), *args, "--targets"],
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
    assert warm["tokens"] == cold["tokens"] and "aotlm_wmm_q4" in cold["targets"]
