"""Decode rows' products on a GPU: a Pallas kernel (Triton lowering) for bf16 / f16, int8 and fp8 weights.

On one H200, XLA's step for Llama-3.2-1B's shape read its weights at under half the HBM bandwidth
(cuBLAS / XLA GEMVs), and int8 weights decoded slower than bf16: ``w.astype(bf16)`` before the dot can
make a step read a converted copy. Here every tile of the stored matrix is loaded once and (int8)
converted in registers: ``y = (x @ w) * scale`` with ``x [..., K]`` bf16 / f16, ``w`` ``[K, N]`` (or
``[N, K]`` with ``nt``: a tied lm_head's table or its int8 copy ``embed_q``) in x's dtype (no scale) or
int8 with the per-output-channel ``scale [N]``, or e4m3 (``quant="fp8"``, with its scale) times x's rows
already rounded to e4m3 (both widened to bf16 in registers: exact products); summed in float32. The
rows (at most ``MAX_ROWS``: decode batches) are padded to a power of two of at least 16 (Triton's
smallest dot); the grid is ``N / bn`` column blocks times ``splits`` slices of K, each program looping
over its slice in steps of ``bk`` rows; the slices' float32 partial sums are added by XLA in a fixed order
(deterministic, unlike atomics).

Off by default: ``AOTLM_GPU_MATMUL=pallas`` turns it on (``pallas:bn=64,bk=128,splits=2,warps=4,stages=3``
fixes the tiles, else ``tiles`` picks them); it is part of the compile-cache key (``cache_tag``). On CPU
the kernel runs in Pallas' interpreter for the tests, and its lowering for ``cuda`` (Triton IR, no GPU
needed) is checked there too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from aotlm.kernels.context import one_device

ENV = "AOTLM_GPU_MATMUL"
MAX_ROWS = 64  # decode rows (batch x tokens per step); prefill keeps XLA's dot
X_DTYPES = (jnp.bfloat16, jnp.float16)  # f32 x keeps XLA's dot at HIGHEST precision (exact)
F8 = jnp.dtype(jnp.float8_e4m3fn)  # fp8 x fp8 (aotlm.models.quant_fp8): both widened to bf16 in the kernel
SCALED = (jnp.dtype(jnp.int8), F8)  # weights stored with a per-output-channel scale
TARGET_PROGRAMS = 264  # two per SM of an H100 / H200 (132 SMs)
MIN_PROGRAMS = 32
INTERPRET = False  # tests on CPU: run the kernel in Pallas' interpreter


@dataclass(frozen=True)
class Tiles:
    """A kernel configuration: columns per program, K rows per step, K slices, Triton warps / stages."""

    bn: int
    bk: int
    splits: int = 1
    warps: int = 4
    stages: int = 3


def parse_setting(env: str, cls: type, example: str):
    """A Pallas kernel's switch ``env``: ``"xla"`` (unset: the default), ``"pallas"`` or ``pallas:k=v,...``
    as a ``cls`` (fields by name, ints; not yet range-checked); one line naming ``example`` otherwise."""
    raw = os.environ.get(env, "").strip()
    if raw in ("", "xla", "pallas"):
        return raw or "xla"
    head, _, rest = raw.partition(":")
    try:
        if head != "pallas" or not rest:
            raise ValueError
        fields = dict(kv.split("=") for kv in rest.split(","))
        if not fields.keys() <= {f.name for f in dataclasses.fields(cls)}:
            raise ValueError
        return cls(**{k: int(v) for k, v in fields.items()})
    except (ValueError, TypeError):
        raise ValueError(f"{env}={raw!r}: give xla, pallas or {example}") from None


def setting_tag(s) -> str:
    """A switch's compile-cache key field: ``"xla"``, ``"pallas"`` or ``pallas-<fields>``."""
    return s if isinstance(s, str) else "pallas-" + "-".join(str(v) for v in dataclasses.astuple(s))


