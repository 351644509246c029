"""Prefill GEMM throughput: XLA's f32 dot against the kernels' GEMMs (``engine/kernels/gemm.h``).

Prints the CPU model, the kernels' ISA level (``aotlm.kernels.isa_level``; ``AOTLM_KERNEL_ISA=avx2``
forces a lower one for an A/B), the f32 FMA, int8 and bf16 multiply-add peaks of the kernels' threads at
that level (``aotlm.kernels.fma_peak`` / ``int8_peak`` / ``bf16_peak``: 8- or 16-lane FMAs, ``vpmaddwd``
or ``vpdpbusd``, ``vdpbf16ps``) and, per GPT-2-small prefill shape (rows x K x N), GFLOP/s (median of
``--runs``) of: XLA's f32 dot, the f32 GEMM kernel on a row-major W (``aotlm_gemm``, not used by the
model), the packed-weight GEMM on f32 panels (f32 prefill), on bf16 panels (``amp="bf16"`` prefill: f32
x; on AMX tiles at the ``amx`` level, x in three bf16 parts) and on int8 panels widened to f32
(``quant="int8"`` prefill), W8A8 (int8 x with per-row scales, ``quant="w8a8"``: f32 x rounded by the
GEMM itself as in the model, and the GEMM alone on x already rounded) and bf16a (x rounded to bf16 in the
graph, bf16 panels, ``quant="bf16a"``).
One process, one run: on a shared machine quote ratios within a run.

    python scripts/bench_gemm.py [--runs 7] [--rows 128,1024] [--shapes gpt2|1b]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from aotlm import kernels
from aotlm.models import lowp, packing

SHAPES = {  # K x N per prefill product
    "gpt2": ((768, 2304), (768, 768), (768, 3072), (3072, 768)),  # GPT-2-small: qkv, o, up, down
    "1b": ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)),  # Llama-3.2-1B: qkv, o, gate+up, down
}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median_s(fn, args, runs: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--rows", default="128,1024", help="comma-separated row counts (prompt x batch)")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="gpt2", help="the model whose products run")
    a = ap.parse_args()
    print(f"cpu: {cpu_model()}; threads: {kernels.threads()}; jax {jax.__version__}")
    peak, ipeak, bpeak = kernels.fma_peak(5), kernels.int8_peak(5), kernels.bf16_peak(5)
    if peak is None or ipeak is None or bpeak is None:
        sys.exit("bench_gemm: the aotlm kernels are not available here (AOTLM_KERNELS=0 or a failed build)")
    print(
        f"kernel ISA: {kernels.isa_level()} (AMX tiles: {'on' if kernels.amx_tiles() else 'off'}); "
        f"peaks (kernel threads, best of 5): f32 FMA {peak:.1f} GFLOP/s, "
        f"int8 multiply-add {ipeak:.1f} Gop/s, bf16 multiply-add "
        + (f"{bpeak:.1f} GFLOP/s" if bpeak else "- (no vdpbf16ps at this level: bf16 x is widened to f32)")
        + " (2 ops per multiply-add)"
    )
    rng = np.random.default_rng(0)
    xla = jax.jit(lambda x, w: x @ w)
    f32 = jax.jit(lambda x, w: kernels.matmul(x, w))
    i8 = jax.jit(lambda x, w, s: kernels.matmul(x, w, s, packed_k=1))
    i8k = jax.jit(lambda xq, w, s, sx: kernels.matmul(xq, w, s, packed_k=1, sx=sx))

    w8a8 = jax.jit(lambda x, w, s: lowp.w8a8(x, w, s, 1, None, 1))  # the model's path: x rounded in the GEMM
    bf16a = jax.jit(lambda x, w: kernels.matmul(x.astype(jnp.bfloat16), w, packed_k=1))
    head = ("M x K x N", "XLA f32", "f32 rows", "f32 panels", "bf16 panels", "int8 panels", "w8a8")
    head += ("w8a8 GEMM", "bf16a")
    widths = (18, 8, 8, 10, 11, 11, 8, 9, 8)
    cols = " | ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True))
    print(cols + " | f32 panels % f32 peak | int8 % f32 peak | w8a8 % int8 peak (GEMM) | bf16a % bf16 peak")
    for m in (int(r) for r in a.rows.split(",")):
        for k, n in SHAPES[a.shapes]:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
            wq = jnp.asarray(packing.pack(rng.integers(-127, 128, (k, n)).astype(np.int8), (0,)))
            wp = jnp.asarray(packing.pack(np.asarray(w), (0,)))
            wb = jnp.asarray(packing.pack(np.asarray(w.astype(jnp.bfloat16)), (0,)))
            s = jnp.asarray(rng.random(n), jnp.float32)
            xq, sx = jax.jit(lowp.quantize_rows)(x)
            gf = lambda t, m=m, k=k, n=n: 2 * m * k * n / t / 1e9
            r = [gf(median_s(f, args, a.runs)) for f, args in ((xla, (x, w)), (f32, (x, w)))]
            panels = ((x, wp, None), (x, wb, None), (x, wq, s))
            r += [gf(median_s(i8, args, a.runs)) for args in panels]
            r += [gf(median_s(w8a8, (x, wq, s), a.runs)), gf(median_s(i8k, (xq, wq, s, sx), a.runs))]
            r += [gf(median_s(bf16a, (x, wb), a.runs))]
            bf = f"{100 * r[7] / bpeak:16.0f}%" if bpeak else f"{'-':>17}"
            print(
                f"{m:>5} x {k:>4} x {n:>5} | {r[0]:8.1f} | {r[1]:8.1f} | {r[2]:10.1f} | {r[3]:11.1f} | "
                f"{r[4]:11.1f} | {r[5]:8.1f} | {r[6]:9.1f} | {r[7]:8.1f} | {100 * r[2] / peak:20.0f}% | "
                f"{100 * r[4] / peak:14.0f}% | "
                f"{100 * r[5] / ipeak:10.0f}% ({100 * r[6] / ipeak:3.0f}%) | {bf}"
            )


if __name__ == "__main__":
    main()
