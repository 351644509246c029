"""``POST /tokenize``, ``/detokenize`` and ``GET /tokenizer_info`` (``aotlm.serve.tokenize``): vLLM's and
llama-server's shapes, the ids the generation endpoints would submit, and one-line errors."""

from __future__ import annotations

import pytest
from scripted import ScriptedEngine
from starlette.testclient import TestClient
from textkit import CHAT_TEMPLATE, EOS, make_tokenizer

from aotlm.serve.app import create_app

KEY = "k"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers.processors import TemplateProcessing

    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.chat_template = CHAT_TEMPLATE
    bos = tok.convert_tokens_to_ids(EOS)  # a tokenizer that adds a BOS: add_special_tokens shows
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, bos)])
    return tok


@pytest.fixture(scope="module")
def setup(tok):
    engine = ScriptedEngine(tok.encode("x", add_special_tokens=False), n_positions=48)
    client = TestClient(create_app(engine, tok, "m", api_key=KEY))
    client.headers["Authorization"] = f"Bearer {KEY}"
    return client, engine


def test_tokenize_as_vllm_and_llama_server(tok, setup):
    client, engine = setup
    text = "def fibonacci(n):"
    plain = tok(text, add_special_tokens=False)["input_ids"]
    bos = tok.convert_tokens_to_ids(EOS)
    vllm = client.post("/tokenize", json={"model": "m", "prompt": text}).json()
    assert vllm == {"tokens": [bos, *plain], "count": len(plain) + 1, "max_model_len": 48}
    assert (
        client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == plain
    )
    llama = client.post(
        "/tokenize", json={"content": text}
    ).json()  # llama-server: no special tokens by default
    assert llama["tokens"] == plain
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain and "".join(p["piece"] for p in pieces) == text
    strs = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs) == EOS + text
    chat = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"flag": True}}
    ids = client.post("/tokenize", json=chat).json()["tokens"]
    assert tok.decode(ids) == "u:hi\na:F!"
    client.post("/v1/chat/completions", json={**chat, "max_tokens": 1})
    assert list(engine.seen[-1].prompt) == ids  # what a chat request submits


def test_tokenizer_info_names_the_special_tokens_and_the_template(tok, setup):
    client, _ = setup
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == CHAT_TEMPLATE
    assert info["model_max_length"] == 48 and info["tokenizer_class"] == type(tok).__name__
    assert set(info) >= {"bos_token", "pad_token", "unk_token"}
    assert TestClient(client.app).get("/tokenizer_info").status_code == 401  # behind the key


def test_detokenize(tok, setup):
    client, _ = setup
    ids = tok("x = 1", add_special_tokens=False)["input_ids"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "x = 1", "content": "x = 1"}


def test_errors_are_one_line_in_the_openai_shape(setup):
    client, _ = setup
    for path, body, status, param in [
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": "x"}, 400, "tokens"),
        ("/detokenize", {"tokens": [999]}, 400, "tokens"),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)
    r = client.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