def setting() -> Tiles | str:
    """``AOTLM_GPU_MATMUL``: ``"xla"`` (the default), ``"pallas"`` (tiles per shape) or fixed ``Tiles``."""
    tiles = parse_setting(
        ENV, Tiles, "pallas:bn=64,bk=128,splits=1,warps=4,stages=3 (powers of two, bn and bk >= 16)"
    )
    if isinstance(tiles, str):
        return tiles
    sizes = (tiles.bn, tiles.bk, tiles.splits, tiles.warps)
    if not all(pow2(v) for v in sizes) or min(tiles.bn, tiles.bk) < 16 or tiles.stages < 1:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r}: bn, bk, splits and warps must be powers of two, bn and bk >= 16"
        )
    return tiles


def on_gpu() -> bool:
    """Whether graphs traced now are for a GPU (jax's default backend)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def head_copy(quant) -> bool:
    """Whether a tied lm_head gets its int8 copy of the embedding (``embed_q``, per vocab row) for the
    kernel: int8 weights (``quant_dtype="s8"`` / ``"int8"``) on a GPU with the kernel switched on."""
    return quant is not None and quant.quant_dtype in ("s8", "int8") and setting() != "xla" and on_gpu()


def cache_tag() -> str:
    """Compile-cache key field: graphs with the Pallas kernel (and its tiles) differ from XLA's."""
    return setting_tag(setting())


def pow2(n: int) -> bool:
    """Whether ``n`` is a power of two (Triton's block sizes)."""
    return n > 0 and n & (n - 1) == 0


def padded_rows(m: int) -> int:
    """Rows the kernel computes for ``m`` rows of x: a power of two, at least 16."""
    return max(16, 1 << (m - 1).bit_length())


