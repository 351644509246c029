"""Qwen2 and Qwen3: Llama layouts with a few switches.

* Qwen2: biases on q/k/v (none on o); optional sliding window on the layers ``layer_types``
  marks ``sliding_attention`` (``use_sliding_window`` + ``max_window_layers``).
* Qwen3: no q/k/v biases (``attention_bias`` covers q/k/v/o, as in Llama), RMSNorm over each
  query/key head before rotary (``qk_norm``), ``head_dim`` given explicitly.
"""

from __future__ import annotations

from aotlm.models import llama
from aotlm.models.arch import ArchConfig
from aotlm.models.weights import row

MODEL_TYPES = ("qwen2", "qwen3")
PREFIXES = llama.PREFIXES


def arch_config(hf) -> ArchConfig:
    return llama.arch_config(
        hf, qk_norm=hf.model_type == "qwen3", **llama.sliding_windows(hf, per_layer=True)
    )


def weight_rows(cfg: ArchConfig, hf) -> list:
    if cfg.model_type == "qwen2":
        return llama.weight_rows(cfg, hf, attn_bias=True)
    rows = llama.weight_rows(cfg, hf)
    for i in range(cfg.n_layers):
        a = f"layers.{i}.self_attn."
        rows += [
            row(("layers", i, "q_norm_scale"), a + "q_norm.weight"),
            row(("layers", i, "k_norm_scale"), a + "k_norm.weight"),
        ]
    return rows
