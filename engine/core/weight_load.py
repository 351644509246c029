"""How a ``CompiledModel`` reads its weights: the family's rows from the checkpoint (or a GGUF file),
each tensor converted into its stored form and placed on the mesh shard by shard, or the
converted leaves of an earlier load from the weight cache (``aotlm.core.weight_cache``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from aotlm import kernels
from aotlm.core import sharding, weight_cache
from aotlm.core.compile_cache import source_hash
from aotlm.kernels import gpu_matmul
from aotlm.models import packing
from aotlm.models.checkpoint import CheckpointError, WeightReader, gc_paused, gguf, gguf_q4k, lora
from aotlm.models.quant import ParamRewriter
from aotlm.models.weights import load_params
from aotlm.progress import bar


class WeightLoading:
    """The loading methods of ``CompiledModel`` (which sets the mesh, spec and precision first)."""

    _weights_out: weight_cache.Writer | None = None  # the leaves of a converting load, for the next one

    def _weight_rows(self, family) -> list:
        """The HF tensors to load (a pipeline stage: its own layers', ``aotlm.core.pipeline``)."""
        return family.weight_rows(self.cfg, self.hf_config)

    def _place(self, path: tuple, arr: np.ndarray):
        """Pad / repeat for the mesh on the host, then copy each device only its own shard."""
        arr = sharding.prepare_param(path, arr, self.tp_degree, self.gqa, self.cfg.n_kv_heads)
        if self._pack:  # the matrices in the kernels' panel layout (aotlm.models.packing)
            arr = packing.prepare(
                path[-1], arr, sharding.param_spec(path, arr.ndim, self._rules), self.tp_degree
            )
        if self._weights_out is not None:  # kept in its final form for the next load (weight_cache),
            arr = self._weights_out.record(path, arr)  # and placed from that file (mapped, no copy held)
        return self._place_final(path, arr)

    def _place_final(self, path: tuple, arr: np.ndarray):
        """A leaf already in its final host form on its devices (each device its own shard)."""
        shard = sharding.param_sharding(self.mesh, path, arr.ndim, self._rules)
        return jax.make_array_from_callback(arr.shape, shard, lambda idx: arr[idx])

    def _weight_key(self, rows, converts: bool) -> tuple[str, dict] | None:
        """The weight-cache entry of this load, or None when nothing is converted (a plain copy)."""
        if not converts or weight_cache.root() is None:
            return None
        fields = {
            "checkpoint": weight_cache.identity(self.path),
            "rows": [(r.targets, r.hf, r.more) for r in rows],
            "precision": self.precision.describe(),
            "quant": repr(self.precision.quant),
            "fuse_qkv": self.fuse_qkv, "tp": self.tp_degree, "gqa": self.gqa, "pack": self._pack,
            "view": self._view,
            "dtype": str(self.dtype), "code": source_hash(), "lora": self.lora and self.lora.digest,
        }  # fmt: skip
        return weight_cache.key(fields), fields

    def _load_weights(self, family) -> dict:
        rows = self._weight_rows(family)
        quant = self.precision.quant  # the matrices' storage (amp's on CPU with the kernels)
        on = quant is not None and kernels.enabled()
        # int8 / bf16 embedding copy for a tied lm_head (the CPU kernels', or the GPU int8 kernel's)
        view = on or gpu_matmul.head_copy(quant)
        # int8 / bf16 / f16 / f32 matrices in the kernels' panel layout (aotlm.models.packing); 4-bit
        # codes are stored only in it (aotlm.models.quant4)
        f32 = np.dtype(jnp.dtype(self.dtype)) == np.float32
        self._pack = on or (quant is not None and quant.int4) or (kernels.enabled() and f32)
        self._view = view
        entry = self._weight_key(rows, quant is not None)  # quantized storage: converted, and compact
        if entry is not None:
            params = weight_cache.load(entry[0], self._place_final)
            if params is not None:
                return params
        self._weights_out = weight_cache.Writer(*entry) if entry is not None else None
        try:
            params = self._convert_weights(family, rows, view)
            if self._weights_out is not None:
                self._weights_out.commit(params)
            return params
        finally:
            if self._weights_out is not None:
                self._weights_out.abandon()
            self._weights_out = None

    def _convert_weights(self, family, rows, view: bool) -> dict:
        """Read the checkpoint's tensors and convert them into this model's stored form."""
        reader = gguf.open_weights(self.path) or WeightReader(self.path)  # a GGUF model: its file
        if self.lora is not None:
            reader = lora.MergedReader(reader, self.lora)
        try:
            rows = bar(rows, "loading weights", unit="tensor")
            np_dtype = np.dtype(jnp.dtype(self.dtype))
            quant = self.precision.quant
            blocks = bool(gguf.q4_types(self.path))  # a GGUF file's 4-bit blocks: kept as they are
            q4k = gguf_q4k.BlockCodes(reader) if blocks else None  # 4-bit codes read from the blocks
            rewriter = None
            if quant or self.fuse_qkv:
                lookup = np_dtype == np.float32  # a GGUF embedding's codes may stay (aotlm.models.lookup)
                tied = self.cfg.tie_embeddings
                rewriter = ParamRewriter(quant, self.fuse_qkv, view, blocks, q4k, lookup, tied)
            with gc_paused():  # ~10^6 small objects made and dropped while converting
                params = load_params(rows, reader, family.PREFIXES, np_dtype, self._place, rewriter, self.cfg)
            if "lm_head" in params:  # untied: the int8 embedding copy is not needed
                params.pop("embed_q", None), params.pop("embed_q_scale", None)
            unused = reader.unused() if self.lora is not None else []
            if unused:
                where = f"LoRA adapter {self.lora.path} changes {unused[0]!r}"
                raise CheckpointError(f"{where}, which aotlm does not read for this family")
            return params
        finally:
            reader.close()
