"""OpenAI's batch file on the serving engine: the JSONL of requests the Batch API takes, run locally.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` or ``/v1/embeddings`` and ``body`` that
endpoint's request;
each output line is the Batch API's ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}``: the endpoint's answer, or its error object with its HTTP status (a request
the server refuses, e.g. a bad ``temperature``, is that line's 400 and the rest run on). The requests go
through the same handlers as ``aotlm serve``'s HTTP ones, up to ``concurrency`` at once, so continuous
batching keeps the slots busy; outputs are written in input order, each line whole and synced
(``aotlm.durable``), and a run started again on the same output skips the ``custom_id`` s it holds.

The whole input is checked first (read by ``aotlm.jobs.plan.json_records``): a line that is not such
an object, an unknown ``url`` or a repeated ``custom_id`` is a ``ValueError`` naming its line, before
any model loads (the Batch API refuses such a file at upload).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aotlm.durable import JsonlAppender, read_jsonl, truncate_partial_line
from aotlm.serve import embeddings, handlers
from aotlm.serve.protocol import APIError
from aotlm.serve.runs import Streamed

ENDPOINTS = {
    "/v1/completions": handlers.completions,
    "/v1/chat/completions": handlers.chat_completions,
    "/v1/responses": handlers.responses,
    "/v1/embeddings": embeddings.embeddings,
}


@dataclass(frozen=True)
class Line:
    """One request of the input file: its line number, ``custom_id``, endpoint and body."""

    number: int
    custom_id: str
    url: str
    body: dict


def read_requests(records: Iterable[tuple[int, str, dict]]) -> list[Line]:
    """The requests of a batch file's records (``jobs.plan.json_records``' ``(line number, where,
    record)``), checked: ``ValueError`` naming the first bad one."""
    out, seen = [], {}
    for number, where, rec in records:
        if not isinstance(rec.get("custom_id"), str):
            raise ValueError(f"{where}: each line needs a 'custom_id' string (and method, url, body)")
        if rec.get("method", "POST") != "POST":
            raise ValueError(f"{where}: 'method' must be POST, got {rec.get('method')!r}")
        if rec.get("url") not in ENDPOINTS:
            raise ValueError(f"{where}: 'url' must be one of {', '.join(ENDPOINTS)}, got {rec.get('url')!r}")
        if not isinstance(rec.get("body"), dict):
            raise ValueError(f"{where}: 'body' must be the request object")
        cid = rec["custom_id"]
        if cid in seen:
            raise ValueError(f"{where}: custom_id {cid!r} repeats line {seen[cid]} (each must be unique)")
        seen[cid] = number
        out.append(Line(number, cid, rec["url"], rec["body"]))
    return out


def done_ids(path: str | Path) -> set[str]:
    """The ``custom_id`` s an earlier run wrote to the output at ``path`` (its cut last line dropped)."""
    if not Path(path).is_file():
        return set()
    truncate_partial_line(path)
    return {r.get("custom_id") for r in read_jsonl(path)}


def output_line(custom_id: str, status: int, body: dict) -> dict:
    """The Batch API's output record of one request."""
    response = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }


async def _never() -> None:
    await asyncio.Event().wait()  # a batch request has no client to go away


async def answer(served: handlers.Served, line: Line) -> dict:
    """One request through its endpoint's handler, as its output record."""
    if line.body.get("stream"):
        why = "a batch request is answered whole: leave 'stream' out"
        return output_line(line.custom_id, 400, APIError(400, why, "stream").body())
    try:
        out = await ENDPOINTS[line.url](served, line.body, _never)
    except APIError as e:
        return output_line(line.custom_id, e.status, e.body())
    if isinstance(out, Streamed):  # not reached: stream is refused above
        out.cancel()
        raise RuntimeError("a batch request was streamed")
    return output_line(line.custom_id, 200, out)


async def run(
    served: handlers.Served,
    lines: Sequence[Line],
    out: JsonlAppender,
    concurrency: int,
    on_done: Callable[[dict], None] = lambda rec: None,
) -> None:
    """Answer ``lines`` (up to ``concurrency`` at once) and append their records to ``out`` in order."""
    gate = asyncio.Semaphore(max(1, concurrency))
    ready: dict[int, dict] = {}
    written = 0

    async def one(i: int, line: Line) -> None:
        nonlocal written
        async with gate:
            rec = await answer(served, line)
        ready[i] = rec
        on_done(rec)
        flush = []
        while written in ready:
            flush.append(ready.pop(written))
            written += 1
        if flush:
            out.write(flush)

    await asyncio.gather(*(one(i, line) for i, line in enumerate(lines)))