def tiles(mp: int, k: int, n: int) -> Tiles | None:
    """A configuration for ``mp`` (padded) rows x ``[K, N]``; None where no power-of-two tile divides.

    64 columns a program (32 / 16 where N needs), 128-row steps of K (64 / 32 / 16 where K needs); K
    split in two while the grid has fewer than ``TARGET_PROGRAMS`` programs and the slices' partial
    sums (4 bytes x splits x mp x N) stay within 1/8 of the weight's bytes; then narrower columns while
    there are fewer than ``MIN_PROGRAMS``.
    """
    bn = next((b for b in (64, 32, 16) if n % b == 0), None)
    bk = next((b for b in (128, 64, 32, 16) if k % b == 0), None)
    if bn is None or bk is None:
        return None
    splits = 1
    while (n // bn) * splits < TARGET_PROGRAMS and (k // bk) % (2 * splits) == 0:
        if 4 * 2 * splits * mp * 8 > k:  # the partial sums would pass 1/8 of the weight's bytes
            break
        splits *= 2
    while (n // bn) * splits < MIN_PROGRAMS and bn > 16 and n % (bn // 2) == 0:  # narrower columns
        bn //= 2
    return Tiles(bn, bk, splits)


def _fits(t: Tiles, mp: int, k: int, n: int) -> bool:
    return n % t.bn == 0 and k % (t.bk * t.splits) == 0


def _kernel(x_ref, w_ref, o_ref, *, pl, bk: int, steps: int, nt: bool):
    """One program: rows x one column block, summed over one K slice in steps of ``bk`` (``pl``: Pallas)."""
    mp, bn = x_ref.shape[0], w_ref.shape[0 if nt else 1]

    def step(i, acc):
        ks = pl.ds(pl.multiple_of(i * bk, bk), bk)
        xa = x_ref[:, ks]
        xa = xa.astype(jnp.bfloat16) if xa.dtype == F8 else xa
        wa = (w_ref[:, ks] if nt else w_ref[ks, :]).astype(xa.dtype)
        dims = (((1,), (1 if nt else 0,)), ((), ()))
        return acc + jax.lax.dot_general(xa, wa, dims, preferred_element_type=jnp.float32)

    o_ref[0] = jax.lax.fori_loop(0, steps, step, jnp.zeros((mp, bn), jnp.float32))


@functools.lru_cache(maxsize=1)
def _pallas():
    from jax.experimental import pallas  # local: imported only where the kernel is traced (~0.1 s)
    from jax.experimental.pallas import triton  # local: as pallas

    return pallas, triton


def _call(x2, w2, t: Tiles, nt: bool, interpret: bool):
    """``x2 [mp, K] @ w2`` -> ``[splits, mp, N]`` float32 partial sums."""
    pl, triton = _pallas()
    mp, k = x2.shape
    n = w2.shape[0] if nt else w2.shape[1]
    ks = k // t.splits
    w_spec = (
        pl.BlockSpec((t.bn, ks), lambda j, s: (j, s)) if nt else pl.BlockSpec((ks, t.bn), lambda j, s: (s, j))
    )
    return pl.pallas_call(
        functools.partial(_kernel, pl=pl, bk=t.bk, steps=ks // t.bk, nt=nt),
        out_shape=jax.ShapeDtypeStruct((t.splits, mp, n), jnp.float32),
        grid=(n // t.bn, t.splits),
        in_specs=[pl.BlockSpec((mp, ks), lambda j, s: (0, s)), w_spec],
        out_specs=pl.BlockSpec((1, mp, t.bn), lambda j, s: (s, 0, j)),
        compiler_params=triton.CompilerParams(num_warps=t.warps, num_stages=t.stages),
        interpret=interpret,
        name="aotlm_gpu_rows",
    )(x2, w2)


def config(x, w, axes: int = 1, nt: bool = False) -> Tiles | None:
    """Static (shapes / dtypes): the tiles ``matmul`` would use for this product, None if it cannot."""
    rows = math.prod(x.shape[: x.ndim - axes])
    xd, wd = jnp.dtype(x.dtype), jnp.dtype(w.dtype)
    pair = wd == F8 if xd == F8 else xd in X_DTYPES and wd in (jnp.dtype(jnp.int8), xd)
    if not pair or not 1 <= rows <= MAX_ROWS:
        return None
    k = math.prod(x.shape[x.ndim - axes :])
    n = w.shape[0] if nt else math.prod(w.shape[axes:])
    if (w.shape[1] if nt else math.prod(w.shape[:axes])) != k:
        return None
    mp, s = padded_rows(rows), setting()
    t = tiles(mp, k, n) if s in ("xla", "pallas") else s
    return t if t is not None and _fits(t, mp, k, n) else None


def takes(x, w, scale, axes: int = 1, nt: bool = False) -> bool:
    """Static: does ``matmul`` take this product on this backend (a GPU, ``AOTLM_GPU_MATMUL`` set, one
    device, bf16 / f16 decode rows, a weight in their dtype or int8 with its per-channel scale; e4m3 rows and
    an e4m3 weight with its scale)?"""
    if (scale is not None) != (jnp.dtype(w.dtype) in SCALED) or setting() == "xla" or not on_gpu():
        return False
    return one_device() and config(x, w, axes, nt) is not None


def matmul(
    x, w, scale, axes: int = 1, nt: bool = False, interpret: bool | None = None, tiles: Tiles | None = None
):
    """``(x @ w) * scale`` (no scale: ``x @ w``) in float32, ``[..., N...]`` (``nt``: ``w [N, K]``, output
    ``[..., N]``).

    ``tiles`` overrides the configuration (tests); ``interpret`` runs Pallas' interpreter (CPU; default
    ``INTERPRET``)."""
    interpret = INTERPRET if interpret is None else interpret
    t = tiles or config(x, w, axes, nt)
    if t is None:
        raise ValueError(f"no GPU kernel tile for x {x.shape} {x.dtype} and w {w.shape} {w.dtype}")
    lead = x.shape[: x.ndim - axes]
    rows, k = math.prod(lead), math.prod(x.shape[x.ndim - axes :])
    out_dims = (w.shape[0],) if nt else w.shape[axes:]
    x2 = x.reshape(rows, k)
    mp = padded_rows(rows)
    x2 = jnp.pad(x2, ((0, mp - rows), (0, 0))) if mp > rows else x2
    w2 = w if nt else w.reshape(k, -1)
    parts = _call(x2, w2, t, nt, interpret)
    y = parts[0]
    for i in range(1, t.splits):  # a fixed order: the same bits every call
        y = y + parts[i]
    y = y[:rows] if scale is None else y[:rows] * scale.reshape(-1).astype(jnp.float32)
    return y.reshape(*lead, *out_dims)
