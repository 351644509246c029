"""``ArchConfig``: the static description of an architecture that every family fills in.

Frozen and hashable, so it can be a ``jax.jit`` static argument: everything a graph's shapes
and maths depend on is here, and a different value is a different compiled graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ArchConfig:
    """Static description of an architecture: everything a graph's shape/maths depends on."""

    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-5
    norm_offset: float = 0.0  # Gemma: x * (1 + w)
    act: str = "silu"
    gated_mlp: bool = True
    position: str = "rope"  # "rope" | "learned" | "alibi"
    inv_freq: tuple[float, ...] = ()
    # rotary inverse frequencies of the sliding-window layers when they differ from ``inv_freq``
    # (Gemma3: ``rope_local_base_freq`` locally, ``rope_theta`` + scaling on global layers); empty =
    # every layer rotates by ``inv_freq``. Static like the windows: baked into each layer's graph.
    local_inv_freq: tuple[float, ...] = ()
    rope_interleaved: bool = False
    learned_pos_offset: int = 0  # OPT stores positions shifted by 2
    parallel_residual: bool = False
    shared_input_norm: bool = False  # parallel residual fed by norm1 only (GPT-J, Falcon)
    post_norm: bool = False  # OPT with do_layer_norm_before=False
    attn_scale: float | None = None  # default 1/sqrt(head_dim)
    embed_scale: float = 1.0
    tie_embeddings: bool = True
    sliding_window: int | None = None
    # per-layer sliding windows (None = global layer), e.g. Gemma2 local/global alternation or
    # Qwen2 max_window_layers; empty = every layer uses ``sliding_window``. A tuple (not a
    # traced array) because each window is baked into that layer's mask in the compiled graph.
    layer_windows: tuple[int | None, ...] = ()
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    qk_norm: bool = False
    clip_qkv: float | None = None  # clamp q/k/v projections to [-c, c] (MPT attn_config.clip_qkv)
    n_experts: int = 0
    experts_per_token: int = 0
    alibi: tuple[float, ...] = ()
    extra: tuple[tuple[str, object], ...] = field(default=())  # family-specific statics

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` (static: it shapes the layer's attention mask)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def rope(self, layer: int) -> tuple[float, ...]:
        """Rotary inverse frequencies of ``layer``: ``local_inv_freq`` on a windowed layer if given."""
        if self.local_inv_freq and self.window(layer) is not None:
            return self.local_inv_freq
        return self.inv_freq
