"""Shared helpers for tests: tiny random-init transformers checkpoints and the HF reference.

Every conformance test builds a small model with transformers (torch, fp32, fixed seed),
``save_pretrained``s it as safetensors and compares aotlm against that same PyTorch model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_checkpoint(root: Path, config, seed: int = 0, scale: float | None = None, **save_kw) -> Path:
    """Save a random-init ``AutoModelForCausalLM`` for ``config`` under ``root``; returns the dir.

    ``scale`` multiplies every weight matrix (peaked logits: fewer near-ties in greedy search).
    """
    import torch
    import transformers

    path = Path(root)
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if scale is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(scale)
    model.save_pretrained(str(path), **save_kw)
    return path


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()


def hf_last_logits(model, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    import torch

    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": torch.tensor(mask)}
        return model(torch.tensor(ids), **kw).logits[:, -1].float().numpy()


def hf_generate(model, ids: np.ndarray, new: int, mask: np.ndarray | None = None, eos=None, pad=0, **extra):
    """transformers' greedy ``generate`` (``extra``: more of its keywords, e.g. ``bad_words_ids``)."""
    import torch

    # an explicit mask: without one, generate treats every pad_token_id in the prompt as padding
    mask = np.ones_like(ids) if mask is None else mask
    kw = {"attention_mask": torch.tensor(mask)}
    with torch.no_grad():
        out = model.generate(
            torch.tensor(ids),
            max_new_tokens=new,
            min_new_tokens=None,
            do_sample=False,
            repetition_penalty=1.0,  # over a generation_config.json (sample() never reads one)
            no_repeat_ngram_size=0,
            eos_token_id=eos,
            pad_token_id=pad,
            **kw,
            **extra,
        )
    return out.numpy()


def left_padded_batch(rng, lengths, vocab: int, pad: int = 0):
    """``(ids, mask)`` for prompts of ``lengths``, left-padded to the longest."""
    n = max(lengths)
    ids = np.full((len(lengths), n), pad, np.int64)
    mask = np.zeros((len(lengths), n), np.int64)
    for i, length in enumerate(lengths):
        ids[i, n - length :] = rng.integers(0, vocab, length)
        mask[i, n - length :] = 1
    return ids, mask


def check_conformance(
    path,
    vocab: int,
    n_positions=(64, 128),
    ctx=(16, 32),
    new_tokens: int = 32,
    tol: float = 1e-4,
    amp: str = "f32",
    tp_degree: int = 1,
    **load_kw,
):
    """The standard conformance check against transformers PyTorch fp32.

    1. last-position logits of a single prompt within ``tol``;
    2. ``new_tokens`` greedy tokens identical to ``generate``;
    3. a left-padded batch of 3 prompts of different lengths identical to ``generate``
       with the same ``attention_mask``.
    Returns the aotlm model (compiled) for further checks.
    """
    from aotlm import AutoModelForSampling

    rng = np.random.default_rng(1)
    ref = hf_model(path)
    eos = ref.config.eos_token_id
    eos = eos if isinstance(eos, int) and eos < vocab else None
    model = AutoModelForSampling.from_pretrained(
        path,
        batch_size=3,
        n_positions=list(n_positions),
        context_length_estimate=list(ctx),
        amp=amp,
        tp_degree=tp_degree,
        compile_cache=False,
        **load_kw,
    )
    ids = rng.integers(0, vocab, (1, 12))
    got = model.forward(ids)
    want = hf_last_logits(ref, ids)
    assert np.abs(got - want).max() <= tol, f"logits differ by {np.abs(got - want).max()}"

    out = model.sample(ids, max_new_tokens=new_tokens)
    exp = hf_generate(ref, ids, new_tokens, eos=None)
    assert out.shape == exp.shape, (out.shape, exp.shape)
    np.testing.assert_array_equal(out, exp)

    ids, mask = left_padded_batch(rng, [5, 13, 9], vocab)
    out = model.sample(ids, max_new_tokens=new_tokens, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    exp = hf_generate(ref, ids, new_tokens, mask=mask, eos=eos)
    np.testing.assert_array_equal(out, exp)
    return model


class Recorder:
    """A streamer (``put`` / ``end``) that keeps what it was given."""

    def __init__(self):
        self.calls = []

    def put(self, tokens):
        self.calls.append(np.asarray(tokens).copy())

    def end(self):
        self.calls.append("end")


# Gemma3's two rope bases: layer 0 local (base 100), layer 1 global (base 10000, linear x8 scaling)
GEMMA3_ROPES = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
}


def gemma3_config(**kw):
    """A tiny ``Gemma3TextConfig`` (q/k norms, one local and one global layer, both ropes); ``kw`` wins."""
    import transformers

    base = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=GEMMA3_ROPES,
        pad_token_id=0,
    )
    return transformers.Gemma3TextConfig(**{**base, **kw})
