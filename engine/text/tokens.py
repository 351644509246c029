"""Text in, text out: tokenizer loading, left padding, incremental detokenization.

aotlm's models take and return token ids; this module is the glue users otherwise write
themselves. Tokenizers are transformers ``AutoTokenizer`` objects loaded offline from the
directory :mod:`aotlm.models.checkpoint.resolve` finds (next to the checkpoint, at the training run root, or
given explicitly). Padding is on the left with an attention mask, the convention of
transformers ``generate`` that aotlm's ``sample()`` follows.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from aotlm.models.checkpoint import CheckpointError
from aotlm.models.checkpoint.resolve import validate_checkpoint
from aotlm.text.unicode import check_text


def quiet_transformers() -> None:
    """Keep transformers' import-time advice ("PyTorch was not found...") off the terminal.

    Only sets defaults: a user's own ``TRANSFORMERS_VERBOSITY`` wins.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def load_tokenizer(directory: str | os.PathLike):
    """``AutoTokenizer`` from a local directory (never downloads), padding on the left."""
    quiet_transformers()
    # local: slow to import (~1-2 s): kept out of `import aotlm` until text is needed
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"the tokenizer in {directory} cannot be loaded: {e}") from e
    tok.padding_side = "left"
    return tok


def tokenizer_for(model_dir: str | os.PathLike, tokenizer=None):
    """A tokenizer object: ``tokenizer`` itself when it is one, else found by ``checkpoint.resolve``."""
    if tokenizer is not None and not isinstance(tokenizer, str | os.PathLike):
        return tokenizer

    files = validate_checkpoint(model_dir, tokenizer)
    return load_tokenizer(files.tokenizer)


def encode(
    tokenizer, prompts: Sequence[str], add_special_tokens: bool = True, **tokenizer_kwargs
) -> list[list[int]]:
    """Token ids of each prompt, as transformers' pipeline makes them (special tokens added unless
    ``add_special_tokens=False``: text rendered by a chat template holds its own).
    ``tokenizer_kwargs`` go to the tokenizer's call (``truncation``, ``max_length``...).

    An empty prompt (or one that encodes to no tokens) is an error naming it: there is no
    position to predict from. Pad tokens the tokenizer adds (``padding="max_length"``) are dropped, as
    their attention mask drops them in transformers (the pipeline pads its batches itself).
    """
    kw = {"add_special_tokens": add_special_tokens, **tokenizer_kwargs}
    rows = []
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise TypeError(f"prompt {i} must be a string, got {type(text).__name__}")
        check_text(text, f"prompt {i}")
        enc = tokenizer(text, **kw) if text else {"input_ids": []}
        ids = list(enc["input_ids"])
        mask = enc.get("attention_mask")
        if mask is not None and 0 in mask:  # padded (padding="max_length"): the pads are not the prompt
            ids = [t for t, m in zip(ids, mask, strict=True) if m]
        if not ids:
            raise ValueError(f"prompt {i} is empty: give at least one character of text")
        rows.append(ids)
    return rows


def bad_word_ids(tokenizer, words) -> list[list[int]]:
    """vLLM's token ids of ``bad_words``: each word as written (its leading spaces dropped), and with
    one space before it where that makes a new first token of the same length (a word in mid-text)."""
    out = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)`` ``[batch, longest]``, padded on the left."""
    n = max(len(r) for r in rows)
    ids = np.full((len(rows), n), pad_id, np.int32)
    mask = np.zeros((len(rows), n), np.int32)
    for i, r in enumerate(rows):
        if r:
            ids[i, n - len(r) :] = r
            mask[i, n - len(r) :] = 1
    return ids, mask


def cut_at_eos(tokens: Sequence[int], eos: Sequence[int]) -> list[int]:
    """The generated tokens up to and including the first eos (the rest is fill)."""
    out = [int(t) for t in tokens]
    stops = set(eos)
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1]
    return out


class IncrementalDecoder:
    """Token ids in, text pieces out, never splitting a multi-byte character.

    Byte-level BPE tokens can hold part of a UTF-8 character, and SentencePiece decodes a
    token differently depending on what precedes it. So the text of a new token is the
    difference between decoding a short window with and without it, and is held back while
    it ends in U+FFFD (an incomplete character). The window restarts after every emitted
    piece, so the cost per token stays constant.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens up to here are already emitted

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(
            tokens, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False
        )

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the newly completed text (maybe empty)."""
        self.tokens.extend(int(t) for t in tokens)
        before = self._decode(self.tokens[self.prefix : self.read])
        now = self._decode(self.tokens[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.tokens)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self.tokens[self.prefix : self.read])
        now = self._decode(self.tokens[self.prefix :])
        self.prefix = self.read = len(self.tokens)
        return now[len(before) :]


class TextStreamer:
    """Prints (or hands to ``on_text``) generated text as tokens arrive.

    Implements the transformers ``BaseStreamer`` protocol that ``sample(streamer=...)``
    calls: ``put(ids)`` (the first call carries the prompt, like ``generate``), then
    ``end()``. With a batch, row 0 is streamed.
    """

    def __init__(
        self,
        tokenizer,
        skip_prompt: bool = True,
        skip_special_tokens: bool = True,
        on_text: Callable[[str], None] | None = None,
        stream=None,
    ):
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.skip_prompt = skip_prompt
        self.next_is_prompt = True
        self.stream = stream
        self.on_text = on_text or self._write
        self.pieces: list[str] = []

    def _write(self, text: str) -> None:
        out = self.stream or sys.stdout
        out.write(text)
        out.flush()

    @staticmethod
    def _row0(value) -> list[int]:
        arr = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
        if arr.ndim == 2:
            arr = arr[0]
        elif arr.ndim == 1 and arr.shape[0] > 1:
            arr = arr[:1]  # one new token per row
        return arr.reshape(-1).tolist()

    def put(self, value) -> None:
        arr = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
        if self.next_is_prompt:
            self.next_is_prompt = False
            if self.skip_prompt:
                return
            tokens = (arr[0] if arr.ndim == 2 else arr).reshape(-1).tolist()
        else:
            tokens = self._row0(arr)
        self._emit(self.decoder.push(tokens))

    def end(self) -> None:
        self._emit(self.decoder.flush())
        self.next_is_prompt = True

    def _emit(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            self.on_text(text)

    @property
    def text(self) -> str:
        """Everything streamed so far."""
        return "".join(self.pieces)


def eos_ids(checkpoint: str | os.PathLike, hf_config, tokenizer) -> list[int]:
    """The ids that end generation, as transformers ``generate`` finds them.

    ``generation_config.json`` first, then ``config.json``; the tokenizer's eos only when
    the checkpoint names none.
    """
    eos = generation_defaults(checkpoint).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in np.atleast_1d(eos).tolist()]


def generation_defaults(checkpoint: str | os.PathLike) -> dict:
    """The checkpoint's ``generation_config.json`` as a dict (empty when absent or unreadable)."""
    f = Path(checkpoint) / "generation_config.json"
    try:
        out = json.loads(f.read_text()) if f.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return out if isinstance(out, dict) else {}
