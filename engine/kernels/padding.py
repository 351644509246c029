"""Padding rows of a prefill call, skipped by the GEMM kernels.

A prompt shorter than its context bucket is padded up to it (positions ``-1``); the padding rows'
outputs are never read, yet a GEMM would multiply them like any other row (a 139-token prompt in
the 192-token bucket: 28% of the work). While a prefill call is traced inside ``padding_rows(pad)``
(``models.decoder.forward``), every one-device prefill GEMM (``aotlm_gemm_pk``, ``aotlm_wmm_q4``)
whose rows are the call's ``[B,T]`` gets ``live_rows`` as an operand and multiplies only the live
ones; a padding row is written as the product of a row of zeros, ``act(bias)`` (``kernels/live.h``).
A live row's numbers do not change: every kernel computes a row from that row alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax.numpy as jnp

from aotlm.kernels import build

_PAD: contextvars.ContextVar = contextvars.ContextVar("aotlm_padding_rows", default=None)


@contextlib.contextmanager
def padding_rows(pad):
    """Within: ``pad [B,T]`` (traced bool, True on padding rows) marks the rows the prefill GEMMs may
    skip; a no-op for calls of at most ``MAX_ROWS`` rows (decode) or with the kernels off."""
    on = build.enabled() and pad.ndim == 2 and math.prod(pad.shape) > build.MAX_ROWS
    token = _PAD.set(pad if on else None)
    try:
        yield
    finally:
        _PAD.reset(token)


def live_rows(lead: tuple[int, ...]):
    """The live-row operand of a GEMM on ``prod(lead)`` rows: int8 ``[M]`` (1: compute the row) when
    ``lead`` is the padded call's ``[B,T]``, else an empty array (every row computed)."""
    pad = _PAD.get()
    if pad is None or tuple(lead) != pad.shape:
        return jnp.zeros((0,), jnp.int8)
    return (~pad).reshape(-1).astype(jnp.int8)
