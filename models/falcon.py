"""Falcon: one fused ``query_key_value`` in three layouts (Falcon-7B multi-query ``[q heads | k | v]``,
Falcon-40B/180B ``new_decoder_architecture`` grouped per kv head, or per-head ``[q, k, v]``),
rotary or ALiBi positions, and three block shapes: parallel attention + MLP from one shared
``input_layernorm`` (7B, and new-architecture models with ``num_ln_in_parallel_attn=1``),
parallel from two norms ``ln_attn`` / ``ln_mlp`` (40B / 180B), or sequential (RW-1B)."""

from __future__ import annotations

from aotlm.models.arch import ArchConfig
from aotlm.models.layers import alibi_slopes, rope_inv_freq
from aotlm.models.llama import rope_params
from aotlm.models.weights import Row, heads_out, linear_t, row, split_qkv

MODEL_TYPES = ("falcon",)
PREFIXES = ("transformer.", "")


def _block(hf) -> str:
    """``"two_norms"`` | ``"shared_norm"`` | ``"sequential"``: which norms feed attention and MLP."""
    if hf.new_decoder_architecture:
        if not hf.parallel_attn:
            raise ValueError(
                "Falcon new_decoder_architecture=True requires parallel_attn=True (as in transformers)"
            )
        return "shared_norm" if getattr(hf, "num_ln_in_parallel_attn", None) == 1 else "two_norms"
    return "shared_norm" if hf.parallel_attn else "sequential"


def _kv_heads(hf) -> int:
    h = hf.num_attention_heads
    if hf.new_decoder_architecture:
        return hf.num_kv_heads
    if hf.multi_query:
        return 1
    if (hf.num_kv_heads or h) != h:
        raise ValueError(
            "Falcon without multi_query / new_decoder_architecture must have num_kv_heads == heads"
        )
    return h


def arch_config(hf) -> ArchConfig:
    h = hf.num_attention_heads
    dh = hf.hidden_size // h
    block = _block(hf)
    if hf.alibi:
        # transformers folds ALiBi into the mask after dividing it by sqrt(head_dim), so the bias
        # is scaled like the scores (Falcon-RW was trained that way)
        pos = dict(position="alibi", alibi=tuple(s * dh**-0.5 for s in alibi_slopes(h)))
    else:
        theta, scaling = rope_params(hf)
        pos = dict(position="rope", inv_freq=rope_inv_freq(dh, theta, scaling))
    return ArchConfig(
        model_type="falcon",
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=h,
        n_kv_heads=_kv_heads(hf),
        head_dim=dh,
        intermediate_size=getattr(hf, "ffn_hidden_size", None) or 4 * hf.hidden_size,
        max_positions=hf.max_position_embeddings,
        norm="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        act=getattr(hf, "activation", "gelu"),
        gated_mlp=False,
        parallel_residual=block != "sequential",
        shared_input_norm=block == "shared_norm",
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        **pos,
    )


def weight_rows(cfg: ArchConfig, hf) -> list[Row]:
    h, k, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    block = _block(hf)
    # grouped per kv head for the new architecture (and per head for plain MHA); MQA: [q | k | v]
    qkv = split_qkv(h, k, dh, grouped=bool(hf.new_decoder_architecture) or k == h)
    norms = {
        "two_norms": [("ln1", "ln_attn"), ("ln2", "ln_mlp")],
        "shared_norm": [("ln1", "input_layernorm")],
        "sequential": [("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")],
    }[block]
    rows = [row(("embed",), "word_embeddings.weight")]
    for i in range(cfg.n_layers):
        p, L = f"h.{i}.", ("layers", i)
        a = p + "self_attention."
        for ours, theirs in norms:
            rows += [
                row(L + (ours + "_scale",), p + theirs + ".weight"),
                row(L + (ours + "_bias",), p + theirs + ".bias"),
            ]
        rows += [
            row([L + ("wq",), L + ("wk",), L + ("wv",)], a + "query_key_value.weight", qkv),
            row(L + ("wo",), a + "dense.weight", heads_out(h, dh)),
            row(L + ("w_up",), p + "mlp.dense_h_to_4h.weight", linear_t),
            row(L + ("w_down",), p + "mlp.dense_4h_to_h.weight", linear_t),
        ]
        if hf.bias:
            rows += [
                row([L + ("bq",), L + ("bk",), L + ("bv",)], a + "query_key_value.bias", qkv),
                row(L + ("bo",), a + "dense.bias"),
                row(L + ("b_up",), p + "mlp.dense_h_to_4h.bias"),
                row(L + ("b_down",), p + "mlp.dense_4h_to_h.bias"),
            ]
    rows += [row(("final_norm_scale",), "ln_f.weight"), row(("final_norm_bias",), "ln_f.bias")]
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "lm_head.weight", linear_t))
    return rows
