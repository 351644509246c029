"""``POST /v1/responses`` (``aotlm.serve.openai_responses``): a Responses request becomes the chat it
asks for (what reaches the engine is what ``/v1/chat/completions`` would submit), its answer comes back
in the Responses shape the official ``openai`` client reads, whole or streamed, text or function calls;
what needs state the server does not keep or other tools is refused by name (stored responses and
``previous_response_id``: test_response_store.py)."""

from __future__ import annotations

import json

import openai
import pytest
from scripted import ScriptedEngine
from starlette.testclient import TestClient
from textkit import CHAT_TEMPLATE, make_tokenizer

from aotlm.serve import openai_responses
from aotlm.serve.app import create_app
from aotlm.serve.protocol import APIError

ANSWER = "x = 1 END y = 2"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS = {"city": "Paris"}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": PARAMS}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def served(tok, text: str = ANSWER, reason: str = "eos"):
    engine = ScriptedEngine(tok.encode(text, add_special_tokens=False), reason=reason)
    http = TestClient(create_app(engine, tok, "m"))
    return (
        openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0),
        engine,
        http,
    )


def test_a_request_becomes_the_chat_it_asks_for():
    parts = [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "in Paris?"}]
    paris, rome = '{"city": "Paris"}', '{"city": "Rome"}'
    call = lambda i, args: {"type": "function_call", "call_id": i, "name": "get_weather", "arguments": args}  # noqa: E731
    schema = {"name": "w", "schema": {"type": "object"}, "strict": True}
    body = {
        "model": "m", "instructions": "be terse", "max_output_tokens": 9, "temperature": 0.5, "top_k": 3,
        "input": [
            {"role": "developer", "content": "use tools"},
            {"type": "message", "role": "user", "content": parts},
            call("c1", paris),
            call("c2", rome),
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", **schema}},
        "include": ["message.output_text.logprobs"], "store": True, "metadata": {"k": "v"},
    }  # fmt: skip
    chat = openai_responses.to_chat(body)
    fn = lambda i, args: {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": args}}  # noqa: E731
    assert chat["messages"] == [
        {"role": "system", "content": "be terse"},
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [fn("c1", paris), fn("c2", rome)]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": schema}
    got = (chat["max_completion_tokens"], chat["temperature"], chat["top_k"], chat["logprobs"])
    assert got == (9, 0.5, 3, True)
    assert openai_responses.to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": "hi", "background": True}, "background", "state this server does not keep"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation", "state this server does not keep"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0]",
            "text only",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
        ({"input": []}, "input", "non-empty list"),
        ({"input": [{"type": "reasoning"}]}, "input[0]", "must be a message"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", "'text.format' must be"),
    ],
)
def test_refusals_name_their_field(body, param, message):
    with pytest.raises(APIError, match=message) as e:
        openai_responses.to_chat(body)
    assert e.value.param == param and e.value.status == 400


def test_the_client_reads_a_text_answer_whole_and_streamed(tok):
    client, engine, http = served(tok)
    r = client.responses.create(model="m", input="hi", instructions="be terse", max_output_tokens=30)
    assert r.output_text == ANSWER and r.status == "completed" and r.object == "response"
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    chat = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]
    assert list(engine.seen[-1].prompt) == http.post("/tokenize", json={"messages": chat}).json()["tokens"]
    assert engine.seen[-1].params.max_tokens == 30
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(engine.seen[-1].prompt), len(engine.script))
    events = list(client.responses.create(model="m", input="hi", stream=True))
    kinds = [e.type for e in events]
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[-4:] == [*tail, "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert events[-1].response.output_text == ANSWER
    assert events[-1].response.usage.output_tokens == len(engine.script)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_and_a_cut_answer(tok):
    client, _, _ = served(tok, CALL)
    r = client.responses.create(model="m", input="weather?", tools=[TOOL])
    (call,) = r.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
    )
    assert call.call_id and r.status == "completed"
    events = list(client.responses.create(model="m", input="weather?", tools=[TOOL], stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.name, json.loads(i.arguments)) for i in done] == [
        ("function_call", "get_weather", PARIS)
    ]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [{"city": "Paris"}]
    client, _, _ = served(tok, reason="length")
    r = client.responses.create(model="m", input="hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    last = list(client.responses.create(model="m", input="hi", stream=True))[-1]
    assert last.type == "response.incomplete"
