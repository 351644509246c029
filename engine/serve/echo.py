"""The prompt in the answer: OpenAI's ``echo`` and vLLM's ``prompt_logprobs``.

* ``echo: true`` (``/v1/completions``): each choice's text starts with its prompt; with ``logprobs``
  its ``logprobs`` lists start with the prompt's tokens (the first one's log-probability and
  alternatives ``null``: nothing precedes it), then the answer's, ``text_offset`` counting from the
  prompt's start. ``max_tokens: 0`` with ``echo`` returns the prompt alone: the legacy way to score a
  text (lm-eval's ``local-completions`` asks ``echo`` + ``logprobs`` + ``max_tokens: 1``).
* ``prompt_logprobs: k`` (vLLM's, both endpoints, not streamed): each choice of a completion (the
  response, for a chat) gets ``prompt_logprobs``: ``null`` for the first prompt token, then per token
  ``{"<id>": {"logprob", "rank", "decoded_token"}}`` for the token itself and the ``k`` most likely.

Prompt log-probabilities are the model's own distribution (no temperature, penalties or bias), as
vLLM's are, and need a server started with ``--prompt-logprobs`` (the engine names the flag
otherwise); ``echo`` without ``logprobs`` needs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aotlm.batching.types import PromptLogprobs, Token
from aotlm.core.sampling import TOP_LOGPROBS_MAX
from aotlm.serve.detok import Piece
from aotlm.serve.responses import finite
from aotlm.serve.structured import FieldError


@dataclass(frozen=True)
class Echo:
    """What a request asks of its prompt: ``echo`` it, report vLLM's ``prompt_logprobs`` (``report``:
    that many alternatives, None: not asked), ``silent`` (``max_tokens`` 0: no answer at all), and
    ``engine``: the ``prompt_logprobs`` the engine computes (None: none)."""

    echo: bool = False
    report: int | None = None
    silent: bool = False
    engine: int | None = None


def parse(body: dict, chat: bool, logprobs: int | None, stream: bool) -> Echo:
    """``echo``, ``prompt_logprobs`` and ``max_tokens: 0`` of a request (``logprobs``: its count)."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise FieldError(f"'echo' must be true or false, got {echo!r}", "echo")
    if echo and chat:
        raise FieldError("'echo' belongs to /v1/completions (a chat answer never repeats its prompt)", "echo")
    k = body.get("prompt_logprobs")
    if k is not None:
        if type(k) is not int or not 0 <= k <= TOP_LOGPROBS_MAX:
            why = f"'prompt_logprobs' must be an integer between 0 and {TOP_LOGPROBS_MAX}, got {k!r}"
            raise FieldError(why, "prompt_logprobs")
        if stream:
            why = "'prompt_logprobs' is not sent in a stream: ask without 'stream' (or echo with logprobs)"
            raise FieldError(why, "prompt_logprobs")
    silent = body.get("max_tokens") == 0 and type(body.get("max_tokens")) is int
    if silent and not echo:
        why = "'max_tokens' 0 returns nothing: it needs 'echo': true (the prompt alone)"
        raise FieldError(why, "max_tokens")
    asked = [n for n in (k, logprobs if echo else None) if n is not None]
    return Echo(bool(echo), k, silent, max(asked) if asked else None)


class EchoRun:
    """One choice's prompt as the answer shows it: ``ids`` and their ``text`` (the prompt as sent,
    or its tokens decoded), with ``logprobs`` alternatives a token (None: no logprobs)."""

    def __init__(self, spec: Echo, ids: list[int], text: str, logprobs: int | None, text_of: Callable):
        self.spec, self.ids, self.text, self.logprobs, self.text_of = spec, ids, text, logprobs, text_of
        self.scores: PromptLogprobs | None = None

    @property
    def waits(self) -> bool:
        """Does the echoed prompt wait for the engine's ``PromptLogprobs``?"""
        return self.spec.echo and self.logprobs is not None

    @property
    def shift(self) -> int:
        """Where the answer starts in the choice's text."""
        return len(self.text) if self.spec.echo else 0

    def piece(self) -> Piece:
        """The echoed prompt as the choice's first piece (its tokens with their scores)."""
        tokens = []
        for t, tid in enumerate(self.ids):
            s = self.scores.tokens[t] if self.scores is not None else None
            k = self.logprobs or 0
            tokens.append(Token(tid) if s is None else Token(tid, s.logprob, s.top[:k]))
        offsets, at = [], 0
        for tid in self.ids:
            offsets.append(at)
            at += len(self.text_of(tid))
        return Piece(self.text, tokens, offsets, echoed=True)

    def report(self) -> list | None:
        """vLLM's ``prompt_logprobs`` list (None: not asked)."""
        k = self.spec.report
        if k is None or self.scores is None:
            return None
        out: list = []
        for s in self.scores.tokens:
            if s is None:
                out.append(None)
                continue
            entry = {str(s.id): self._entry(s.logprob, s.rank, s.id)}
            for rank, (tid, lp) in enumerate(s.top[:k], 1):
                entry.setdefault(str(tid), self._entry(lp, rank, tid))
            out.append(entry)
        return out

    def _entry(self, logprob: float, rank: int, tid: int) -> dict:
        return {"logprob": finite(logprob), "rank": rank, "decoded_token": self.text_of(tid)}
