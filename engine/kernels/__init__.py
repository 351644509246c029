"""CPU kernels behind ``jax.ffi``: low-precision-weight matmuls and decode attention dots.

XLA:CPU converts a whole bf16 / int8 weight matrix before a GEMV (1-2 GB/s of weights), so
decode with such weights was slower than f32. ``wmatmul.cc`` streams the stored bytes once per
call, converts them in registers (int8: integer dot products with x rounded to int16 per row,
``int8.h``; int8, bf16 and f16 weights stored in the panel layout at load, ``packed.h`` and
``aotlm.models.packing``) and splits the work over every core. ``bdot.h``: decode attention's batched small
products, which XLA:CPU ran at ~2 GFLOP/s, computed over the KV cache in place.

Build: compiled on first use with the system ``g++`` into ``$AOTLM_KERNEL_CACHE`` (default
``~/.cache/aotlm/kernels/<hash>/``), the hash covering the sources, flags, compiler and jaxlib.
Not a ``pip install`` extension because the build needs jaxlib's FFI headers inside pip's
isolated build env (a second jaxlib download per build) and a ``-mavx2`` binary must not break
installs on machines without a compiler or AVX2: here any failure only means the pure-JAX path.

Used when: the default backend is CPU, the CPU has AVX2+FMA+F16C, the build succeeded and
``AOTLM_KERNELS`` is not ``0``. ISA levels (``isa``): the library is built for the best level the CPU
has -- ``avx2``, ``avx512`` (F/BW/VL/DQ: 16-lane FMAs in the GEMMs and prompt attention) or
``avx512vnni`` (also ``vpdpbusd`` for W8A8, ``vpdpwssd`` in the int8 row kernels) or ``avx512bf16``
(also ``vdpbf16ps`` for ``quant="bf16a"``'s bf16-activation GEMM) or ``amx`` (W8A8's prefill GEMM on
``tdpbssd`` tiles, bf16 panels' on ``tdpbf16ps``, int8 panels' prefill rows on int16 x's two int8 digits:
``amx_tiles()`` says whether the tiles run) -- or for
``AOTLM_KERNEL_ISA``; ``isa_level()`` says which. The level is in the build hash and ``cache_tag()``.
Weights of every dtype take the kernel for 1..``MAX_ROWS`` rows
(decode, batched decode, the ``k + 1`` tokens a speculative check feeds). More rows (prefill):
packed int8 / bf16 / f16 weights take the GEMM of ``gemm.h`` (``aotlm_gemm_pk``: W widened to f32
block by block, f32 x, bias and MLP activation in its output pass; int8 x with per-row scales
under ``quant="w8a8"``; bf16 x with bf16 weights under ``quant="bf16a"``); an f32 GEMM
(``aotlm_gemm``) exists but ``models.layers.GEMM_F32`` keeps XLA's dot, which measured faster inside
the model. 4-bit weights (``quant="int4"``) take one kernel for every row count (``int4.h``: x
rounded to int8 per group, ``vpdpbusd`` / ``vpmaddubsw`` on the nibbles; ``matmul_q4``). A prompt
attends over its own tokens in ``attn.h`` (``causal_attention``). The prefill kernels run on XLA's
own intra-op threads.

Two GPU kernels live here too (Pallas, Triton lowering), each off unless switched on: ``gpu_matmul``,
decode rows' products with bf16 / f16 or int8 weights (int8 read as stored; ``AOTLM_GPU_MATMUL=pallas``,
``gpu_matmul_ok`` / ``matmul_gpu``), and ``gpu_attention``, a decode step's attention over the cache
in one kernel (``AOTLM_GPU_ATTENTION=pallas``, ``gpu_attention_ok`` / ``decode_attention_gpu``).
"""

from __future__ import annotations

from aotlm.kernels.argmax import argmax, argmax_ok
from aotlm.kernels.attention import (
    attention_ok,
    bdot,
    causal_attention,
    causal_attention_ok,
    decode_attention,
    decode_attention_ok,
)
from aotlm.kernels.build import (
    MAX_ROWS,
    KernelWarning,
    amx_tiles,
    bf16_peak,
    build_hash,
    cache_tag,
    enabled,
    ensure_registered,
    fma_peak,
    int8_peak,
    isa_level,
    pack_panels,
    read_gbps,
    threads,
    transpose,
)
from aotlm.kernels.context import mesh_context
from aotlm.kernels.dense import (
    convert,
    gemm_fuses,
    gemm_supported,
    matmul,
    row_limit,
    supported,
    w8a8_fused,
    w8a8_rows,
)
from aotlm.kernels.gpu_attention import attend as decode_attention_gpu
from aotlm.kernels.gpu_attention import takes as gpu_attention_ok
from aotlm.kernels.gpu_matmul import matmul as matmul_gpu
from aotlm.kernels.gpu_matmul import takes as gpu_matmul_ok
from aotlm.kernels.isa import KernelIsaError
from aotlm.kernels.lora import lora_add, lora_add_many, lora_ok
from aotlm.kernels.padding import padding_rows
from aotlm.kernels.q4 import matmul_q4, q4_fuses, q4_group, q4_supported, unpack_q4

__all__ = [
    "MAX_ROWS",
    "KernelIsaError",
    "KernelWarning",
    "amx_tiles",
    "argmax",
    "argmax_ok",
    "lora_add",
    "lora_add_many",
    "lora_ok",
    "attention_ok",
    "build_hash",
    "bdot",
    "cache_tag",
    "causal_attention",
    "causal_attention_ok",
    "convert",
    "decode_attention",
    "decode_attention_gpu",
    "decode_attention_ok",
    "enabled",
    "ensure_registered",
    "fma_peak",
    "gemm_fuses",
    "gemm_supported",
    "gpu_attention_ok",
    "gpu_matmul_ok",
    "int8_peak",
    "bf16_peak",
    "isa_level",
    "matmul",
    "matmul_gpu",
    "matmul_q4",
    "mesh_context",
    "pack_panels",
    "padding_rows",
    "w8a8_fused",
    "w8a8_rows",
    "q4_fuses",
    "q4_group",
    "q4_supported",
    "row_limit",
    "read_gbps",
    "supported",
    "threads",
    "transpose",
    "unpack_q4",
]
