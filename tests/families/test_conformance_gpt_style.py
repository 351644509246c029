"""Conformance of the GPT-J, GPT-NeoX, OPT, BLOOM, MPT, Falcon and GPTBigCode families against
transformers PyTorch fp32: one tiny random checkpoint per architecture variant real checkpoints
use. ``FULL`` variants run the whole ``check_conformance`` (logits, 32 greedy tokens, left-padded
batch == ``generate``); ``PREFILL`` variants differ from a ``FULL`` one only in weight layout /
block wiring, so they check the last-position logits of a left-padded batch (one compiled
graph) to keep the file fast on a shared 2-core machine.

Edge cases covered: vocab 101, head_dim 80 (GPT-NeoX), 6 heads (non-power-of-two ALiBi),
partial rotary (GPT-J interleaved 8/16 dims, NeoX 25% of 80), MQA / GQA / MHA fused layouts,
tied and untied embeddings, post-norm OPT without final norm, MPT clip_qkv.
"""

import inspect

import numpy as np
import pytest
import torch
import transformers
from conformance import check_conformance, hf_model, left_padded_batch

from aotlm import AutoModelForSampling

V = 101  # vocab not a multiple of 8
SCALE = 4.0  # weights x4: sharper attention, so a wrong rotary / ALiBi detail moves logits by >1e-3
T = transformers
TINY = dict(vocab_size=V)

FULL = {
    # interleaved rotary on 8 of 16 head dims, parallel residual from ln_1, lm_head with bias
    "gptj": lambda: T.GPTJConfig(n_embd=64, n_head=4, n_layer=2, rotary_dim=8, n_positions=128, **TINY),
    # head_dim 80 (not a power of two), rotary_pct 0.25 -> 20 rotary dims, parallel residual, untied
    "gpt_neox_parallel": lambda: T.GPTNeoXConfig(
        hidden_size=160,
        num_attention_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
        rotary_pct=0.25,
        max_position_embeddings=128,
        **TINY,
    ),
    # OPT-350m shape: post-norm (and no final norm), project_in/out 32 <-> 64, relu, tied
    "opt_350m_like": lambda: T.OPTConfig(
        hidden_size=64,
        num_attention_heads=4,
        ffn_dim=96,
        num_hidden_layers=2,
        word_embed_proj_dim=32,
        do_layer_norm_before=False,
        max_position_embeddings=128,
        **TINY,
    ),
    # 6 heads: ALiBi slopes for a non-power-of-two head count; tied
    "bloom": lambda: T.BloomConfig(hidden_size=96, n_head=6, n_layer=2, **TINY),
    # 6 heads; clip_qkv small enough to clip many q/k/v values of a random init; tied
    "mpt": lambda: T.MptConfig(
        d_model=96,
        n_heads=6,
        n_layers=2,
        max_seq_len=128,
        expansion_ratio=2,
        attn_config={"clip_qkv": 0.05},
        **TINY,
    ),
    # Falcon-40B shape: new decoder architecture, GQA (2 kv heads), ln_attn / ln_mlp
    "falcon_40b_like": lambda: T.FalconConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        num_hidden_layers=2,
        new_decoder_architecture=True,
        max_position_embeddings=128,
        **TINY,
    ),
    # SantaCoder shape: multi-query, learned positions, tied
    "gpt_bigcode_mqa": lambda: T.GPTBigCodeConfig(
        n_embd=64, n_head=4, n_layer=2, n_positions=128, multi_query=True, **TINY
    ),
}

PREFILL = {
    # Falcon-7B shape: multi-query, parallel attention + MLP from one norm, rotary, no bias
    "falcon_7b_like": lambda: T.FalconConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        multi_query=True,
        parallel_attn=True,
        bias=False,
        max_position_embeddings=128,
        **TINY,
    ),
    # Falcon-RW shape: ALiBi, sequential block, MHA, biases
    "falcon_rw_like": lambda: T.FalconConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        multi_query=False,
        parallel_attn=False,
        alibi=True,
        bias=True,
        max_position_embeddings=128,
        **TINY,
    ),
    "gpt_neox_sequential_tied": lambda: T.GPTNeoXConfig(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=96,
        num_hidden_layers=2,
        rotary_pct=0.5,
        use_parallel_residual=False,
        tie_word_embeddings=True,
        max_position_embeddings=128,
        **TINY,
    ),
    "opt_prenorm_untied": lambda: T.OPTConfig(
        hidden_size=64,
        num_attention_heads=4,
        ffn_dim=96,
        num_hidden_layers=2,
        word_embed_proj_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=128,
        **TINY,
    ),
    "bloom_untied": lambda: T.BloomConfig(
        hidden_size=64, n_head=4, n_layer=2, tie_word_embeddings=False, **TINY
    ),
    "mpt_untied": lambda: T.MptConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=128, tie_word_embeddings=False, **TINY
    ),
    # Falcon2-11B shape: new architecture with one shared norm; MQA via num_kv_heads=1; untied
    "falcon_one_ln_untied": lambda: T.FalconConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=1,
        num_hidden_layers=2,
        new_decoder_architecture=True,
        num_ln_in_parallel_attn=1,
        tie_word_embeddings=False,
        max_position_embeddings=128,
        **TINY,
    ),
    "gpt_bigcode_mha_untied": lambda: T.GPTBigCodeConfig(
        n_embd=64,
        n_head=4,
        n_layer=2,
        n_positions=128,
        multi_query=False,
        tie_word_embeddings=False,
        **TINY,
    ),
}


