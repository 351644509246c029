"""The OpenAI-compatible HTTP app: routes, auth, body limit, errors in OpenAI's shape.

``create_app`` builds a FastAPI app over a started ``Engine``; ``uvicorn`` (or any ASGI
server) serves it. FastAPI is imported inside ``create_app``: it is the optional ``[serve]``
extra, and ``aotlm.cli`` imports this module for every command, whose start-up must neither
pay for nor need it. (For the same reason this module has no ``from __future__ import
annotations``: FastAPI reads the handlers' ``Request`` annotation, a local name here.)

Status codes: 400 malformed JSON, wrong types or ranges, an empty or too long prompt;
401 a missing or wrong ``Authorization: Bearer KEY`` on ``/v1/*`` when an API key is set
(``/health`` and ``/metrics`` stay open, for load balancers and scrapers); 404 an unknown
``model`` (a request without ``model`` gets the served one) or path; 413 a body over
``max_body_bytes``; 429 the engine's queue is full; 503 the server is shutting down; 500
anything unexpected (logged, never a traceback to the client). All in OpenAI's
``{"error": {"message", "type", "param", "code"}}``.
"""

import json
import logging
import secrets
import time
from typing import TYPE_CHECKING

from aotlm.serve import tokenize
from aotlm.serve.adapters import Adapters, add_adapter_routes
from aotlm.serve.cors import Cors
from aotlm.serve.detok import TokenTexts
from aotlm.serve.embeddings import embeddings
from aotlm.serve.handlers import Served, chat_completions, completions, engine_stopped, responses
from aotlm.serve.metrics import Metrics, StatusCounter
from aotlm.serve.protocol import APIError, bad, error_body
from aotlm.serve.request_defaults import Defaults
from aotlm.serve.response_store import ResponseStore, add_stored_routes
from aotlm.serve.runs import ClientGone, Streamed
from aotlm.text.unicode import NOT_TEXT, lone_surrogate

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("aotlm.serve")

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 32k-token prompt as JSON ids is ~250 KB
PATHS = (
    "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses",
    "/v1/embeddings", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenize", "/detokenize",
    "/tokenizer_info",
)  # fmt: skip
# the endpoints a request body goes through a handler of (``add_generation_routes``)
GENERATION = {
    "/v1/completions": completions,
    "/v1/chat/completions": chat_completions,
    "/v1/responses": responses,
    "/v1/embeddings": embeddings,
}
CLIENT_ERRORS = (400, 401, 404, 405, 413)  # OpenAI's "invalid_request_error"; 5xx: "server_error"


def engine_running(engine) -> bool:
    """The engine's own view when it has one (``running``), else assume it runs."""
    running = getattr(engine, "running", True)
    return bool(running() if callable(running) else running)


