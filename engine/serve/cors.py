"""Cross-origin requests (CORS) for browser front ends, with vLLM's flags and defaults.

A chat page served from another origin calls the API from the browser, which first sends a preflight
``OPTIONS`` and then reads the answer only when it carries ``Access-Control-Allow-Origin``. As vLLM's
server (and llama.cpp's), every origin, method and header is allowed by default, credentials are not;
``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers`` (JSON lists) and
``--allow-credentials`` narrow or widen that. Preflights are answered before the API key is checked
(a browser sends no ``Authorization`` on them); the requests that follow still need the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

FLAGS = {"allowed_origins": "--allowed-origins", "allowed_methods": "--allowed-methods",
         "allowed_headers": "--allowed-headers"}  # fmt: skip


@dataclass(frozen=True)
class Cors:
    """What a cross-origin request may do (Starlette's ``CORSMiddleware`` settings)."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    def add_to(self, app) -> None:
        """Wrap ``app`` (call it last: the outermost middleware answers preflights first)."""
        from starlette.middleware.cors import CORSMiddleware  # local: optional [serve] extra

        app.add_middleware(
            CORSMiddleware,
            allow_origins=self.allowed_origins,
            allow_methods=self.allowed_methods,
            allow_headers=self.allowed_headers,
            allow_credentials=self.allow_credentials,
        )


def json_list(text: str, flag: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: ``'["https://a.example"]'``), else a ``ValueError``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        example = "'[\"https://chat.example\"]'"
        raise ValueError(f"{flag} takes a JSON list of strings, e.g. {example}, got {text!r}")
    return value


def from_flags(args) -> Cors:
    """The ``Cors`` of ``aotlm serve``'s flags (each a JSON list; absent: vLLM's default)."""
    lists = {k: json_list(getattr(args, k), f) for k, f in FLAGS.items() if getattr(args, k) is not None}
    return Cors(**lists, allow_credentials=args.allow_credentials)


def add_flags(p) -> None:
    """``aotlm serve``'s CORS flags (vLLM's names)."""
    for key, flag in FLAGS.items():
        what = key.removeprefix("allowed_")
        p.add_argument(flag, default=None, metavar="JSON", help=f"cross-origin {what} allowed (default: all)")
    p.add_argument(
        "--allow-credentials", action="store_true", help="let cross-origin requests carry cookies / auth"
    )
