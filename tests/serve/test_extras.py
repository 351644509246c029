"""vLLM's extra request fields (``aotlm.serve.extras``): what reaches the engine (the prompt's ids,
the constraint) and what the client reads (stop strings kept, special tokens shown), over a
scripted engine that records each submit; and the refusals by name."""

from __future__ import annotations

import json

import pytest
from scripted import ScriptedEngine
from starlette.testclient import TestClient
from textkit import CHAT_TEMPLATE, EOS, make_tokenizer

from aotlm.batching.types import Token
from aotlm.serve import extras
from aotlm.serve.app import create_app
from aotlm.serve.detok import ChoiceText
from aotlm.serve.structured import FieldError
from aotlm.text.tokens import bad_word_ids

ANSWER = "x = 1 END y = 2"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def served(tok, script=None, variables=None, **kw):
    engine = ScriptedEngine(tok.encode(ANSWER) if script is None else script, **kw)
    return TestClient(create_app(engine, tok, "m", chat_template_kwargs=variables)), engine


def test_chat_template_fields_reach_the_template(tok):
    client, engine = served(tok)
    chat = {"messages": CHAT, "max_tokens": 4}
    for extra, rendered in [
        ({}, "u:hi\na:ok\na:"),
        ({"chat_template_kwargs": {"flag": True}}, "u:hi\na:ok\na:F!"),
        ({"add_generation_prompt": False}, "u:hi\na:ok\n"),
        ({"add_generation_prompt": False, "continue_final_message": True}, "u:hi\na:ok"),
        ({"documents": [{"text": "doc one"}]}, "d:doc one\nu:hi\na:ok\na:"),
    ]:
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 200, r.text
        assert tok.decode(engine.seen[-1].prompt) == rendered, extra
    for extra, param in [
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"documents": "doc"}, "documents"),
        ({"chat_template": "{{ 'x' }}"}, "chat_template"),
    ]:
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_prompt_fields_shape_the_ids(tok):
    client, engine = served(tok, n_positions=48)
    ids = tok.encode("def fibonacci(n): return n")
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and list(engine.seen[-1].prompt) == ids[-3:]
    client.post("/v1/completions", json={"prompt": ids * 9, "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert list(engine.seen[-1].prompt) == (ids * 9)[-48:]  # the window's worth
    bos = tok.convert_tokens_to_ids(EOS)
    from tokenizers.processors import TemplateProcessing

    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, bos)])
    try:
        client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 2})
        assert engine.seen[-1].prompt[0] == bos  # completions: the tokenizer's own, by default
        client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 2, "add_special_tokens": False})
        assert engine.seen[-1].prompt[0] != bos
        client.post("/v1/chat/completions", json={"messages": CHAT[:1], "max_tokens": 2})
        assert engine.seen[-1].prompt[0] != bos  # chats: the template's only
        client.post("/v1/chat/completions", json={"messages": CHAT[:1], "add_special_tokens": True})
        assert engine.seen[-1].prompt[0] == bos
    finally:
        tok.backend_tokenizer.post_processor = None
    for bad in (0, -2, 1.5, True, "3"):
        r = client.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", bad


def test_stop_strings_kept_and_special_tokens_shown(tok):
    client, _ = served(
        tok, script=[*tok.encode("x = 1"), tok.convert_tokens_to_ids(EOS), *tok.encode(" END y")]
    )
    body = {"prompt": "a", "max_tokens": 9, "stop": ["END"]}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "x = 1 "
    kept = client.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == "x = 1 END" and kept["choices"][0]["finish_reason"] == "stop"
    shown = client.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()
    assert shown["choices"][0]["text"] == f"x = 1{EOS} "
    stream = {**body, "include_stop_str_in_output": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=stream) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks) == "x = 1 END"


def test_guided_fields_are_response_formats(tok):
    pytest.importorskip("llguidance")
    client, engine = served(tok, script=tok.encode("yes"))
    for extra, kind in [
        ({"guided_choice": ["yes", "no (maybe)"]}, "regex"),
        ({"guided_json": {"type": "object"}}, "json_schema"),
        ({"guided_json": '{"type": "object"}'}, "json_schema"),
        ({"guided_regex": "[a-z]+"}, "regex"),
        ({"structured_outputs": {"choice": ["yes"]}}, "regex"),
        ({"structured_outputs": {"json_object": True}}, "json_object"),
    ]:
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert engine.seen[-1].matcher is not None, extra
        assert extras.guided_format(extra)["type"] == kind
    assert extras.guided_format({"guided_choice": ["a.b", "c"]})["regex"] == r"(a\.b|c)"
    for extra in [
        {"guided_choice": []},
        {"guided_json": "not json"},
        {"guided_regex": "a", "guided_json": {}},
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
        {"structured_outputs": {"yaml": "x"}},
    ]:
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, **extra})
        assert r.status_code == 400, (extra, r.text)


