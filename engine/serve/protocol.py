"""OpenAI request bodies in, checked values out; OpenAI's error shape.

Plain Python on the decoded JSON (no pydantic models), so every message names the field the
way the client sent it, and the HTTP layer turns an ``APIError`` into
``{"error": {"message", "type", "param", "code"}}`` with its status. Unknown fields are
ignored (OpenAI clients send extras such as ``user`` or ``metadata``); fields that ask for
something this server does not do (``suffix``, ``best_of`` != ``n``, the deprecated
``functions``) are rejected by name rather than silently dropped. ``response_format``,
``logit_bias`` and ``tools`` are ``aotlm.serve.structured``'s; vLLM's extra fields (``guided_json``,
``include_stop_str_in_output``, ``chat_template_kwargs``, ...) ``aotlm.serve.extras``'; ``echo`` and
``prompt_logprobs`` ``aotlm.serve.echo``'s.

Completions take ``prompt`` as a string, a list of strings, a list of token ids or a list of
token-id lists; several prompts give ``len(prompts) * n`` choices, numbered prompt-major as
OpenAI does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from aotlm.batching.types import SamplingParams
from aotlm.core import sampler_params
from aotlm.core.sampling import TOP_LOGPROBS_MAX as MAX_LOGPROBS  # per token (OpenAI's limit too)
from aotlm.serve import echo, extras, structured
from aotlm.serve.chat import ChatError, validate_messages

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SEED_RANGE = 2**32  # the in-graph sampler's seeds are uint32


class APIError(Exception):
    """An error the client gets as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape (``openai`` clients read ``error.message`` into their exceptions)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, code="invalid_value" if param else None)


@dataclass(frozen=True)
class Common:
    """What both endpoints share: the sampling settings and how to answer."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    max_tokens: int | None  # None: the endpoint's default, worked out once the prompt is known
    params: SamplingParams  # max_tokens and seed are set per choice by ``choice_params``
    form: structured.Structured = structured.Structured()  # response_format, tools, logit_bias
    extras: extras.Extras = extras.Extras()  # vLLM's fields for the prompt and the text
    echo: echo.Echo = echo.Echo()  # the prompt in the answer: echo, prompt_logprobs
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk


@dataclass(frozen=True)
class CompletionBody:
    common: Common
    prompts: tuple[str | tuple[int, ...], ...]


@dataclass(frozen=True)
class ChatBody:
    common: Common
    messages: list[dict]


# ------------------------------------------------------------------ field readers
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(f"'{name}' must be {_range(lo, hi)}, got {v}", name)
    return v


def get_float(
    body: dict, name: str, default: float, lo: float, hi: float | None, lo_open: bool = False
) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not (isinstance(v, int | float) and not isinstance(v, bool)) or math.isnan(v):
        raise bad(f"'{name}' must be a number, got {v!r}", name)
    if v < lo or (hi is not None and v > hi) or (lo_open and v == lo):
        if hi is None:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"in ({lo:g}, {hi:g}]" if lo_open else f"between {lo:g} and {hi:g}"
        raise bad(f"'{name}' must be {rng}, got {v}", name)
    return float(v)


def _sampling(body: dict) -> dict:
    """The request's sampling settings (``sampler_params.TABLE``'s OpenAI names; absent: default)."""
    out = {}
    for name, p in sampler_params.BY_OPENAI.items():
        r = p.http_range or p.range
        if not p.integer:
            out[name] = get_float(body, name, p.default, r.lo, r.hi, r.lo_open)
        elif name == "top_k":  # vLLM's -1 is "off", like 0
            out[name] = max(get_int(body, name, p.default, -1, r.hi), 0)
        else:
            out[name] = get_int(body, name, p.default, r.lo, r.hi)
    return out


def get_bool(body: dict, name: str, default: bool) -> bool:
    try:
        return extras.flag(body, name, default)
    except structured.FieldError as e:
        raise bad(str(e), e.param) from None


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} strings, got {len(items)}", "stop")
    if any(s == "" for s in items):
        raise bad("'stop' strings must not be empty", "stop")
    return tuple(dict.fromkeys(items))


def _stop_token_ids(body: dict) -> tuple[tuple[int, ...], ...]:
    """vLLM's extra ``stop_token_ids``: each id ends generation (checked in the graph)."""
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    return tuple((t,) for t in dict.fromkeys(v))


