"""``aotlm serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

aotlm serve [CHECKPOINT | --model M] [--host 127.0.0.1] [--port 8000] [--batch-size 8]
            [--max-queue 64] [--api-key KEY] [--max-tokens-cap N] [--served-model-name NAME]
            [--no-prefix-cache] [--prefix-cache-mb 512] [--no-warmup] [--lenient-schemas]
            [--lora NAME=DIR ...] [--max-loras N] [--max-lora-rank R] [--prompt-logprobs]
            [--generation-config auto|vllm|DIR] [--override-generation-config JSON]
            [--allowed-origins JSON] [--allowed-methods JSON] [--allowed-headers JSON] [--allow-credentials]
            [--ssl-certfile PEM --ssl-keyfile PEM] [--max-stored-responses 1024]

The model is compiled for every bucket before the port opens, so the first request does not
compile, and the serving graphs run once (``SlotBatch.warm_up``; ``--no-warmup`` skips it),
so the first requests do not pay an executable's costlier first run either; the prefills whose
compute dwarfs that (``batching.policy.warmed``) are left to their first request. Without
``--n-positions`` it serves the checkpoint's whole context window (capped at 4096 by
``serve_kwargs``, as ``aotlm compile --serve`` does; token buckets are the powers of two up
to it). SIGTERM / SIGINT:
``/health`` turns 503 and new requests get 503 at once, uvicorn stops accepting connections
and waits up to ``--shutdown-timeout`` s for the requests in flight, cancels what is left,
then the engine stops; exit code 0.

FastAPI, uvicorn and prometheus-client are the optional ``[serve]`` extra: this module (which
every ``aotlm`` command imports) and ``aotlm.serve.app`` import them only when the server
starts, so other commands neither load nor need them.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.batching.engine import PREFIX_STORE_BYTES, Engine
from aotlm.cli.common import add_model_args, graphs_ready, model_kwargs, serve_kwargs, setup_logging
from aotlm.cli.templates import add_template_args, template_variables, use_template
from aotlm.serve import cors
from aotlm.serve.adapters import Adapters
from aotlm.serve.app import create_app
from aotlm.serve.request_defaults import Defaults
from aotlm.serve.request_defaults import load as load_defaults
from aotlm.serve.response_store import DEFAULT_MAX_ITEMS, ResponseStore
from aotlm.text.tokens import eos_ids, tokenizer_for

log = logging.getLogger("aotlm.serve")

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client")


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (default 64)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default $AOTLM_API_KEY; none: open)",
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM"
    )
    p.add_argument(
        "--max-stored-responses", type=int, default=DEFAULT_MAX_ITEMS, metavar="N",
        help=f"Responses API answers kept for previous_response_id (the newest; default {DEFAULT_MAX_ITEMS}, "
        "0: none)",
    )  # fmt: skip
    p.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve HTTPS with this certificate")
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")
    add_engine_args(p)
    cors.add_flags(p)
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    p.set_defaults(fn=cmd_serve)


def add_engine_args(p) -> None:
    """The flags of the serving engine and its request handling (``aotlm serve`` and ``aotlm run-batch``)."""
    add_model_args(p)
    p.add_argument("--model", dest="model_alias", default=None, metavar="M", help="the checkpoint (alias)")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="upper bound of any request's max_tokens")
    p.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: the checkpoint name)"
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="do not reuse the K/V a free slot holds for a prompt starting with its tokens",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=PREFIX_STORE_BYTES / 2**20,
        help="MB of K/V kept for reuse after the slot holding it is reused (default 512; 0: none)",
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="do not run the graphs once before the port opens"
    )
    p.add_argument(
        "--lenient-schemas",
        action="store_true",
        help="JSON schemas and tool parameters that do not say 'strict' keep JSON Schema's letter: an object "
        "without additionalProperties accepts extra keys (default: closed, as OpenAI's strict mode and vLLM)",
    )
    p.add_argument(
        "--prompt-logprobs",
        action="store_true",
        help="compile the graphs that score prompts: OpenAI's echo with logprobs (lm-eval's "
        "local-completions) and vLLM's prompt_logprobs (one more graph per prefill shape)",
    )
    p.add_argument(
        "--embeddings",
        action="store_true",
        help="compile the graphs that return a prompt's last hidden state: POST /v1/embeddings (vLLM's "
        "last-token pooling, normalized; one more graph per prefill shape)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) from "
        "the checkpoint's generation_config.json (auto, the default), none (vllm) or DIR's (vLLM's flag)",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="fields over the generation config's, e.g. '{\"temperature\": 0.5}'",
    )
    add_template_args(p, "default variables for every chat's template (a request's chat_template_kwargs win)")
    p.add_argument("--quiet", action="store_true", help="no aotlm INFO lines")


def lacks_extra(command: str) -> bool:
    """Is a ``[serve]`` package missing? Then ``command``'s one-line error is printed (checked before
    loading the model)."""
    missing = next((name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None), None)
    if missing:
        why = f"{missing} is not installed; install the server extra: pip install -e '.[serve]'"
        print(f"aotlm {command}: error: {why}", file=sys.stderr)
    return missing is not None


def _model_name(args, checkpoint: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    given = args.model_alias or args.checkpoint_given
    return given if given else Path(checkpoint).name


def _check_flags(args: argparse.Namespace) -> None:
    """Server flags out of range, each named with its value, before anything binds or loads."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.api_key is not None and not args.api_key.strip():  # e.g. --api-key "$KEY" with KEY unset
        raise ValueError("--api-key is empty; give the key, or leave the flag out to serve without one")
    if args.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be >= 0 (0: none), got {args.max_stored_responses}")
    args.cors = cors.from_flags(args)
    _check_tls(args.ssl_certfile, args.ssl_keyfile)