def test_fields_not_applied_are_refused_by_name_unless_they_ask_nothing(tok):
    client, _ = served(tok)
    for name, value in [
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("spaces_between_special_tokens", False),
        ("logits_processors", ["x"]),
        ("detokenize", False),
        ("add_generation_prompt", False),  # a chat field, on /v1/completions
    ]:
        r = client.post("/v1/completions", json={"prompt": "a", name: value})
        assert r.status_code == 400, name
        assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"]
    noops = {
        "min_tokens": 0,
        "use_beam_search": False,
        "length_penalty": 1.0,
        "detokenize": True,
    }
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, **noops}).status_code == 200


def test_parse_and_choice_text_units(tok):
    got = extras.parse({"chat_template_kwargs": {"enable_thinking": False}}, chat=True)
    assert got.template == {
        "enable_thinking": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
    }
    assert extras.parse({}, chat=False) == extras.Extras()
    with pytest.raises(FieldError, match="'skip_special_tokens' must be true or false"):
        extras.parse({"skip_special_tokens": "no"}, chat=False)
    text = ChoiceText(tok, ["y =", "END"], include_stop=True)  # the earliest one ends it, kept
    released = "".join(p.text for t in tok.encode(ANSWER) if (p := text.push(Token(t))) is not None)
    assert text.stopped and released + text.finish().text == "x = 1 END"


def test_bans_go_to_the_engine_as_a_matcher(tok):
    from aotlm.generate.bans import RequestBans

    client, engine = served(tok)
    allowed = tok.encode(" x = 1")
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "allowed_token_ids": allowed})
    m = engine.seen[-1].matcher
    assert r.status_code == 200 and isinstance(m, RequestBans)
    bits = m.mask()
    assert [t for t in range(320) if bits[t // 32] >> (t % 32) & 1] == sorted(set(allowed))
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "bad_words": ["return"]})
    words = bad_word_ids(tok, ["return"])
    assert r.status_code == 200 and engine.seen[-1].matcher.longer == tuple(
        tuple(w) for w in words if len(w) > 1
    )
    for bad in (
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"bad_words": "x"},
        {"bad_words": [""]},
    ):
        r = client.post("/v1/completions", json={"prompt": "a", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), bad
    assert (
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "bad_words": []}).status_code
        == 200
    )


