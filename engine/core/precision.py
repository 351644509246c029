"""What ``amp`` means on this backend: the compute dtype, the KV-cache dtype and the weight storage.

``amp`` ("f32" | "bf16" | "f16") is what the user asks for and what the model reports
(``model.amp``, artifacts, ``aotlm cache list``); ``resolve`` turns it and ``quant`` into a
``Precision``, the one place that decides how a model is stored and computed:

* Backends without the CPU kernels (GPU, TPU; CPU with ``AOTLM_KERNELS=0`` or no AVX2 build):
  ``amp`` is the compute dtype. Activations, KV cache and every weight are in it (int8 weights
  are dequantized to it), softmax / norms / logits accumulate in f32.
* CPU with the kernels (``aotlm.kernels.enabled()``): ``amp="bf16"`` / ``"f16"`` store the big
  matrices (q/k/v/o, MLP, lm_head: ``CONTRACT_AXES``) in bf16 / f16, as ``quant="bf16"`` does,
  and keep activations, the embedding, norms, biases and the KV cache in f32. With ``quant`` given
  (int8 weights) the weights are the quant's, with f32 activations: ``QuantizationConfig(
  quant_dtype="s8", dequant_dtype="bf16")`` with ``amp="bf16"`` decodes exactly like ``quant="int8"``.
* ``kv_cache_dtype`` ("f32" | "bf16" | "f16"; None = the above) sets the cache's storage apart from
  ``amp``: writes round to it, reads convert it to the compute dtype (the ``bdot`` kernel in
  registers). Why apart: the rule below keeps an f32 cache for batch 1, where the cache is small,
  but at batch 8 GPT-2-small's decode step reads 113 MB of f32 cache beside 125 MB of int8 weights.

Why (GPT-2-small random init, ``fuse_qkv``, batch 1, prompt 128, 128 new tokens, greedy; 2-core
AMD EPYC Zen 2, AVX2/FMA/F16C, no AVX-512 BF16; one process, variants round robin, median of 5;
decode speed as a ratio to f32):

| activations | matrices | KV cache | decode vs f32 | converts in the decode HLO |
|---|---|---|---|---|
| bf16 (amp="bf16" as compute) | bf16, row-major | bf16 | 1.12x | 1586 |
| f32 | bf16, row-major | bf16 | 1.19x | 226 |
| f32 | bf16, row-major | f32 | 1.60x | 34 (f32: 34) |
| f32 | bf16, panel layout | f32 (**amp="bf16" here**) | 1.91x | 34 |
| f16 (amp="f16" as compute) | f16, row-major | f16 | 1.49x | 408 |
| f32 | f16, row-major | f32 | 1.58x | 34 |
| f32 | f16, panel layout (**amp="f16" here**) | f32 | 1.97x (bf16 panels: 1.90x) | 34 |
| bf16, int8 weights | int8, panel | bf16 | 2.29x | 1588 |
| f32, int8 weights (**int8 + amp="bf16" here**) | int8, panel | f32 | 3.33x (quant="int8": 3.26x) | 34 |

The CPU has no bf16 arithmetic, so XLA:CPU upcasts every bf16 op to f32 and back: around each
elementwise op, norm and softmax (1586 converts per step, GELU on 3072-wide rows among them), and
around the KV-cache update, where it converts each layer's whole bf16 cache to f32 and back every
step (``f32[1,12,256,64]`` converts, 24 per step: that alone took 1.60x to 1.19x). The kernels
convert x to f32 before the product anyway, so f32 activations and an f32 cache cost the matmuls
nothing and give up only the cache's memory, while amp's point on this backend -- half the weight
bytes per token -- comes from the storage. (An f16 cache measured 1.65x against the f32 cache's
1.58x, within noise; one rule, f32, keeps bf16 and f16 alike.) f16 weights take the panel layout
(``aotlm.models.packing``) like bf16: row-major bf16 measured the same as row-major f16 (1.60x vs
1.58x), so the layout was the difference, and the panel kernel reads f16 with F16C conversions
(``packed.h``): in one run row-major f16 went 1.59x (bf16 panels 1.85x), f16 panels 1.97x (bf16
panels 1.90x). int8 weights with amp bf16 (the transformers-neuronx int8 example) then run
exactly ``quant="int8"``'s graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from aotlm import kernels
from aotlm.models.quant import QuantizationConfig, quant_config

logger = logging.getLogger("aotlm.core.precision")

AMP_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# kv_cache_dtype names (None: follow amp, as above); long names are accepted and canonicalized
KV_CACHE_DTYPES = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16",
                   "float16": "f16"}  # fmt: skip
# a quantization's activations as ``describe`` says them
ACTIVATIONS_SAID = {
    "s8": ", int8 matmul",
    "bf16": ", bf16 prefill",
    "s16": ", int16 int4 matmul",
    "f32": ", f32-exact int4 matmul",
    "f8": ", fp8 matmul",
}


def amp_dtype(amp: str):
    """The jnp dtype of an ``amp`` name; a clear error for anything else."""
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp={amp!r} is not supported; choose one of {list(AMP_DTYPES)}")
    return AMP_DTYPES[amp]


@dataclass(frozen=True)
class Precision:
    """How one model is stored and computed (``resolve``).

    ``compute``: activations and the weights loaded as they are (embedding, norms, biases, and
    matrices ``quant`` leaves alone). ``kv``: the KV cache. ``quant``: storage of the big
    matrices (``aotlm.models.quant``), None for ``compute``.
    """

    amp: str
    compute: type
    kv: type
    quant: QuantizationConfig | None

    @property
    def kv_buffer(self):
        """The dtype the cache buffers are allocated in: ``kv``, except that a bf16 cache on CPU holds
        its bits as uint16 (XLA:CPU upcast every bf16 cache write to f32 over the whole layer;
        ``aotlm.models.layers.cache_view``)."""
        if jnp.dtype(self.kv) == jnp.bfloat16 and jax.default_backend() == "cpu":
            return jnp.uint16
        return self.kv

    @property
    def matmul(self) -> str | None:
        """The precision every matmul / einsum of the graphs is lowered at (``jax.default_matmul_precision``):
        ``"highest"`` under float32 compute, so that f32 means f32 on every backend (XLA:GPU otherwise runs
        f32 products as TF32: logits ~1e-3 off transformers'); None (the backend's default) for bf16 /
        f16 compute, whose products are as precise as their inputs. Baked into each executable."""
        return "highest" if jnp.dtype(self.compute) == jnp.float32 else None

    @property
    def weights_only(self) -> bool:
        """``amp`` became low-precision weight storage with f32 activations (the kernels' CPU path)."""
        return self.amp != "f32" and jnp.dtype(self.compute) == jnp.float32

    def describe(self) -> str:
        """One line for logs and reports, e.g. ``amp=bf16: bf16 weights, f32 activations, f32 KV``."""
        weights = self.quant.label if self.quant is not None else self.amp
        name = lambda d: {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[jnp.dtype(d).name]
        low = self.quant.activations if self.quant is not None else None
        low = "f8" if self.quant is not None and self.quant.fp8 else low  # every product's rows: e4m3
        acts = name(self.compute) + ACTIVATIONS_SAID.get(low, "")
        return f"amp={self.amp}: {weights} weights, {acts} activations, {name(self.kv)} KV"


def kv_cache_name(kv_cache_dtype: str | None) -> str | None:
    """The canonical ``kv_cache_dtype`` ("f32" | "bf16" | "f16", or None); one line naming the
    choices for anything else (int8 caches with per-head scales are not implemented)."""
    if kv_cache_dtype is None:
        return None
    name = KV_CACHE_DTYPES.get(str(kv_cache_dtype).lower()) if isinstance(kv_cache_dtype, str) else None
    if name is None:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported; choose one of "
            f"{[None, *dict.fromkeys(KV_CACHE_DTYPES.values())]} (None follows amp)"
        )
    return name


def warn_slow(quant: QuantizationConfig | None) -> None:
    """One log line where a storage has no fast path on this backend: fp8 on a CPU (XLA converts the
    e4m3 operands of every product; ``aotlm.models.quant_fp8``)."""
    if quant is not None and quant.fp8 and jax.default_backend() == "cpu":
        logger.warning("quant='fp8' is for GPUs with fp8 tensor cores; on a CPU use int8 or int4 (faster)")


def check_dequant(amp: str, quant: QuantizationConfig | None) -> None:
    """transformers-neuronx's rule: a given ``dequant_dtype`` must equal ``amp``."""
    if quant is None or quant.dequant_dtype is None or quant.dequant_dtype == amp:
        return
    raise ValueError(
        f"QuantizationConfig(dequant_dtype={quant.dequant_dtype!r}) does not match amp={amp!r}: the "
        f"dequant dtype must be the model's amp; pass amp={quant.dequant_dtype!r}, or "
        f"dequant_dtype={amp!r} (or None, which means the amp)"
    )


def resolve(
    amp: str,
    quant: str | QuantizationConfig | None,
    kernels_on: bool | None = None,
    kv_cache_dtype: str | None = None,
) -> Precision:
    """``(amp, quant)`` -> ``Precision`` for this backend (``kernels_on``: default
    ``aotlm.kernels.enabled()``, i.e. CPU with the kernels built and not switched off).
    ``kv_cache_dtype`` (``kv_cache_name``) overrides the KV dtype amp implies, on any backend."""
    dtype = amp_dtype(amp)
    q = quant_config(quant)
    check_dequant(amp, q)
    kv = kv_cache_name(kv_cache_dtype)
    if kernels_on is None:
        kernels_on = kernels.enabled()
    if amp == "f32" or not kernels_on:  # amp is the compute dtype (GPU / TPU, or no kernels)
        return Precision(amp, dtype, AMP_DTYPES[kv] if kv else dtype, q)
    if q is None:  # the matrices in amp's dtype, read by the kernels; the rest f32
        q = QuantizationConfig(quant_dtype=amp)
    return Precision(amp, jnp.float32, AMP_DTYPES[kv] if kv else jnp.float32, q)
