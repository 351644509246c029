"""OpenAI's response objects as dicts: whole responses, stream chunks, logprobs, usage.

One place for the wire shapes, so the completions and chat endpoints (streamed or not)
cannot drift apart; the handlers only decide what goes in them.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from aotlm.serve.detok import Piece
from aotlm.serve.structured import Structured, read_calls

COMPLETION, CHAT = "text_completion", "chat.completion"
# The lowest log-probability sent: a token that top-k / top-p / min-p cut has -inf, which JSON has no
# number for (vLLM sends the same floor)
LOGPROB_FLOOR = -9999.0


def finite(logprob: float | None) -> float | None:
    """``logprob`` with -inf raised to ``LOGPROB_FLOOR`` (None stays None)."""
    return None if logprob is None else max(float(logprob), LOGPROB_FLOOR)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose K/V was reused."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(obj: dict | str) -> str:
    """One server-sent event (``data: [DONE]`` for the string)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def completion_logprobs(piece: Piece, text_of: Callable[[int], str]) -> dict:
    """Legacy completions logprobs: parallel lists; ``top_logprobs`` as ``{text: logprob}``.

    ``text_offset`` is each token's start in the choice's text (an echoed prompt's first token has
    no log-probability: ``null`` there, and for its alternatives).
    """
    top = lambda t: None if t.logprob is None else {text_of(i): finite(lp) for i, lp in t.top}  # noqa: E731
    return {
        "tokens": [text_of(t.id) for t in piece.tokens],
        "token_logprobs": [finite(t.logprob) for t in piece.tokens],
        "top_logprobs": [top(t) for t in piece.tokens],
        "text_offset": list(piece.offsets),
    }


def _entry(text: str, logprob: float | None) -> dict:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(piece: Piece, text_of: Callable[[int], str]) -> dict:
    """Chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    content = []
    for t in piece.tokens:
        item = _entry(text_of(t.id), t.logprob)
        item["top_logprobs"] = [_entry(text_of(i), lp) for i, lp in t.top]
        content.append(item)
    return {"content": content}


class Shapes:
    """The response shapes of one HTTP request (``id``, ``created``, ``model`` shared)."""

    def __init__(
        self,
        kind: str,
        rid: str,
        created: int,
        model: str,
        text_of: Callable[[int], str],
        form: Structured | None = None,
    ):
        self.kind, self.id, self.created, self.model, self.text_of = kind, rid, created, model, text_of
        self.form = form or Structured()

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, piece: Piece) -> dict:
        if self.kind == CHAT:
            return chat_logprobs(piece, self.text_of)
        return completion_logprobs(piece, self.text_of)

    def merge_logprobs(self, pieces: list[Piece]) -> dict:
        return self.logprobs(
            Piece(
                "".join(p.text for p in pieces),
                [t for p in pieces for t in p.tokens],
                [o for p in pieces for o in p.offsets],
            )
        )

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
        if self.kind == CHAT:
            message: dict = {"role": "assistant", "content": text}
            calls = read_calls(self.form, text, finish_reason) if self.form.reads_calls else []
            if calls:  # OpenAI: content null, finish_reason "tool_calls"
                message, finish_reason = (
                    {"role": "assistant", "content": None, "tool_calls": calls},
                    "tool_calls",
                )
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, choices: list[dict], use: dict) -> dict:
        return {**self._head(self.kind), "choices": choices, "usage": use}

    def chunk(
        self,
        index: int,
        text: str | None,
        logprobs: dict | None,
        finish_reason: str | None,
        with_usage: bool,
        role: bool = False,
    ) -> dict:
        """A streamed choice delta; ``role`` marks a chat stream's first chunk of a choice."""
        if self.kind == CHAT:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs}
            choice["finish_reason"] = finish_reason
            out = {**self._head(COMPLETION), "choices": [choice]}
        if with_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked for
        return out

    def whole_chunk(
        self, index: int, pieces: list[Piece], want_lp: bool, reason: str, with_usage: bool
    ) -> dict:
        """A held-back answer (tools) as one chunk: its tool calls (``delta.tool_calls``, each
        with its ``index``) or its text."""
        lp = self.merge_logprobs(pieces) if want_lp else None
        choice = self.choice(index, "".join(p.text for p in pieces), lp, reason)
        out = self.chunk(index, choice["message"]["content"], lp, choice["finish_reason"], with_usage)
        calls = choice["message"].get("tool_calls")
        if calls:
            out["choices"][0]["delta"] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        return out

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == CHAT else COMPLETION
        return {**self._head(obj), "choices": [], "usage": use}