def test_request_bans_units(tok):
    from aotlm.generate.bans import ALL_ONES, RequestBans

    on = lambda mask: [t for t in range(64) if mask[t // 32] >> (t % 32) & 1]  # noqa: E731
    m = RequestBans(64, words=[(5,), (7, 8)], eos_ids=[3])
    assert 5 not in on(m.mask()) and 8 in on(m.mask())
    m.advance([7])
    assert 8 not in on(m.mask()) and 7 in on(m.mask())
    m.advance([9])
    assert 8 in on(m.mask())

    class Grammar:  # allows 1, 2 and 5; records what it was fed
        fed: list = []

        def fill(self, out):
            out[:] = 0
            out[0] = (1 << 1) | (1 << 2) | (1 << 5)
            return out

        def advance(self, tokens):
            self.fed.extend(tokens)
            return True

    both = RequestBans(64, allowed=[2, 5, 9], words=[(5,)], eos_ids=[3], inner=Grammar())
    assert on(both.mask()) == [2] and both.advance([2]) and Grammar.fed == [2]
    nothing = RequestBans(64, allowed=[5], words=[(5,)], eos_ids=[3])
    assert on(nothing.mask()) == [3]  # nothing left: the eos may end it
    assert (RequestBans(64).mask() == ALL_ONES).all()
    # vLLM's variants of a bad word: as written, and with a space before it when that is a new token
    ids = bad_word_ids(tok, ["  fibonacci"])
    assert ids[0] == tok.encode("fibonacci") and all(ids)
    if len(ids) > 1:
        assert ids[1] == tok.encode(" fibonacci") and len(ids[1]) == len(ids[0])


def test_min_tokens_holds_back_the_end(tok):
    from aotlm.generate.bans import RequestBans

    client, engine = served(tok)
    n = len(tok.encode(ANSWER))
    body = {"prompt": "a", "max_tokens": 20, "stop": ["END"], "stop_token_ids": [7]}
    for least, text in [(0, "x = 1 "), (2, "x = 1 "), (n, ANSWER)]:  # END's own tokens end past token 2
        got = client.post("/v1/completions", json={**body, "min_tokens": least}).json()
        assert got["choices"][0]["text"] == text, least
    m = engine.seen[-1].matcher
    assert isinstance(m, RequestBans) and m.min_tokens == n and 7 in m.held
    r = client.post("/v1/completions", json={**body, "min_tokens": 21})
    assert r.status_code == 400 and "'min_tokens' (21) must be at most 'max_tokens' (20)" in r.text
    for bad in (-1, 1.5, "2"):
        assert client.post("/v1/completions", json={**body, "min_tokens": bad}).status_code == 400
    eos = RequestBans(64, eos_ids=[3], min_tokens=2, held=[3, 9])
    on = lambda mask: {t for t in range(64) if mask[t // 32] >> (t % 32) & 1}  # noqa: E731
    assert not {3, 9} & on(eos.mask())
    eos.advance([1])
    assert not {3, 9} & on(eos.mask())
    eos.advance([2])
    assert {3, 9} <= on(eos.mask())


def test_server_template_variables_under_the_requests(tok):
    client, engine = served(tok, variables={"flag": True})  # aotlm serve --chat-template-kwargs
    chat = {"messages": CHAT[:1], "max_tokens": 2}
    client.post("/v1/chat/completions", json=chat)
    assert tok.decode(engine.seen[-1].prompt).endswith("a:F!")
    client.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"flag": False}})
    assert tok.decode(engine.seen[-1].prompt).endswith("a:")


def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(tok):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk's usage is its choice's so far."""
    script = tok.encode(" a b c", add_special_tokens=False)
    client, _ = served(tok, script=script)
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in [
        ("/v1/completions", {"prompt": "x = 1"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ]:
        with client.stream("POST", path, json={**body, "stream": True, "stream_options": options}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        *chunks, last = events
        prompt = last["usage"]["prompt_tokens"]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
        assert counts == sorted(counts) and counts[-1] == last["usage"]["completion_tokens"] == len(script)
        assert all(c["usage"]["total_tokens"] == prompt + n for c, n in zip(chunks, counts, strict=True))
        assert last["choices"] == [] and (
            path == "/v1/completions" or counts[0] == 0
        )  # the chat's role chunk
    r = client.post(
        "/v1/completions",
        json={"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
    )
    assert r.status_code == 400 and "needs 'include_usage': true" in r.json()["error"]["message"]


def test_token_ids_beside_the_text(tok):
    """vLLM's ``return_token_ids``: each choice's ``token_ids`` (the answer's), the prompt's
    ``prompt_token_ids`` (per choice of a completion, once for a chat); streamed: each chunk's own
    ids, whose concatenation is the whole answer's, the prompt's in a choice's first chunk."""
    script = tok.encode(ANSWER)
    client, engine = served(tok, script=script)
    out = client.post("/v1/completions", json={"prompt": "x = 1", "return_token_ids": True, "n": 2}).json()
    prompt = list(engine.seen[-1].prompt)
    assert [(c["token_ids"], c["prompt_token_ids"]) for c in out["choices"]] == [(script, prompt)] * 2
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "return_token_ids": True}).json()
    assert (
        chat["prompt_token_ids"] == list(engine.seen[-1].prompt) and chat["choices"][0]["token_ids"] == script
    )
    for path, body in [
        ("/v1/completions", {"prompt": "x = 1"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ]:
        with client.stream("POST", path, json={**body, "stream": True, "return_token_ids": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == script
        first = chunks[0] if path.endswith("chat/completions") else chunks[0]["choices"][0]
        assert first["prompt_token_ids"] == list(engine.seen[-1].prompt)
        assert all(
            "prompt_token_ids" not in c and "prompt_token_ids" not in c["choices"][0] for c in chunks[1:]
        )
    plain = client.post("/v1/completions", json={"prompt": "x = 1"}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_logprobs_name_tokens_by_id_on_request(tok):
    """vLLM's ``return_tokens_as_token_ids``: every token in logprobs is ``"token_id:N"``."""
    script = tok.encode(ANSWER)
    client, _ = served(tok, script=[Token(t, -0.5, ((t, -0.5),)) for t in script])
    body = {"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in script]
    assert [list(d) for d in lp["top_logprobs"]] == [[f"token_id:{t}"] for t in script]
    chat = {"messages": CHAT, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in script]
    assert content[0]["bytes"] == list(f"token_id:{script[0]}".encode())
