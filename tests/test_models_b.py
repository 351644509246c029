"""Conformance of the llama-like families against transformers PyTorch fp32:
Mistral (sliding window), Mixtral (top-2 MoE), Qwen2 (qkv bias, per-layer windows), Qwen3
(qk-norm, explicit head_dim), Gemma, Gemma2 (softcaps, local/global layers, sandwich norms), Phi-3
(fused weights, partial rotary, sliding window).

Edge configs covered: GQA ratios 1 / 2 / 4 / 8, head_dim 48 and 80 (not powers of two, and
not hidden/heads), vocab 101, tied and untied embeddings, windows smaller than the prompt.
"""

import numpy as np
import pytest
import transformers
from conformance import check_conformance, hf_generate, hf_last_logits, hf_model, make_checkpoint

from aotlm.models import family_for

V = 101
TINY = dict(vocab_size=V, num_hidden_layers=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def _ckpt(ckpt_dir, name, cfg, scale=None):
    return make_checkpoint(ckpt_dir / name, cfg, scale=scale)


def test_mistral_sliding_window_mqa(ckpt_dir):
    """Window 10 < every prompt; the decode graph (width 64) exceeds it; GQA ratio 8 (MQA); head_dim 48."""
    cfg = transformers.MistralConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=48,
        intermediate_size=96,
        sliding_window=10,
        tie_word_embeddings=False,
        **TINY,
    )
    path = _ckpt(ckpt_dir, "mistral", cfg, scale=2.0)
    model = check_conformance(path, vocab=V)
    assert model.cfg.sliding_window == 10 and not model.cfg.layer_windows
    # a prompt longer than the largest context bucket: chunked prefill across the window
    ref = hf_model(path)
    ids = np.random.default_rng(4).integers(0, V, (3, 40))
    np.testing.assert_allclose(model.forward(ids), hf_last_logits(ref, ids), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(model.sample(ids, max_new_tokens=20), hf_generate(ref, ids, 20))


def test_mixtral_top2_moe(ckpt_dir):
    """4 experts, top-2; MHA (GQA ratio 1); tied embeddings."""
    cfg = transformers.MixtralConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        **TINY,
    )
    path = _ckpt(ckpt_dir, "mixtral", cfg, scale=3.0)
    model = check_conformance(path, vocab=V)
    assert model.cfg.n_experts == 4 and model.params["layers"][0]["e_down"].shape == (4, 48, 32)


def test_moe_routing_matches_transformers_router():
    """Renormalised top-k softmax weights, against the transformers router module itself."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    from aotlm.models.moe import routing_weights

    cfg = transformers.MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    router = MixtralTopKRouter(cfg)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(20, 16)
    logits, scores, idx = router(x)
    want = np.zeros((20, 8), np.float32)
    np.put_along_axis(want, idx.numpy(), scores.detach().numpy(), axis=1)
    got = np.asarray(routing_weights(logits.detach().numpy(), 2))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert ((got > 0).sum(-1) == 2).all()


@pytest.mark.parametrize("tie", [True, False])
def test_qwen2_bias_tie_and_layer_windows(ckpt_dir, tie):
    """q/k/v biases, GQA ratio 4; untied variant also has a sliding window on layer 1 only."""
    extra = {} if tie else dict(use_sliding_window=True, sliding_window=9, max_window_layers=1)
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=tie,
        **extra,
        **TINY,
    )
    path = _ckpt(ckpt_dir, f"qwen2_tie{tie}", cfg, scale=2.0)
    model = check_conformance(path, vocab=V)
    assert ("lm_head" in model.params) is (not tie)
    assert "bq" in model.params["layers"][0] and "bo" not in model.params["layers"][0]
    assert model.cfg.layer_windows == (() if tie else (None, 9))


def test_qwen3_qk_norm_head_dim_80(ckpt_dir):
    cfg = transformers.Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=80,
        intermediate_size=96,
        tie_word_embeddings=False,
        **TINY,
    )
    path = _ckpt(ckpt_dir, "qwen3", cfg, scale=2.0)
    model = check_conformance(path, vocab=V)
    assert model.cfg.qk_norm and model.cfg.head_dim == 80


def test_gemma(ckpt_dir):
    """sqrt(hidden) embedding scale, (1 + w) RMSNorm, gelu-tanh, head_dim 48, MQA, tied."""
    cfg = transformers.GemmaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=48,
        intermediate_size=96,
        pad_token_id=0,
        **TINY,
    )
    path = _ckpt(ckpt_dir, "gemma", cfg)
    model = check_conformance(path, vocab=V)
    assert model.cfg.norm_offset == 1.0 and model.cfg.embed_scale == 8.0 and "lm_head" not in model.params


def test_gemma2_softcaps_local_global(ckpt_dir):
    """Softcaps small enough to bite, window 10 on layer 0 (local) and none on layer 1 (global)."""
    cfg = transformers.Gemma2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=4.0,
        sliding_window=10,
        pad_token_id=0,
        **TINY,
    )
    path = _ckpt(ckpt_dir, "gemma2", cfg, scale=4.0)
    model = check_conformance(path, vocab=V)
    c = model.cfg
    assert c.layer_windows == (10, None) and c.attn_softcap == 1.5 and c.logit_softcap == 4.0
    assert "ln1_post_scale" in model.params["layers"][1] and "ln2_post_scale" in model.params["layers"][1]


def test_phi3_fused_partial_rotary_window(ckpt_dir):
    """Fused qkv / gate_up, partial rotary 0.5, window 12 < the 13-token prompt; GQA ratio 2."""
    cfg = transformers.Phi3Config(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=96,
        sliding_window=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=0,
        **TINY,
    )
    path = _ckpt(ckpt_dir, "phi3", cfg, scale=2.0)
    model = check_conformance(path, vocab=V)
    assert len(model.cfg.inv_freq) == 2 and model.cfg.sliding_window == 12


def test_phi3_longrope_is_rejected():
    cfg = transformers.Phi3Config(
        hidden_size=64,
        num_attention_heads=8,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
    )
    with pytest.raises(ValueError, match="longrope"):
        family_for("phi3").arch_config(cfg)


def test_registry_lists_new_families():
    from aotlm.models import supported_model_types

    for mt in ("mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"):
        assert mt in supported_model_types()
    with pytest.raises(ValueError, match="layer_types"):
        cfg = transformers.Qwen2Config(use_sliding_window=True, sliding_window=4, num_hidden_layers=2)
        cfg.layer_types = ["sliding_attention", "chunked_attention"]
        family_for("qwen2").arch_config(cfg)
