"""Phi-3: Llama maths with fused weights: ``qkv_proj`` ([q; k; v] rows) and ``gate_up_proj``
([gate; up] rows); default rotary (optionally partial); ``sliding_window`` on every layer.

``longrope`` (``su`` / ``yarn``) scaling picks short or long factors from the sequence length
at run time, which a static-shape graph cannot do: it is rejected with an error.
"""

from __future__ import annotations

from aotlm.models import llama
from aotlm.models.arch import ArchConfig
from aotlm.models.layers import rope_inv_freq
from aotlm.models.weights import linear_t, row, split_qkv

MODEL_TYPES = ("phi3",)
PREFIXES = llama.PREFIXES
_FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def arch_config(hf) -> ArchConfig:
    rp = dict(getattr(hf, "rope_parameters", None) or {})
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype != "default":
        raise ValueError(
            f"Phi-3 rope_type {rtype!r} is not supported: longrope switches between short and long "
            "factors depending on the sequence length, which a static-shape graph cannot; only the "
            "default rotary embedding (e.g. Phi-3-mini-4k) is supported"
        )
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ValueError("Phi-3 with attention/MLP biases is not supported")
    dh = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rot = int(dh * float(rp.get("partial_rotary_factor", 1.0)))
    theta = float(rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    return llama.arch_config(hf, head_dim=dh, inv_freq=rope_inv_freq(rot, theta, None))


def weight_rows(cfg: ArchConfig, hf) -> list:
    f = cfg.intermediate_size
    rows = [r for r in llama.weight_rows(cfg, hf) if not any(n in r.hf for n in _FUSED)]
    qkv = split_qkv(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, grouped=False)  # [q | k | v] rows
    split_gate_up = lambda a: (linear_t(a[:f]), linear_t(a[f:]))
    for i in range(cfg.n_layers):
        p, L = f"layers.{i}.", ("layers", i)
        rows += [
            row([L + ("wq",), L + ("wk",), L + ("wv",)], p + "self_attn.qkv_proj.weight", qkv),
            row([L + ("w_gate",), L + ("w_up",)], p + "mlp.gate_up_proj.weight", split_gate_up),
        ]
    return rows
