"""Per-row LoRA adapters inside the graphs: one table of adapter slots per projection, and each
row's adapter index picks its slot (the punica / S-LoRA idea, with static shapes).

A layer that can take adapters holds, besides a projection ``w`` (``wq``, ``wk``, ``wv``, ``wo``,
``w_up``, ``w_gate``, ``w_down``: ``[*in, *out]``), two leaves:

* ``<w>_lora_a [N, *in, R]``: the ``N`` slots' ``A`` matrices, transposed into ``w``'s input layout;
* ``<w>_lora_b [N, R, *out]``: their ``B`` matrices in ``w``'s output layout, times the adapter's scale.

An adapter of rank ``r < R`` fills the first ``r`` columns and leaves zeros (exact). The tables are
traced weights: loading, replacing or unloading an adapter writes a slot and never recompiles.
The rows' indices (``[B]`` int32, ``-1``: the base model) come from the graph's inputs through
``rows`` (``decoder.forward`` sets it for the call); ``lora`` adds ``x @ A[i] @ B[i]`` to a
projection's output for every row with an adapter. Few rows (``B < N``) gather each row's own
slot; more rows multiply by every slot at once and keep each row's own (every slot read once
per step, however many rows share it); on CPU a call whose rows are all base skips the work
(``lax.cond``; on other backends a branch costs a round trip to the host, so it is computed).
With the CPU kernels (one device, float32 activations) ``kernels.lora_add_many`` reads each row's
slot in place and adds to the output in place instead: no gathered copies, no product with other
slots, nothing for base rows; ``lora_many`` updates the projections of one input (q / k / v, gate /
up) in one call.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax

from aotlm import kernels

TARGETS = ("wq", "wk", "wv", "wo", "w_up", "w_gate", "w_down")  # the projections adapters may change
_ROWS: contextvars.ContextVar = contextvars.ContextVar("aotlm_lora_rows", default=None)


def leaf_names(target: str) -> tuple[str, str]:
    """The table leaves of projection ``target``: ``(A, B)``."""
    return f"{target}_lora_a", f"{target}_lora_b"


def scale_name(target: str) -> str:
    """The leaf of int8 tables' scales ``[N, R]``: per slot and rank, ``A``'s column scale times ``B``'s
    row scale (``h = (x @ A) * s``)."""
    return f"{target}_lora_s"


def has_tables(p: dict) -> bool:
    """Does the layer ``p`` hold adapter tables?"""
    return any(leaf_names(t)[0] in p for t in TARGETS)


@contextlib.contextmanager
def rows(idx):
    """Within: ``idx [B]`` (traced int32, ``-1`` for the base model) is each row's adapter slot."""
    token = _ROWS.set(idx)
    try:
        yield
    finally:
        _ROWS.reset(token)


def lora(y, x, p: dict, target: str):
    """``y`` (projection ``target``'s output for ``x``) plus each row's adapter update."""
    return lora_many((y,), x, p, (target,))[0]


def lora_many(ys: tuple, x, p: dict, targets: tuple[str, ...]) -> tuple:
    """``lora`` for projections ``targets`` of the same ``x`` (q / k / v, gate / up): with the CPU
    kernel one call updates them all (each row's slot grouped once, one call's overhead)."""
    idx = _ROWS.get()
    live = [i for i, t in enumerate(targets) if leaf_names(t)[0] in p]
    if idx is None or not live:
        return tuple(ys)
    a_name = leaf_names(targets[live[0]])[0]
    n_in = p[a_name].ndim - 2
    bsz = x.shape[0]
    idx = idx[:bsz]  # the state may hold more rows than the call runs
    flat = x.reshape(*x.shape[: x.ndim - n_in], -1)  # [B, T, in]
    rows = flat.reshape(-1, flat.shape[-1])  # [B*T, in]
    tables = [_flat_tables(p, targets[i]) for i in live]
    f32 = all(ys[i].dtype == jnp.float32 for i in live)
    kernel = f32 and all(kernels.lora_ok(rows, a, b) for a, b, _ in tables)
    out = list(ys)
    if kernel:  # slots read in place, each y updated in place
        got = kernels.lora_add_many(
            [ys[i].reshape(rows.shape[0], -1) for i in live], rows, jnp.repeat(idx, flat.shape[1]), tables
        )
        for i, y in zip(live, got, strict=True):
            out[i] = y.reshape(ys[i].shape)
        return tuple(out)
    for i, (a, b, s) in zip(live, tables, strict=True):
        out[i] = _xla(ys[i], flat, a, b, s, idx)
    return tuple(out)


def _flat_tables(p: dict, target: str):
    """Projection ``target``'s tables as ``A [N, in, R]``, ``B [N, R, out]`` and int8 tables' scales
    ``[N, R]`` (None for float tables)."""
    a, b = (p[n] for n in leaf_names(target))
    return (
        a.reshape(a.shape[0], -1, a.shape[-1]),
        b.reshape(b.shape[0], b.shape[1], -1),
        p.get(scale_name(target)),
    )


def _xla(y, flat, a, b, s, idx):
    """XLA's form of one projection's update (``flat [B, T, in]``; tables flattened)."""

    def update():
        gather = flat.shape[0] < a.shape[0]
        d = _gathered(flat, a, b, s, idx) if gather else _stacked(flat, a, b, s, idx)
        d = jnp.where((idx >= 0).reshape(-1, *([1] * (d.ndim - 1))), d, 0.0)
        return (y + d.reshape(y.shape).astype(jnp.float32)).astype(y.dtype)

    if jax.default_backend() != "cpu":
        return update()
    return lax.cond(jnp.any(idx >= 0), update, lambda: y)


def _operand(t, x):
    """A table as a dot operand: int8 tables widened to ``x``'s dtype (their scales come after)."""
    return t.astype(x.dtype) if t.dtype == jnp.int8 else t


def _gathered(x, a, b, s, idx):
    """Each row times its own slot: ``x [B, T, in]`` -> ``[B, T, out]`` (float32)."""
    slot = jnp.maximum(idx, 0)
    h = jnp.einsum(
        "bti,bir->btr", x, _operand(jnp.take(a, slot, axis=0), x), preferred_element_type=jnp.float32
    )
    if s is not None:
        h = h * jnp.take(s, slot, axis=0)[:, None, :]
    bt = _operand(jnp.take(b, slot, axis=0), x)
    return jnp.einsum("btr,bro->bto", h.astype(bt.dtype), bt, preferred_element_type=jnp.float32)


def _stacked(x, a, b, s, idx):
    """Every row times every slot, each row keeping its own: each slot read once."""
    n, _, r = a.shape
    h = jnp.einsum("bti,nir->btnr", x, _operand(a, x), preferred_element_type=jnp.float32)
    own = (jnp.arange(n)[None, :] == idx[:, None]).astype(h.dtype)  # [B, N]
    h = h * own[:, None, :, None] * (1.0 if s is None else s[None, None])
    bt = _operand(b, x)
    return jnp.einsum("btnr,nro->bto", h.astype(bt.dtype), bt, preferred_element_type=jnp.float32)
