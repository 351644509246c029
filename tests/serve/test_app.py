"""``aotlm serve``'s HTTP front end on a real server: uvicorn in a thread over the real engine
and a tiny random GPT-2 with a trained byte-level tokenizer, driven by the official ``openai``
client and raw HTTP. One server for the module (compiled once); the error mapping the real
engine rarely produces (a full queue, a stopped engine) runs against a stub engine in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from http_server import serving
from starlette.testclient import TestClient
from textkit import make_text_checkpoint

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.batching.engine import Engine
from aotlm.batching.types import EngineStopped, Finish, QueueFull, Token
from aotlm.cli.app import main
from aotlm.serve.app import create_app
from aotlm.serve.detok import ChoiceText
from aotlm.serve.protocol import APIError, choice_params, parse_chat, parse_completion
from aotlm.text.tokens import cut_at_eos, eos_ids, tokenizer_for

KEY = "sk-test-key"
NAME = "tiny-gpt2"
SHAPES = dict(batch_size=4, n_positions=64)
BODY_CAP = 1 << 16
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Srv:
    url: str
    engine: Engine
    app: object
    tok: object
    ref: object  # a batch-1 model of the same checkpoint for sample() references
    eos: list[int]
    ckpt: Path
    cache: Path

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", KEY), max_retries=0, **kw)

    def post(
        self, path: str, body=None, *, key: str | None = KEY, content=None, timeout=60
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, content=content, headers=headers, timeout=timeout)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    ckpt = make_text_checkpoint(root / "gpt2", family="gpt2")
    cache = root / "compile_cache"
    tok = tokenizer_for(ckpt)
    model = AutoModelForSampling.from_pretrained(
        ckpt, continuous_batching=True, compile_cache=str(cache), **SHAPES
    )
    model.compile()
    ref = AutoModelForSampling.from_pretrained(ckpt, batch_size=1, n_positions=64, compile_cache=str(cache))
    eos = eos_ids(ckpt, model.hf_config, tok)
    engine = Engine(model, eos_token_id=eos, max_queue=32).start()
    app = create_app(engine, tok, NAME, api_key=KEY, max_body_bytes=BODY_CAP)
    with serving(app) as url:
        yield Srv(url, engine, app, tok, ref, eos, ckpt, cache)
    engine.shutdown(timeout=5)


def wait_idle(srv: Srv, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = srv.engine.stats()
        if s["active_slots"] == 0 and s["queue_depth"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the engine is still busy: {srv.engine.stats()}")


@pytest.fixture
def slow_engine(srv, monkeypatch):
    """The engine's requests as submitted, on a device slowed to >= 5 ms a decode step, so a
    60-token request outlasts a client that leaves after its first token (the tiny model
    would otherwise finish first and the test would prove nothing)."""
    submitted = []
    submit, decode = srv.engine.submit, srv.engine.batch.decode

    def recording_submit(*a, **kw):
        req = submit(*a, **kw)
        push = req.push

        def recording_push(item):  # the Finish as the engine sent it, whoever reads the stream
            if isinstance(item, Finish):
                FINISHES[req.id] = item
            push(item)

        req.push = recording_push
        submitted.append(req)
        return req

    def slow_decode(steps, *a, **kw):
        time.sleep(0.005 * steps)
        return decode(steps, *a, **kw)

    monkeypatch.setattr(srv.engine, "submit", recording_submit)
    monkeypatch.setattr(srv.engine.batch, "decode", slow_decode)
    monkeypatch.setattr(srv.engine, "solo_chunk", None)  # short calls: a cancel lands before the end
    yield submitted
    wait_idle(srv)


FINISHES: dict = {}  # request id -> the Finish the engine pushed (slow_engine's requests)


def engine_finishes(reqs, timeout: float = 10) -> list:
    """The ``Finish`` each request ended with, waiting for the last ones: a cancelled request's
    ``Finish`` is pushed just after it leaves the queue or its slot, which ``wait_idle`` sees."""
    deadline = time.monotonic() + timeout
    while any(r.id not in FINISHES for r in reqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [FINISHES.get(r.id) for r in reqs]


def reference(srv: Srv, ids: list[int], max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish_reason) of greedy ``sample()`` on the batch-1 model."""
    out = srv.ref.sample([ids], max_new_tokens=max_tokens, eos_token_id=srv.eos)
    new = cut_at_eos(out[0][len(ids) :], srv.eos)
    text = srv.tok.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text, len(new), "stop" if new and new[-1] in srv.eos else "length"


