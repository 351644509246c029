"""Text that is not text: lone UTF-16 surrogates.

JSON may spell one (``"\\ud800"``) and a command line may carry one (bytes that are not UTF-8
arrive as surrogate escapes); no tokenizer encodes it (``tokenizers`` raises a ``TypeError``
that names neither the input nor the fix). These find it first, so the error can say where.
"""

from __future__ import annotations

NOT_TEXT = (
    "holds a lone UTF-16 surrogate (a \\ud800-style escape or bytes that are not UTF-8), which is not text"
)


def lone_surrogate(value, path: str = "") -> str | None:
    """Where in a decoded JSON value a string holds a lone surrogate, e.g. ``messages[0].content``
    (``path`` when ``value`` is such a string itself); None if nowhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        where = lone_surrogate(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if where is not None:
            return where
    return None


def check_text(text: str, what: str) -> None:
    """A ``ValueError`` naming ``what`` when ``text`` cannot be encoded as UTF-8."""
    if lone_surrogate(text, what) is not None:
        raise ValueError(f"{what} {NOT_TEXT}; give valid Unicode (UTF-8) text")