def make_checkpoint(path, config, seed: int = 0, scale: float | None = None):
    """A random-init checkpoint whose biases and norm weights are random too.

    transformers initialises every bias to 0 and every norm weight to 1, which would leave the
    layout of those tensors (e.g. per-head fused q/k/v biases, which norm is which) untested.
    """
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
            elif scale is not None:
                p.mul_(scale)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tiny reference models run fastest single-threaded on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(FULL))
def test_conformance(name, ckpt_dir):
    path = make_checkpoint(ckpt_dir / f"a_{name}", FULL[name](), scale=SCALE)
    check_conformance(path, vocab=V)


def _hf_padded_logits(ref, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Last-position logits with the position ids ``generate`` derives from the mask."""
    kw = {"attention_mask": torch.tensor(mask)}
    if "position_ids" in inspect.signature(ref.forward).parameters:
        kw["position_ids"] = torch.tensor(np.where(mask > 0, np.cumsum(mask, 1) - 1, 0))
    with torch.no_grad():
        return ref(torch.tensor(ids), **kw).logits[:, -1].numpy()


@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_left_padded(name, ckpt_dir):
    path = make_checkpoint(ckpt_dir / f"a_{name}", PREFILL[name](), scale=SCALE)
    ref = hf_model(path)
    model = AutoModelForSampling.from_pretrained(
        path, batch_size=3, n_positions=64, context_length_estimate=16, compile_cache=False
    )
    assert model.cfg.tie_embeddings == ("lm_head" not in model.params)
    ids, mask = left_padded_batch(np.random.default_rng(2), [5, 13, 9], V)
    got = model.forward(ids, attention_mask=mask)
    want = _hf_padded_logits(ref, ids, mask)
    assert np.abs(got - want).max() <= 1e-4, f"logits differ by {np.abs(got - want).max()}"


@pytest.mark.parametrize("n_heads", [4, 6, 12])
@pytest.mark.parametrize("bias_max", [8, 16])
def test_mpt_alibi_slopes_match_transformers(n_heads, bias_max):
    """MPT's slopes (incl. the config's alibi_bias_max, which transformers' MptModel ignores)
    against transformers' own ``build_mpt_alibi_tensor``; for bias_max 8 they equal BLOOM's."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from aotlm.models.layers import alibi_slopes
    from aotlm.models.mpt import mpt_alibi_slopes

    want = build_mpt_alibi_tensor(n_heads, 2, bias_max)[:, 0, 0].neg().numpy()  # slope * (0 - 1)
    np.testing.assert_allclose(mpt_alibi_slopes(n_heads, bias_max), want, rtol=1e-6)
    if bias_max == 8:
        np.testing.assert_allclose(mpt_alibi_slopes(n_heads), alibi_slopes(n_heads), rtol=1e-12)


def test_unsupported_variants_are_rejected():
    from aotlm.models import family_for

    bad = [
        T.MptConfig(d_model=32, n_heads=4, n_layers=1, attn_config={"qk_ln": True}),
        T.BloomConfig(hidden_size=32, n_head=4, n_layer=1, apply_residual_connection_post_layernorm=True),
        T.OPTConfig(hidden_size=32, num_attention_heads=4, layer_norm_elementwise_affine=False),
        T.GPTBigCodeConfig(n_embd=32, n_head=4, n_layer=1, add_cross_attention=True),
    ]
    for cfg in bad:
        with pytest.raises(ValueError, match="not supported|decoder-only"):
            family_for(cfg.model_type).arch_config(cfg)
