"""``POST /v1/embeddings``: OpenAI's embeddings endpoint, pooled as vLLM pools a causal LM.

Each input (``input``: a string, a list of strings, token ids or lists of them, as a completion's
``prompt``) is encoded by the serving engine (the same slots, batched with the other requests) and
its embedding is the final-normed hidden state of its last token, L2-normalized (vLLM's ``LAST``
pooling with ``normalize``, which decoder-only embedding models such as Qwen3-Embedding or
e5-mistral are trained for; the tokenizer adds what the model's ends with, e.g. an eos). Fields:
``encoding_format`` (``float``, or ``base64`` of little-endian float32), vLLM's ``normalize`` (false: the
raw hidden state), ``truncate_prompt_tokens`` and ``add_special_tokens``; ``dimensions`` only as the
model's own size (nothing is trained to be cut). Needs a server started with ``--embeddings``.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Awaitable, Callable

import numpy as np

from aotlm.batching.types import Embedding, Finish, SamplingParams
from aotlm.serve import extras, protocol
from aotlm.serve.handlers import Served, check_model, encode_text, submit_all, truncated
from aotlm.serve.protocol import APIError, bad
from aotlm.serve.runs import gathered_unless_gone


def _options(body: dict) -> tuple[str, bool]:
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad(f"'encoding_format' must be float or base64, got {fmt!r}", "encoding_format")
    return fmt, protocol.get_bool(body, "normalize", True)


async def embeddings(served: Served, body: dict, disconnected: Callable[[], Awaitable[None]]) -> dict:
    """``POST /v1/embeddings``: one engine request per input, answered together."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    adapter = check_model(served, body.get("model"))
    fmt, normalize = _options(body)
    try:
        more = extras.parse({k: body.get(k) for k in ("truncate_prompt_tokens", "add_special_tokens")}, False)
    except extras.FieldError as e:
        raise bad(str(e), e.param) from None
    add = True if more.add_special_tokens is None else more.add_special_tokens
    jobs = []
    for p in protocol.prompts(body.get("input"), "input"):
        ids = encode_text(served, p, add, "input") if isinstance(p, str) else list(p)
        protocol.check_token_ids(ids, served.engine.vocab_size, "input")
        ids = truncated(ids, more.truncate, served.engine.n_positions)
        room = served.engine.n_positions - 1  # the engine keeps a slot for a step it never runs
        if len(ids) > room:
            why = f"'input' {len(jobs)} holds {len(ids)} tokens; an embedding here takes at most {room}"
            raise bad(why, "input")
        jobs.append((ids, [SamplingParams(max_tokens=1, temperature=0.0, embed=True, adapter=adapter)]))
    reqs = submit_all(served, jobs, f"embd-{uuid.uuid4().hex}", "input", [None] * len(jobs))

    async def one(req) -> np.ndarray:
        vector = None
        async for item in req:
            if isinstance(item, Embedding):
                vector = np.asarray(item.vector, np.float32)
            elif isinstance(item, Finish) and vector is None:
                why = "the engine failed while encoding; see the server log"
                raise APIError(500, why, None, "server_error", "engine_error")
        return vector

    vectors = await gathered_unless_gone(
        [one(r) for r in reqs], disconnected, lambda: [r.cancel() for r in reqs]
    )
    return _response(served, body, vectors, fmt, normalize, sum(len(ids) for ids, _ in jobs), adapter)


def _response(served, body, vectors, fmt: str, normalize: bool, tokens: int, adapter) -> dict:
    dims = body.get("dimensions")
    size = len(vectors[0])
    if dims is not None and dims != size:
        raise bad(
            f"this model's embeddings have {size} dimensions; 'dimensions' cannot change that", "dimensions"
        )
    data = []
    for i, v in enumerate(vectors):
        if normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        out = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": out})
    use = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": adapter or served.model_name, "usage": use}
