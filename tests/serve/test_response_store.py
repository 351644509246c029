"""Stored Responses API answers (``aotlm.serve.response_store``) through the official ``openai`` client:
``previous_response_id`` continues a stored conversation (earlier inputs and answers, not their
instructions: what reaches the engine is that chat's prompt), ``store=false`` keeps nothing,
``responses.retrieve`` / ``responses.delete``, the newest N kept, and a server that stores nothing."""

from __future__ import annotations

import json

import openai
import pytest
from scripted import ScriptedEngine
from starlette.testclient import TestClient
from textkit import CHAT_TEMPLATE, make_tokenizer

from aotlm.serve.app import create_app
from aotlm.serve.protocol import APIError
from aotlm.serve.response_store import ResponseStore, history

ANSWER = "x = 1"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def served(tok, text=ANSWER, store=True):
    engine = ScriptedEngine(tok.encode(text, add_special_tokens=False), reason="eos")
    http = TestClient(create_app(engine, tok, "m", responses=ResponseStore(8) if store else None))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    return client, engine, http


def prompt_of(http, messages) -> list[int]:
    return http.post("/tokenize", json={"messages": messages}).json()["tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_the_conversation(tok, stream):
    client, engine, http = served(tok)

    def create(**kw):
        if not stream:
            return client.responses.create(model="m", **kw)
        return list(client.responses.create(model="m", stream=True, **kw))[-1].response

    first = create(input="hi", instructions="be terse")
    assert first.store is True and first.previous_response_id is None
    second = create(input="more", instructions="be kind", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == ANSWER
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ANSWER}]
    want = [{"role": "system", "content": "be kind"}, *turns, {"role": "user", "content": "more"}]
    assert list(engine.seen[-1].prompt) == prompt_of(http, want)  # the old instructions stay behind
    create(input="again", previous_response_id=second.id)
    chain = [*want[1:], {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "again"}]
    assert list(engine.seen[-1].prompt) == prompt_of(http, chain)
    assert client.responses.retrieve(second.id).output_text == ANSWER


def test_a_function_call_turn_then_its_output(tok):
    client, engine, http = served(tok, CALL)
    r = client.responses.create(model="m", input="weather?", tools=[TOOL])
    (call,) = r.output
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    client.responses.create(model="m", input=[out], tools=[TOOL], previous_response_id=r.id)
    fn = {"name": "get_weather", "arguments": call.arguments}
    want = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call.call_id, "type": "function", "function": fn}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    got = http.post("/tokenize", json={"messages": want, "tools": tools}).json()["tokens"]
    assert list(engine.seen[-1].prompt) == got and json.loads(call.arguments) == {"city": "Paris"}


def test_store_false_retrieve_and_delete(tok):
    client, _, _ = served(tok)
    kept = client.responses.create(model="m", input="hi")
    gone = client.responses.create(model="m", input="hi", store=False)
    assert gone.store is False
    with pytest.raises(openai.BadRequestError, match="is not stored here"):
        client.responses.create(model="m", input="more", previous_response_id=gone.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)


def test_the_newest_are_kept_and_a_server_without_a_store():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert (
        len(store) == 2
        and store.get("r0") is None
        and history(store, "r2") == [{"role": "user", "content": "2"}]
    )
    with pytest.raises(APIError, match="dropped as the oldest past the newest 2") as e:
        history(store, "r0")
    assert e.value.param == "previous_response_id" and e.value.status == 400
    with pytest.raises(APIError, match="--max-stored-responses 0"):
        history(None, "r2")
    with pytest.raises(ValueError, match=">= 1"):
        ResponseStore(0)


def test_a_server_that_stores_nothing(tok):
    client, _, _ = served(tok, store=False)
    r = client.responses.create(model="m", input="hi")
    assert r.store is False
    with pytest.raises(openai.BadRequestError, match="does not keep"):
        client.responses.create(model="m", input="more", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
