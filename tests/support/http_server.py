"""An app served by uvicorn in a thread on a free local port, for the HTTP tests (tests/serve)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serving(app, start_timeout: float = 30) -> Iterator[str]:
    """Serve ``app`` while inside; yields its base URL (``http://127.0.0.1:PORT``)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def tiny_engine_server(root, family: str, **graphs) -> Iterator[tuple[str, object, object]]:
    """A tiny text checkpoint of ``family`` (``textkit``) under ``root``, its continuous-batching engine
    (2 slots, 64 positions, ``graphs``: the extra graph kinds, e.g. ``embeddings=True``) served as model
    ``"m"``; yields ``(url, checkpoint, tokenizer)``."""
    from textkit import make_text_checkpoint

    from aotlm.api.causal_lm import AutoModelForSampling
    from aotlm.batching.engine import Engine
    from aotlm.serve.app import create_app
    from aotlm.text.tokens import eos_ids, tokenizer_for

    ckpt = make_text_checkpoint(root / family, family=family)
    tok = tokenizer_for(ckpt)
    kw = dict(batch_size=2, n_positions=64, context_length_estimate=[16], compile_cache=str(root / "cc"))
    model = AutoModelForSampling.from_pretrained(ckpt, continuous_batching=True, **kw, **graphs).compile()
    engine = Engine(model, eos_token_id=eos_ids(ckpt, model.hf_config, tok)).start()
    try:
        with serving(create_app(engine, tok, "m")) as url:
            yield url, ckpt, tok
    finally:
        engine.shutdown(timeout=5)
