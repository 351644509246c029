"""The fused decode-attention kernel (``kernels.decode_attention``, ``dattn.h``) against NumPy.

One query token per row, grouped-query heads, a cache bigger than the call (more rows, more slots),
per-row slot limits, holes in the mask (padding slots, a sliding window), rows whose own token is
hidden (finished serving rows) or that see nothing at all, and f32 / bf16 (as its bits) / f16
caches; head shapes that take the avx512 builds' G-query loops (``dattn512.h``) and ones that do
not. Slots past a row's limit and rows past the call hold NaN: reading one would show."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aotlm import kernels

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="aotlm kernels unavailable on this machine")


def _reference(q, keys, values, k_new, v_new, mask, lim, scale):
    """float64 softmax attention of each (row, kv head) over its visible slots and its own token."""
    i_n, g_n, dh = q.shape
    out = np.zeros((i_n, g_n, dh))
    kh = i_n // mask.shape[0]
    w = mask.shape[1] - 1
    for i in range(i_n):
        b, n = i // kh, min(int(lim[i]), w)
        vis = np.concatenate([mask[b, :n], mask[b, w:]])
        ks = np.concatenate([keys[i, :n], k_new[i][None]])[vis]
        vs = np.concatenate([values[i, :, :n].T, v_new[i][None]])[vis]
        if not vis.any():
            continue
        s = scale * q[i] @ ks.T
        p = np.exp(s - s.max(-1, keepdims=True))
        out[i] = (p / p.sum(-1, keepdims=True)) @ vs
    return out


@pytest.mark.parametrize("cdt", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "b, kh, g, dh, s, w",
    [
        (1, 3, 3, 64, 256, 256),
        (3, 2, 1, 40, 300, 271),
        (5, 1, 4, 17, 160, 144),
        (2, 4, 2, 8, 9, 9),
        (4, 2, 4, 128, 200, 197),  # avx512 builds: the G-query loops (G <= 4, Dh % 16 == 0) ...
        (3, 2, 2, 16, 40, 37),
        (3, 1, 5, 32, 70, 33),  # ... and G = 5, which they leave to bdot.h's dots
    ],
)
def test_decode_attention_matches_numpy(cdt, b, kh, g, dh, s, w):
    rng = np.random.default_rng(b * 100 + dh)
    i_n, rows = b * kh, b + 1  # the cache holds one row more than the call
    q = rng.standard_normal((i_n, g, dh)).astype(np.float32)
    keys = np.asarray(jnp.asarray(rng.standard_normal((rows * kh, s, dh)), cdt))
    values = np.asarray(jnp.asarray(rng.standard_normal((rows * kh, dh, s)), cdt))
    k_new, v_new = (rng.standard_normal((i_n, dh)).astype(np.float32) for _ in range(2))
    lim = rng.integers(0, w + 1, b).repeat(kh)
    lim[:kh] = w  # the first row sees its whole window
    if b > 2:
        lim[kh : 2 * kh] = 0  # a row with nothing in the cache
    mask = np.ones((b, w + 1), bool)
    mask[:, :w] &= rng.random((b, w)) > 0.1  # padding slots
    mask[0, : w // 3] = False  # a sliding window
    if b > 1:
        mask[-1, w] = False  # a finished row: its own token hidden
    if b > 2:
        mask[1, w] = False  # ... and nothing else either: zeros
    kn, vn = keys.astype(np.float32).copy(), values.astype(np.float32).copy()
    for i in range(rows * kh):
        n = lim[i] if i < i_n else 0
        kn[i, n:], vn[i, :, n:] = np.nan, np.nan
    want = _reference(q, kn, vn, k_new, v_new, mask, lim, 0.125)
    as_c = lambda x: jnp.asarray(x, cdt)
    if cdt == jnp.bfloat16:  # how the models store a bf16 cache: its bits
        as_c = lambda x: jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16)
    f = jax.jit(lambda *a: kernels.decode_attention(*a, scale=0.125))
    got = np.asarray(f(q, as_c(kn), as_c(vn), k_new, v_new, mask, jnp.asarray(lim, jnp.int32)))
    assert got.shape == (i_n, g, dh) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    if b > 2:
        assert not got[kh : 2 * kh].any()  # the row that sees nothing
