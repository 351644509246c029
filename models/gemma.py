"""Gemma and Gemma2.

Gemma: Llama layout with the embedding scaled by ``sqrt(hidden)`` (cast to the compute
dtype first, as transformers does), ``x * (1 + w)`` RMSNorm, gelu-tanh gated MLP, explicit
``head_dim``, tied embeddings.

Gemma2 adds: norms on the attention and MLP outputs (``ln1_post`` / ``ln2_post``, with
``pre_feedforward_layernorm`` as ``ln2``), tanh softcapping of attention scores and final
logits, attention scale ``query_pre_attn_scalar ** -0.5`` and local (sliding window) /
global layers following ``layer_types``.
"""

from __future__ import annotations

import dataclasses

from aotlm.models import llama
from aotlm.models.arch import ArchConfig
from aotlm.models.weights import row

MODEL_TYPES = ("gemma", "gemma2")
PREFIXES = llama.PREFIXES


def arch_config(hf) -> ArchConfig:
    kw = dict(
        norm_offset=1.0,
        embed_scale=float(hf.hidden_size**0.5),
        act=getattr(hf, "hidden_activation", None) or hf.hidden_act,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )
    if kw["act"] == "gelu":  # legacy Gemma configs: transformers maps it to the tanh approximation
        kw["act"] = "gelu_pytorch_tanh"
    if hf.model_type == "gemma2":
        kw.update(
            attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None),
            logit_softcap=getattr(hf, "final_logit_softcapping", None),
            **llama.sliding_windows(hf, per_layer=True),
        )
    else:
        kw["sliding_window"] = None
    return llama.arch_config(hf, **kw)


def weight_rows(cfg: ArchConfig, hf) -> list:
    rows = llama.weight_rows(cfg, hf)
    if cfg.model_type != "gemma2":
        return rows
    # Gemma2: "post_attention_layernorm" normalises the attention output (ln1_post), and the MLP
    # input norm is "pre_feedforward_layernorm" (ln2).
    rename = {"ln2_scale": "ln1_post_scale"}
    rows = [
        dataclasses.replace(r, targets=tuple(t[:-1] + (rename.get(t[-1], t[-1]),) for t in r.targets))
        for r in rows
    ]
    for i in range(cfg.n_layers):
        p, L = f"layers.{i}.", ("layers", i)
        rows += [
            row(L + ("ln2_scale",), p + "pre_feedforward_layernorm.weight"),
            row(L + ("ln2_post_scale",), p + "post_feedforward_layernorm.weight"),
        ]
    return rows
