"""Every parameter leaf's logical axes, declared once (and the axes int8 quantization contracts).

``aotlm.core.sharding`` maps logical axes onto the mesh; ``packing`` adds the two inner dims of
the kernels' panel layout; ``quant`` and the loader use the contracted axes. Plain tables: this
module imports nothing, so every other model module can read them.
"""

from __future__ import annotations

Path = tuple  # ("embed",) or ("layers", 3, "wq")

# Logical axes of every parameter leaf name, declared once. ``aotlm.core.sharding`` maps
# logical axes onto the mesh (Megatron layout: heads / mlp / vocab split over "tp").
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "pos_embed": (None, "embed"),
    "lm_head": ("embed", "vocab"),
    "lm_head_bias": ("vocab",),
    "embed_q": ("vocab", "embed"),  # int8 copy of the embedding for a tied lm_head (models/quant.py)
    "embed_q_scale": ("vocab",),
    "embed_gscale": ("vocab", None),  # a file's grouped embedding codes: group scales (models/lookup.py)
    "embed_gmin": ("vocab", None),  # and offsets
    "proj_in": (None, "embed"),
    "proj_out": ("embed", None),
    "wq": ("embed", "heads", None),
    "wk": ("embed", "kv_heads", None),
    "wv": ("embed", "kv_heads", None),
    "bq": ("heads", None),
    "bk": ("kv_heads", None),
    "bv": ("kv_heads", None),
    "wo": ("heads", None, "embed"),
    "bo": ("embed",),
    "w_up": ("embed", "mlp"),
    "w_gate": ("embed", "mlp"),
    "b_up": ("mlp",),
    "b_gate": ("mlp",),
    "w_down": ("mlp", "embed"),
    "b_down": ("embed",),
    "router": ("embed", None),
    "e_up": ("experts", "embed", "mlp"),
    "e_gate": ("experts", "embed", "mlp"),
    "e_down": ("experts", "mlp", "embed"),
    # fused forms (``fuse_qkv``, see models/quant.py): the kv-heads / mlp axis stays the sharded one
    "wqkv": ("embed", "kv_heads", None, None),
    "bqkv": ("kv_heads", None, None),
    "w_gu": ("embed", None, "mlp"),
    "b_gu": (None, "mlp"),
    "e_gu": ("experts", "embed", None, "mlp"),
}

# Per-row LoRA tables (aotlm.models.adapters): ``A [slots, *in, rank]``, ``B [slots, rank, *out]``,
# the projection's own input / output axes sharded as its weight's; int8 tables' scales replicated
for _w in ("wq", "wk", "wv", "wo", "w_up", "w_gate", "w_down"):
    _n_in = 2 if _w == "wo" else 1
    LOGICAL_AXES[_w + "_lora_a"] = (None, *LOGICAL_AXES[_w][:_n_in], None)
    LOGICAL_AXES[_w + "_lora_b"] = (None, None, *LOGICAL_AXES[_w][_n_in:])
    LOGICAL_AXES[_w + "_lora_s"] = (None, None)  # int8 tables' scales [slots, rank]: replicated

# Contracted (input) axes of every matrix int8 quantization applies to (models/quant.py). Its
# per-output-channel scale ``<name>_scale`` has the weight's other axes, so it shards with it.
CONTRACT_AXES: dict[str, tuple[int, ...]] = {
    "wq": (0,),
    "wk": (0,),
    "wv": (0,),
    "wqkv": (0,),
    "wo": (0, 1),
    "w_up": (0,),
    "w_gate": (0,),
    "w_gu": (0,),
    "w_down": (0,),
    "e_up": (1,),
    "e_gate": (1,),
    "e_gu": (1,),
    "e_down": (1,),
    "lm_head": (0,),
}
QUANT_SCALES = {f"{n}_scale": n for n in CONTRACT_AXES}  # scale leaf -> its weight
LOGICAL_AXES.update(
    {
        s: tuple(a for i, a in enumerate(LOGICAL_AXES[n]) if i not in CONTRACT_AXES[n])
        for s, n in QUANT_SCALES.items()
    }
)
