"""GPT-J: rotary on the first ``rotary_dim`` dims of each head with *interleaved* pairs
(GPT-J's ``rotate_every_two``), a parallel residual fed by one shared ``ln_1``, separate bias-free
q/k/v projections, and an ``lm_head`` that has a bias."""

from __future__ import annotations

from aotlm.models.arch import ArchConfig
from aotlm.models.layers import rope_inv_freq
from aotlm.models.weights import Row, heads_in, heads_out, linear_t, row

MODEL_TYPES = ("gptj",)
PREFIXES = ("transformer.", "")


def arch_config(hf) -> ArchConfig:
    d, h = hf.n_embd, hf.n_head
    dh = d // h
    rot = hf.rotary_dim or dh  # static: how many dims rotate is baked into the graph
    return ArchConfig(
        model_type="gptj",
        vocab_size=hf.vocab_size,
        hidden_size=d,
        n_layers=hf.n_layer,
        n_heads=h,
        n_kv_heads=h,
        head_dim=dh,
        intermediate_size=hf.n_inner or 4 * d,
        max_positions=hf.n_positions,
        norm="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        act=hf.activation_function,
        gated_mlp=False,
        position="rope",
        inv_freq=rope_inv_freq(rot, 10000.0, None),
        rope_interleaved=True,
        parallel_residual=True,
        shared_input_norm=True,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def weight_rows(cfg: ArchConfig, hf) -> list[Row]:
    h, dh = cfg.n_heads, cfg.head_dim
    rows = [row(("embed",), "wte.weight")]
    for i in range(cfg.n_layers):
        p, L = f"h.{i}.", ("layers", i)
        rows += [
            row(L + ("ln1_scale",), p + "ln_1.weight"),
            row(L + ("ln1_bias",), p + "ln_1.bias"),
            row(L + ("wq",), p + "attn.q_proj.weight", heads_in(h, dh)),
            row(L + ("wk",), p + "attn.k_proj.weight", heads_in(h, dh)),
            row(L + ("wv",), p + "attn.v_proj.weight", heads_in(h, dh)),
            row(L + ("wo",), p + "attn.out_proj.weight", heads_out(h, dh)),
            row(L + ("w_up",), p + "mlp.fc_in.weight", linear_t),
            row(L + ("b_up",), p + "mlp.fc_in.bias"),
            row(L + ("w_down",), p + "mlp.fc_out.weight", linear_t),
            row(L + ("b_down",), p + "mlp.fc_out.bias"),
        ]
    rows += [row(("final_norm_scale",), "ln_f.weight"), row(("final_norm_bias",), "ln_f.bias")]
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "lm_head.weight", linear_t))
    rows.append(row(("lm_head_bias",), "lm_head.bias"))
    return rows
