"""The sampling parameters, one table: what each is called, stored as, defaults to and accepts.

Every place a sampling parameter appears derives from ``TABLE``: the per-row pytree the graphs
carry (``RowParams``: the ``"row"`` entries, one ``[B]`` array each), the neutral host state,
the range checks of ``sample()``, batch records and HTTP requests, transformers'
``GenerationConfig`` fields and OpenAI's request fields (``aotlm.generate.params``), the command
lines' flags and the names speculative decoding and beam search accept. Adding a parameter is
one ``Param`` here plus its effect in ``aotlm.core.sampling`` (its docs: the serving guide).

Kept free of JAX so that command-line parsing and record validation stay cheap to import
(``RowParams`` becomes a JAX pytree through ``as_pytree``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

SAME = object()  # ``Param.hf_default``: transformers' default is aotlm's
NGRAM_MAX = 8  # largest no_repeat_ngram_size (static: the window of the in-graph n-gram match)


@dataclass(frozen=True)
class Range:
    """The values a parameter takes: ``lo`` / ``hi`` bounds (None: unbounded), ``lo_open``
    excludes ``lo``; ``integer`` values only; ``note`` says what the neutral value means."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False
    note: str = ""

    def holds(self, x: Any) -> np.ndarray:
        """Elementwise: is ``x`` (a number or an array of them) inside the range?"""
        x = np.asarray(x)
        ok = np.ones(x.shape, bool)
        if self.lo is not None:
            ok &= (x > self.lo) if self.lo_open else (x >= self.lo)
        if self.hi is not None:
            ok &= x <= self.hi
        return ok

    def text(self) -> str:
        """``"must be in (0, 1]"``, ``"must be >= 0 (0 disables top-k)"``, ..."""
        lo, hi = _fmt(self.lo), _fmt(self.hi)
        if self.lo is not None and self.hi is not None:
            rule = f"must be in {'(' if self.lo_open else '['}{lo}, {hi}]"
        elif self.lo is not None:
            rule = f"must be {'>' if self.lo_open else '>='} {lo}"
        else:
            rule = f"must be <= {hi}"
        return f"{rule} ({self.note})" if self.note else rule


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:g}" if abs(x) < 1e6 else str(int(x))


@dataclass(frozen=True)
class Param:
    """One sampling parameter.

    ``name``: its field in ``RowParams`` (the graphs' name) or the host's; ``dtype``: the numpy
    dtype of its per-row array; ``default``: its value when not given (neutral: it changes
    nothing; ``seed``'s None draws a random seed); ``hf``: transformers' name (``sample()``,
    ``GenerationConfig``, batch records, command-line flags) or None; ``openai``: the HTTP
    request's field (OpenAI's or vLLM's extension) or None; ``scope``: ``"row"`` a ``RowParams``
    field of both the decode and the serving state, ``"slot"`` the serving state's own field,
    ``"host"`` used on the host only; ``warper``: it shapes the distribution a sampled row draws
    from (transformers' logits warpers: speculative decoding takes these); ``hf_default``:
    transformers' own default where it differs (``SAME`` otherwise); ``http_range``: the
    HTTP API's range where it differs (OpenAI's narrower one).
    """

    name: str
    dtype: str
    default: Any
    range: Range | None
    help: str
    hf: str | None = None
    openai: str | None = None
    scope: str = "row"
    warper: bool = False
    hf_default: Any = SAME
    http_range: Range | None = None

    @property
    def integer(self) -> bool:
        return np.issubdtype(np.dtype(self.dtype), np.integer)

    @property
    def fill(self) -> Any:
        """The neutral value of its per-row array (a seed not given is drawn per row later)."""
        return 0 if self.default is None else self.default


_U32 = 2**32 - 1
TABLE: tuple[Param, ...] = (
    Param("do_sample", "bool", False, None, "sample instead of greedy", hf="do_sample", warper=False),
    Param("temperature", "float32", 1.0, Range(0, note="0 means greedy"), "softmax temperature",
          hf="temperature", openai="temperature", warper=True, http_range=Range(0, 2)),
    Param("top_h", "float32", 0.0, Range(0, 1, note="0 disables it"),
          "keep the likeliest tokens whose entropy stays within top_h x the top-100's (Top-H decoding)",
          hf="top_h", warper=True, hf_default=None),
    Param("top_k", "int32", 0, Range(0, integer=True, note="0 disables top-k"), "keep the k likeliest tokens",
          hf="top_k", openai="top_k", warper=True, hf_default=50),
    Param("top_p", "float32", 1.0, Range(0, 1, lo_open=True), "keep the likeliest tokens holding this mass",
          hf="top_p", openai="top_p", warper=True),
    Param("min_p", "float32", 0.0, Range(0, 1), "drop tokens below min_p x the likeliest's probability",
          hf="min_p", openai="min_p", warper=True, hf_default=None),
    Param("typical_p", "float32", 1.0, Range(0, 1, lo_open=True, note="1 disables it"),
          "keep the tokens closest to the expected surprise holding this mass (locally typical sampling)",
          hf="typical_p", openai="typical_p", warper=True),
    Param("epsilon_cutoff", "float32", 0.0, Range(0, 1, note="0 or 1 disables it"),
          "drop tokens below this probability (epsilon sampling)", hf="epsilon_cutoff", warper=True),
    Param("eta_cutoff", "float32", 0.0, Range(0, 1, note="0 or 1 disables it"),
          "drop tokens below min(eta, sqrt(eta) x exp(-entropy)) (eta sampling)", hf="eta_cutoff",
          warper=True),
    Param("repetition_penalty", "float32", 1.0, Range(0, lo_open=True, note="1 disables it"),
          "divide the scores of seen tokens (CTRL's penalty)", hf="repetition_penalty",
          openai="repetition_penalty", http_range=Range(0, 10, lo_open=True)),
    Param("ngram", "int32", 0, Range(0, NGRAM_MAX, integer=True), "ban repeating n-grams of this size",
          hf="no_repeat_ngram_size"),
    Param("seed", "uint32", None, Range(0, _U32, integer=True), "random seed (per row)",
          hf="seed", openai="seed", http_range=Range(-(2**63), 2**63 - 1, integer=True)),
    Param("presence_penalty", "float32", 0.0, Range(-2, 2), "subtract from generated tokens' scores (OpenAI)",
          openai="presence_penalty", scope="slot"),
    Param("frequency_penalty", "float32", 0.0, Range(-2, 2), "subtract per generation of a token (OpenAI)",
          openai="frequency_penalty", scope="slot"),
    Param("min_new", "int64", 0, Range(0, integer=True), "no eos before this many new tokens",
          hf="min_new_tokens", scope="host", hf_default=None),
    Param("min_len", "int64", 0, Range(0, integer=True), "no eos before this total length",
          hf="min_length", scope="host"),
)  # fmt: skip

