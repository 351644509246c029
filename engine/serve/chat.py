"""Chat messages to prompt text: the tokenizer's chat template, or a plain fallback.

OpenAI's ``messages`` are checked here (roles, text content) so a malformed conversation is
a 400 naming ``messages[i]``, not a template error. A model without a chat template (the
bundled ``tiny-py`` has none) still answers chat requests with the fallback
documented in ``render`` instead of refusing them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content, where: str, role: str) -> str:
    """A message's content as one string: a string, or the text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}.content[{j}]: only text parts are supported, got {kind!r}", where)
            if not isinstance(part.get("text"), str):
                raise ChatError(f"{where}.content[{j}].text must be a string", where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatError(f"{where}.content must be a string or a list of text parts", where)


def _call(c, where: str) -> dict:
    """An assistant message's tool call, its arguments as an object (what HF templates read)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise ChatError(f"{where}.function.arguments must be a JSON object string", where) from None
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


class ChatError(ValueError):
    """A malformed ``messages`` list; ``param`` is ``messages[i]`` (HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def validate_messages(messages) -> list[dict]:
    """``[{"role", "content"}]`` with string content, or ``ChatError`` naming the message."""
    if messages is None:
        raise ChatError("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where} must be an object with 'role' and 'content'", where)
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", where)
        msg = {"role": role, "content": _text(m.get("content"), where, role)}
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise ChatError(f"{where}.tool_calls must be a list on an assistant message", where)
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def render(
    tokenizer, messages: Sequence[dict], tools: Sequence[dict] = (), template: dict | None = None
) -> tuple[str, bool]:
    """``(prompt text, add special tokens when encoding)`` for validated ``messages``.

    With the tokenizer's ``chat_template``: its text with the generation prompt, encoded
    without added special tokens because the template writes them itself (as
    ``apply_chat_template(tokenize=True)`` does). Without one, the fallback: every message as
    ``<|{role}|>\\n{content}\\n``, then ``<|assistant|>\\n`` for the answer, e.g.::

        <|system|>
        You are terse.
        <|user|>
        Hi
        <|assistant|>

    encoded like a plain prompt (the tokenizer adds its BOS if it has one). ``tools`` (OpenAI
    tool objects) go to the template as ``tools=``; the fallback lists them first as
    ``<|tools|>\n{JSON list}\n``, and writes a message's tool calls as JSON after its content.
    ``template``: more keywords for the template (``aotlm.serve.extras``: ``add_generation_prompt``,
    ``continue_final_message``, ``documents``, a request's ``chat_template_kwargs``); the fallback
    follows the first two and lists documents as ``<|documents|>\n{JSON list}\n``.
    """
    kw = {"add_generation_prompt": True, **(template or {})}
    if getattr(tokenizer, "chat_template", None):
        try:
            if tools:
                kw["tools"] = list(tools)
            text = tokenizer.apply_chat_template(list(messages), tokenize=False, **kw)
        except Exception as e:  # jinja's TemplateError, raise_exception() in templates, ...
            raise ChatError(f"the model's chat template rejected the messages: {e}", "messages") from e
        return text, False
    listed = lambda items: json.dumps(list(items), ensure_ascii=False, separators=(",", ":"))  # noqa: E731
    head = [f"<|tools|>\n{listed(tools)}\n"] if tools else []
    if kw.get("documents"):
        head.append(f"<|documents|>\n{listed(kw['documents'])}\n")
    parts = [f"<|{m['role']}|>\n{m['content']}{_calls_text(m)}\n" for m in messages]
    if kw.get("continue_final_message"):  # the answer goes on from the last message's text
        parts[-1] = parts[-1][:-1]
    return "".join(head + parts) + ("<|assistant|>\n" if kw["add_generation_prompt"] else ""), True


def _calls_text(m: dict) -> str:
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in m.get("tool_calls", ())
    ]
    return json.dumps(calls, ensure_ascii=False) if calls else ""