def _reject_unsupported(body: dict, n: int) -> None:
    """Fields that would change the answer in ways this server cannot honour."""
    if body.get("suffix"):
        raise bad("'suffix' (insertion) is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad(f"'best_of' is not supported (only best_of == n, got {best_of!r})", "best_of")


def _common(
    body: dict, max_n: int, max_tokens: int | None, logprobs: int | None, chat: bool, closed: bool = True
) -> Common:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    n = get_int(body, "n", 1, 1, max_n)
    _reject_unsupported(body, n)
    try:
        guided = extras.guided_format(body)  # vLLM's guided_json & co: a response_format
        form = structured.parse(body if guided is None else {**body, "response_format": guided}, chat, closed)
        more = extras.parse(body, chat)
        stream = extras.flag(body, "stream", False)
        prompt = echo.parse(body, chat, logprobs, stream)
    except structured.FieldError as e:
        raise bad(str(e), e.param) from None
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = get_bool(options or {}, "include_usage", False)
    every = get_bool(options or {}, "continuous_usage_stats", False)
    if every and not include_usage:  # vLLM: usage on every chunk is part of include_usage
        raise bad("'continuous_usage_stats' needs 'include_usage': true", "stream_options")
    params = SamplingParams(
        **_sampling(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=get_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        logit_bias=form.logit_bias,
        prompt_logprobs=prompt.engine,
    )
    if more.min_tokens and max_tokens is not None and more.min_tokens > max_tokens:
        raise bad(
            f"'min_tokens' ({more.min_tokens}) must be at most 'max_tokens' ({max_tokens})", "min_tokens"
        )
    stop = _stop(body)
    return Common(model, n, stream, include_usage, stop, max_tokens, params, form, more, prompt, every)


def _logprobs_count(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < 0:
        raise bad(f"'{name}' must be an integer between 0 and {MAX_LOGPROBS}, got {v!r}", name)
    if v > MAX_LOGPROBS:
        raise bad(f"'{name}' must be at most {MAX_LOGPROBS} (the server's limit), got {v}", name)
    return v


# ------------------------------------------------------------------ endpoints
def prompts(v, name: str = "prompt") -> tuple[str | tuple[int, ...], ...]:
    """``prompt``'s four OpenAI forms (``/v1/embeddings``' ``input``'s too), as a tuple of strings or
    token-id tuples; ``name`` is the field the errors name."""
    if isinstance(v, str):
        items = [v]
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        items = [tuple(v)]
    elif isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        items = v
    elif isinstance(v, list) and v and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in v):
        items = [tuple(p) for p in v]
    elif isinstance(v, list) and not v:
        raise bad(f"'{name}' is empty: give at least one prompt", name)
    elif v is None:
        raise bad(f"'{name}' is required", name)
    else:
        why = f"'{name}' must be a string, a list of strings, a list of token ids or a list of token-id lists"
        raise bad(why, name)
    for p in items:
        if len(p) == 0:
            raise bad(f"'{name}' is empty: give at least one character or token", name)
    return tuple(items)


def parse_completion(body: dict, max_n: int, closed: bool = True) -> CompletionBody:
    """``POST /v1/completions``; ``max_n`` caps the choices (``n`` times the prompts); ``closed``:
    the server's reading of schemas that do not say ``strict`` (``structured``)."""
    given = prompts(body.get("prompt"))
    max_tokens = get_int(body, "max_tokens", None, 0)  # 0: the prompt alone, with echo (``echo``)
    common = _common(
        body,
        max_n,
        1 if max_tokens == 0 else max_tokens,
        _logprobs_count(body, "logprobs"),
        chat=False,
        closed=closed,
    )
    if len(given) * common.n > max_n:
        raise bad(f"{len(given)} prompts x n={common.n} is over the limit of {max_n} choices", "n")
    return CompletionBody(common, given)


def parse_chat(body: dict, max_n: int, closed: bool = True) -> ChatBody:
    """``POST /v1/chat/completions``: ``logprobs`` is a flag, ``top_logprobs`` the count."""
    try:
        messages = validate_messages(body.get("messages"))
    except ChatError as e:
        raise bad(str(e), e.param) from None
    want = get_bool(body, "logprobs", False)
    top = _logprobs_count(body, "top_logprobs")
    if top is not None and not want:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = get_int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, 1)
    common = _common(body, max_n, max_tokens, (top or 0) if want else None, chat=True, closed=closed)
    return ChatBody(common, messages)


def choice_params(
    common: Common,
    prompt_len: int,
    n_positions: int,
    default_max_tokens: int | None,
    max_tokens_cap: int | None,
) -> list[SamplingParams]:
    """One ``SamplingParams`` per choice: ``max_tokens`` resolved, ``seed + i`` for choice ``i``
    (modulo 2**32, the sampler's seed range, so any integer OpenAI accepts works).

    Without ``max_tokens`` a request gets ``default_max_tokens`` (None: the rest of the
    context window), never more than the context has room for nor the server's cap, so a
    default never makes a request fail. An explicit value over the cap is an error; one that
    does not fit the context is the engine's ``validate`` error.
    """
    room = max(n_positions - prompt_len, 1)  # no room at all: the engine names the prompt length
    if common.max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        if max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
    else:
        max_tokens = common.max_tokens
        if max_tokens_cap is not None and max_tokens > max_tokens_cap:
            raise bad(
                f"'max_tokens' must be at most {max_tokens_cap} on this server, got {max_tokens}",
                "max_tokens",
            )
    base = replace(common.params, max_tokens=max_tokens)
    seed = base.seed
    return [base if seed is None else replace(base, seed=(seed + i) % SEED_RANGE) for i in range(common.n)]


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(
            f"token id {bad_ids[0]} in '{param}' is outside the vocabulary (0..{vocab_size - 1})", param
        )
