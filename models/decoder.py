"""The decoder-only transformer every family is an instance of.

A family file (``gpt2.py``, ``llama.py`` ...) turns a transformers config into an
``ArchConfig`` (static: frozen and hashable, so it can be a ``jax.jit`` static argument)
and lists its HF weight names; the maths lives here and in ``layers.py``:

    x_0 = embed(tokens) * embed_scale (+ pos_embed(positions))
    pre-norm:       x += attn(norm1(x));  x += mlp(norm2(x))
    parallel:       x += attn(norm1(x)) + mlp(norm2(x) or norm1(x))
    post-norm:      x = norm1(x + attn(x)); x = norm2(x + mlp(x))
    logits = norm_f(x) @ W_out

Parameters are a pytree: ``{"embed", ["pos_embed"], "layers": [per-layer dict], ...}``.
Per-layer dicts (not stacked arrays) keep every weight a whole buffer, so no graph ever
slices (and copies) weights in the decode hot path. Optional weights (biases, extra
norms) are simply absent from the dict; the code checks presence, which is static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aotlm import kernels
from aotlm.models import adapters, flash, lookup, lowp, packing, quant4, quant8, quant_fp8
from aotlm.models import layers as L
from aotlm.models import projections as P
from aotlm.models.arch import ArchConfig
from aotlm.models.moe import moe_mlp


def embed(cfg: ArchConfig, params, tokens, positions):
    x = lookup.take(params, tokens)  # a plain gather, or rebuilt from a file's grouped codes
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    if "proj_in" in params:  # OPT-350m: word_embed_proj_dim != hidden_size
        x = L.dense(x, params["proj_in"], name="proj_in")
    if "embed_norm_scale" in params:  # BLOOM: word_embeddings_layernorm
        x = L.norm(cfg.norm, x, params, "embed_norm", cfg.norm_eps, cfg.norm_offset)
    if cfg.position == "learned":
        pos = jnp.clip(positions, 0, cfg.max_positions - 1) + cfg.learned_pos_offset
        x = x + jnp.take(params["pos_embed"], pos, axis=0).astype(x.dtype)
    return x


def qkv_heads(cfg: ArchConfig, p, x, rotary, index: int):
    """q ``[B,T,H,Dh]``, k, v ``[B,T,K,Dh]`` of layer ``index``: projected, clipped, normed, rotated
    (``rotary``: ``forward``'s tables by inverse frequencies)."""
    q, k, v = P.project_qkv(x, p)
    if cfg.clip_qkv is not None:  # MPT / DBRX attn_config.clip_qkv (elementwise, so per q/k/v)
        q, k, v = (jnp.clip(y, -cfg.clip_qkv, cfg.clip_qkv) for y in (q, k, v))
    if cfg.qk_norm:
        q = L.rms_norm(q, p["q_norm_scale"], cfg.norm_eps, cfg.norm_offset)
        k = L.rms_norm(k, p["k_norm_scale"], cfg.norm_eps, cfg.norm_offset)
    if cfg.position == "rope":
        tables = rotary[cfg.rope(index)]  # Gemma3: the windowed layers' own base
        q = L.apply_rotary(q, tables, cfg.rope_interleaved)
        k = L.apply_rotary(k, tables, cfg.rope_interleaved)
    return q, k, v


def attention_block(cfg: ArchConfig, p, x, rotary, kv, write_idx, mask, alibi_bias, index: int):
    """Self-attention of layer ``index``; returns the output and the updated (k, v) cache."""
    ck, cv = kv
    if own_tokens_kernel(cfg, x, mask, alibi_bias):  # a prompt from slot 0: no cache read
        plain = cfg.clip_qkv is None and not cfg.qk_norm and cfg.position != "rope"
        qkv = P.fused_qkv(x, p) if plain else None  # read in place by the kernel: no slicing copies
        q, k, v = (qkv, None, None) if qkv is not None else qkv_heads(cfg, p, x, rotary, index)
        o, kt, vt = kernels.causal_attention(q, k, v, mask[1], cfg.scale)
        return P.out_proj(p, o), L.write_cache(ck, cv, kt, vt, write_idx)
    q, k, v = qkv_heads(cfg, p, x, rotary, index)
    if isinstance(mask, flash.Keys):  # a long call: key blocks with an online softmax
        slopes = cfg.alibi if cfg.position == "alibi" else None
        o = flash.attend(q, k, v, kv, mask, cfg.scale, cfg.attn_softcap, slopes)
    else:
        o = whole_attention(cfg, q, k, v, kv, write_idx, mask, alibi_bias)
    # Make the cache write depend on the attention output so that it is scheduled after the
    # cache read: otherwise XLA may write first and must then copy the whole cache layer every
    # step to keep the read correct (optimization_barrier is removed too early on CPU). The
    # dependency is elementwise on each kv head's first query head: local under any sharding.
    b, t, kh, dh = k.shape
    zero = jnp.zeros((), k.dtype) * o.reshape(b, t, kh, -1, dh)[:, :, :, 0, :].astype(k.dtype)
    k, v = k + zero, v + zero
    return P.out_proj(p, o), L.update_cache(ck, cv, k, v, write_idx)


def whole_attention(cfg: ArchConfig, q, k, v, kv, write_idx, mask, alibi_bias) -> jax.Array:
    """``layers.attend`` over the old cache and the call's new keys, with whole masks ``[B,T,W]``."""
    (m_old, m_new), (b_old, b_new) = mask, alibi_bias or (None, None)
    fused = m_old is not None and alibi_bias is None and cfg.attn_softcap is None
    if fused and kernels.decode_attention_ok(q):  # one query token per row: one kernel call
        return L.attend_decode(q, k, v, kv, m_old, m_new, old_limit(write_idx, m_new), cfg.scale)
    if fused and kernels.gpu_attention_ok(q, kv[0], m_old.shape[-1]):  # the same on a GPU
        return L.attend_decode(q, k, v, kv, m_old, m_new, old_limit(write_idx, m_new), cfg.scale, gpu=True)
    segments = [(jnp.swapaxes(k, 1, 2), jnp.transpose(v, (0, 2, 3, 1)), m_new, b_new, None)]
    if m_old is not None:  # the whole cache: attend reads its first m_old.shape[-1] slots
        segments.insert(0, (*kv, m_old, b_old, old_limit(write_idx, m_new)))
    return L.attend(q, segments, cfg.scale, cfg.attn_softcap)


def old_limit(write_idx, m_new):
    """The cache slots each row's queries may see: none at or past its write slot (``write_idx``,
    a scalar or ``[B]``). Per row, a row whose new tokens are all padding (a finished serving row)
    sees none, so the kernels read nothing of it."""
    if jnp.ndim(write_idx) == 0:
        return write_idx
    return jnp.where(jnp.any(m_new, axis=(1, 2)), write_idx, 0)


def own_tokens_kernel(cfg: ArchConfig, x, mask, alibi_bias) -> bool:
    """Static: does this call attend with ``kernels.causal_attention``? A prompt from slot 0 (whole
    masks, no old segment) without ALiBi or soft-capping, on the CPU kernels: one call per layer
    instead of XLA's two batched dots, masking, softmax and layout copies, only the causal half of
    the scores, and k / v come back in the cache's layouts."""
    if isinstance(mask, flash.Keys) or mask[0] is not None or alibi_bias is not None:
        return False
    return cfg.attn_softcap is None and kernels.causal_attention_ok(x)


def feed_forward(cfg: ArchConfig, p, x):
    if cfg.n_experts:
        return moe_mlp(cfg, p, x)
    return P.mlp(x, p, cfg.act, cfg.gated_mlp)


def layer(cfg: ArchConfig, p, x, rotary, kv, write_idx, mask, alibi_bias, index: int):
    """Decoder layer ``index`` (of the whole model: it picks the layer's static window / rope tables)."""
    n = lambda y, name: L.norm(cfg.norm, y, p, name, cfg.norm_eps, cfg.norm_offset)
    if cfg.post_norm:
        a, kv = attention_block(cfg, p, x, rotary, kv, write_idx, mask, alibi_bias, index)
        x = n(x + a, "ln1")
        return n(x + feed_forward(cfg, p, x), "ln2"), kv
    h = n(x, "ln1")
    a, kv = attention_block(cfg, p, h, rotary, kv, write_idx, mask, alibi_bias, index)
    if "ln1_post_scale" in p:  # Gemma2: norm on the attention output before the residual add
        a = n(a, "ln1_post")
    if cfg.parallel_residual:
        m_in = h if cfg.shared_input_norm else n(x, "ln2")
        return x + a + feed_forward(cfg, p, m_in), kv
    x = x + a
    m = feed_forward(cfg, p, n(x, "ln2"))
    if "ln2_post_scale" in p:  # Gemma2: norm on the MLP output before the residual add
        m = n(m, "ln2_post")
    return x + m, kv


def visibility(cfg: ArchConfig, cache_pos, positions, write_idx, width: int) -> tuple[dict, tuple | None]:
    """Per distinct sliding window, what a layer's attention needs to know who sees whom.

    Whole masks (``layers.attention_mask``) and ALiBi biases for a short call; for a long one
    (``flash.use_blocked``, static shapes) a ``flash.Keys`` from which each key block's
    visibility and bias are rebuilt, since a whole ``[T, W]`` mask would not fit.
    Returns ``({window: mask or Keys}, alibi bias or None)``.
    """
    windows = {cfg.window(i) for i in range(cfg.n_layers)}  # one mask per distinct window
    cache_pos = cache_pos[: positions.shape[0]]  # a call may run the cache's first rows only
    if flash.use_blocked(positions.shape[1], width):
        return {w: flash.Keys(cache_pos, positions, write_idx, width, w) for w in windows}, None
    masks = {w: L.attention_mask(cache_pos, positions, write_idx, width, w) for w in windows}
    if cfg.position != "alibi":
        return masks, None
    slopes = jnp.asarray(cfg.alibi, jnp.float32)[None, :, None, None]  # slope * key position:
    key_bias = lambda kp: slopes * jnp.maximum(kp, 0).astype(jnp.float32)[:, None, None, :]
    return masks, (key_bias(cache_pos[:, :width]) if width else None, key_bias(positions))  # [B,H,1,W|T]


def forward(
    cfg: ArchConfig, params, cache, tokens, positions, write_idx, width: int, first_layer: int = 0, lora=None
):
    """Run ``tokens [B,T]`` at cache slots ``write_idx .. write_idx+T-1``.

    A pipeline stage (``aotlm.core.pipeline``) passes its own layers from ``first_layer`` (static)
    on, and hidden states ``[B,T,D]`` instead of token ids unless it is the first stage; the
    final norm runs where its weights are (the last stage).

    ``write_idx`` is traced: a scalar (all rows write the same slots) or ``[B]`` (each row its
    own slot, as serving slots do; then ``T == 1`` in practice). The cache may hold more rows
    than ``tokens``: the call reads and writes its first ``B`` rows only (a serving decode
    graph for fewer live rows than slots).
    ``positions [B,T]`` are the tokens' model positions (``-1`` marks padding, whose
    slot stays invisible to every query). ``width`` (static) is how many cache slots the
    queries attend to besides their own tokens (0: none, for a prompt starting at slot 0).
    ``lora [B]`` (traced int32, or None: every row the base model) is each row's adapter slot
    (``adapters``; ``-1``: none), read where the layers hold adapter tables.
    Returns final-normed hidden states ``[B,T,D]`` and the new cache.
    """
    positions = positions.astype(jnp.int32)
    kv_pos = L.write_at(cache["pos"], positions, write_idx, 1)
    pos = jnp.maximum(positions, 0)
    masks, bias = visibility(cfg, cache["pos"], positions, write_idx, width)
    x = embed(cfg, params, tokens, pos) if tokens.ndim == 2 else tokens
    n_layers = len(params["layers"])
    freqs = {cfg.rope(first_layer + i) for i in range(n_layers)} if cfg.position == "rope" else ()
    rotary = {f: L.rotary_tables(pos, f) for f in freqs}  # once per call, shared by the layers
    new_k, new_v = [], []
    # a prefill's padding rows: the GEMMs skip them; each row's adapter
    with kernels.padding_rows(positions < 0), adapters.rows(lora):
        for i, p in enumerate(params["layers"]):
            kv = (cache["k"][i], cache["v"][i])
            li = first_layer + i
            x, (ck, cv) = layer(cfg, p, x, rotary, kv, write_idx, masks[cfg.window(li)], bias, li)
            new_k.append(ck)
            new_v.append(cv)
    if "final_norm_scale" in params:
        x = L.norm(cfg.norm, x, params, "final_norm", cfg.norm_eps, cfg.norm_offset)
    if "proj_out" in params:
        x = L.dense(x, params["proj_out"], name="proj_out")
    return x, {"k": new_k, "v": new_v, "pos": kv_pos}


def logits(cfg: ArchConfig, params, h):
    """``h [..., D]`` -> float32 logits ``[..., vocab]`` (padding columns removed).

    With low-precision weights and few rows the CPU kernels (``aotlm.kernels``) take the
    matmul; ``h`` goes in as float32 so the logits come out float32. Under int8 weights a tied
    lm_head reads ``embed_q`` (an int8 copy of the embedding rows, ``models/quant.py``). Under
    W8A8 the row kernel rounds up to ``kernels.MAX_ROWS`` rows of ``h`` to int8 as every other
    matmul's (``layers.dense``; more rows, e.g. scoring every position, stay f32).
    """
    hf = h.astype(jnp.float32)
    tied = "lm_head" not in params
    w, scale, name = (
        (params["lm_head"], params.get("lm_head_scale"), "lm_head")
        if not tied
        else (params["embed_q"], params["embed_q_scale"], "embed_q")
        if "embed_q" in params
        else (params["embed"], None, "embed")
    )
    pk = packing.packed_k(name, w.ndim)
    a8, graph_a8 = lowp.w8a8_rows(hf, w, scale, 1, name, pk)  # W8A8: h rounded to int8 as in layers.dense
    if quant_fp8.is_fp8(w, scale):  # fp8 lm_head / embedding copy [V, D] (aotlm.models.quant_fp8)
        out = quant_fp8.dense(hf, w, scale, 1, nt=tied, name=name)
    elif quant4.is_int4(w, scale):  # 4-bit lm_head / embedding copy (aotlm.models.quant4)
        out = quant4.dense4(hf, w, scale, 1, name)
    elif quant8.is_int8_groups(w, scale):  # a GGUF file's Q8_0 lm_head as stored (aotlm.models.quant8)
        out = quant8.dense8(hf, w, scale, 1, name)
    elif kernels.supported(hf, w, 1, name, pk):
        out = kernels.matmul(hf, w, scale, name=name, nt=tied, packed_k=pk, a8=a8)
    elif kernels.gpu_matmul_ok(h, w, scale, 1, nt=tied):  # GPU decode rows: the table / copy read once
        out = kernels.matmul_gpu(h, w, scale, 1, nt=tied)
    elif not tied and graph_a8:  # W8A8 without the kernels: the graph rounds h
        out = lowp.w8a8(hf, w, scale, 1, name, pk)
    elif not tied:  # int8 (with lm_head_scale, models/quant.py) or float lm_head
        out = jnp.dot(h, L.xla_weight(w, h, scale is not None, name), preferred_element_type=jnp.float32)
        if scale is not None:
            out = out * scale.astype(jnp.float32)
    else:
        # contract with the embedding's own D axis: `embed.T` made XLA copy the whole table per step
        out = jax.lax.dot_general(
            h, params["embed"], (((h.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    out = out[..., : cfg.vocab_size]  # before the bias: the int8 lm_head's vocab may be padded further
    if "lm_head_bias" in params:
        out = out + params["lm_head_bias"][: cfg.vocab_size].astype(jnp.float32)
    if cfg.logit_softcap is not None:
        out = jnp.tanh(out / cfg.logit_softcap) * cfg.logit_softcap
    return out
