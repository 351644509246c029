"""GPTBigCode (SantaCoder, StarCoder): GPT-2 blocks with learned positions and a fused ``c_attn``
``Linear`` that is multi-query ``[q heads | k | v]`` (``multi_query=True``) or per-head
``[q, k, v]`` (``multi_query=False``)."""

from __future__ import annotations

from aotlm.models.arch import ArchConfig
from aotlm.models.weights import Row, heads_out, linear_t, row, split_qkv

MODEL_TYPES = ("gpt_bigcode",)
PREFIXES = ("transformer.", "")


def arch_config(hf) -> ArchConfig:
    if getattr(hf, "add_cross_attention", False):
        raise ValueError(
            "GPTBigCode with cross-attention is an encoder-decoder; aotlm runs decoder-only models"
        )
    d, h = hf.n_embd, hf.n_head
    dh = d // h
    return ArchConfig(
        model_type="gpt_bigcode",
        vocab_size=hf.vocab_size,
        hidden_size=d,
        n_layers=hf.n_layer,
        n_heads=h,
        n_kv_heads=1 if hf.multi_query else h,
        head_dim=dh,
        intermediate_size=hf.n_inner or 4 * d,
        max_positions=hf.n_positions,
        norm="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        act=hf.activation_function,
        gated_mlp=False,
        position="learned",
        attn_scale=dh**-0.5 if hf.scale_attn_weights else 1.0,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


def weight_rows(cfg: ArchConfig, hf) -> list[Row]:
    h, k, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = split_qkv(h, k, dh, grouped=k == h)
    rows = [row(("embed",), "wte.weight"), row(("pos_embed",), "wpe.weight")]
    for i in range(cfg.n_layers):
        p, L = f"h.{i}.", ("layers", i)
        rows += [
            row(L + ("ln1_scale",), p + "ln_1.weight"),
            row(L + ("ln1_bias",), p + "ln_1.bias"),
            row([L + ("wq",), L + ("wk",), L + ("wv",)], p + "attn.c_attn.weight", qkv),
            row([L + ("bq",), L + ("bk",), L + ("bv",)], p + "attn.c_attn.bias", qkv),
            row(L + ("wo",), p + "attn.c_proj.weight", heads_out(h, dh)),
            row(L + ("bo",), p + "attn.c_proj.bias"),
            row(L + ("ln2_scale",), p + "ln_2.weight"),
            row(L + ("ln2_bias",), p + "ln_2.bias"),
            row(L + ("w_up",), p + "mlp.c_fc.weight", linear_t),
            row(L + ("b_up",), p + "mlp.c_fc.bias"),
            row(L + ("w_down",), p + "mlp.c_proj.weight", linear_t),
            row(L + ("b_down",), p + "mlp.c_proj.bias"),
        ]
    rows += [row(("final_norm_scale",), "ln_f.weight"), row(("final_norm_bias",), "ln_f.bias")]
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "lm_head.weight", linear_t))
    return rows
