"""GGUF tensor names -> Hugging Face checkpoint names, and llama.cpp's layout changes undone.

llama.cpp's converter (``convert_hf_to_gguf.py``) renames every tensor to its standard names
(``token_embd``, ``blk.N.attn_q``, ...; gguf-py's ``TensorNameMap`` holds them) and changes a few
layouts on the way; :func:`hf_tensor` reverses both, so the converted checkpoint is what the
family's ``save_pretrained`` would have written and every ``weight_rows`` table reads it unchanged:

* ``llama`` (also Mistral, which llama.cpp writes as ``llama``): the rows of ``attn_q`` / ``attn_k``
  are permuted per head for llama.cpp's interleaved rope (``(2, Dh/2)`` -> ``(Dh/2, 2)``); undone.
* ``gemma2`` / ``gemma3``: every norm weight is stored as ``1 + w`` (the ``x * (1 + w)`` RMSNorm);
  1 is subtracted, in float32.
* ``gpt2``: the ``Conv1D`` matrices (``c_attn``, ``c_proj``, ``c_fc``) are stored transposed to the
  usual ``[out, in]``; transposed back to ``[in, out]``.
* ``bloom``: the fused q/k/v rows are stored as ``[q | k | v]``; regrouped per head (``[H, 3, Dh]``).

Only architectures that both aotlm (a model family) and transformers' GGUF loading (the reference
the tests compare against) support are listed in :data:`ARCHS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from aotlm.models.checkpoint import formats

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GEMMA2_LAYER = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",  # Phi-3's fused gate/up: llama.cpp keeps it as one ffn_up
    "ffn_down": "mlp.down_proj",
}
_GPT2_TOP = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_GPT2_LAYER = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_BLOOM_TOP = {
    "token_embd": "transformer.word_embeddings",
    "token_embd_norm": "transformer.word_embeddings_layernorm",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_BLOOM_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}


@dataclass(frozen=True)
class Arch:
    """One GGUF ``general.architecture``: its HF names and the model_type aotlm builds it as."""

    model_type: str  # transformers' model_type of the converted checkpoint
    top: dict[str, str]  # GGUF name (no .weight / .bias) -> HF name
    layer: dict[str, str]  # per block: GGUF ``blk.N.<key>`` -> HF ``<layer_prefix>N.<value>``
    layer_prefix: str = "model.layers."
    also: tuple[str, ...] = ()  # other model_types transformers may read the file as


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", _LLAMA_TOP, _LLAMA_LAYER, also=("mistral",)),  # Mistral: "mistral" in its name
    "qwen2": Arch("qwen2", _LLAMA_TOP, _LLAMA_LAYER),
    "qwen3": Arch("qwen3", _LLAMA_TOP, _LLAMA_LAYER),
    "phi3": Arch("phi3", _LLAMA_TOP, _PHI3_LAYER),
    "gemma2": Arch("gemma2", _LLAMA_TOP, _GEMMA2_LAYER),
    "gemma3": Arch("gemma3_text", _LLAMA_TOP, _GEMMA2_LAYER),
    "gpt2": Arch("gpt2", _GPT2_TOP, _GPT2_LAYER, "transformer.h."),
    "bloom": Arch("bloom", _BLOOM_TOP, _BLOOM_LAYER, "transformer.h."),
}
# llama.cpp tensors no supported family reads; refused by name rather than dropped silently
# tensors that configure the model rather than weigh it: read into config.json at conversion
ROPE_FACTORS = (
    "rope_freqs"  # Llama 3.x: llama.cpp's converter writes its llama3 rope scaling as these divisors
)
UNSUPPORTED_TENSORS = {
    "rope_factors_long": "Phi-3 LongRoPE factors (128k-context models)",
    "rope_factors_short": "Phi-3 LongRoPE factors (128k-context models)",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


def hf_name(arch: Arch, gguf_name: str) -> str | None:
    """The HF checkpoint name of GGUF tensor ``gguf_name`` (None: not a tensor of this table)."""
    base, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    m = _BLOCK.match(base)
    if m is None:
        hf = arch.top.get(base)
        return None if hf is None else f"{hf}.{suffix}"
    hf = arch.layer.get(m.group(2))
    return None if hf is None else f"{arch.layer_prefix}{m.group(1)}.{hf}.{suffix}"


def unpermute_rope(a: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Llama q / k weight ``[H*Dh, D]`` or bias.

    llama.cpp stores each head's rows as ``(Dh/2, 2)`` (pairs for its interleaved rope) where HF has
    ``(2, Dh/2)`` (halves for ``rotate_half``).
    """
    half = a.shape[0] // n_heads // 2
    return a.reshape(n_heads, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def bloom_qkv(a: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``[q | k | v]`` rows of Bloom's fused projection -> HF's per-head ``[H, 3, Dh]``."""
    q, k, v = (x.reshape(n_heads, -1, *a.shape[1:]) for x in np.split(a, 3, axis=0))
    return np.stack([q, k, v], axis=1).reshape(a.shape)


def key_of(gguf_name: str) -> str:
    """The tensor's kind, without block number and suffix: ``"blk.3.attn_q.weight"`` -> ``"attn_q"``."""
    return gguf_name.rsplit(".", 1)[0].rsplit(".", 1)[-1]


def transform(arch_name: str, gguf_name: str, meta: dict) -> Callable[[np.ndarray], np.ndarray] | None:
    """The layout change to undo for ``gguf_name`` (None: stored as HF stores it).

    ``meta``: the converted config's fields (``num_attention_heads``, ``num_key_value_heads``, ``n_head``).
    """
    key = key_of(gguf_name)
    if arch_name == "llama" and key in ("attn_q", "attn_k"):
        heads = meta["num_attention_heads"] if key == "attn_q" else meta["num_key_value_heads"]
        return lambda a: unpermute_rope(a, heads)
    if needs_float(arch_name, gguf_name):  # Gemma's norms stored as 1 + w
        return lambda a: np.asarray(a, np.float32) - np.float32(1.0)
    if transposed(arch_name, gguf_name):
        return formats.transposed
    if arch_name == "bloom" and key == "attn_qkv":
        return lambda a: bloom_qkv(a, meta["n_head"])
    return None


def transposed(arch_name: str, gguf_name: str) -> bool:
    """Whether ``gguf_name`` is a GPT-2 ``Conv1D`` matrix (stored ``[out, in]``, HF keeps ``[in, out]``)."""
    return arch_name == "gpt2" and key_of(gguf_name) in _GPT2_CONV1D and gguf_name.endswith(".weight")


def needs_float(arch_name: str, gguf_name: str) -> bool:
    """Whether the change for ``gguf_name`` is arithmetic (stored as float32, not the file's f16 / bf16)."""
    return arch_name in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight")
