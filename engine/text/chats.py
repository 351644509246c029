"""Chats as pipeline inputs, as ``transformers.pipeline("text-generation")`` takes them.

A chat is a list of ``{"role", "content"}`` messages; the pipeline takes one chat or a list of
chats, renders each through the tokenizer's chat template (with the generation prompt, or, when
the last message is the assistant's, continuing that message: transformers' "prefill"), and
answers with the chat plus the new assistant message (``return_full_text``) or the new text.
"""

from __future__ import annotations

from collections.abc import Sequence


def _is_chat(x) -> bool:
    return isinstance(x, list | tuple) and bool(x) and isinstance(x[0], dict)


def split(text_inputs) -> tuple[list[list[dict]] | None, bool]:
    """``(chats, single)``: the chats in ``text_inputs`` (None when it holds text prompts) and
    whether one chat was given (answered as one list of candidates, not a list of lists)."""
    if _is_chat(text_inputs):
        chats, single = [list(text_inputs)], True
    elif isinstance(text_inputs, list | tuple) and text_inputs and all(map(_is_chat, text_inputs)):
        chats, single = [list(c) for c in text_inputs], False
    else:
        return None, False
    for i, chat in enumerate(chats):
        for j, m in enumerate(chat):
            if not (isinstance(m, dict) and "role" in m and "content" in m):
                where = f"message {j}" + ("" if single else f" of chat {i}")
                raise ValueError(f"{where} is not a {{'role', 'content'}} dict; give every message both keys")
    return chats, single


def continues(chat: Sequence[dict], continue_final_message: bool | None) -> bool:
    """Whether the answer continues the last message (default: when it is the assistant's)."""
    if continue_final_message is None:
        return chat[-1]["role"] == "assistant"
    return bool(continue_final_message)


def render(
    tokenizer,
    chat: Sequence[dict],
    final: bool,
    tools: Sequence[dict] | None = None,
    documents: Sequence[dict] | None = None,
    **variables,
) -> str:
    """The chat's prompt text (encode it without added special tokens: the template writes them);
    ``tools``, ``documents`` (retrieval documents, for templates that take them) and ``variables``
    (e.g. ``enable_thinking=False``) go to the template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template (a base model?): give the prompt as text, or a tokenizer "
            "with a chat_template"
        )
    kw = {**variables, "tools": list(tools)} if tools else dict(variables)
    if documents:
        kw["documents"] = list(documents)
    try:
        return tokenizer.apply_chat_template(
            list(chat), tokenize=False, add_generation_prompt=not final, continue_final_message=final, **kw
        )
    except Exception as e:  # jinja's TemplateError, raise_exception() in templates, a missing final message
        raise ValueError(f"the chat template rejected the chat: {e}") from e


def reply(chat: Sequence[dict], text: str, final: bool) -> list[dict]:
    """The chat with the answer: a new assistant message, or the last message continued."""
    if final:
        last = chat[-1]
        return [*chat[:-1], {"role": last["role"], "content": last["content"] + text}]
    return [*chat, {"role": "assistant", "content": text}]