async def read_json(request, limit: int) -> dict:
    """The body as a JSON object, read at most ``limit`` bytes far (413 beyond)."""
    declared = request.headers.get("content-length")
    why = f"the request body is over the limit of {limit} bytes"
    too_big = APIError(413, why, None, code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    where = lone_surrogate(body)
    if where is not None:
        raise bad(f"'{where}' {NOT_TEXT}; send valid Unicode", where.split(".")[0].split("[")[0])
    return body


def create_app(
    engine,
    tokenizer,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cors: Cors | None = None,
    **served_kw,
) -> "FastAPI":
    """The app over a started ``engine``; ``app.state.served.stopping = True`` starts draining.

    ``api_key``: required on ``/v1/*`` and the token routes; ``max_body_bytes``: the largest body read;
    ``cors``: what cross-origin (browser) requests may do (None: vLLM's default, any origin).
    The rest (``max_n``, ``max_tokens_cap``, ``lenient_schemas``, ``adapters``, ``chat_template_kwargs``,
    ``request_defaults``, ``responses``) are ``build_served``'s.
    """
    from fastapi import FastAPI  # local: optional [serve] extra, see the module docstring

    served = build_served(engine, tokenizer, model_name, **served_kw)
    metrics = served.metrics
    app = FastAPI(title="aotlm", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.served = served
    app.add_middleware(StatusCounter, metrics=metrics, known=lambda p: p in PATHS)
    add_error_handlers(app)
    check_key = key_checker(api_key)
    add_generation_routes(app, served, check_key, max_body_bytes)
    add_info_routes(app, served, check_key)
    add_token_routes(app, served, check_key, lambda request: read_json(request, max_body_bytes))
    add_adapter_routes(app, served.adapters, check_key, lambda request: read_json(request, max_body_bytes))
    add_stored_routes(app, served.responses, check_key)
    (cors or Cors()).add_to(app)  # outermost: preflights are answered before the key is checked
    return app


def build_served(
    engine,
    tokenizer,
    model_name: str,
    max_n: int = 16,
    max_tokens_cap: int | None = None,
    lenient_schemas: bool = False,
    adapters: Adapters | None = None,
    chat_template_kwargs: dict | None = None,
    request_defaults: Defaults | None = None,
    responses: ResponseStore | None = None,
) -> Served:
    """What the request handlers need (``create_app`` serves it; ``aotlm run-batch`` calls the handlers
    on it without HTTP). ``max_n`` caps the choices of one request; ``max_tokens_cap`` (default: the
    engine's ``max_tokens_cap``) caps default and explicit ``max_tokens``; ``lenient_schemas``: schemas
    that do not say ``strict`` keep open objects (``aotlm.serve.structured``); ``adapters``: the model's
    LoRA adapters, named by a request's ``model`` (``aotlm.serve.adapters``); ``chat_template_kwargs``:
    template variables for every chat (a request's own win); ``request_defaults``: sampling defaults of
    requests that leave them out (``aotlm.serve.request_defaults``); ``responses``: where Responses API
    answers are stored for ``previous_response_id`` (None: none are)."""
    if max_tokens_cap is None:
        max_tokens_cap = getattr(engine, "max_tokens_cap", None)
    served = Served(engine, tokenizer, model_name, Metrics(), TokenTexts(tokenizer), max_n, max_tokens_cap)
    served.lenient_schemas, served.adapters = lenient_schemas, adapters
    served.template_defaults = dict(chat_template_kwargs or {})
    served.defaults = request_defaults or Defaults()
    served.responses = responses
    return served


def error_response(status: int, message: str, param=None, kind=None, code=None, headers=None):
    """A ``JSONResponse`` in OpenAI's error shape."""
    from fastapi.responses import JSONResponse  # local: optional [serve] extra

    kind = kind or ("invalid_request_error" if status in CLIENT_ERRORS else "server_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def add_error_handlers(app: "FastAPI") -> None:
    """Every error, ours or the framework's, in OpenAI's shape; never a traceback to the client."""
    from fastapi import Request  # local: optional [serve] extra
    from fastapi.exceptions import RequestValidationError  # local: optional [serve] extra
    from starlette.exceptions import HTTPException  # local: optional [serve] extra (FastAPI's base)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return error_response(e.status, e.message, e.param, e.type, e.code, headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid request: {first.get('msg', e)}", param)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        why = f"internal server error ({type(e).__name__}); see the server log"
        return error_response(500, why, code="internal_error")


def key_checker(api_key: str | None):
    """``check(request)``: raises 401 unless the request carries ``Authorization: Bearer api_key``."""

    def check_key(request) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), api_key.encode()):
            why = "missing or wrong API key: send 'Authorization: Bearer KEY'"
            raise APIError(401, why, None, code="invalid_api_key")

    return check_key


def add_generation_routes(app: "FastAPI", served: Served, check_key, max_body_bytes: int) -> None:
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/embeddings``: JSON, or
    server-sent events when streamed."""
    from fastapi import Request  # local: optional [serve] extra
    from fastapi.responses import JSONResponse, Response, StreamingResponse  # local: optional [serve] extra
    from starlette.requests import ClientDisconnect  # local: optional [serve] extra

    class SSE(StreamingResponse):
        """Server-sent events whose engine requests are cancelled however the response ends."""

        def __init__(self, result: Streamed):
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            super().__init__(result.chunks, media_type="text/event-stream", headers=headers)
            self.result = result

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.result.cancel()

    async def generate(request: Request, handler):
        check_key(request)
        if served.stopping or not engine_running(served.engine):
            raise engine_stopped()

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        try:
            body = await read_json(request, max_body_bytes)
            out = await handler(served, body, disconnected)
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody reads it; counted as 499 in the metrics
        return SSE(out) if isinstance(out, Streamed) else JSONResponse(out)

    def route(handler):
        async def post(request: Request):
            return await generate(request, handler)

        return post

    for path, handler in GENERATION.items():
        app.post(path)(route(handler))


def add_info_routes(app: "FastAPI", served: Served, check_key) -> None:
    """``/v1/models``, ``/health`` and ``/metrics``."""
    from fastapi import Request  # local: optional [serve] extra
    from fastapi.responses import JSONResponse, Response  # local: optional [serve] extra

    created, engine, name = int(time.time()), served.engine, served.model_name

    def model_card(model_id: str = name) -> dict:
        card = {"id": model_id, "object": "model", "created": created, "owned_by": "aotlm"}
        if model_id != name:  # a LoRA adapter (vLLM's card: its base model is its parent)
            card |= {"parent": name, "root": served.adapters.source(model_id)}
        return card | {"max_model_len": engine.n_positions}

    def ids() -> list[str]:
        return [name] + (served.adapters.names() if served.adapters else [])

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_key(request)
        return {"object": "list", "data": [model_card(i) for i in ids()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str):
        check_key(request)
        if model_id not in ids():
            raise APIError(404, f"the model '{model_id}' does not exist", "model", code="model_not_found")
        return model_card(model_id)

    @app.get("/health")
    async def health():
        if served.stopping or not engine_running(engine):
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        return Response(served.metrics.render(engine.stats()), media_type=served.metrics.content_type)


def add_token_routes(app: "FastAPI", served: Served, check_key, read) -> None:
    """``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (``aotlm.serve.tokenize``), behind the API
    key when one is set."""
    from fastapi import Request  # local: optional [serve] extra

    @app.get("/tokenizer_info")
    async def get_tokenizer_info(request: Request):
        check_key(request)
        return tokenize.tokenizer_info(served)

    @app.post("/tokenize")
    async def post_tokenize(request: Request):
        check_key(request)
        return tokenize.tokenize(served, await read(request))

    @app.post("/detokenize")
    async def post_detokenize(request: Request):
        check_key(request)
        return tokenize.detokenize(served, await read(request))
