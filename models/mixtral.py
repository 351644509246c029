"""Mixtral: Mistral attention with a top-k mixture-of-experts MLP (``models/moe.py``).

Checkpoints store each expert separately (``block_sparse_moe.experts.{e}.w1/w2/w3``: gate,
down, up, torch ``[out, in]``) and the router as ``block_sparse_moe.gate``; the loader stacks
the experts into ``e_gate``/``e_up [E,D,F]`` and ``e_down [E,F,D]``.
"""

from __future__ import annotations

import numpy as np

from aotlm.models import llama
from aotlm.models.arch import ArchConfig
from aotlm.models.weights import linear_t, row

MODEL_TYPES = ("mixtral",)
PREFIXES = llama.PREFIXES


def arch_config(hf) -> ArchConfig:
    return llama.arch_config(
        hf, n_experts=int(hf.num_local_experts), experts_per_token=int(hf.num_experts_per_tok)
    )


def _stack_t(*mats: np.ndarray) -> np.ndarray:
    """E torch ``[out, in]`` matrices -> ``[E, in, out]``."""
    return np.ascontiguousarray(np.stack([m.T for m in mats]))


def weight_rows(cfg: ArchConfig, hf) -> list:
    rows = [r for r in llama.weight_rows(cfg, hf) if ".mlp." not in r.hf]
    for i in range(cfg.n_layers):
        p, L = f"layers.{i}.block_sparse_moe.", ("layers", i)
        for target, w in (("e_gate", "w1"), ("e_down", "w2"), ("e_up", "w3")):
            first, *more = [f"{p}experts.{e}.{w}.weight" for e in range(cfg.n_experts)]
            rows.append(row(L + (target,), first, _stack_t, more=more))
        rows.append(row(L + ("router",), p + "gate.weight", linear_t))
    return rows
