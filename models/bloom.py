"""BLOOM: ALiBi positions (standard slopes, any head count), a LayerNorm right after the word
embeddings, fused ``query_key_value`` laid out per head as ``[q, k, v]``, tanh-GELU MLP."""

from __future__ import annotations

from aotlm.models.arch import ArchConfig
from aotlm.models.layers import alibi_slopes
from aotlm.models.weights import Row, heads_out, linear_t, row, split_qkv

MODEL_TYPES = ("bloom",)
PREFIXES = ("transformer.", "")
NO_POSITION_LIMIT = 1 << 20  # ALiBi has no learned table; n_positions bounds the cache instead


def arch_config(hf) -> ArchConfig:
    if getattr(hf, "apply_residual_connection_post_layernorm", False):
        raise ValueError("BLOOM with apply_residual_connection_post_layernorm=True is not supported")
    d, h = hf.hidden_size, hf.n_head
    return ArchConfig(
        model_type="bloom",
        vocab_size=hf.vocab_size,
        hidden_size=d,
        n_layers=hf.n_layer,
        n_heads=h,
        n_kv_heads=h,
        head_dim=d // h,
        intermediate_size=4 * d,
        max_positions=NO_POSITION_LIMIT,
        norm="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        act="gelu_new",  # bloom_gelu_forward is the tanh approximation
        gated_mlp=False,
        position="alibi",
        alibi=alibi_slopes(h),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


def weight_rows(cfg: ArchConfig, hf) -> list[Row]:
    h, dh = cfg.n_heads, cfg.head_dim
    rows = [
        row(("embed",), "word_embeddings.weight"),
        row(("embed_norm_scale",), "word_embeddings_layernorm.weight"),
        row(("embed_norm_bias",), "word_embeddings_layernorm.bias"),
    ]
    for i in range(cfg.n_layers):
        p, L = f"h.{i}.", ("layers", i)
        a = p + "self_attention."
        rows += [
            row(L + ("ln1_scale",), p + "input_layernorm.weight"),
            row(L + ("ln1_bias",), p + "input_layernorm.bias"),
            row(
                [L + ("wq",), L + ("wk",), L + ("wv",)],
                a + "query_key_value.weight",
                split_qkv(h, h, dh, True),
            ),
            row(
                [L + ("bq",), L + ("bk",), L + ("bv",)], a + "query_key_value.bias", split_qkv(h, h, dh, True)
            ),
            row(L + ("wo",), a + "dense.weight", heads_out(h, dh)),
            row(L + ("bo",), a + "dense.bias"),
            row(L + ("ln2_scale",), p + "post_attention_layernorm.weight"),
            row(L + ("ln2_bias",), p + "post_attention_layernorm.bias"),
            row(L + ("w_up",), p + "mlp.dense_h_to_4h.weight", linear_t),
            row(L + ("b_up",), p + "mlp.dense_h_to_4h.bias"),
            row(L + ("w_down",), p + "mlp.dense_4h_to_h.weight", linear_t),
            row(L + ("b_down",), p + "mlp.dense_4h_to_h.bias"),
        ]
    rows += [row(("final_norm_scale",), "ln_f.weight"), row(("final_norm_bias",), "ln_f.bias")]
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "lm_head.weight", linear_t))
    return rows
