"""Tool calls that close: the bundled model served over HTTP, tools whose parameters do not say
``additionalProperties``, ``tool_choice="required"`` at temperature 0.7, and the official client.

Read as JSON Schema's letter, such parameters let a weak model invent keys until ``max_tokens`` ends
the answer mid-call; aotlm reads them closed (as OpenAI's strict mode and xgrammar / vLLM do), so
every answer is a call with only the declared keys. An answer cut by ``max_tokens`` is never
presented as a call. ``closed_objects`` unit-tests the schema rewrite itself.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from aotlm.generate.constraints import Constraint, close_objects, from_response_format  # noqa: E402
from aotlm.serve import structured  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
DECLARED = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in TOOLS}
MSG = [{"role": "user", "content": "What is 223 plus 4?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from aotlm.api.causal_lm import AutoModelForSampling
    from aotlm.batching.engine import Engine
    from aotlm.serve.app import create_app
    from aotlm.text.tokens import eos_ids, tokenizer_for

    ckpt = "aotlm/tiny-py"
    tok = tokenizer_for(ckpt)
    model = AutoModelForSampling.from_pretrained(
        ckpt,
        continuous_batching=True,
        compile_cache=str(tmp_path_factory.mktemp("cc")),
        batch_size=4,
        n_positions=[512],
        context_length_estimate=[128, 512],
    ).compile()
    engine = Engine(model, eos_token_id=eos_ids(ckpt, model.hf_config, tok), max_queue=64).start()
    app = create_app(engine, tok, "tiny-py")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", max_retries=0)
    server.should_exit = True
    thread.join(10)
    engine.shutdown(timeout=5)


def ask(client, **kw):
    kw = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 80, "temperature": 0.7, **kw}
    return client.chat.completions.create(model="tiny-py", messages=MSG, **kw).choices[0]


def test_required_calls_close_with_only_declared_keys(client):
    for seed in range(20):
        out = ask(client, seed=seed)
        assert out.finish_reason == "tool_calls", (seed, out.finish_reason, out.message.content)
        assert out.message.content is None and len(out.message.tool_calls) == 1
        call = out.message.tool_calls[0].function
        args = json.loads(call.arguments)
        assert set(args) <= DECLARED[call.name], (seed, call.name, args)
        assert set(args) >= DECLARED[call.name], (seed, call.name, args)  # all are required


def test_a_call_cut_by_max_tokens_is_not_presented_as_a_call(client):
    for kw in (
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "add"}}},
    ):
        out = ask(client, seed=1, max_tokens=3, **kw)
        assert out.finish_reason == "length"
        assert not out.message.tool_calls and out.message.content, out.message
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.message.content)  # the partial call, as text


def test_closed_objects():
    schema = {
        "type": "object",
        "properties": {
            "p": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "pairs": {"type": "array", "prefixItems": [{"type": "integer"}]},
            "maps": {"type": "object", "patternProperties": {"^k": {"type": "string"}}},
        },
        "$defs": {"d": {"properties": {"y": {"type": "string"}}}},
        "allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}],
    }
    out = close_objects(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["p"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True  # what a schema says is kept
    assert props["pairs"]["items"] is False
    assert "additionalProperties" not in props["maps"]
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert all("additionalProperties" not in m for m in out["allOf"])  # members of allOf stay open
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["p"]


def test_strict_false_and_the_server_default_keep_open_objects():
    obj = {"type": "object", "properties": {"x": {"type": "integer"}}}
    closed = json.loads(from_response_format({"type": "json_schema", "json_schema": {"schema": obj}}).source)
    assert closed["additionalProperties"] is False
    fmt = {"type": "json_schema", "json_schema": {"schema": obj, "strict": False}}
    assert "additionalProperties" not in json.loads(from_response_format(fmt).source)
    lenient = {"type": "json_schema", "json_schema": {"schema": obj}}
    assert "additionalProperties" not in json.loads(from_response_format(lenient, closed=False).source)
    strict = {"type": "json_schema", "json_schema": {"schema": obj, "strict": True}}
    assert json.loads(from_response_format(strict, closed=False).source)["additionalProperties"] is False
    tools = json.loads(json.dumps(TOOLS))
    tools[1]["function"]["strict"] = False
    form = structured.parse({"tools": tools, "tool_choice": "required"}, chat=True)
    calls = json.loads(form.constraint.source)["anyOf"]
    assert calls[0]["properties"]["arguments"]["additionalProperties"] is False
    assert "additionalProperties" not in calls[1]["properties"]["arguments"]
    assert Constraint.json_schema(obj, closed=False).source == json.dumps(obj, separators=(",", ":"))
