"""OPT: learned positions stored shifted by 2, ReLU MLP, pre-norm or post-norm
(``do_layer_norm_before=False``, OPT-350m, which then has no final norm) and an optional
``project_in`` / ``project_out`` pair when ``word_embed_proj_dim != hidden_size``."""

from __future__ import annotations

from aotlm.models.arch import ArchConfig
from aotlm.models.weights import Row, bias_heads, heads_in, heads_out, linear_t, row

MODEL_TYPES = ("opt",)
PREFIXES = ("model.decoder.", "decoder.", "model.", "")


def arch_config(hf) -> ArchConfig:
    if not getattr(hf, "layer_norm_elementwise_affine", True):
        raise ValueError(
            "OPT with layer_norm_elementwise_affine=False (norms without weights) is not supported"
        )
    d, h = hf.hidden_size, hf.num_attention_heads
    return ArchConfig(
        model_type="opt",
        vocab_size=hf.vocab_size,
        hidden_size=d,
        n_layers=hf.num_hidden_layers,
        n_heads=h,
        n_kv_heads=h,
        head_dim=d // h,
        intermediate_size=hf.ffn_dim,
        max_positions=hf.max_position_embeddings,
        norm="layernorm",
        norm_eps=1e-5,  # torch LayerNorm default; OPT has no config key for it
        act=hf.activation_function,
        gated_mlp=False,
        position="learned",
        learned_pos_offset=2,
        post_norm=not hf.do_layer_norm_before,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


def weight_rows(cfg: ArchConfig, hf) -> list[Row]:
    h, dh = cfg.n_heads, cfg.head_dim
    bias = getattr(hf, "enable_bias", True)
    rows = [row(("embed",), "embed_tokens.weight"), row(("pos_embed",), "embed_positions.weight")]
    if hf.word_embed_proj_dim != hf.hidden_size:
        rows += [
            row(("proj_in",), "project_in.weight", linear_t),
            row(("proj_out",), "project_out.weight", linear_t),
        ]
    for i in range(cfg.n_layers):
        p, L = f"layers.{i}.", ("layers", i)
        a = p + "self_attn."
        rows += [
            row(L + ("ln1_scale",), p + "self_attn_layer_norm.weight"),
            row(L + ("ln1_bias",), p + "self_attn_layer_norm.bias"),
            row(L + ("wq",), a + "q_proj.weight", heads_in(h, dh)),
            row(L + ("wk",), a + "k_proj.weight", heads_in(h, dh)),
            row(L + ("wv",), a + "v_proj.weight", heads_in(h, dh)),
            row(L + ("wo",), a + "out_proj.weight", heads_out(h, dh)),
            row(L + ("ln2_scale",), p + "final_layer_norm.weight"),
            row(L + ("ln2_bias",), p + "final_layer_norm.bias"),
            row(L + ("w_up",), p + "fc1.weight", linear_t),
            row(L + ("w_down",), p + "fc2.weight", linear_t),
        ]
        if bias:
            rows += [
                row(L + ("bq",), a + "q_proj.bias", bias_heads(h, dh)),
                row(L + ("bk",), a + "k_proj.bias", bias_heads(h, dh)),
                row(L + ("bv",), a + "v_proj.bias", bias_heads(h, dh)),
                row(L + ("bo",), a + "out_proj.bias"),
                row(L + ("b_up",), p + "fc1.bias"),
                row(L + ("b_down",), p + "fc2.bias"),
            ]
    # transformers builds the final norm only for pre-norm models (not OPT-350m)
    if hf.do_layer_norm_before and not getattr(hf, "_remove_final_layer_norm", False):
        rows += [
            row(("final_norm_scale",), "final_layer_norm.weight"),
            row(("final_norm_bias",), "final_layer_norm.bias"),
        ]
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "lm_head.weight", linear_t))
    return rows
