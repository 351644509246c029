"""The two generation endpoints without HTTP: parse, tokenize, submit, then collect or stream.

Kept apart from ``app`` (the FastAPI glue) so the work of a request is plain asyncio over
``Engine`` and ``Request``: one engine request per choice, read with ``async for``. Whatever
way a handler ends (answer sent, client gone, server shutting down, an error) its engine
requests are cancelled, so a slot never keeps generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from aotlm.batching.types import (
    EngineStopped,
    InvalidRequest,
    QueueFull,
    Request,
    SamplingParams,
)
from aotlm.generate import bans
from aotlm.generate.constraints import Constraint, ConstraintError, Grammars, Matcher
from aotlm.serve import extras, openai_responses, protocol, response_store
from aotlm.serve.adapters import Adapters
from aotlm.serve.chat import ChatError, render
from aotlm.serve.detok import ChoiceText, TokenTexts
from aotlm.serve.echo import EchoRun
from aotlm.serve.metrics import Metrics
from aotlm.serve.protocol import APIError, Common
from aotlm.serve.request_defaults import Defaults
from aotlm.serve.response_store import ResponseStore
from aotlm.serve.responses import CHAT, COMPLETION, Shapes, sse, usage
from aotlm.serve.runs import ChoiceRun, Streamed, answer_ids, cancel_all, gathered_unless_gone, run_usage
from aotlm.text.tokens import bad_word_ids

log = logging.getLogger("aotlm.serve")


@dataclass
class Served:
    """What every request handler needs; one per app."""

    engine: object
    tokenizer: object
    model_name: str
    metrics: Metrics
    texts: TokenTexts
    max_n: int = 16  # choices per HTTP request (n times the prompts)
    max_tokens_cap: int | None = None
    stopping: bool = False  # set on SIGTERM: /health says 503 and new requests are refused
    lenient_schemas: bool = False  # schemas that do not say `strict` keep JSON Schema's open objects
    grammars: Grammars | None = None  # structured outputs, built at the first constrained request
    adapters: Adapters | None = None  # LoRA adapters a request's `model` may name (aotlm.serve.adapters)
    template_defaults: dict = field(default_factory=dict)  # serve --chat-template-kwargs
    defaults: Defaults = field(
        default_factory=Defaults
    )  # generation_config.json's (aotlm.serve.request_defaults)
    responses: ResponseStore | None = None  # stored Responses API answers (aotlm.serve.response_store)

    def matchers(self, c: Constraint | None, n: int) -> list[Matcher | None]:
        """``n`` fresh matchers of ``c`` (None: unconstrained); a bad schema or grammar is a 400
        with the library's message."""
        if c is None:
            return [None] * n
        try:
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.engine.vocab_size, self.eos_ids())
            return [self.grammars.matcher(c) for _ in range(n)]
        except ConstraintError as e:
            raise protocol.bad(f"invalid {c.kind.replace('_', ' ')}: {e}", "response_format") from None

    def banned(self, matchers: list, common: Common) -> list:
        """The matchers with the request's ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` over
        them (``bans.RequestBans``)."""
        more = common.extras
        if not (more.allowed_token_ids or more.bad_words or more.min_tokens):
            return matchers
        protocol.check_token_ids(more.allowed_token_ids, self.engine.vocab_size, "allowed_token_ids")
        words = bad_word_ids(self.tokenizer, more.bad_words)
        vocab, eos = self.engine.vocab_size, self.eos_ids()
        held = [*eos, *(s[0] for s in common.params.stop_token_ids)]
        kw = dict(min_tokens=more.min_tokens, held=held)
        return [bans.RequestBans(vocab, more.allowed_token_ids, words, eos, m, **kw) for m in matchers]

    def eos_ids(self) -> list[int]:
        """The ids that end an answer: the engine's, else the tokenizer's."""
        eos = getattr(self.engine, "eos_token_id", ()) or [self.tokenizer.eos_token_id]
        return [t for t in eos if t is not None]


def engine_error(e: Exception, prompt_param: str) -> APIError:
    """The engine's refusals as HTTP errors (400 / 429 / 503)."""
    if isinstance(e, InvalidRequest):
        param = prompt_param if e.param in (None, "prompt") else e.param
        return APIError(400, str(e), param, code="invalid_value")
    if isinstance(e, QueueFull):
        why = str(e) or "the queue is full; retry later"
        return APIError(429, f"the server is busy: {why}", None, "rate_limit_error", "rate_limit_exceeded")
    return engine_stopped()


