"""One choice's tokens to text: incremental decoding, text stop strings, held-back text.

The engine stops on token ids only; a text stop string can span tokens or end inside one,
so it is found here on the decoded text. OpenAI's semantics: the text is cut before the
stop string (which is not returned) and ``finish_reason`` is ``"stop"``; the caller cancels
the engine request so its slot frees. While streaming, text that could be the start of a
stop string is held back until it is clear it is not, so a client never sees text that the
final answer does not contain; a streamed answer is the non-streamed answer cut in pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from aotlm.batching.types import Finish, Token
from aotlm.core.graphs import FinishReason
from aotlm.text.tokens import IncrementalDecoder


def finish_reason(finish: Finish, stopped_by_text: bool) -> str:
    """OpenAI's ``finish_reason``: an eos, a stop-token sequence or a stop string -> ``"stop"``.

    ``"cancelled"`` (not one of OpenAI's values) is left for a request the server itself cut
    short (shutdown); a client that went away never reads its reason.
    """
    return "stop" if stopped_by_text else FinishReason.of(finish.reason).openai


@dataclass
class Piece:
    """Text released to the client and the tokens it came from (with their text offsets)."""

    text: str
    tokens: list[Token] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each token's start in the choice's text
    echoed: bool = False  # the prompt, echoed (``aotlm.serve.echo``): its tokens are not the answer's


class ChoiceText:
    """Incremental text of one choice with its stop strings.

    ``push`` each ``Token`` and send the returned ``Piece``; ``finish`` at the end releases
    whatever was held back. After a stop string ``stopped`` is true and further tokens (the
    engine may make a few before the cancel lands) are ignored.
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = tuple(stop)
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the stop string stays
        self.min_tokens = min_tokens  # vLLM's: no stop string ends the answer before this many tokens
        self.floor = 0  # a stop string counts only if it ends past this many characters
        self.longest = max(map(len, self.stop), default=0)
        self.text = ""  # decoded so far (cut at a stop string once found)
        self.sent = 0  # characters of ``text`` released
        self.pending: list[Token] = []
        self.pending_offsets: list[int] = []
        self.stopped = False
        self.n_tokens = 0  # tokens that count toward the answer (up to the stop string's)

    def push(self, token: Token) -> Piece | None:
        if self.stopped:
            return None
        self.n_tokens += 1
        self.pending.append(token)
        self.pending_offsets.append(len(self.text))
        self.text += self.decoder.push([token.id])
        if self.n_tokens < self.min_tokens:
            self.floor = len(self.text)
        return self._release(final=False)

    def finish(self) -> Piece:
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> Piece:
        end = len(self.text)
        if self.stop and not self.stopped:
            hit = self._find_stop()
            if hit is not None:
                at, stop = hit
                end = at + len(stop) if self.include_stop else at
                self.stopped, self.text = True, self.text[:end]
            elif not final:
                end -= self._held()
        piece = Piece(self.text[self.sent : end])
        self.sent = max(self.sent, end)
        if end == len(self.text) or final or self.stopped:  # nothing held: the tokens go with it
            piece.tokens, piece.offsets = self.pending, self.pending_offsets
            self.pending, self.pending_offsets = [], []
        return piece

    def _find_stop(self) -> tuple[int, str] | None:
        """``(start, stop string)`` of the earliest stop string; none can start in text already released."""
        start = max(0, self.sent - self.longest)
        at = lambda s: max(start, self.floor - len(s) + 1)  # noqa: E731 -- ending past the min_tokens' text
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, at(s))) >= 0]
        return min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else None

    def _held(self) -> int:
        """Length of the longest unreleased tail that begins some stop string."""
        tail = self.text[self.sent :]
        for k in range(min(len(tail), self.longest - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return k
        return 0


class TokenTexts:
    """A token id's own text for logprobs (cached; special tokens shown, not skipped).

    A byte-level token holding part of a UTF-8 character decodes to U+FFFD on its own; its
    ``bytes`` are then those of the replacement character, not the raw byte.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            if len(self.cache) < 1 << 17:
                self.cache[token_id] = text
        return text
