"""The chat-template flags of ``aotlm chat`` and ``aotlm serve``, as llama-server and vLLM take them:
``--chat-template`` (a template in place of the tokenizer's: a file, or the template's own text) and
``--chat-template-kwargs`` (variables for it, e.g. Qwen3's ``{"enable_thinking": false}``; a server's
requests may set their own, which win). Both are checked before any model loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aotlm.text.preprocess import TEMPLATE_OWN


def add_template_args(p: argparse.ArgumentParser, variables_help: str) -> None:
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|JINJA",
        help="a chat template in place of the tokenizer's: a .jinja file, or the template text",
    )
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON", help=variables_help)


def template_variables(given: str | None) -> dict:
    """``--chat-template-kwargs``: a JSON object of template variables ({} without the flag)."""
    if given is None:
        return {}
    try:
        kw = json.loads(given)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs is not JSON ({e}); give an object of variables") from None
    if not isinstance(kw, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    own = sorted(k for k in kw if k in TEMPLATE_OWN)
    if own:
        raise ValueError(f"--chat-template-kwargs may not set {own}; they are set for each conversation")
    return kw


def use_template(tokenizer, given: str | None, variables: dict | None = None) -> None:
    """``--chat-template``: the file's text (or ``given`` itself, when it is a Jinja template) becomes
    the tokenizer's chat template, once it renders a one-message chat."""
    if given is None:
        return
    path = Path(given).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif "{{" in given or "{%" in given:
        text = given
    else:
        raise ValueError(f"--chat-template {given!r}: no such file, nor a Jinja template; give either")
    chat = [{"role": "user", "content": "hi"}]
    try:
        tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True, chat_template=text, **(variables or {})
        )
    except Exception as e:  # jinja's TemplateSyntaxError, UndefinedError, raise_exception() ...
        raise ValueError(f"--chat-template does not render a one-message chat: {e}") from None
    tokenizer.chat_template = text