def engine_stopped() -> APIError:
    why = "the server is shutting down; retry on another instance"
    return APIError(503, why, None, "server_error", "service_unavailable")


def submit_all(
    served: Served,
    jobs: Sequence[tuple[list[int], list[SamplingParams]]],
    rid: str,
    prompt_param: str,
    matchers: Sequence[Matcher | None],
) -> list[Request]:
    """Validate every choice first, then submit all; a failure part-way cancels the rest."""
    if served.stopping:
        raise engine_stopped()
    engine = served.engine
    reqs: list[Request] = []
    try:
        for ids, plist in jobs:
            for p in plist:
                engine.validate(ids, p)
        for ids, plist in jobs:
            for p in plist:
                m = matchers[len(reqs)]
                reqs.append(engine.submit(ids, p, request_id=f"{rid}-{len(reqs)}", matcher=m))
    except (InvalidRequest, QueueFull, EngineStopped) as e:
        for r in reqs:
            r.cancel()
        raise engine_error(e, prompt_param) from None
    return reqs


def check_model(served: Served, model: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` names (None: the base model), or a 404."""
    if served.adapters is not None:
        return served.adapters.resolve(model)
    if model is not None and model != served.model_name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{served.model_name}'",
            "model",
            code="model_not_found",
        )


def encode_text(served: Served, text: str, add_special_tokens: bool, param: str) -> list[int]:
    ids = list(served.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if not ids:
        raise protocol.bad(f"'{param}' encodes to no tokens: give some text", param)
    return ids


async def completions(served: Served, body: dict, disconnected: Callable[[], Awaitable[None]]):
    """``POST /v1/completions``: a response dict, or a ``Streamed``."""
    parsed = protocol.parse_completion(served.defaults.apply(body), served.max_n, not served.lenient_schemas)
    common = parsed.common
    adapter = check_model(served, common.model)
    vocab = served.engine.vocab_size
    more = common.extras
    add = True if more.add_special_tokens is None else more.add_special_tokens
    prompts, shown = [], []
    for p in parsed.prompts:
        ids = encode_text(served, p, add, "prompt") if isinstance(p, str) else list(p)
        protocol.check_token_ids(ids, vocab)
        n_pos = served.engine.n_positions
        kept = truncated(ids, more.truncate, n_pos)
        if common.echo.silent and len(kept) >= n_pos:  # its one (unshown) step needs a slot
            why = f"with 'max_tokens' 0 a prompt may hold {n_pos - 1} tokens, got {len(kept)}"
            raise protocol.bad(why, "prompt")
        prompts.append(kept)
        if common.echo.echo:  # the prompt as sent, or as its (kept) tokens read
            same = isinstance(p, str) and len(kept) == len(ids)
            skip = more.skip_special_tokens
            shown.append(p if same else served.tokenizer.decode(kept, skip_special_tokens=skip))
    default_max = served.defaults.default_max(protocol.COMPLETION_DEFAULT_MAX_TOKENS)
    run = _run(served, COMPLETION, common, prompts, default_max, "prompt", disconnected, adapter, shown)
    return await run


async def chat_completions(served: Served, body: dict, disconnected: Callable[[], Awaitable[None]]):
    """``POST /v1/chat/completions``; ``max_tokens`` defaults to the rest of the context."""
    parsed = protocol.parse_chat(served.defaults.apply(body), served.max_n, not served.lenient_schemas)
    adapter = check_model(served, parsed.common.model)
    more = parsed.common.extras
    ids = chat_ids(served, parsed.messages, parsed.common.form.tools, more)
    ids = truncated(ids, more.truncate, served.engine.n_positions)
    default_max = served.defaults.default_max(None)
    return await _run(served, CHAT, parsed.common, [ids], default_max, "messages", disconnected, adapter)


async def responses(served: Served, body: dict, disconnected: Callable[[], Awaitable[None]]):
    """``POST /v1/responses`` (``aotlm.serve.openai_responses``): the chat it asks for, answered in
    the Responses API's shape."""
    store = served.responses
    if not isinstance(body, dict):
        raise protocol.bad("the request body must be a JSON object")
    chat = openai_responses.to_chat(body, response_store.history(store, body.get("previous_response_id")))
    model = check_model(served, chat.get("model")) or served.model_name
    keep = store is not None and body.get("store", True) is not False
    answer = openai_responses.Answer(body, model, int(time.time()), stored=keep)
    asked = chat["messages"][1:] if body.get("instructions") is not None else chat["messages"]

    def done(response: dict, turn: dict) -> None:  # instructions are not carried over (OpenAI's rule)
        if keep:
            store.put(response, [*asked, turn])

    out = await chat_completions(served, chat, disconnected)
    if isinstance(out, Streamed):
        return Streamed(openai_responses.events(answer, out.chunks, done), out.runs)
    response = answer.whole(out)
    msg = out["choices"][0]["message"]
    done(response, openai_responses.assistant_turn(msg.get("content") or "", msg.get("tool_calls") or []))
    return response


def chat_ids(served: Served, messages: list[dict], tools, more: extras.Extras) -> list[int]:
    """A chat's prompt ids: rendered with the server's and the request's template variables (the
    request's win), encoded with the template's special tokens unless ``add_special_tokens`` says."""
    try:
        variables = {**served.template_defaults, **more.template}
        text, add_special = render(served.tokenizer, messages, tools, variables)
    except ChatError as e:
        raise protocol.bad(str(e), e.param) from None
    add = add_special if more.add_special_tokens is None else more.add_special_tokens
    return encode_text(served, text, add, "messages")


def truncated(ids: list[int], keep: int | None, n_positions: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the window's worth)."""
    if keep is None:
        return ids
    keep = n_positions if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


async def _run(served, kind, common, prompts, default_max, param, disconnected, adapter=None, shown=()):
    n_pos, cap = served.engine.n_positions, served.max_tokens_cap
    params = lambda ids: protocol.choice_params(common, len(ids), n_pos, default_max, cap)  # noqa: E731
    jobs = [(ids, [p.replace(adapter=adapter) for p in params(ids)]) for ids in prompts]
    prefix = "chatcmpl" if kind == CHAT else "cmpl"
    rid = f"{prefix}-{uuid.uuid4().hex}"
    more = common.extras
    text_of = _token_id_str if more.token_id_strs else served.texts  # vLLM's return_tokens_as_token_ids
    shapes = Shapes(kind, rid, int(time.time()), adapter or served.model_name, text_of, common.form)
    n = sum(len(plist) for _, plist in jobs)  # grammars compile off the event loop (first: ~1 s)
    matchers = await asyncio.to_thread(served.matchers, common.form.constraint, n)
    matchers = served.banned(matchers, common)
    reqs = submit_all(served, jobs, rid, param, matchers)
    runs, k = [], 0
    for no, (ids, plist) in enumerate(jobs):
        for _ in plist:
            show = dict(include_stop=more.include_stop_str, skip_special_tokens=more.skip_special_tokens)
            text = ChoiceText(served.tokenizer, common.stop, min_tokens=more.min_tokens, **show)
            echo = _echo_run(served, common, ids, shown[no] if shown else "")
            runs.append(ChoiceRun(k, reqs[k], text, served.metrics, len(ids), no, echo, ids))
            k += 1
    prompt_tokens = sum(len(ids) for ids in prompts)  # once per prompt, whatever n is (as OpenAI)
    want_lp = common.params.logprobs is not None
    if common.stream:
        usage_on = (common.include_usage, common.continuous_usage)
        return Streamed(_stream(runs, shapes, want_lp, usage_on, prompt_tokens, more.return_token_ids), runs)
    return await _collect(runs, shapes, want_lp, prompt_tokens, disconnected, more.return_token_ids)


def _token_id_str(token_id: int) -> str:
    return f"token_id:{token_id}"


def _echo_run(served: Served, common: Common, ids: list[int], text: str) -> EchoRun | None:
    """A choice's prompt as its answer shows it (None: the request asks nothing of it)."""
    spec = common.echo
    if not spec.echo and spec.report is None:
        return None
    return EchoRun(spec, ids, text, common.params.logprobs, served.texts)


async def _collect(runs, shapes: Shapes, want_lp: bool, prompt_tokens: int, disconnected, ids: bool) -> dict:
    """Gather every choice; a client that goes away first cancels them all (``ids``: vLLM's
    ``return_token_ids``)."""

    async def one(run: ChoiceRun) -> dict:
        pieces, reason = [], None
        async for piece, reason in run.events():  # noqa: B007 -- the last reason is the finish
            pieces.append(piece)
        lp = shapes.merge_logprobs(pieces) if want_lp else None
        choice = shapes.choice(run.index, "".join(p.text for p in pieces), lp, reason)
        if run.echo is not None and run.echo.spec.report is not None and shapes.kind != CHAT:
            choice["prompt_logprobs"] = run.echo.report()  # vLLM's: per choice of a completion
        if ids:
            choice["token_ids"] = answer_ids(pieces)
            if shapes.kind != CHAT:
                choice["prompt_token_ids"] = run.prompt_ids
        return choice

    choices = await gathered_unless_gone([one(r) for r in runs], disconnected, lambda: cancel_all(runs))
    out = shapes.response(choices, run_usage(runs, prompt_tokens))
    if shapes.kind == CHAT and runs[0].echo is not None:  # vLLM's: once for a chat's one prompt
        out["prompt_logprobs"] = runs[0].echo.report()
    if shapes.kind == CHAT and ids:
        out["prompt_token_ids"] = runs[0].prompt_ids
    return out


async def _stream(
    runs: list[ChoiceRun],
    shapes: Shapes,
    want_lp: bool,
    usage_on: tuple[bool, bool],
    prompt_tokens: int,
    ids=False,
) -> AsyncIterator[str]:
    """SSE chunks of every choice as they come, a usage chunk if asked (``usage_on[0]``), then
    ``[DONE]``; with ``usage_on[1]`` (vLLM's ``continuous_usage_stats``) each chunk's usage holds its
    choice's tokens so far; with ``ids`` (``return_token_ids``) each chunk its own ``token_ids`` and a
    choice's first chunk the prompt's.

    A client that disconnects makes the server cancel this generator (or close it): the
    ``finally`` cancels the engine requests either way.
    """
    queue: asyncio.Queue = asyncio.Queue()
    include_usage, every = usage_on

    async def pump(run: ChoiceRun) -> None:
        try:
            async for piece, reason in run.events():
                n = run.completion_tokens if reason is not None else run.text.n_tokens
                queue.put_nowait((run.index, piece, reason, n))
        except Exception as e:  # handed to the generator, which reports it in the stream
            queue.put_nowait((run.index, e, None, 0))

    by_index = {r.index: r for r in runs}
    first = set(by_index)  # choices whose first chunk is still to be sent

    def out(chunk: dict, index: int, n: int, pieces) -> str:
        if every:
            chunk["usage"] = usage(by_index[index].prompt_tokens, n)
        if ids:
            chunk["choices"][0]["token_ids"] = answer_ids(pieces)
            if index in first:
                where = chunk if shapes.kind == CHAT else chunk["choices"][0]
                where["prompt_token_ids"] = by_index[index].prompt_ids
        first.discard(index)
        return sse(chunk)

    tasks = [asyncio.ensure_future(pump(r)) for r in runs]
    try:
        if shapes.kind == CHAT:
            for r in runs:
                yield out(shapes.chunk(r.index, "", None, None, include_usage, role=True), r.index, 0, [])
        remaining = len(runs)
        held: dict[int, list] = {r.index: [] for r in runs}
        while remaining:
            index, piece, reason, n = await queue.get()
            if isinstance(piece, Exception):
                raise piece
            remaining -= reason is not None
            if shapes.form.reads_calls:  # tool calls: the answer is read whole, then sent
                held[index].append(piece)
                if reason is not None:
                    whole = shapes.whole_chunk(index, held[index], want_lp, reason, include_usage)
                    yield out(whole, index, n, held[index])
                continue
            if reason is None and not piece.text and not want_lp and not (ids and piece.tokens):
                continue  # tokens whose text is still held back: nothing to say yet
            lp = shapes.logprobs(piece) if want_lp else None
            yield out(shapes.chunk(index, piece.text, lp, reason, include_usage), index, n, [piece])
        if include_usage:
            yield sse(shapes.usage_chunk(run_usage(runs, prompt_tokens)))
        yield sse("[DONE]")
    except Exception as e:  # headers are sent: the error goes into the stream, then it ends
        log.exception("stream %s failed", shapes.id)
        why = f"internal server error ({type(e).__name__}); see the server log"
        yield sse(e.body() if isinstance(e, APIError) else protocol.error_body(why, "server_error"))
        yield sse("[DONE]")
    finally:
        for t in tasks:
            t.cancel()
        cancel_all(runs)