def _check_tls(certfile: str | None, keyfile: str | None) -> None:
    """The certificate and its key load (before the model does: a bad pair fails in a second)."""
    if certfile is None and keyfile is None:
        return
    if certfile is None:
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate the key belongs to)")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:  # a missing file, a key that does not match, not PEM
        what = f"--ssl-certfile {certfile}" + (f" / --ssl-keyfile {keyfile}" if keyfile else "")
        raise ValueError(f"cannot use {what}: {getattr(e, 'strerror', None) or e}") from None


def prepare(args: argparse.Namespace) -> dict:
    """``add_engine_args``' flags checked (each bad one named), the checkpoint given once; returns the
    chat template variables. Nothing is loaded yet."""
    if args.model_alias and args.checkpoint and args.model_alias != args.checkpoint:
        raise ValueError(
            f"give the model once: positional {args.checkpoint!r} or --model {args.model_alias!r}"
        )
    args.checkpoint = args.checkpoint_given = args.checkpoint or args.model_alias
    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
        raise ValueError(f"--max-tokens-cap must be >= 1, got {args.max_tokens_cap}")
    variables = template_variables(args.chat_template_kwargs)
    setup_logging(args.quiet)
    return variables


@dataclass
class Started:
    """A loaded model's started engine and what its requests are read with."""

    model: object
    engine: Engine
    tokenizer: object
    name: str
    defaults: Defaults
    variables: dict


def start_engine(args: argparse.Namespace, variables: dict, max_queue: int) -> Started:
    """Tokenizer, chat template and request defaults (a bad one named before the weights load), then
    the model with its serving graphs and the started engine (warmed up unless ``--no-warmup``)."""
    kw = serve_kwargs(
        model_kwargs(args), args.checkpoint, args.prompt_logprobs, args.embeddings
    )  # resolves it
    tokenizer = tokenizer_for(args.checkpoint)
    use_template(tokenizer, args.chat_template, variables)
    defaults = load_defaults(args.generation_config, args.checkpoint, args.override_generation_config)
    if defaults.described():
        log.info("request defaults from the generation config: %s", defaults.described())
    model = _load(args.checkpoint, kw)
    t0 = time.perf_counter()
    engine = Engine(
        model,
        eos_token_id=eos_ids(args.checkpoint, model.hf_config, tokenizer),
        max_queue=max_queue,
        max_tokens_cap=args.max_tokens_cap,
        prefix_cache=not args.no_prefix_cache,
        prefix_store_bytes=int(args.prefix_cache_mb * 2**20),
        warm_up=not args.no_warmup,
    ).start()
    if engine.warmed is not None:
        n, total = engine.warmed
        log.info(
            "%d of %d serving graphs run once in %.2fs (the costliest prefills run first for a request; "
            "--no-warmup skips it)",
            n, total, time.perf_counter() - t0,
        )  # fmt: skip
    return Started(model, engine, tokenizer, _model_name(args, args.checkpoint), defaults, variables)


def cmd_serve(args: argparse.Namespace) -> int:
    if lacks_extra("serve"):
        return 2
    _check_flags(args)
    variables = prepare(args)
    args.api_key = args.api_key or os.environ.get("AOTLM_API_KEY") or None
    sock = _bind(args.host, args.port)  # before the model loads: a port in use fails in a second
    up = start_engine(args, variables, args.max_queue)
    model, engine = up.model, up.engine
    try:
        adapters = Adapters(model, engine, up.name) if model.adapter_slots is not None else None
        app = create_app(
            engine, up.tokenizer, up.name, api_key=args.api_key, lenient_schemas=args.lenient_schemas,
            adapters=adapters, chat_template_kwargs=variables, request_defaults=up.defaults, cors=args.cors,
            responses=ResponseStore(args.max_stored_responses) if args.max_stored_responses else None,
        )  # fmt: skip
        port = sock.getsockname()[1]  # --port 0: the one the system picked
        scheme = "https" if args.ssl_certfile else "http"
        ready = f"aotlm serve: {scheme}://{args.host}:{port} (model {up.name}, {model.batch_size} slots)"
        _serve(app, sock, args, ready)
    finally:
        engine.shutdown(timeout=min(args.shutdown_timeout, 5.0))  # in-flight requests drained above
    return 0


def _load(checkpoint: str, kw: dict):
    """The model with every serving graph compiled or loaded from the compile cache; a line per phase
    (a first start compiles them all, which takes minutes on a small CPU: no silent wait)."""
    t0 = time.perf_counter()
    model = AutoModelForSampling.from_pretrained(checkpoint, **kw)
    n = len(model.graph_keys())
    log.info(
        "weights loaded in %.2fs; %d serving graphs to compile or load from the compile cache "
        "(`aotlm compile CKPT --serve` makes them ahead)",
        time.perf_counter() - t0,
        n,
    )
    t0 = time.perf_counter()
    model.compile()
    log.info("%s", graphs_ready(model, time.perf_counter() - t0))
    return model


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock


def _serve(app, sock: socket.socket, args: argparse.Namespace, ready_line: str) -> None:
    """Run uvicorn until SIGTERM / SIGINT; return (not re-raise the signal) once drained."""
    import uvicorn  # local: optional [serve] extra

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.served.stopping = True  # /health 503, new requests 503, in-flight go on
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                print(ready_line, flush=True)

    # uvicorn restores the handlers it found and raises the caught signal again after
    # draining; these make that a no-op, so the process exits 0 after engine.shutdown
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    tls = dict(ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
    config = uvicorn.Config(
        app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout, **tls
    )
    server = Server(config)
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's way to say it could not start (it logged why)
        raise OSError(f"cannot serve on {args.host}:{args.port}") from None
