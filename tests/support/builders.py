"""Builders shared by several test modules: tiny random checkpoints, the prompts they are run on,
error measures. Test modules import these (never each other's private helpers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from aotlm import AutoModelForSampling

T = transformers
V = 101  # the vocabulary of ``llama_config``
PROMPTS = np.random.default_rng(1).integers(0, V, (2, 9))


def save_checkpoint(
    path: Path, cfg, seed: int = 0, scale: float = 1.0, peaked: bool = False, noisy_1d: bool = False
):
    """Random-init checkpoint. ``peaked``: lm_head = permuted embedding rows (a successor model).
    ``noisy_1d``: random biases / norm weights too (so fused bias layouts are really checked)."""
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
            elif noisy_1d:
                p.add_(0.1 * torch.randn_like(p))
        if peaked:
            perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
            model.get_output_embeddings().weight.copy_(model.get_input_embeddings().weight[perm])
    model.save_pretrained(str(path))
    return path


def llama_config(**kw):
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    return T.LlamaConfig(
        **{**base, **kw},
        num_hidden_layers=2,
        vocab_size=V,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def peaked_checkpoint(ckpt_dir: Path) -> Path:
    """The peaked Llama (``save_checkpoint(peaked=True)``): greedy top-1 margins >= 20% of max|logit|."""
    return save_checkpoint(ckpt_dir / "wo_peaked", llama_config(), seed=0, peaked=True)


def rel_error(y, ref) -> float:
    """``max|y - ref| / max|ref|``, in float64."""
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max())


def run_with_kernels(path, monkeypatch, on: bool, **kw):
    """``(last-prompt logits, 16 greedy tokens, kernels called, model)`` of ``PROMPTS`` with the
    CPU kernels on or off (``AOTLM_KERNELS``)."""
    monkeypatch.setenv("AOTLM_KERNELS", "1" if on else "0")
    m = AutoModelForSampling.from_pretrained(
        path, batch_size=2, n_positions=32, context_length_estimate=32, compile_cache=False, **kw
    )
    m.compile()
    texts = [exe.as_text() for exe in m._executables.values()]
    return m.forward(PROMPTS), m.sample(PROMPTS, max_new_tokens=16), any("aotlm_wmm" in t for t in texts), m
