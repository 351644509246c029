"""A small random-init GPT-2 checkpoint written without torch (the default demo model).

Until aotlm bundles a small trained model, ``aotlm demo`` and the README's first command
use this: a real HF-format checkpoint (``config.json`` + ``model.safetensors`` with the
names ``GPT2LMHeadModel.save_pretrained`` writes), so the whole loading path is exercised.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

import numpy as np

TINY_GPT2 = dict(vocab_size=512, n_positions=256, n_embd=128, n_layer=4, n_head=4)


def make_tiny_gpt2(path: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """Write a random GPT-2 checkpoint to ``path`` (kept if one is already there)."""
    # local: kept out of `import aotlm` until weights are read or written
    from safetensors.numpy import save_file

    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    if path.exists() and (not path.is_dir() or set(os.listdir(path)) - {"config.json", "model.safetensors"}):
        # the half-written checkpoint below is replaced; anything else is the user's and is kept
        raise ValueError(f"{path} exists and is not a tiny checkpoint; choose a new or empty directory")
    spec = {**TINY_GPT2, **overrides}
    v, p, d, n_layer = spec["vocab_size"], spec["n_positions"], spec["n_embd"], spec["n_layer"]
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)
    t = {"transformer.wte.weight": w(v, d), "transformer.wpe.weight": w(p, d)}
    for i in range(n_layer):
        h = f"transformer.h.{i}."
        t |= {
            h + "ln_1.weight": 1 + w(d),
            h + "ln_1.bias": w(d),
            h + "attn.c_attn.weight": w(d, 3 * d),
            h + "attn.c_attn.bias": w(3 * d),
            h + "attn.c_proj.weight": w(d, d),
            h + "attn.c_proj.bias": w(d),
            h + "ln_2.weight": 1 + w(d),
            h + "ln_2.bias": w(d),
            h + "mlp.c_fc.weight": w(d, 4 * d),
            h + "mlp.c_fc.bias": w(4 * d),
            h + "mlp.c_proj.weight": w(4 * d, d),
            h + "mlp.c_proj.bias": w(d),
        }
    t |= {"transformer.ln_f.weight": 1 + w(d), "transformer.ln_f.bias": w(d)}
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": v,
        "n_positions": p,
        "n_embd": d,
        "n_layer": n_layer,
        "n_head": spec["n_head"],
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "bos_token_id": v - 1,
        "eos_token_id": v - 1,
        "tie_word_embeddings": True,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(t, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


GPT2_SMALL = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)


def make_gpt2_small(path: str | os.PathLike = "/tmp/aotlm-bench/gpt2-small") -> Path:
    """A random-init GPT-2-small (124M) checkpoint for benchmarks (real size, random weights)."""
    return make_tiny_gpt2(path, **GPT2_SMALL)


def cpu_model() -> str:
    """CPU name, core count and the SIMD flags that matter for the kernels (printed by every benchmark)."""
    try:
        info = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return f"{platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"

    def field(key: str) -> str:
        return next((ln.split(":", 1)[1].strip() for ln in info if ln.split(":")[0].strip() == key), "?")

    # a VM's "model name" may be just the brand ("AMD EPYC"): family/model tell the generation
    name = f"{field('model name')} (family {field('cpu family')} model {field('model')})"
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    simd = [
        f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags
    ]
    return f"{name}, {os.cpu_count()} cores, {' '.join(simd)}"
