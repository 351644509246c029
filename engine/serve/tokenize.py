"""``POST /tokenize`` and ``POST /detokenize``: the server's tokenizer, as vLLM and llama-server offer it.

One shape answers the clients of both: a text as vLLM's ``prompt`` (special tokens added by default)
or llama-server's ``content`` (none added by default: its ``add_special``), or vLLM's chat
``messages`` (rendered as ``/v1/chat/completions`` renders them, with its template fields); the answer
holds ``tokens`` (llama-server's ``with_pieces``: ``{"id", "piece"}`` objects), ``count`` and
``max_model_len`` (vLLM's), and ``token_strs`` with vLLM's ``return_token_strs``. ``/detokenize``
takes ``tokens`` and answers the text as both ``prompt`` (vLLM) and ``content`` (llama-server).
``GET /tokenizer_info`` (vLLM's) names the special tokens and the chat template in use: with it and
``/tokenize``, lm-eval's API backends tokenize through the server (no ``tokenizer=`` to give).
"""

from __future__ import annotations

from aotlm.serve import extras, protocol, structured
from aotlm.serve.chat import ChatError, validate_messages
from aotlm.serve.handlers import Served, chat_ids, check_model


def _ids(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if not isinstance(v, list) or not all(type(t) is int for t in v):
        raise protocol.bad(f"'{name}' must be a list of token ids", name)
    return v


def _text_ids(served: Served, body: dict) -> list[int]:
    """The ids of the body's text or chat, encoded as the generation endpoints encode them."""
    if body.get("messages") is not None:
        try:
            messages = validate_messages(body["messages"])
            more = extras.parse(body, chat=True)
            tools = structured.parse(body, chat=True).tools
        except (ChatError, structured.FieldError) as e:
            raise protocol.bad(str(e), e.param) from None
        return chat_ids(served, messages, tools, more)
    name = "content" if "content" in body else "prompt"
    text = body.get(name)
    if not isinstance(text, str):
        raise protocol.bad(f"'{name}' must be a string (or give 'messages')", name)
    key = "add_special" if name == "content" else "add_special_tokens"
    add = protocol.get_bool(body, key, name == "prompt")
    return list(served.tokenizer(text, add_special_tokens=add)["input_ids"]) if text else []


def tokenize(served: Served, body: dict) -> dict:
    """``POST /tokenize``."""
    check_model(served, body.get("model"))
    ids = _text_ids(served, body)
    out: dict = {"tokens": ids, "count": len(ids), "max_model_len": served.engine.n_positions}
    if protocol.get_bool(body, "with_pieces", False):
        out["tokens"] = [{"id": t, "piece": served.texts(t)} for t in ids]
    if protocol.get_bool(body, "return_token_strs", False):
        out["token_strs"] = [served.texts(t) for t in ids]
    return out


def detokenize(served: Served, body: dict) -> dict:
    """``POST /detokenize``."""
    check_model(served, body.get("model"))
    ids = _ids(body, "tokens")
    protocol.check_token_ids(ids, served.engine.vocab_size, "tokens")
    text = served.tokenizer.decode(ids)
    return {"prompt": text, "content": text}


def tokenizer_info(served: Served) -> dict:
    """``GET /tokenizer_info``: the tokenizer's class, special tokens, chat template and the window."""
    tok = served.tokenizer
    out = {"tokenizer_class": type(tok).__name__, "model_max_length": served.engine.n_positions}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        out[name] = value if isinstance(value, str) else None
    template = getattr(tok, "chat_template", None)
    out["chat_template"] = template if isinstance(template, str) else None
    return out
