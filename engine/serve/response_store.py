"""Stored responses of ``POST /v1/responses``: what ``previous_response_id`` continues from, and
``GET`` / ``DELETE /v1/responses/{id}``.

OpenAI's Responses API stores a response unless the request says ``"store": false``, and a later request
naming it as ``previous_response_id`` continues its conversation: the earlier turns' messages (inputs
and outputs, not their ``instructions``) come before the new input. Here they live in memory, the newest
``max_items`` (``aotlm serve --max-stored-responses N``; the oldest go first, 0 keeps none), and are
gone when the server stops. Each holds the response as answered and its conversation as chat messages;
a conversation shares its earlier turns' message objects, so a long chain costs one turn per response.
(No ``from __future__ import annotations``: FastAPI reads the routes' ``Request`` annotation, a local
name here.)
"""

from collections import OrderedDict
from dataclasses import dataclass

from aotlm.serve.protocol import APIError, bad

DEFAULT_MAX_ITEMS = 1024


@dataclass(frozen=True)
class Stored:
    """A stored response (as answered) and its conversation (chat messages, its own answer last)."""

    response: dict
    conversation: list[dict]


class ResponseStore:
    """The newest ``max_items`` responses by id."""

    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS):
        if max_items < 1:
            raise ValueError(f"a response store holds >= 1 responses, got {max_items}")
        self.max_items = max_items
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = Stored(response, conversation)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def history(store: "ResponseStore | None", previous) -> list[dict]:
    """The conversation ``previous_response_id`` continues (``[]`` without one); a 400 naming the field
    when it is not a stored response."""
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise bad("'previous_response_id' must be a response id (a string)", "previous_response_id")
    if store is None:
        raise bad(
            "'previous_response_id' needs stored responses, which this server does not keep (started with "
            "--max-stored-responses 0); send the whole input",
            "previous_response_id",
        )
    found = store.get(previous)
    if found is None:
        raise bad(
            f"previous response {previous!r} is not stored here (never made, made with store=false, deleted, "
            f"or dropped as the oldest past the newest {store.max_items})",
            "previous_response_id",
        )
    return found.conversation


def add_stored_routes(app, store: "ResponseStore | None", check_key) -> None:
    """``GET`` and ``DELETE /v1/responses/{id}`` (404 for an id not stored)."""
    from fastapi import Request  # local: optional [serve] extra

    def found(response_id: str) -> Stored:
        item = store.get(response_id) if store is not None else None
        if item is None:
            raise APIError(404, f"response {response_id!r} is not stored here", "response_id")
        return item

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        check_key(request)
        return found(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        check_key(request)
        found(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
