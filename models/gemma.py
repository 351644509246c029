"""Gemma and Gemma2.

Gemma: Llama layout with the embedding scaled by ``sqrt(hidden)`` (cast to the compute
dtype first, as transformers does), ``x * (1 + w)`` RMSNorm, gelu-tanh gated MLP, explicit
``head_dim``, tied embeddings.

Gemma2 adds: norms on the attention and MLP outputs (``ln1_post`` / ``ln2_post``, with
``pre_feedforward_layernorm`` as ``ln2``), tanh softcapping of attention scores and final
logits, attention scale ``query_pre_attn_scalar ** -0.5`` and local (sliding window) /
global layers following ``layer_types``.

Gemma3 text (``gemma3_text``, ``Gemma3ForCausalLM``) is Gemma2 plus an RMSNorm (``x * (1 + w)``) on
each query / key head before rotary (``qk_norm``) and its own rotary per layer kind: the sliding
layers' base (``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]`` in transformers 5)
and the global layers' (``rope_theta`` + ``rope_scaling``, e.g. linear x8). Like transformers, it
applies the final-logit softcap when configured but never ``attn_logit_softcapping`` (transformers'
Gemma3 attention does not pass it on). The multimodal wrapper (``gemma3``) is refused in ``UNSUPPORTED``.
"""

from __future__ import annotations

import dataclasses

from aotlm.models import llama
from aotlm.models.arch import ArchConfig
from aotlm.models.layers import rope_inv_freq
from aotlm.models.weights import row

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
PREFIXES = llama.PREFIXES
UNSUPPORTED = {  # model_type -> why not, and what to use (aotlm.models.family_for says it)
    "gemma3": "is the multimodal Gemma 3 wrapper (vision + text), which aotlm does not load; use a "
    "text-only checkpoint (model_type 'gemma3_text', Gemma3ForCausalLM, e.g. gemma-3-270m or gemma-3-1b)",
}


def arch_config(hf) -> ArchConfig:
    kw = dict(
        norm_offset=1.0,
        embed_scale=float(hf.hidden_size**0.5),
        act=getattr(hf, "hidden_activation", None) or hf.hidden_act,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )
    if kw["act"] == "gelu":  # legacy Gemma configs: transformers maps it to the tanh approximation
        kw["act"] = "gelu_pytorch_tanh"
    if hf.model_type == "gemma":
        kw["sliding_window"] = None
    else:
        kw.update(
            attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
            logit_softcap=getattr(hf, "final_logit_softcapping", None),
            **llama.sliding_windows(hf, per_layer=True),
        )
    if hf.model_type == "gemma2":  # transformers' Gemma3 attention never passes its softcap on
        kw["attn_softcap"] = getattr(hf, "attn_logit_softcapping", None)
    if hf.model_type == "gemma3_text":
        kw.update(qk_norm=True, **gemma3_ropes(hf))
    return llama.arch_config(hf, **kw)


def gemma3_ropes(hf) -> dict:
    """``inv_freq`` (global layers) and ``local_inv_freq`` (sliding layers) of a Gemma3 text config."""
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=true (EmbeddingGemma) makes an encoder, not a causal LM; "
            "aotlm runs causal Gemma3 checkpoints only"
        )
    if "sliding_attention" in (getattr(hf, "layer_types", None) or ()) and hf.sliding_window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is null; set it")
    per_type = getattr(hf, "rope_parameters", None) or {}
    if "full_attention" in per_type:  # transformers 5: one rope dict per layer type
        glob, loc = per_type["full_attention"], per_type.get("sliding_attention") or {}
        global_rope = (glob.get("rope_theta", 1e6), glob)
        local_rope = (loc.get("rope_theta", 1e4), loc)
    else:  # transformers 4 keys: rope_scaling is the global layers' only
        global_rope = (getattr(hf, "rope_theta", 1e6), getattr(hf, "rope_scaling", None))
        local_rope = (getattr(hf, "rope_local_base_freq", 1e4), None)
    dh = hf.head_dim
    return dict(inv_freq=rope_inv_freq(dh, *global_rope), local_inv_freq=rope_inv_freq(dh, *local_rope))


def weight_rows(cfg: ArchConfig, hf) -> list:
    rows = llama.weight_rows(cfg, hf)
    if cfg.model_type == "gemma":
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
        if cfg.qk_norm:  # Gemma3
            rows += [
                row(L + ("q_norm_scale",), p + "self_attn.q_norm.weight"),
                row(L + ("k_norm_scale",), p + "self_attn.k_norm.weight"),
            ]
    return rows
