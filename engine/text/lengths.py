"""How many tokens the text-generation pipeline generates for a prompt, as transformers counts them.

A call's ``max_new_tokens``, else its ``max_length`` (prompt + new tokens), else the checkpoint's
``generation_config.json`` (its ``max_new_tokens``, else its ``max_length``), else transformers'
pipeline default of 256 new tokens capped to the room the compiled ``n_positions`` leaves. A count
that does not fit is refused, naming the prompt and the fix; so is one that leaves no new token.
"""

from __future__ import annotations

from dataclasses import dataclass

from aotlm.text import call_args

DEFAULT_MAX_NEW_TOKENS = 256  # transformers' pipeline default, capped to what the model was compiled for


@dataclass(frozen=True)
class Lengths:
    """The pipeline's length rules over one compiled model and its checkpoint's defaults."""

    n_positions: int
    default_new: int | None = None  # generation_config.json's max_new_tokens
    default_length: int | None = None  # generation_config.json's max_length

    def new_tokens(self, i: int, p_len: int, asked, length: int | None = None, offset: int = 0) -> int:
        """New tokens for prompt ``i`` of ``p_len`` tokens (``offset``: a prefix's tokens, which the
        checkpoint's ``max_length`` does not count)."""
        room = self.n_positions - p_len
        asked = call_args.new_tokens(asked)
        if asked is None and length is not None:
            asked = length - p_len
            if asked < 1:  # as transformers refuses it
                raise ValueError(
                    f"prompt {i} has {p_len} tokens, max_length={length} leaves no new one; raise max_length "
                    "(prompt + new tokens) or give max_new_tokens"
                )
            if asked > room:
                raise ValueError(
                    f"prompt {i} has {p_len} tokens; max_length={length} needs {p_len + asked} positions but "
                    f"the model was compiled for n_positions={self.n_positions}; lower max_length or "
                    "load the model with a larger n_positions"
                )
        if asked is None and self.default_new is None and self.default_length is not None:
            asked = max(1, min(int(self.default_length) + offset - p_len, room))  # transformers' max_length
        if asked is None:
            asked = min(self.default_new or DEFAULT_MAX_NEW_TOKENS, room)
            if asked < 1:
                raise ValueError(
                    f"prompt {i} has {p_len} tokens, which fills n_positions={self.n_positions}; "
                    "shorten it or load the model with a larger n_positions"
                )
        if asked < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {asked}")
        if asked > room:
            raise ValueError(
                f"prompt {i} has {p_len} tokens; with max_new_tokens={asked} it needs {p_len + asked} "
                f"positions but the model was compiled for n_positions={self.n_positions}; "
                "lower max_new_tokens or load the model with a larger n_positions"
            )
        return int(asked)

    def wanted(self, i: int, p_len: int, asked, length: int | None, offset: int = 0) -> int:
        """The new tokens prompt ``i`` asks for whatever room it leaves (``handle_long_generation``
        cuts the prompt to make that room): the default of 256 is not capped."""
        asked = call_args.new_tokens(asked)
        if asked is None and length is not None:
            asked = length - p_len
            if asked < 1:
                self.new_tokens(i, p_len, None, length)  # refuses it, naming max_length
        if asked is None and self.default_new is None and self.default_length is not None:
            asked = max(1, int(self.default_length) + offset - p_len)
        return asked if asked is not None else (self.default_new or DEFAULT_MAX_NEW_TOKENS)
