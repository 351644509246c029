"""GPT-2 (and GPT-3-style checkpoints saved as gpt2): learned positions, pre-LayerNorm,
GELU MLP, fused Conv1D q/k/v stored as ``[in, out]``, tied embeddings."""

from __future__ import annotations

import numpy as np

from aotlm.models.arch import ArchConfig
from aotlm.models.weights import bias_heads, heads_in, heads_out, linear_t, row

MODEL_TYPES = ("gpt2",)
PREFIXES = ("transformer.", "")


def arch_config(hf) -> ArchConfig:
    if getattr(hf, "add_cross_attention", False):
        raise ValueError("GPT-2 with cross-attention is an encoder-decoder; aotlm runs decoder-only models")
    if getattr(hf, "scale_attn_by_inverse_layer_idx", False) or getattr(hf, "reorder_and_upcast_attn", False):
        raise ValueError("GPT-2 scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    d, h = hf.n_embd, hf.n_head
    return ArchConfig(
        model_type="gpt2",
        vocab_size=hf.vocab_size,
        hidden_size=d,
        n_layers=hf.n_layer,
        n_heads=h,
        n_kv_heads=h,
        head_dim=d // h,
        intermediate_size=hf.n_inner or 4 * d,
        max_positions=hf.n_positions,
        norm="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        act=hf.activation_function,
        gated_mlp=False,
        position="learned",
        attn_scale=(d // h) ** -0.5 if getattr(hf, "scale_attn_weights", True) else 1.0,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),  # False: GGUF files' own output matrix
    )


def weight_rows(cfg: ArchConfig, hf) -> list:
    h, dh = cfg.n_heads, cfg.head_dim
    split_w = lambda a: tuple(heads_in(h, dh, transpose=False)(x) for x in np.split(a, 3, axis=1))
    split_b = lambda a: tuple(bias_heads(h, dh)(x) for x in np.split(a, 3))
    rows = [row(("embed",), "wte.weight"), row(("pos_embed",), "wpe.weight")]
    for i in range(cfg.n_layers):
        p, L = f"h.{i}.", ("layers", i)
        rows += [
            row((L + ("ln1_scale",)), p + "ln_1.weight"),
            row((L + ("ln1_bias",)), p + "ln_1.bias"),
            row([L + ("wq",), L + ("wk",), L + ("wv",)], p + "attn.c_attn.weight", split_w),
            row([L + ("bq",), L + ("bk",), L + ("bv",)], p + "attn.c_attn.bias", split_b),
            row(L + ("wo",), p + "attn.c_proj.weight", heads_out(h, dh, transpose=False)),
            row(L + ("bo",), p + "attn.c_proj.bias"),
            row(L + ("ln2_scale",), p + "ln_2.weight"),
            row(L + ("ln2_bias",), p + "ln_2.bias"),
            row(L + ("w_up",), p + "mlp.c_fc.weight"),
            row(L + ("b_up",), p + "mlp.c_fc.bias"),
            row(L + ("w_down",), p + "mlp.c_proj.weight"),
            row(L + ("b_down",), p + "mlp.c_proj.bias"),
        ]
    rows += [row(("final_norm_scale",), "ln_f.weight"), row(("final_norm_bias",), "ln_f.bias")]
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "lm_head.weight", linear_t))
    return rows
