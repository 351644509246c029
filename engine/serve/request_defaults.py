"""The server's request defaults: the checkpoint's ``generation_config.json`` as vLLM's server reads it.

vLLM (``--generation-config auto``, its default) takes ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` from the model's ``generation_config.json`` as the
defaults of every request that leaves them out: each one the file sets (vLLM reads
``GenerationConfig.to_diff_dict()``, which under transformers 5 keeps every value set, ``top_k: 50``
too); ``do_sample`` is not read, so a file's ``temperature`` samples even beside ``do_sample: false``.
``max_new_tokens`` bounds the default ``max_tokens``: completions get the smaller of it and OpenAI's
16, chats the smaller of it and the context's room; a request's own ``max_tokens`` wins (vLLM caps it
too). ``--generation-config vllm`` reads no file, ``--generation-config DIR`` reads ``DIR``'s, and
``--override-generation-config JSON`` sets fields over the file's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from aotlm.serve import protocol
from aotlm.text.tokens import generation_defaults

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # the request fields they become
LENGTH = "max_new_tokens"  # -> the default max_tokens


@dataclass(frozen=True)
class Defaults:
    """``sampling``: request fields (OpenAI names) a request leaves out; ``max_tokens``: the bound of
    its default ``max_tokens`` (None: the endpoint's own)."""

    sampling: dict = field(default_factory=dict)
    max_tokens: int | None = None

    def apply(self, body: dict) -> dict:
        """``body`` with the defaults under its own fields (a null field is left out)."""
        if not self.sampling or not isinstance(body, dict):
            return body
        return {**self.sampling, **{k: v for k, v in body.items() if v is not None}}

    def default_max(self, endpoint_default: int | None) -> int | None:
        """The default ``max_tokens`` of an endpoint whose own is ``endpoint_default`` (None: the room)."""
        if self.max_tokens is None:
            return endpoint_default
        return self.max_tokens if endpoint_default is None else min(self.max_tokens, endpoint_default)

    def described(self) -> str:
        shown = dict(self.sampling, **({"max_tokens": self.max_tokens} if self.max_tokens else {}))
        return ", ".join(f"{k}={v}" for k, v in shown.items())


def load(source: str, checkpoint: str, override: str | None = None) -> Defaults:
    """The defaults ``--generation-config source`` (``auto``, ``vllm`` or a folder) and
    ``--override-generation-config`` give; a bad value is a ``ValueError`` naming it."""
    if source == "vllm":
        raw: dict = {}
    elif source == "auto":
        raw = generation_defaults(checkpoint)
    else:
        if not (Path(source) / "generation_config.json").is_file():
            raise ValueError(
                f"--generation-config {source}: no generation_config.json there (or give auto, vllm)"
            )
        raw = generation_defaults(source)
    if override:
        try:
            extra = json.loads(override)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError(
                "--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'"
            )
        raw = {**raw, **extra}
    taken = {k: raw[k] for k in FIELDS if raw.get(k) is not None}
    length = raw.get(LENGTH)
    if length is not None and (type(length) is not int or length < 1):
        raise ValueError(f"generation config: max_new_tokens must be an integer >= 1, got {length!r}")
    try:
        protocol.parse_completion({"prompt": "x", **taken, "max_tokens": length}, 1)
    except protocol.APIError as e:
        raise ValueError(f"generation config: {e.message}") from None
    return Defaults(taken, length)
