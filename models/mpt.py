"""MPT: ALiBi with MPT's own slopes (``2^-(i * alibi_bias_max / H')`` over the next power of two
``H'``, interleaved for other head counts: not BLOOM's), no biases anywhere (LayerNorms
included), fused ``Wqkv`` laid out ``[q | k | v]``, optional ``clip_qkv``."""

from __future__ import annotations

import math

from aotlm.models.arch import ArchConfig
from aotlm.models.weights import Row, heads_out, linear_t, row, split_qkv

MODEL_TYPES = ("mpt",)
PREFIXES = ("transformer.", "")


def mpt_alibi_slopes(n_heads: int, bias_max: float = 8) -> tuple[float, ...]:
    """Head slopes as MPT (and transformers' ``build_mpt_alibi_tensor``) compute them."""
    n2 = 2 ** math.ceil(math.log2(n_heads))
    slopes = [1.0 / 2 ** ((i + 1) * bias_max / n2) for i in range(n2)]
    if n2 != n_heads:
        slopes = (slopes[1::2] + slopes[::2])[:n_heads]
    return tuple(slopes)


def _attn_config(hf) -> dict:
    ac = hf.attn_config
    return ac.to_dict() if hasattr(ac, "to_dict") else dict(ac or {})


def arch_config(hf) -> ArchConfig:
    ac = _attn_config(hf)
    unsupported = {
        "alibi": (ac.get("alibi", True) is not True, "learned positions (alibi=False)"),
        "qk_ln": (bool(ac.get("qk_ln", False)), "qk_ln=True"),
        "prefix_lm": (bool(ac.get("prefix_lm", False)), "prefix_lm=True"),
        "attn_type": (ac.get("attn_type", "multihead_attention") != "multihead_attention", "multi-query"),
    }
    bad = [msg for cond, msg in unsupported.values() if cond]
    if bad:
        raise ValueError(
            f"MPT attn_config with {', '.join(bad)} is not supported (transformers' MptModel does not "
            "implement it either, so there is no reference to match)"
        )
    d, h = hf.d_model, hf.n_heads
    clip = ac.get("clip_qkv")
    return ArchConfig(
        model_type="mpt",
        vocab_size=hf.vocab_size,
        hidden_size=d,
        n_layers=hf.n_layers,
        n_heads=h,
        n_kv_heads=h,
        head_dim=d // h,
        intermediate_size=int(hf.expansion_ratio * d),
        max_positions=hf.max_seq_len,
        norm="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        act="gelu",
        gated_mlp=False,
        position="alibi",
        # MPT's own code honours alibi_bias_max; transformers' MptModel always uses 8 (every
        # public MPT checkpoint has 8, where both agree)
        alibi=mpt_alibi_slopes(h, ac.get("alibi_bias_max", 8)),
        attn_scale=ac.get("softmax_scale"),
        clip_qkv=float(clip) if clip else None,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


def weight_rows(cfg: ArchConfig, hf) -> list[Row]:
    h, dh = cfg.n_heads, cfg.head_dim
    rows = [row(("embed",), "wte.weight")]
    for i in range(cfg.n_layers):
        p, L = f"blocks.{i}.", ("layers", i)
        rows += [
            row(L + ("ln1_scale",), p + "norm_1.weight"),
            row([L + ("wq",), L + ("wk",), L + ("wv",)], p + "attn.Wqkv.weight", split_qkv(h, h, dh, False)),
            row(L + ("wo",), p + "attn.out_proj.weight", heads_out(h, dh)),
            row(L + ("ln2_scale",), p + "norm_2.weight"),
            row(L + ("w_up",), p + "ffn.up_proj.weight", linear_t),
            row(L + ("w_down",), p + "ffn.down_proj.weight", linear_t),
        ]
    rows.append(row(("final_norm_scale",), "norm_f.weight"))
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "lm_head.weight", linear_t))
    return rows