BY_NAME: dict[str, Param] = {p.name: p for p in TABLE}
BY_HF: dict[str, Param] = {p.hf: p for p in TABLE if p.hf}
BY_OPENAI: dict[str, Param] = {p.openai: p for p in TABLE if p.openai}
ROW: tuple[Param, ...] = tuple(p for p in TABLE if p.scope == "row")
HF_NAMES: tuple[str, ...] = tuple(BY_HF)  # transformers-named settings sample() takes per row
WARPERS: tuple[str, ...] = tuple(p.hf for p in TABLE if p.warper and p.hf)
# what speculative decoding samples with (the distribution's settings, no penalties)
DRAW_NAMES: tuple[str, ...] = ("do_sample", *WARPERS, "seed")
GREEDY: dict[str, Any] = {p.hf: p.default for p in TABLE if p.hf}  # transformers' names, neutral values
# transformers' GenerationConfig() defaults for the settings aotlm applies (top_k=50 when sampling;
# None: transformers leaves it unset)
HF_DEFAULTS: dict[str, Any] = {
    p.hf: p.default if p.hf_default is SAME else p.hf_default for p in TABLE if p.hf and p.name != "seed"
}


def _row_class() -> type:
    fields = [(p.name, Any) for p in ROW]

    def replace(self, **changes: Any) -> Any:
        return dataclasses.replace(self, **changes)

    doc = (
        "The per-row sampler settings the graphs carry, one ``[B]`` array each, in "
        "``sampler_params.ROW`` order: " + ", ".join(f"``{p.name}`` ({p.dtype})" for p in ROW) + "."
    )
    return dataclasses.make_dataclass(
        "RowParams", fields, namespace={"replace": replace, "__doc__": doc, "__module__": __name__}
    )


RowParams = _row_class()


@functools.cache
def as_pytree() -> None:
    """Register ``RowParams`` with JAX (every field a traced leaf), once: when the first one is made
    or ``aotlm.core.state`` is imported (before a saved graph, whose pytrees name the class, is
    loaded), so this module itself stays importable without JAX."""
    import jax  # local: JAX stays out of command-line parsing

    jax.tree_util.register_dataclass(RowParams, [p.name for p in ROW], [])


def _rows(fields: dict[str, Any]) -> Any:
    as_pytree()
    return RowParams(**fields)


def row_spec(make: Callable[[np.dtype], Any]) -> Any:
    """``RowParams`` of ``make(dtype)`` per field (abstract arrays to lower a graph with)."""
    return _rows({p.name: make(np.dtype(p.dtype)) for p in ROW})


def neutral_rows(rows: int) -> Any:
    """``RowParams`` of numpy arrays holding every field's neutral value (greedy, no penalty)."""
    return _rows({p.name: np.full(rows, p.fill, np.dtype(p.dtype)) for p in ROW})


def row_params(values: Mapping[str, np.ndarray]) -> Any:
    """The ``RowParams`` among ``values`` (per-row arrays by ``name``, e.g. host-only ones too)."""
    return _rows({p.name: values[p.name] for p in ROW})


def violations(values: Mapping[str, Any], http: bool = False) -> list[tuple[str, str]]:
    """``(name, message)`` for each value (one, or an array of per-row values; keyed by ``name``,
    ``hf`` or ``openai``) outside its range, in the order given; unknown keys are not checked.
    ``http``: the HTTP API's ranges."""
    bad = []
    for key, value in values.items():
        p = BY_NAME.get(key) or BY_HF.get(key) or BY_OPENAI.get(key)
        rng = p and ((http and p.http_range) or p.range)
        if value is None or not rng:
            continue
        arr = np.asarray(value)
        ok = rng.holds(arr)
        if not ok.all():
            bad.append((key, f"{key}={arr[~ok][0] if arr.ndim else arr} is invalid: {rng.text()}"))
    return bad
