"""Structured outputs through ``aotlm serve`` with the official ``openai`` client: JSON schemas,
``json_object``, regex and Lark constraints, ``logit_bias`` and tool calls, on a tiny random GPT-2
(a random model writes valid JSON only because the mask makes it)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import openai
import pytest
import uvicorn
from compile_counter import count_compiles
from textkit import make_tokenizer

pytest.importorskip("llguidance")

from aotlm.api.causal_lm import AutoModelForSampling  # noqa: E402
from aotlm.batching.engine import Engine  # noqa: E402
from aotlm.batching.types import SamplingParams, Token  # noqa: E402
from aotlm.serve.app import create_app  # noqa: E402
from aotlm.text.tokens import eos_ids  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PICK = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "ok", "tags"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "p": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "boolean"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "required": ["p"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, PICK, NESTED]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MSG = [{"role": "user", "content": "def fibonacci(n):"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    import transformers
    from conformance import make_checkpoint

    root = tmp_path_factory.mktemp("structured")
    tok = make_tokenizer(root / "tok")  # a context of 1024: the tools' JSON goes into the prompt
    ids = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=len(tok), n_positions=1024, **ids
    )
    ckpt = make_checkpoint(root / "gpt2", cfg, scale=4.0)
    tok.save_pretrained(str(ckpt))
    model = AutoModelForSampling.from_pretrained(
        ckpt,
        continuous_batching=True,
        compile_cache=str(root / "cc"),
        batch_size=4,
        n_positions=[512, 1024],  # two token buckets: fewer serving graphs to compile
        context_length_estimate=[64, 512],
    )
    model.compile()
    engine = Engine(model, eos_token_id=eos_ids(ckpt, model.hf_config, tok), max_queue=64).start()
    app = create_app(engine, tok, "tiny", api_key="k")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="k", max_retries=0
    )
    yield client, engine, tok
    server.should_exit = True
    thread.join(10)
    engine.shutdown(timeout=5)


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def chat(client, **kw):
    kw.setdefault("max_tokens", 48)
    return client.chat.completions.create(model="tiny", messages=MSG, **kw)


def streamed_text(client, **kw) -> tuple[str, str]:
    parts, reason = [], None
    for ch in chat(client, stream=True, **kw):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            reason = ch.choices[0].finish_reason
    return "".join(parts), reason


def test_fifty_schema_requests_validate_with_no_compile(srv):
    """50 concurrent requests over three schemas and json_object, greedy and sampled: every
    answer parses and validates; nothing compiles after warm-up."""
    client, _, tok = srv
    cases = [(SCHEMAS[i % 3] if i % 5 else None, i % 2 * 0.9, i) for i in range(50)]
    # a random model has no reason to ever close an unconstrained key: json_object rows get a
    # logit_bias towards '"', ':', '1' and '}' (the mask still decides what is valid)
    closing = {str(tok.convert_tokens_to_ids(c)): 6 for c in ('"', ":", "1", "}")}

    def one(case):
        schema, temp, seed = case
        if schema is None:
            rf, bias = {"type": "json_object"}, closing
        else:
            rf, bias = fmt(schema), None
        return chat(client, response_format=rf, temperature=temp, seed=seed, logit_bias=bias).choices[0]

    with count_compiles() as compiled, ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, cases))
    assert compiled["backend"] == 0, f"{compiled['backend']} compilations after warm-up"
    for (schema, _, _), choice in zip(cases, got, strict=True):
        assert choice.finish_reason == "stop", choice
        obj = json.loads(choice.message.content)
        jsonschema.validate(obj, schema if schema is not None else {"type": "object"})
        if schema is not None:  # properties in the schema's order, as OpenAI writes them
            assert list(obj) == [k for k in schema["properties"] if k in obj]


def test_streamed_equals_non_streamed(srv):
    client = srv[0]
    for schema, temp in ((PERSON, 0.0), (PICK, 1.0), (NESTED, 0.7)):
        kw = dict(response_format=fmt(schema), temperature=temp, seed=5)
        whole = chat(client, **kw).choices[0]
        text, reason = streamed_text(client, **kw)
        assert (text, reason) == (whole.message.content, whole.finish_reason)
        jsonschema.validate(json.loads(text), schema)


def test_bad_schema_and_grammar_are_400_with_the_library_message(srv):
    client = srv[0]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format=fmt({"type": "object", "properties": {"a": {"type": "strin"}}}))
    assert "Invalid type: strin" in e.value.body["message"] and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"response_format": {"type": "regex", "regex": "[0-9"}})
    assert "unclosed character class" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "yaml"})
    assert "response_format.type" in e.value.body["message"]


def test_regex_and_lark_constraints_always_match(srv):
    import re

    client = srv[0]
    for seed in range(6):
        rf = {"type": "regex", "regex": "[0-9]{3}-[a-z]{2}(!|\\?)"}
        out = client.completions.create(
            model="tiny",
            prompt="x =",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"response_format": rf},
        )
        assert re.fullmatch("[0-9]{3}-[a-z]{2}(!|\\?)", out.choices[0].text), out.choices[0].text
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'
    for seed in range(4):
        rf = {"type": "grammar", "grammar": lark}
        text = chat(client, temperature=1.0, seed=seed, max_tokens=40, extra_body={"response_format": rf})
        text = text.choices[0].message.content
        if text.endswith(")"):  # a complete sentence of the grammar (else cut at max_tokens)
            assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", text), text
        else:
            assert re.fullmatch(r"\((?:[1-9][0-9]?\+?)*", text), text


def test_constrained_rows_leave_unconstrained_tokens_unchanged(srv):
    """An unconstrained greedy request alone and sharing the batch with three constrained ones
    (which join while it runs) gets the same tokens."""
    _, engine, tok = srv
    from aotlm.generate.constraints import Constraint, Grammars

    prompt = tok("import os\n")["input_ids"]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = [t.id for t in engine.submit(prompt, sp) if isinstance(t, Token)]
    g = Grammars(tok, engine.vocab_size, engine.eos_token_id)
    req = engine.submit(prompt, sp)
    others = [
        engine.submit(
            prompt, SamplingParams(max_tokens=80, temperature=0), matcher=g.matcher(Constraint.json_schema(s))
        )
        for s in SCHEMAS
    ]
    shared = [t.id for t in req if isinstance(t, Token)]
    for r, s in zip(others, SCHEMAS, strict=True):
        ids = [t.id for t in r if isinstance(t, Token)]
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), s)
    assert shared == alone


def test_logit_bias_bans_and_forces(srv):
    client, _, tok = srv
    kw = dict(model="tiny", prompt="for i in", max_tokens=8, temperature=0, logprobs=0)
    plain = client.completions.create(**kw)
    first = plain.choices[0].logprobs.tokens[0]
    first_id = tok.convert_tokens_to_ids(tok.tokenize(first))[0]
    banned = client.completions.create(**kw, logit_bias={str(first_id): -100})
    assert banned.choices[0].text and not banned.choices[0].text.startswith(first)
    forced_id = tok.convert_tokens_to_ids("x")
    forced = client.completions.create(
        **kw, logit_bias={str(forced_id): 100}, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].text == "x" * 8
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, logit_bias={"99999": 5})
    assert "outside the vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, logit_bias={str(t): 1 for t in range(301)})
    assert "at most 300" in e.value.body["message"]


def check_call(call, tools=(WEATHER, CLOCK)):
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_tool_choice_required_and_named(srv):
    client = srv[0]
    for seed in range(8):
        out = chat(
            client, tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=seed, max_tokens=120
        ).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        assert len(out.message.tool_calls) == 1
        check_call(out.message.tool_calls[0])
    named = {"type": "function", "function": {"name": "get_time"}}
    out = chat(client, tools=[WEATHER, CLOCK], tool_choice=named, temperature=0, max_tokens=120).choices[0]
    assert out.message.tool_calls[0].function.name == "get_time"
    check_call(out.message.tool_calls[0])


def test_tool_calls_stream(srv):
    client = srv[0]
    kw = dict(tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=3, max_tokens=120)
    whole = chat(client, **kw).choices[0].message.tool_calls[0]
    calls, reason = [], None
    for ch in chat(client, stream=True, **kw):
        if ch.choices and ch.choices[0].delta.tool_calls:
            calls += ch.choices[0].delta.tool_calls
        if ch.choices and ch.choices[0].finish_reason:
            reason = ch.choices[0].finish_reason
    assert reason == "tool_calls" and len(calls) == 1
    assert (calls[0].function.name, calls[0].function.arguments) == (
        whole.function.name,
        whole.function.arguments,
    )


def test_tool_errors_and_history(srv):
    client = srv[0]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "'nope'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tool_choice="required")
    assert "needs 'tools'" in e.value.body["message"]
    history = MSG + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    out = client.chat.completions.create(model="tiny", messages=history, tools=[CLOCK], max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_auto_reads_calls_from_text():
    from aotlm.serve import structured

    s = structured.parse({"tools": [WEATHER, CLOCK]}, chat=True)
    assert s.tool_choice == "auto" and s.constraint is None
    calls = structured.read_calls(
        s, 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "UTC"})
    ]
    assert structured.read_calls(s, '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}')
    assert structured.read_calls(s, "no call here") == []
    assert structured.read_calls(s, '{"name": "unknown", "arguments": {}}') == []
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2
    assert len(structured.read_calls(s, two)) == 2
    one = structured.parse({"tools": [WEATHER, CLOCK], "parallel_tool_calls": False}, chat=True)
    assert len(structured.read_calls(one, two)) == 1  # at most one call, as OpenAI promises
    with pytest.raises(structured.FieldError, match="'parallel_tool_calls' must be true or false"):
        structured.parse({"tools": [WEATHER], "parallel_tool_calls": "no"}, chat=True)


def test_mask_applies_in_the_sampler():
    import jax.numpy as jnp

    from aotlm.core import sampling

    v = 70
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, v)), jnp.float32)
    allow = np.full((2, sampling.mask_words(v)), 0xFFFFFFFF, np.uint32)
    assert np.array_equal(sampling.constrain(logits, jnp.asarray(allow), None, None), logits)
    allow[0] = 0
    allow[0, 1] = 1 << 3  # token 35 only
    ids = np.full((2, 4), -1, np.int32)
    ids[1, 0] = 7
    vals = np.zeros((2, 4), np.float32)
    vals[1, 0] = 100
    out = np.asarray(sampling.constrain(logits, jnp.asarray(allow), jnp.asarray(ids), jnp.asarray(vals)))
    assert np.isfinite(out[0]).tolist() == [t == 35 for t in range(v)]
    assert out[1, 7] == pytest.approx(float(logits[1, 7]) + 100) and out[1].argmax() == 7
