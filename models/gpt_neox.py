"""GPT-NeoX / Pythia: partial rotary (``rotary_pct`` of each head, rotate-half pairs), parallel
residual with two input norms (or sequential with ``use_parallel_residual=False``), and a fused
``query_key_value`` whose output is laid out per head as ``[q, k, v]``."""

from __future__ import annotations

from aotlm.models.arch import ArchConfig
from aotlm.models.layers import rope_inv_freq
from aotlm.models.llama import rope_params
from aotlm.models.weights import Row, heads_out, linear_t, row, split_qkv

MODEL_TYPES = ("gpt_neox",)
PREFIXES = ("gpt_neox.", "")


def arch_config(hf) -> ArchConfig:
    h = hf.num_attention_heads
    dh = hf.hidden_size // h
    theta, scaling = rope_params(hf)
    rp = getattr(hf, "rope_parameters", None) or {}
    pct = rp.get("partial_rotary_factor", getattr(hf, "rotary_pct", 1.0))
    return ArchConfig(
        model_type="gpt_neox",
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=h,
        n_kv_heads=h,
        head_dim=dh,
        intermediate_size=hf.intermediate_size,
        max_positions=hf.max_position_embeddings,
        norm="layernorm",
        norm_eps=hf.layer_norm_eps,
        act=hf.hidden_act,
        gated_mlp=False,
        position="rope",
        inv_freq=rope_inv_freq(int(dh * pct), theta, scaling),
        parallel_residual=bool(hf.use_parallel_residual),
        shared_input_norm=False,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def weight_rows(cfg: ArchConfig, hf) -> list[Row]:
    h, dh = cfg.n_heads, cfg.head_dim
    bias = getattr(hf, "attention_bias", True)
    qkv = [("wq",), ("wk",), ("wv",)]
    bqkv = [("bq",), ("bk",), ("bv",)]
    rows = [row(("embed",), "embed_in.weight")]
    for i in range(cfg.n_layers):
        p, L = f"layers.{i}.", ("layers", i)
        rows += [
            row(L + ("ln1_scale",), p + "input_layernorm.weight"),
            row(L + ("ln1_bias",), p + "input_layernorm.bias"),
            row([L + t for t in qkv], p + "attention.query_key_value.weight", split_qkv(h, h, dh, True)),
            row(L + ("wo",), p + "attention.dense.weight", heads_out(h, dh)),
            row(L + ("ln2_scale",), p + "post_attention_layernorm.weight"),
            row(L + ("ln2_bias",), p + "post_attention_layernorm.bias"),
            row(L + ("w_up",), p + "mlp.dense_h_to_4h.weight", linear_t),
            row(L + ("b_up",), p + "mlp.dense_h_to_4h.bias"),
            row(L + ("w_down",), p + "mlp.dense_4h_to_h.weight", linear_t),
            row(L + ("b_down",), p + "mlp.dense_4h_to_h.bias"),
        ]
        if bias:
            rows += [
                row([L + t for t in bqkv], p + "attention.query_key_value.bias", split_qkv(h, h, dh, True)),
                row(L + ("bo",), p + "attention.dense.bias"),
            ]
    rows += [
        row(("final_norm_scale",), "final_layer_norm.weight"),
        row(("final_norm_bias",), "final_layer_norm.bias"),
    ]
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "embed_out.weight", linear_t))
    return rows
