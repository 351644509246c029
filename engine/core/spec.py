"""``ModelSpec``: one frozen description of a compiled model's shape, precision, parallelism
and buckets, resolved once from ``from_pretrained``'s arguments and the checkpoint's config.

Everything that lists a model's configuration derives from it: the constructor arguments a
``--config`` file, saved artifacts and batch jobs carry (``MODEL_KEYS``, ``arguments()``), the
compile-cache fingerprint's configuration part (``fingerprint()``), and a pipelined model's view
of its stages (``dataclasses.replace(stage_spec, batch_size=..., pp_degree=...)``).
``CompiledModel`` exposes each field as a read-only attribute (``model.batch_size`` ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from aotlm.core import buckets as bk
from aotlm.core import inputs, precision, sharding
from aotlm.core.precision import Precision
from aotlm.models.arch import ArchConfig
from aotlm.models.quant import QuantizationConfig, quant_config

DEFAULT_N_POSITIONS = 2048  # capped at config.json's maximum positions

# constructor argument -> the field that holds it, resolved
ARGUMENTS = {
    "batch_size": "batch_size",
    "n_positions": "tg_buckets",
    "context_length_estimate": "ctx_buckets",
    "tp_degree": "tp_degree",
    "pp_degree": "pp_degree",
    "gqa": "gqa",
    "amp": "amp",
    "quant": "quant",
    "fuse_qkv": "fuse_qkv",
    "kv_cache_dtype": "kv_cache_dtype",
}
MODEL_KEYS = tuple(ARGUMENTS)  # from_pretrained arguments the shape flags, --config files and artifacts carry


@dataclass(frozen=True)
class ModelSpec:
    """A model's resolved configuration.

    Shape: ``cfg`` (the architecture), ``batch_size``, ``tg_buckets`` (token buckets: KV widths;
    ``n_positions`` is the largest) and ``ctx_buckets`` (prompt chunk lengths). Precision: ``amp``
    and ``kv_cache_dtype`` as asked, ``quant`` (weight storage) and what they mean on this
    backend, ``precision``. Parallelism: ``tp_degree``, ``gqa`` (how KV heads are sharded) and
    ``pp_degree`` (1 for one model or one pipeline stage).
    """

    cfg: ArchConfig
    batch_size: int
    tg_buckets: list[int]
    ctx_buckets: list[int]
    tp_degree: int
    gqa: str
    amp: str
    quant: QuantizationConfig | None
    fuse_qkv: bool
    kv_cache_dtype: str | None
    precision: Precision
    pp_degree: int = 1

    @property
    def n_positions(self) -> int:
        return max(self.tg_buckets)

    @property
    def dtype(self) -> Any:
        """The compute dtype."""
        return self.precision.compute

    @classmethod
    def resolve(
        cls,
        cfg: ArchConfig,
        batch_size: int | None = None,
        n_positions: int | list[int] | None = None,
        context_length_estimate: int | list[int] | None = None,
        tp_degree: int = 1,
        amp: str = "f32",
        gqa: str | None = None,
        quant: str | QuantizationConfig | None = None,
        fuse_qkv: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> ModelSpec:
        """Check the arguments against ``cfg`` and fill in the defaults."""
        batch_size = 1 if batch_size is None else batch_size
        inputs.count(tp_degree, "tp_degree", allow_none=False)
        if not isinstance(fuse_qkv, bool | np.bool_):
            raise TypeError(f"fuse_qkv must be True or False, got {fuse_qkv!r} ({type(fuse_qkv).__name__})")
        # weight storage (models/quant.py): int8 + per-channel scales, fused q/k/v and gate/up.
        # Both change the params pytree, hence the compile-cache fingerprint (``param_tree``).
        quant = quant_config(quant)  # as given (artifacts record it)
        if n_positions is None:  # transformers-neuronx's default, capped at the checkpoint's positions
            n_positions = min(DEFAULT_N_POSITIONS, cfg.max_positions)
        tg = bk.token_buckets(n_positions)
        check_shapes(cfg, batch_size, tg)
        gqa = None if gqa is None else str(getattr(gqa, "value", gqa))  # aotlm.config.GQA members too
        precision.warn_slow(quant_config(quant))
        return cls(
            cfg=cfg,
            batch_size=int(batch_size),
            tg_buckets=tg,
            ctx_buckets=bk.context_buckets(context_length_estimate, tg),
            tp_degree=int(tp_degree),
            gqa=sharding.choose_gqa(cfg.n_heads, cfg.n_kv_heads, int(batch_size), int(tp_degree), gqa),
            amp=amp,  # as asked; what it means on this backend is ``precision``
            quant=quant,
            fuse_qkv=bool(fuse_qkv),
            kv_cache_dtype=precision.kv_cache_name(kv_cache_dtype),  # as asked (None: follows amp)
            precision=precision.resolve(amp, quant, None, kv_cache_dtype),  # compute / KV / matrices
        )

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    def arguments(self) -> dict:
        """The constructor arguments that rebuild this configuration (``quant`` as resolved)."""
        out = {arg: getattr(self, field) for arg, field in ARGUMENTS.items()}
        return out | {"n_positions": list(self.tg_buckets), "context_length_estimate": list(self.ctx_buckets)}

    def fingerprint(self) -> dict:
        """The configuration part of the compile-cache fingerprint (``CompiledModel.fingerprint``)."""
        return {
            "arch": self.cfg,
            "batch_size": self.batch_size,
            "n_positions": self.n_positions,
            "amp": self.amp,
            "precision": self.precision.describe(),  # what amp means here (aotlm.core.precision)
            "matmul_precision": self.precision.matmul,
            "tp_degree": self.tp_degree,
            "gqa": self.gqa,
        }


class SpecAttributes:
    """Read-only attributes for every ``ModelSpec`` field (and ``n_positions``, ``dtype``) of
    ``self.spec``: ``model.batch_size`` is ``model.spec.batch_size``."""

    spec: ModelSpec


for _name in [f.name for f in dataclasses.fields(ModelSpec)] + ["n_positions", "dtype"]:
    setattr(SpecAttributes, _name, property(lambda self, _n=_name: getattr(self.spec, _n)))


def check_shapes(cfg: ArchConfig, batch_size: int, tg_buckets: tuple[int, ...]) -> None:
    """What every configuration is refused for on any backend (``from_pretrained`` and the memory plan
    of ``aotlm compile --dry-run`` alike): no rows, or more positions than learned ones."""
    if inputs.count(batch_size, "batch_size") < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if cfg.position == "learned" and max(tg_buckets) > cfg.max_positions:
        raise ValueError(
            f"n_positions={max(tg_buckets)} exceeds this model's {cfg.max_positions} learned "
            f"positions; use n_positions <= {cfg.max_positions}"
        )
