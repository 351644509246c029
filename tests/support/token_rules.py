"""The setup the token-rule tests share (``bans``, ``sequence_bias``): three left-padded prompts of a
101-token vocabulary (rows of 6, 4 and 5 real tokens), and ``sample()`` / transformers' greedy
``generate`` over them with the same eos and pad."""

from __future__ import annotations

import numpy as np
from conformance import hf_generate, hf_model

from aotlm import AutoModelForSampling

KW = dict(n_positions=[32, 64], context_length_estimate=[8, 16], compile_cache=False)
NEW, EOS = 12, 2


class Prompts:
    """``ids`` / ``mask`` ``[3, 6]`` drawn with ``seed``; ``ours`` and ``theirs`` generate ``NEW`` tokens."""

    def __init__(self, seed: int):
        ids = np.random.default_rng(seed).integers(3, 101, (3, 6))
        self.mask = np.ones_like(ids)
        self.mask[1, :2] = self.mask[2, :1] = 0
        self.ids = np.where(self.mask > 0, ids, 0)

    def theirs(self, ref, **kw) -> np.ndarray:
        return hf_generate(ref, self.ids, NEW, self.mask, eos=EOS, pad=0, **kw)

    def ours(self, model, **kw) -> np.ndarray:
        return model.sample(
            self.ids, attention_mask=self.mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0, **kw
        )


def model_pair(path):
    """The checkpoint compiled for the three prompts, and transformers' model of it."""
    return AutoModelForSampling.from_pretrained(path, batch_size=3, **KW), hf_model(path)
