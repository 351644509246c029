"""What XLA's own CPU paths do with this CPU: its f32, bf16 and int8 dots under each XLA flag set, beside
the aotlm kernels on the same shapes (``engine/kernels``; issue: use oneDNN / XNNPACK / YNNPACK where
they beat hand kernels).

Per flag set (a child process each: ``XLA_FLAGS`` is read once, at import), per GPT-2-small matrix
(K x N) and row count M: GFLOP/s (median of ``--runs``) of ``x @ w`` in f32, in bf16 (bf16 x and w,
f32 accumulation: ``preferred_element_type``) and in int8 (int8 x and w, int32 accumulation). A flag
this jaxlib does not know makes its child fail: that row says so. Then the kernels' f32-panel GEMM and
W8A8 GEMM on the same shapes in this process (``aotlm.kernels.matmul``), the CPU model, ISA level and
peaks. One run: on a shared machine quote ratios within it.

    python scripts/bench_xla_cpu.py [--runs 5] [--rows 1,128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

FLAG_SETS = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "xnn-dot": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "ynn-dot": "--xla_cpu_experimental_ynn_fusion_type=dot",
}
SHAPES = ((768, 2304), (768, 3072), (3072, 768))  # GPT-2-small: qkv, up, down
DTYPES = ("f32", "bf16", "int8")


def child(rows: list[int], runs: int) -> None:
    """In a child with ``XLA_FLAGS`` set: one JSON line ``{"M,K,N": {dtype: GFLOP/s}}``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_gemm import median_s

    rng = np.random.default_rng(0)
    acc = {"f32": jnp.float32, "bf16": jnp.float32, "int8": jnp.int32}
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}
    out = {}
    for m in rows:
        for k, n in SHAPES:
            res = {}
            for name in DTYPES:
                x = jnp.asarray(rng.integers(-100, 100, (m, k)), dt[name])
                w = jnp.asarray(rng.integers(-100, 100, (k, n)), dt[name])
                f = jax.jit(lambda x, w, a=acc[name]: jnp.dot(x, w, preferred_element_type=a))
                res[name] = 2 * m * k * n / median_s(f, (x, w), runs) / 1e9
            out[f"{m},{k},{n}"] = res
    print(json.dumps(out))


def kernel_rates(rows: list[int], runs: int) -> dict[str, dict[str, float]]:
    """The kernels' f32-panel and W8A8 GEMMs on the same shapes (GFLOP/s)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_gemm import median_s

    from aotlm import kernels
    from aotlm.models import packing
    from aotlm.models.lowp import quantize_rows

    rng = np.random.default_rng(0)
    f32 = jax.jit(lambda x, w: kernels.matmul(x, w, None, packed_k=1))  # f32 panels

    @jax.jit
    def w8a8(x, w, s):
        xq, sx = quantize_rows(x)
        return kernels.matmul(xq, w, s, packed_k=1, sx=sx)

    out = {}
    for m in rows:
        for k, n in SHAPES:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            wp = jnp.asarray(packing.pack(rng.standard_normal((k, n)).astype(np.float32), (0,)))
            wq = jnp.asarray(packing.pack(rng.integers(-127, 128, (k, n)).astype(np.int8), (0,)))
            s = jnp.asarray(rng.random(n), jnp.float32)
            gf = lambda t, m=m, k=k, n=n: 2 * m * k * n / t / 1e9
            t32, t8 = median_s(f32, (x, wp), runs), median_s(w8a8, (x, wq, s), runs)
            out[f"{m},{k},{n}"] = {"f32": gf(t32), "w8a8": gf(t8)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rows", default="1,128", help="comma-separated row counts")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    if a.child:
        child(rows, a.runs)
        return 0
    from bench_gemm import cpu_model

    from aotlm import kernels

    print(f"cpu: {cpu_model()}; kernel ISA: {kernels.isa_level()}; threads: {kernels.threads()}")
    peak, ipeak = kernels.fma_peak(5), kernels.int8_peak(5)
    print(f"peaks (kernel threads): f32 FMA {peak} GFLOP/s, int8 multiply-add {ipeak} Gop/s")
    results: dict[str, dict | str] = {}
    for name, flags in FLAG_SETS.items():
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        cmd = [sys.executable, __file__, "--child", "--runs", str(a.runs), "--rows", a.rows]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
        last = p.stdout.strip().splitlines()[-1:] if p.returncode == 0 else []
        why = (p.stderr.strip().splitlines() or ["?"])[-1][:120]
        results[name] = json.loads(last[0]) if last else f"failed: {why}"
    mine = kernel_rates(rows, a.runs)
    head = ["M x K x N"] + [f"{f} {d}" for f in FLAG_SETS for d in DTYPES] + ["kernel f32", "kernel w8a8"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for key in mine:
        cells = [key.replace(",", " x ")]
        for name in FLAG_SETS:
            r = results[name]
            cells += [f"{r[key][d]:.1f}" for d in DTYPES] if isinstance(r, dict) else ["-"] * len(DTYPES)
        cells += [f"{mine[key]['f32']:.1f}", f"{mine[key]['w8a8']:.1f}"]
        print("| " + " | ".join(cells) + " |")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"- {name} ({FLAG_SETS[name]}): {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
