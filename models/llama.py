"""Llama family (also Mistral: Llama + a sliding window on every layer): RMSNorm, rotary
positions (incl. llama3 ``rope_scaling``), grouped-query attention, SwiGLU MLP.

Other llama-like families (Mixtral, Qwen2/3, Gemma, Phi-3) call ``arch_config(hf, **overrides)``
and filter / extend ``weight_rows``."""

from __future__ import annotations

from aotlm.models.arch import ArchConfig
from aotlm.models.layers import rope_inv_freq
from aotlm.models.weights import bias_heads, heads_in, heads_out, linear_t, row

MODEL_TYPES = ("llama", "mistral")
PREFIXES = ("model.", "")


def rope_params(hf) -> tuple[float, dict | None]:
    """(theta, scaling dict) from either ``rope_parameters`` (transformers 5) or the old keys."""
    rp = getattr(hf, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    scaling = rp if rp.get("rope_type", "default") != "default" else getattr(hf, "rope_scaling", None)
    return float(theta), scaling


def sliding_windows(hf, per_layer: bool = False) -> dict:
    """``sliding_window`` / ``layer_windows`` ArchConfig fields for ``hf``.

    ``per_layer``: honour ``hf.layer_types`` (Qwen2/3, Gemma2); Mistral, Mixtral and Phi-3
    apply ``hf.sliding_window`` to every layer and ignore ``layer_types``.
    """
    sw = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None) if per_layer else None
    if sw is None or not types:
        return {"sliding_window": sw}
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported (sliding / full attention only)")
    windows = tuple(int(sw) if t == "sliding_attention" else None for t in types)
    if len(set(windows)) == 1:  # uniform: a single window (or none) for every layer
        return {"sliding_window": windows[0]}
    return {"sliding_window": int(sw), "layer_windows": windows}


def arch_config(hf, **overrides) -> ArchConfig:
    h = hf.num_attention_heads
    dh = getattr(hf, "head_dim", None) or hf.hidden_size // h
    theta, scaling = rope_params(hf)
    rot = int(dh * (getattr(hf, "partial_rotary_factor", None) or 1.0))
    kw = dict(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=h,
        n_kv_heads=getattr(hf, "num_key_value_heads", None) or h,
        head_dim=dh,
        intermediate_size=hf.intermediate_size,
        max_positions=hf.max_position_embeddings,
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        act=getattr(hf, "hidden_act", None) or getattr(hf, "hidden_activation", None),  # Gemma2: the latter
        gated_mlp=True,
        position="rope",
        inv_freq=rope_inv_freq(rot, theta, scaling, getattr(hf, "rope_freq_factors", None)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        **sliding_windows(hf),
    )
    kw.update(overrides)
    return ArchConfig(**kw)


def weight_rows(cfg: ArchConfig, hf, attn_bias: bool | None = None) -> list:
    h, k, dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn_bias = getattr(hf, "attention_bias", False) if attn_bias is None else attn_bias
    mlp_bias = getattr(hf, "mlp_bias", False)
    rows = [row(("embed",), "embed_tokens.weight")]
    for i in range(cfg.n_layers):
        p, L = f"layers.{i}.", ("layers", i)
        a = p + "self_attn."
        rows += [
            row(L + ("ln1_scale",), p + "input_layernorm.weight"),
            row(L + ("wq",), a + "q_proj.weight", heads_in(h, dh)),
            row(L + ("wk",), a + "k_proj.weight", heads_in(k, dh)),
            row(L + ("wv",), a + "v_proj.weight", heads_in(k, dh)),
            row(L + ("wo",), a + "o_proj.weight", heads_out(h, dh)),
            row(L + ("ln2_scale",), p + "post_attention_layernorm.weight"),
            row(L + ("w_gate",), p + "mlp.gate_proj.weight", linear_t),
            row(L + ("w_up",), p + "mlp.up_proj.weight", linear_t),
            row(L + ("w_down",), p + "mlp.down_proj.weight", linear_t),
        ]
        if attn_bias:
            rows += [
                row(L + ("bq",), a + "q_proj.bias", bias_heads(h, dh)),
                row(L + ("bk",), a + "k_proj.bias", bias_heads(k, dh)),
                row(L + ("bv",), a + "v_proj.bias", bias_heads(k, dh)),
            ]
        if getattr(hf, "attention_bias", False):
            rows.append(row(L + ("bo",), a + "o_proj.bias"))
        if mlp_bias:
            rows += [
                row(L + ("b_gate",), p + "mlp.gate_proj.bias"),
                row(L + ("b_up",), p + "mlp.up_proj.bias"),
                row(L + ("b_down",), p + "mlp.down_proj.bias"),
            ]
    rows.append(row(("final_norm_scale",), "norm.weight"))
    if not cfg.tie_embeddings:
        rows.append(row(("lm_head",), "lm_head.weight", linear_t))
    return rows
