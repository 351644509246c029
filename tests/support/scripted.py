"""A scripted serving engine: the contract ``aotlm.serve`` drives (``validate``, ``submit``, ``stats``),
answering every request with fixed tokens and keeping what it was given (the prompt's ids, the
sampling settings, the matcher), so a test sees what reaches the engine without compiling a model."""

from __future__ import annotations

from aotlm.batching.types import Finish, Request, Token


class ScriptedEngine:
    """Answers every request with ``script`` (token ids, or ``Token`` items with their logprobs), then a
    finish (``reason``, default length); keeps what it got."""

    def __init__(self, script: list, n_positions: int = 64, reason: str = "length"):
        self.script, self.n_positions, self.vocab_size, self.running = script, n_positions, 320, True
        self.reason = reason  # how every answer ends (a FinishReason label)
        self.seen: list[Request] = []

    def validate(self, prompt, params):
        pass

    def submit(self, prompt, params, request_id=None, matcher=None):
        req = Request(request_id or "r", tuple(prompt), params, 0.0, matcher)
        for t in self.script:
            req.push(t if isinstance(t, Token) else Token(t))
        req.push(Finish(self.reason, len(prompt), len(self.script), 0.0))
        self.seen.append(req)
        return req

    def stats(self):
        return {"queue_depth": 0, "active_slots": 0, "slots": 4}
