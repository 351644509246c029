"""``POST /v1/responses``: OpenAI's Responses API over the chat pipeline (vLLM serves it too).

A request is read into a chat request and answered by ``/v1/chat/completions``' machinery (the chat
template, sampling, structured outputs, tool calls, prefix reuse, LoRA), and its answer written back
in the Responses shape. Responses are stored unless ``store`` is false (``aotlm.serve.response_store``),
so ``previous_response_id`` continues one; ``background``, ``conversation`` and built-in tools are
refused by name.

* ``input``: a string (one user message) or a list of items: messages (``{"role", "content"}``, the
  content a string or ``input_text`` / ``output_text`` parts; ``developer`` reads as ``system``),
  ``function_call`` items (the assistant's calls) and ``function_call_output`` items (their results,
  as ``tool`` messages); ``instructions`` is a system message before them.
* ``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs``, ``parallel_tool_calls`` and
  the sampling extras (``top_k``, ``seed``, ...) as on a chat; ``text.format`` (``json_schema``,
  ``json_object``, ``text``) is the chat's ``response_format``; ``tools`` are function tools
  (``{"type": "function", "name", "parameters", ...}``), ``tool_choice`` as the Responses API writes it.
* The answer: a ``message`` item with one ``output_text`` part, or ``function_call`` items; ``status``
  ``"incomplete"`` (``incomplete_details.reason`` ``"max_output_tokens"``) when the length ran out.
  Streamed: ``response.created``, ``response.in_progress``, the items' ``output_item.added``,
  ``content_part.added``, ``output_text.delta`` ... ``done`` (``function_call_arguments.delta`` /
  ``done`` for calls), then ``response.completed`` (or ``response.incomplete``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from aotlm.serve.protocol import bad

REFUSED = ("background", "conversation", "prompt")  # need state this server does not keep
PASSED = ("model", "temperature", "top_p", "top_logprobs", "parallel_tool_calls", "stream", "user", "seed",
          "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
          "logit_bias", "ignore_eos", "min_tokens", "bad_words", "skip_special_tokens",
          "chat_template_kwargs")  # fmt: skip
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def to_chat(body: dict, history: list[dict] | None = None) -> dict:
    """The chat request a Responses request asks for (a 400 naming what it cannot be); ``history``: the
    conversation of its ``previous_response_id`` (chat messages), after the instructions."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name in REFUSED:
        if body.get(name) is not None:
            raise bad(
                f"'{name}' needs state this server does not keep; send the whole input",
                name,
            )
    if body.get("reasoning") not in (None, {}) or body.get("truncation") not in (None, "disabled"):
        name = "reasoning" if body.get("reasoning") not in (None, {}) else "truncation"
        raise bad(f"'{name}' is not supported by this server; leave it out", name)
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    messages += [*(history or []), *_messages(body.get("input"))]
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = messages
    include = body.get("include") or []
    if body.get("top_logprobs") is not None or "message.output_text.logprobs" in include:
        chat["logprobs"] = True
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            out.append({"role": ROLES[item["role"]], "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            fn = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            call = {"id": item.get("call_id"), "type": "function", "function": fn}
            if (
                out
                and out[-1]["role"] == "assistant"
                and out[-1].get("tool_calls")
                and not out[-1]["content"]
            ):
                out[-1]["tool_calls"].append(call)  # calls made together: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        else:
            why = f"{where} must be a message ({{role, content}}), a function_call or a function_call_output"
            raise bad(why, where)
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise bad(
                    f"{where}.content[{j}] must be a text part (input_text): this server reads text only",
                    where,
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise bad(f"{where}.content must be a string or a list of input_text parts", where)


def _format(fmt) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad(
        "'text.format' must be {type: text}, {type: json_object} or {type: json_schema, schema}", "text"
    )


def _tool(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise bad(f"tools[{i}]: only function tools run here, got {kind!r}", f"tools[{i}]")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# ------------------------------------------------------------------ answers
def _usage(use: dict | None) -> dict | None:
    if use is None:
        return None
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": use["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": use["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": use["total_tokens"],
    }


def _text_part(text: str, logprobs: list) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _logprobs(chat_lp: dict | None) -> list:
    """Chat logprobs' ``content`` as the Responses API's (the same entries)."""
    return [] if not chat_lp else list(chat_lp.get("content") or [])


def _call_item(call: dict) -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}  # fmt: skip


class Answer:
    """One Responses request's answer shapes (id, creation time, what it echoes of the request)."""

    def __init__(self, body: dict, model: str, created: int, stored: bool = False):
        self.id, self.model, self.created = f"resp_{uuid.uuid4().hex}", model, created
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.body, self.stored = body, stored

    def response(self, output: list, status: str, use: dict | None) -> dict:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "output": output, "usage": _usage(use), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature"), "top_p": b.get("top_p"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [], "text": b.get("text") or {"format": {"type": "text"}},
            "store": self.stored, "previous_response_id": b.get("previous_response_id"), "reasoning": None,
            "truncation": "disabled",
            "metadata": b.get("metadata") or {}, "user": b.get("user"),
        }  # fmt: skip

    def message(self, text: str, logprobs: list, status: str = "completed") -> dict:
        content = [_text_part(text, logprobs)] if status == "completed" else []
        return {
            "type": "message",
            "id": self.msg_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def whole(self, chat: dict) -> dict:
        """The answer of a chat response (not streamed)."""
        choice = chat["choices"][0]
        msg, reason = choice["message"], choice["finish_reason"]
        if msg.get("tool_calls"):
            output = [_call_item(c) for c in msg["tool_calls"]]
        else:
            output = [self.message(msg.get("content") or "", _logprobs(choice.get("logprobs")))]
        return self.response(output, "incomplete" if reason == "length" else "completed", chat.get("usage"))


def assistant_turn(text: str, calls: list[dict]) -> dict:
    """The answer as the chat message a later turn's history holds (calls in the chat's form)."""
    if not calls:
        return {"role": "assistant", "content": text}
    calls = [{"id": c.get("id"), "type": "function", "function": c["function"]} for c in calls]
    return {"role": "assistant", "content": text, "tool_calls": calls}


async def events(answer: Answer, chunks: AsyncIterator[str], done=None) -> AsyncIterator[str]:
    """The Responses API's stream from a chat stream's SSE chunks (``stream_options.include_usage``);
    ``done(response, assistant_turn)`` is called with the final response before its event."""
    seq = iter(range(1 << 62))

    def event(kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    yield event("response.created", response=answer.response([], "in_progress", None))
    yield event("response.in_progress", response=answer.response([], "in_progress", None))
    text, lps, reason, use, calls, opened = "", [], None, None, [], False
    ids = dict(item_id=answer.msg_id, output_index=0, content_index=0)
    async for raw in chunks:
        data = raw[6:].strip() if raw.startswith("data: ") else ""
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            yield event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
            return
        use = chunk.get("usage") or use
        for c in chunk.get("choices") or []:
            delta, reason = c.get("delta") or {}, c.get("finish_reason") or reason
            calls += delta.get("tool_calls") or []
            piece, lp = delta.get("content"), _logprobs(c.get("logprobs"))
            if piece or lp:
                if not opened:
                    opened = True
                    yield event(
                        "response.output_item.added",
                        output_index=0,
                        item=answer.message("", [], "in_progress"),
                    )
                    yield event("response.content_part.added", **ids, part=_text_part("", []))
                text, lps = text + (piece or ""), lps + lp
                yield event("response.output_text.delta", **ids, delta=piece or "", logprobs=lp)
    output = []
    if opened or not calls:
        if not opened:
            yield event(
                "response.output_item.added", output_index=0, item=answer.message("", [], "in_progress")
            )
            yield event("response.content_part.added", **ids, part=_text_part("", []))
        yield event("response.output_text.done", **ids, text=text, logprobs=lps)
        yield event("response.content_part.done", **ids, part=_text_part(text, lps))
        output.append(answer.message(text, lps))
        yield event("response.output_item.done", output_index=0, item=output[-1])
    for call in calls:
        i, item = len(output), _call_item(call)
        yield event(
            "response.output_item.added",
            output_index=i,
            item={**item, "arguments": "", "status": "in_progress"},
        )
        common = dict(item_id=item["id"], output_index=i)
        yield event("response.function_call_arguments.delta", **common, delta=item["arguments"])
        yield event(
            "response.function_call_arguments.done", **common, arguments=item["arguments"], name=item["name"]
        )
        output.append(item)
        yield event("response.output_item.done", output_index=i, item=item)
    status = "incomplete" if reason == "length" else "completed"
    final = answer.response(output, status, use)
    if done is not None:
        done(final, assistant_turn(text, calls))
    yield event(f"response.{status}", response=final)