def background_streams(srv: Srv, n: int) -> ThreadPoolExecutor:
    """``n`` long sampled streams that keep other slots busy."""
    pool = ThreadPoolExecutor(n)
    kw = dict(model=NAME, max_tokens=55, stream=True, extra_body={"ignore_eos": True})
    for i in range(n):
        pool.submit(lambda i=i: list(srv.client().completions.create(prompt=[5 + i, 6, 7], seed=i, **kw)))
    return pool


# ------------------------------------------------------------------ generation
def test_greedy_matches_sample_while_other_slots_are_busy(srv, slow_engine):
    prompts = [[11, 12, 13], list(range(20, 30)), [(7 * i) % 300 + 1 for i in range(40)]]  # 40: 2 chunks
    expected = [reference(srv, ids, 20) for ids in prompts]
    pool = background_streams(srv, 3)  # 55 tokens at >= 5 ms a step: busy throughout
    greedy = lambda ids: srv.client().completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0)
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(greedy, prompts))
    pool.shutdown(wait=True)
    for r, (text, n, reason) in zip(got, expected, strict=True):
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == reason
        assert r.usage.completion_tokens == n and r.usage.total_tokens == n + r.usage.prompt_tokens


def test_streamed_text_equals_non_streamed(srv):
    client = srv.client()
    kw = dict(model=NAME, prompt="def fibonacci(n):", max_tokens=30, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": "print(i)"}]
    ckw = dict(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**ckw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ckw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_the_responses_api_answers_as_the_chat_does(srv):
    """``client.responses.create`` on the real engine: the chat's greedy text, whole and streamed."""
    client = srv.client()
    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": "print(i)"}]
    chat = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    kw = dict(model=NAME, instructions="x", input="print(i)", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


def test_raw_sse_framing_and_done(srv):
    body = {"model": NAME, "prompt": "import os", "max_tokens": 5, "stream": True}
    with httpx.stream(
        "POST", srv.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ") and json.loads(e[6:])["object"] == "text_completion"


def test_chat_fallback_template_and_no_model_field(srv):
    """The tokenizer has no chat template: the documented fallback; ``model`` may be left out."""
    text = "<|user|>\nhello\n<|assistant|>\n"
    ids = srv.tok(text)["input_ids"]
    expected, n, _ = reference(srv, ids, 12)
    r = srv.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"] == expected
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == n
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        srv.tok("<|user|>\nhel\nlo\n<|assistant|>\n")["input_ids"]
    )


def test_chat_default_max_tokens_is_the_rest_of_the_context(srv):
    r = srv.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "extra": 1, "ignore_eos": True},
    )
    use = r.json()["usage"]
    assert r.status_code == 200 and use["prompt_tokens"] + use["completion_tokens"] == SHAPES["n_positions"]
    r = srv.post("/v1/completions", {"prompt": "x", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's completions default


def test_stop_strings_cut_the_text_and_free_the_slot(srv, slow_engine):
    client = srv.client()
    kw = dict(
        model=NAME,
        prompt="for i in range(10):",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    stop = next(full[k : k + 2] for k in range(3, len(full) - 2) if full.find(full[k : k + 2]) > 0)
    want = full[: full.find(stop)]
    r = client.completions.create(stop=[stop, "\x00never"], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"
    wait_idle(srv)
    _, *stopped = engine_finishes(slow_engine)  # the first was read to its end by the server
    assert [f.reason for f in stopped] == ["cancelled"] * 2
    assert all(f.completion_tokens < 40 for f in stopped)  # the slot freed early


def test_seeded_sampling_is_reproducible_and_choices_use_seed_plus_i(srv):
    client = srv.client()
    kw = dict(model=NAME, prompt="value = ", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(n=2, seed=7, **kw)
    b = client.completions.create(n=2, seed=7, **kw)
    c = client.completions.create(n=1, seed=8, **kw)
    texts = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert texts == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    assert texts[1] == c.choices[0].text
    assert texts[0] != texts[1]


def test_several_prompts_times_n_choices(srv):
    r = srv.post(
        "/v1/completions", {"prompt": ["def f", "import"], "n": 2, "max_tokens": 3, "temperature": 0}
    )
    out = r.json()
    assert r.status_code == 200 and sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    by = {c["index"]: c["text"] for c in out["choices"]}
    assert by[0] == by[1] and by[2] == by[3]  # greedy: the n copies agree
    assert out["usage"]["prompt_tokens"] == len(srv.tok("def f")["input_ids"]) + len(
        srv.tok("import")["input_ids"]
    )


def test_allowed_token_ids_and_bad_words_hold_on_the_engine(srv):
    from aotlm.batching.types import SamplingParams
    from aotlm.generate.bans import RequestBans

    prompt = srv.tok.encode("value = ")
    vocab = srv.engine.vocab_size

    def run(matcher=None, **kw):
        p = SamplingParams(max_tokens=12, ignore_eos=True, **kw)
        return [t.id for t in srv.engine.submit(prompt, p, matcher=matcher) if isinstance(t, Token)]

    allowed = srv.tok.encode(" x = 1 + y")
    drawn = run(RequestBans(vocab, allowed=allowed), temperature=1.0, seed=3)
    assert len(drawn) == 12 and set(drawn) <= set(allowed)
    base = run(temperature=0.0)
    pair = tuple(base[:2])
    singles = [(t,) for t in base[2:] if t not in pair][:1]
    out = run(RequestBans(vocab, words=[pair, *singles]), temperature=0.0)
    assert not any(s in out for (s,) in singles) and all(tuple(out[i : i + 2]) != pair for i in range(11))
    assert out[0] == base[0] and out != base  # the first token of the pair alone is no bad word
    k = next(i for i in range(1, 12) if base[i] not in base[:i])  # its first token not seen before
    stop = ((base[k],),)
    assert len(run(temperature=0.0, stop_token_ids=stop)) == k + 1
    held = run(RequestBans(vocab, min_tokens=k + 3, held=[base[k]]), temperature=0.0, stop_token_ids=stop)
    assert len(held) >= k + 3 and base[k] not in held[: k + 3]  # vLLM's min_tokens
    r = srv.post("/v1/completions", {"prompt": "value = ", "max_tokens": 4, "allowed_token_ids": [vocab]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_logprobs_shapes(srv):
    client = srv.client()
    r = client.completions.create(
        model=NAME, prompt="def", max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(
        client.completions.create(
            model=NAME,
            prompt="def",
            max_tokens=6,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens

    r = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.bytes == list(item.token.encode())
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True
    )
    assert all(item.top_logprobs == [] for item in r.choices[0].logprobs.content)


# ------------------------------------------------------------------ errors
LONG = list(range(1, 101))  # 100 tokens > 64 positions
BAD = [
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 62}, 400, None),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": 3, "prompt": "x"}, 400, "model"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 9},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools",
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"prompt": "x"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0]",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 80}]}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_the_openai_error_shape(srv, path, body, status, param):
    r = srv.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(
    "content,status",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b"\xff\xfe", 400),
        (b'{"prompt": "' + b"x" * BODY_CAP + b'"}', 413),
    ],
)
def test_malformed_and_oversized_bodies(srv, content, status):
    r = srv.post("/v1/completions", content=content)
    assert r.status_code == status and set(r.json()["error"]) == ERROR_KEYS


@pytest.mark.parametrize(
    "path,content,where",
    [
        ("/v1/completions", b'{"prompt": "a<S>b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "x<S>"], "max_tokens": 2}', "prompt[1]"),
        ("/v1/completions", b'{"prompt": "a", "stop": ["<S>"], "max_tokens": 2}', "stop[0]"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "<S>"}]}], "n": 1}',
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where(srv, path, content, where):
    """Valid JSON, but not text: the tokenizer raised a TypeError on it (a 500)."""
    for lone in (b"\\ud800", b"\\udc00", b"\\ud83d"):
        r = srv.post(path, content=content.replace(b"<S>", lone))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"].startswith(f"'{where}' holds a lone UTF-16 surrogate"), err
        assert err["param"] == where.split("[")[0]
    assert srv.post(path, content=content.replace(b"<S>", b"\\ud83d\\ude00")).status_code == 200  # a pair


def test_logprobs_of_cut_tokens_are_strict_json(srv):
    """Tokens that top_k cut have log-probability -inf, which JSON has no number for: the server sends
    ``responses.LOGPROB_FLOOR`` (vLLM's -9999.0), streamed or not, on both endpoints."""

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text[:200]}"))

    sampled = {"max_tokens": 3, "temperature": 1.0, "top_k": 1, "seed": 1, "ignore_eos": True}
    bodies = {
        "completions": {"prompt": "def", "logprobs": 3},
        "chat/completions": {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 3,
        },
    }
    for path, body in bodies.items():
        body = {"model": NAME, **sampled, **body}
        r = srv.post(f"/v1/{path}", body, timeout=60)
        assert r.status_code == 200, r.text
        lp = strict(r.text)["choices"][0]["logprobs"]
        tops = lp["top_logprobs"] if path == "completions" else [t["top_logprobs"] for t in lp["content"]]
        values = [sorted(t.values() if path == "completions" else [x["logprob"] for x in t]) for t in tops]
        assert values and all(v == [-9999.0, -9999.0, 0.0] for v in values), values
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{srv.url}/v1/{path}", json={**body, "stream": True}, headers=auth) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all(strict(e) for e in events[:-1])


def test_logprobs_limit_message_names_it(srv):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().completions.create(model=NAME, prompt="x", logprobs=6)
    assert "at most 5" in e.value.message and e.value.param == "logprobs"


def test_auth_and_unknown_routes(srv):
    ok = {"model": NAME, "prompt": "x", "max_tokens": 1}
    assert srv.post("/v1/completions", ok, key=None).status_code == 401
    r = srv.post("/v1/completions", ok, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        srv.client(api_key="wrong").models.list()
    assert srv.post("/v1/completions", ok).status_code == 200
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}  # open without a key
    assert [m.id for m in srv.client().models.list()] == [NAME]
    for r in (srv.post("/v1/nothing", {}), httpx.get(srv.url + "/v1/completions")):
        assert r.status_code in (404, 405) and set(r.json()["error"]) == ERROR_KEYS


def test_draining_server_says_503(srv):
    served = srv.app.state.served
    served.stopping = True
    try:
        assert httpx.get(srv.url + "/health").status_code == 503
        r = srv.post("/v1/completions", {"prompt": "x"})
        assert r.status_code == 503 and set(r.json()["error"]) == ERROR_KEYS
    finally:
        served.stopping = False
    assert httpx.get(srv.url + "/health").status_code == 200


class StubEngine:
    """Refuses every request the way a full or stopping engine does."""

    def __init__(self, error: Exception):
        self.error, self.n_positions, self.vocab_size, self.running = error, 64, 320, True

    def validate(self, prompt, params):
        if prompt[0] == 1:
            raise RuntimeError("a bug")

    def submit(self, prompt, params, request_id=None, matcher=None):
        raise self.error

    def stats(self):
        return {"queue_depth": 3, "active_slots": 4, "slots": 4}


@pytest.mark.parametrize("error,status", [(QueueFull("full"), 429), (EngineStopped("bye"), 503)])
def test_queue_full_and_stopped_engine(srv, error, status):
    client = TestClient(create_app(StubEngine(error), srv.tok, NAME))
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == status and set(r.json()["error"]) == ERROR_KEYS
    assert "aotlm_queue_depth 3.0" in client.get("/metrics").text


def test_unexpected_errors_are_500_in_the_openai_shape(srv, caplog):
    client = TestClient(create_app(StubEngine(QueueFull()), srv.tok, NAME), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"prompt": [1, 2]})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "Traceback" not in r.text and "a bug" not in r.text
    assert any("failed" in rec.message for rec in caplog.records)  # logged with its traceback


# ------------------------------------------------------------------ disconnects, metrics
def test_dropped_streams_free_their_slots(srv, slow_engine):
    before = srv.metric('aotlm_request_finish_total{finish_reason="cancelled"}')
    body = {"prompt": [1, 2, 3], "max_tokens": 60, "stream": True, "ignore_eos": True, "temperature": 1}
    headers = {"Authorization": f"Bearer {KEY}"}
    for _ in range(3):
        clients = [httpx.Client(timeout=30) for _ in range(6)]  # 6 streams > 4 slots: 2 wait in the queue
        streams = [c.stream("POST", srv.url + "/v1/completions", json=body, headers=headers) for c in clients]
        for s in streams[:4]:
            next(s.__enter__().iter_lines())  # the first event, then drop the connection
        for s in streams[4:]:
            s.__enter__()  # headers only: still queued
        for s, c in zip(streams, clients, strict=True):
            s.__exit__(None, None, None)
            c.close()
    wait_idle(srv)
    finishes = engine_finishes(slow_engine)
    assert len(finishes) == 18 and all(f.reason == "cancelled" for f in finishes), finishes
    assert all(f.completion_tokens < 60 for f in finishes)
    assert srv.metric('aotlm_request_finish_total{finish_reason="cancelled"}') == before + 18
    with ThreadPoolExecutor(8) as ex:
        done = list(
            ex.map(lambda i: srv.post("/v1/completions", {"prompt": [i + 1], "max_tokens": 8}), range(8))
        )
    assert [r.status_code for r in done] == [200] * 8


def test_non_streamed_client_that_leaves_cancels(srv, slow_engine):
    body = {"prompt": [4, 5], "max_tokens": 60, "ignore_eos": True, "n": 2}
    for _ in range(2):
        with pytest.raises(httpx.TimeoutException):
            srv.post("/v1/completions", body, timeout=0.1)
    wait_idle(srv)
    finishes = engine_finishes(slow_engine)
    assert len(finishes) == 4 and all(f.reason == "cancelled" and f.completion_tokens < 60 for f in finishes)


def test_metrics_and_health(srv):
    srv.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    srv.post("/v1/completions", {"prompt": "x", "max_tokens": 0})
    ids = list(range(1, 41))  # sent twice: the second reuses the K/V the first left in its row
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0}
    first, again = (srv.post("/v1/completions", body).json() for _ in range(2))
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    text = httpx.get(srv.url + "/metrics").text
    assert "aotlm_prompt_tokens_cached_total 0.0" not in text
    for name in [
        "aotlm_prompt_tokens_cached_total",
        "aotlm_prefix_cache_hit_rate",
        "aotlm_prefix_cache_token_rate",
        "aotlm_prefix_cache_rows",
        "aotlm_queue_depth",
        "aotlm_active_slots",
        "aotlm_slots 4.0",
        "aotlm_prompt_tokens_total",
        "aotlm_generation_tokens_total",
        'aotlm_request_finish_total{finish_reason="length"}',
        'aotlm_http_requests_total{path="/v1/completions",status="200"}',
        'aotlm_http_requests_total{path="/v1/completions",status="400"}',
        "aotlm_time_to_first_token_seconds_bucket",
        "aotlm_inter_token_latency_seconds_bucket",
        "aotlm_request_latency_seconds_bucket",
    ]:
        assert name in text, name
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


# ------------------------------------------------------------------ the command
def test_cli_serve_starts_answers_and_exits_0_on_sigterm(srv):
    env = dict(os.environ, AOTLM_API_KEY="cli-key")
    shapes = ["--batch-size", "4", "--n-positions", "64", "--cache-dir", str(srv.cache)]
    cmd = [sys.executable, "-m", "aotlm.cli", "serve", str(srv.ckpt), "--port", "0", *shapes]
    cmd += ["--served-model-name", "m"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        url, _, rest = line.removeprefix("aotlm serve: ").partition(" ")
        assert url.startswith("http://127.0.0.1:") and rest == "(model m, 4 slots)", (
            line,
            proc.stderr.read(),
        )
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="cli-key", max_retries=0)
        assert client.completions.create(model="m", prompt="def", max_tokens=4).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read()  # a line per start-up phase: a cold start is never a silent wait
        for phase in ("weights loaded in", "serving graphs to compile", "graphs ready in", "run once in"):
            assert phase in log, log
    finally:
        proc.kill()
        proc.wait()
    port = srv.url.rpartition(":")[2]  # taken (the module's server): one line, exit 2, before loading
    busy = subprocess.run([*cmd[:6], port, *cmd[7:]], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2 and busy.stderr.strip().startswith(
        f"aotlm serve: error: cannot serve on 127.0.0.1:{port}"
    )


def test_cli_serve_over_tls(srv, tmp_path, capsys):
    openssl = shutil.which("openssl") or pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    for bad, why in (
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "gone.pem")], "cannot use --ssl-cert"),
        (["--ssl-certfile", str(key)], "cannot use --ssl-certfile"),  # a key where the certificate goes
        (["--ssl-keyfile", str(key)], "--ssl-keyfile needs --ssl-certfile"),
    ):
        assert main(["serve", str(tmp_path / "no-model"), "--port", "0", *bad]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err, err
    shapes = ["--batch-size", "4", "--n-positions", "64", "--cache-dir", str(srv.cache), "--no-warmup"]
    cmd = [sys.executable, "-m", "aotlm.cli", "serve", str(srv.ckpt), "--port", "0", *shapes]
    cmd += ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--served-model-name", "m"]
    cmd += ["--shutdown-timeout", "3"]  # the client's idle TLS connection stays open until then
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        url = line.removeprefix("aotlm serve: ").partition(" ")[0]
        assert url.startswith("https://127.0.0.1:"), (line, proc.stderr.read())
        trust = ssl.create_default_context(cafile=str(cert))
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=httpx.Client(verify=trust)
        )
        assert client.completions.create(model="m", prompt="def", max_tokens=3).usage.completion_tokens >= 1
        with pytest.raises(httpx.ConnectError):  # the certificate is not one the system trusts
            httpx.get(f"{url}/health")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_other_commands_do_not_import_the_server_stack():
    stack = "{'fastapi', 'uvicorn', 'prometheus_client', 'starlette'}"
    code = f"import sys, aotlm.cli.app; print(sorted({stack} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_serve_extra_is_a_one_line_error():
    code = "import sys; sys.modules['fastapi'] = None; from aotlm.cli import main; sys.exit(main(['serve']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "aotlm serve: error: fastapi is not installed; install the server extra: pip install -e '.[serve]'"
    ]


