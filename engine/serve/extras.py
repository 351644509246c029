"""vLLM's extra request fields (its OpenAI-compatible server's), read as vLLM reads them.

Applied:

* ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and the newer
  ``structured_outputs`` (``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``): the same
  constraint as the matching ``response_format`` (``guided_choice``: exactly one of the strings);
* ``include_stop_str_in_output``: a stop string that ends the answer stays in it;
* ``skip_special_tokens`` (default true): false keeps special tokens in the text;
* ``add_special_tokens``: whether the tokenizer adds its own (default: completions yes, chats no,
  since the chat template writes them);
* ``truncate_prompt_tokens``: only the prompt's last ``k`` tokens (-1: as many as the window holds);
* ``allowed_token_ids`` (the only tokens an answer may hold), ``bad_words`` (words it may not hold,
  matched in its own tokens as vLLM matches them) and ``min_tokens`` (no eos, stop token or stop string
  before that many tokens): ``aotlm.generate.bans.RequestBans``;
* ``return_tokens_as_token_ids`` (logprobs name each token ``"token_id:N"``) and ``return_token_ids``
  (each choice's ``token_ids``, the prompt's ``prompt_token_ids``: per choice of a completion, once
  for a chat; in a stream each chunk's own ``token_ids`` and the prompt's in a choice's first chunk);
* chats: ``add_generation_prompt`` (default true), ``continue_final_message`` (the answer goes on
  from the last message), ``documents`` and ``chat_template_kwargs`` (e.g. Qwen3's
  ``{"enable_thinking": false}``), all given to the model's chat template.

Refused by name when set to anything but their no-op value, rather than answered as if they were
not there: ``use_beam_search``, ``length_penalty``, ``spaces_between_special_tokens``,
``chat_template`` (a request's own template is not run), ``logits_processors``,
``guided_whitespace_pattern``, ``detokenize``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from aotlm.serve.structured import FieldError
from aotlm.text.preprocess import TEMPLATE_OWN

# vLLM fields this server does not apply, with the values that ask for nothing (accepted)
REFUSED = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True),
    "chat_template": (None,),
    "logits_processors": (None, []),
    "guided_whitespace_pattern": (None,),
    "detokenize": (None, True),
}
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class Extras:
    """What a request's vLLM fields ask of its prompt and its text."""

    include_stop_str: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool | None = None  # None: the endpoint's default
    truncate: int | None = None  # the prompt's last tokens kept (-1: the window's worth)
    allowed_token_ids: tuple[int, ...] = ()  # the only tokens the answer may hold (empty: any)
    bad_words: tuple[str, ...] = ()  # words the answer may not hold
    min_tokens: int = 0  # tokens before an eos, a stop token or a stop string may end the answer
    template: dict = field(default_factory=dict)  # chat: keywords for apply_chat_template
    token_id_strs: bool = False  # return_tokens_as_token_ids: logprobs' tokens as "token_id:N"
    return_token_ids: bool = False  # the answer's (and prompt's) token ids beside the text


def flag(body: dict, name: str, default):
    """A true/false field (absent or null: ``default``); ``FieldError`` naming it otherwise."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise FieldError(f"'{name}' must be true or false, got {v!r}", name)
    return v


def parse(body: dict, chat: bool) -> Extras:
    """The vLLM fields of a request body (``chat``: the chat-only ones are allowed)."""
    for name, oks in REFUSED.items():
        v = body.get(name)
        if v is not None and not any(v == ok and type(v) is type(ok) for ok in oks):
            raise FieldError(f"'{name}' is not supported by this server; leave it out", name)
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (type(truncate) is not int or truncate == 0 or truncate < -1):
        why = f"'truncate_prompt_tokens' must be an integer >= 1 (or -1), got {truncate!r}"
        raise FieldError(why, "truncate_prompt_tokens")
    template = _template(body) if chat else {}
    if not chat:
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents"):
            if body.get(name) is not None:
                raise FieldError(f"'{name}' belongs to /v1/chat/completions", name)
    allowed = body.get("allowed_token_ids")
    if allowed is not None and not (
        isinstance(allowed, list) and allowed and all(type(t) is int and t >= 0 for t in allowed)
    ):
        raise FieldError("'allowed_token_ids' must be a non-empty list of token ids", "allowed_token_ids")
    words = body.get("bad_words") or []
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise FieldError("'bad_words' must be a list of non-empty strings", "bad_words")
    least = body.get("min_tokens")
    if least is not None and (type(least) is not int or least < 0):
        raise FieldError(f"'min_tokens' must be an integer >= 0, got {least!r}", "min_tokens")
    return Extras(
        min_tokens=least or 0,
        allowed_token_ids=tuple(allowed or ()),
        bad_words=tuple(words),
        include_stop_str=flag(body, "include_stop_str_in_output", False),
        skip_special_tokens=flag(body, "skip_special_tokens", True),
        add_special_tokens=flag(body, "add_special_tokens", None),
        truncate=truncate,
        template=template,
        token_id_strs=flag(body, "return_tokens_as_token_ids", False),
        return_token_ids=flag(body, "return_token_ids", False),
    )


def _template(body: dict) -> dict:
    """apply_chat_template's keywords: the generation prompt or the last message continued, the
    request's documents and its chat_template_kwargs."""
    gen = flag(body, "add_generation_prompt", True)
    cont = flag(body, "continue_final_message", False)
    if gen and cont:
        raise FieldError(
            "'continue_final_message' needs 'add_generation_prompt': false (the answer goes on from the "
            "last message instead of starting a new one)",
            "continue_final_message",
        )
    given = body.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        raise FieldError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kw = dict(given or {})
    clash = sorted(k for k in kw if k in TEMPLATE_OWN)  # apply_chat_template's own: the server sets them
    if clash:
        why = f"'chat_template_kwargs' may not set {clash}; use the request's own fields"
        raise FieldError(why, "chat_template_kwargs")
    docs = body.get("documents")
    if docs is not None:
        if not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs):
            raise FieldError("'documents' must be a list of objects", "documents")
        kw["documents"] = docs
    return {**kw, "add_generation_prompt": gen, "continue_final_message": cont}


def guided_format(body: dict) -> dict | None:
    """The ``response_format`` that a request's ``guided_*`` / ``structured_outputs`` field means
    (None: it has none); both forms, or one with ``response_format``, are refused."""
    given = {GUIDED[k]: body[k] for k in GUIDED if body.get(k) is not None}
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise FieldError("'structured_outputs' must be an object", "structured_outputs")
        given |= {k: v for k, v in so.items() if v is not None and v is not False}
    if not given:
        return None
    param = next(k for k in (*GUIDED, "structured_outputs") if body.get(k) is not None)
    if len(given) > 1 or body.get("response_format") is not None:
        raise FieldError("give one of response_format, guided_json / _regex / _choice / _grammar", param)
    ((kind, v),) = given.items()
    if kind == "json":
        try:
            schema = json.loads(v) if isinstance(v, str) else v
        except json.JSONDecodeError:
            schema = None
        if not isinstance(schema, dict):
            raise FieldError(f"'{param}' must be a JSON schema (an object)", param)
        return {"type": "json_schema", "json_schema": {"name": "guided", "schema": schema}}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise FieldError(f"'{param}' must be a non-empty list of non-empty strings", param)
        return {"type": "regex", "regex": "(" + "|".join(map(re.escape, v)) + ")"}
    if kind in ("regex", "grammar"):
        return {"type": kind, kind: v}
    why = f"'structured_outputs' takes json, regex, choice, grammar or json_object, got {kind!r}"
    raise FieldError(why, param)