# ------------------------------------------------------------------ units
class CharTokenizer:
    """Token i is ``VOCAB[i]`` (0 is a special token): enough for ``IncrementalDecoder``."""

    VOCAB = ["<eos>", "ab", "cE", "N", "D", "zz", "EN", "x", "aENDb"]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))


def test_stop_string_text_is_held_back_then_cut():
    text = ChoiceText(CharTokenizer(), ["END"])
    out = [text.push(Token(i)).text for i in (1, 2, 3, 7, 6)]
    assert out == ["ab", "c", "", "ENx", ""]  # "E", "EN": maybe the stop string, held back
    last = text.push(Token(4))
    assert text.stopped and last.text == "" and [t.id for t in last.tokens] == [6, 4]
    assert text.text == "abcENx" and text.n_tokens == 6 and text.push(Token(5)) is None
    inside = ChoiceText(CharTokenizer(), ["END", "zz"])
    assert inside.push(Token(8)).text == "a" and inside.stopped
    held = ChoiceText(CharTokenizer(), ["END"])
    assert [held.push(Token(i)).text for i in (1, 2)] == ["ab", "c"] and held.finish().text == "E"
    plain = ChoiceText(CharTokenizer())
    pieces = [plain.push(Token(i)) for i in (1, 2, 0)]
    assert [p.offsets for p in pieces] == [[0], [2], [4]] and plain.finish().text == ""


def test_choice_params_defaults_caps_and_seeds():
    common = parse_completion({"prompt": "x", "n": 3, "seed": 2**32 - 2}, max_n=4).common
    ps = choice_params(common, prompt_len=60, n_positions=64, default_max_tokens=16, max_tokens_cap=None)
    assert [p.max_tokens for p in ps] == [4] * 3 and [p.seed for p in ps] == [2**32 - 2, 2**32 - 1, 0]
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]}, max_n=4).common
    assert choice_params(chat, 10, 64, None, None)[0].max_tokens == 54
    assert choice_params(chat, 10, 64, None, 20)[0].max_tokens == 20
    explicit = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 30}, 4).common
    with pytest.raises(APIError) as e:
        choice_params(explicit, 10, 64, None, 20)
    assert e.value.status == 400 and e.value.param == "max_tokens"
