"""``POST /v1/embeddings`` (``aotlm.serve.embeddings``) on a real server built with ``embeddings=True``:
each input's embedding is transformers' final hidden state of its last token, normalized (vLLM's
last-token pooling), for inputs of one prefill chunk and of several, as floats or base64, through the
official ``openai`` client; generation on the same server is unchanged; refusals name their field."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from conformance import hf_model
from http_server import tiny_engine_server
from starlette.testclient import TestClient

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.batching.engine import Engine
from aotlm.serve.app import create_app

SHORT, LONG = "the cat sat", "the cat sat on the mat and then the dog"  # 11 and 37 tokens


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    with tiny_engine_server(root, "llama", embeddings=True) as (url, ckpt, tok):
        ref = AutoModelForSampling.from_pretrained(
            ckpt, batch_size=1, n_positions=64, compile_cache=str(root / "cc")
        )
        yield url, tok, hf_model(ckpt), ref, ckpt


def last_hidden(hf, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()


def test_embeddings_are_transformers_last_hidden_state_normalized(srv):
    url, tok, hf, _, _ = srv
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    out = client.embeddings.create(model="m", input=[SHORT, LONG])
    assert len(tok(LONG)["input_ids"]) > 16  # several prefill chunks
    for text, item in zip([SHORT, LONG], out.data, strict=True):
        want = last_hidden(hf, tok(text)["input_ids"])
        np.testing.assert_allclose(item.embedding, want / np.linalg.norm(want), atol=1e-5)
    assert [d.index for d in out.data] == [0, 1]
    assert out.usage.prompt_tokens == len(tok(SHORT)["input_ids"]) + len(tok(LONG)["input_ids"])
    ids = tok(SHORT)["input_ids"]
    raw = httpx.post(
        url + "/v1/embeddings", json={"input": ids, "normalize": False, "encoding_format": "base64"}
    )
    got = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(got, last_hidden(hf, ids), rtol=1e-4, atol=1e-5)


def test_generation_on_the_same_server_is_unchanged(srv):
    """An embedded prompt leaves nothing behind: a completion of the same text (its prefix reused or
    not) is ``sample()``'s."""
    url, tok, _, ref, _ = srv
    httpx.post(url + "/v1/embeddings", json={"input": LONG})
    body = {"prompt": LONG, "max_tokens": 5, "temperature": 0}
    got = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
    ids = tok(LONG)["input_ids"]
    want = ref.sample(np.array([ids]), max_new_tokens=5)[0, len(ids) :].tolist()
    assert got == tok.decode(want)


def test_refusals_name_their_field(srv, tmp_path):
    url, tok, _, _, ckpt = srv
    post = lambda body: httpx.post(url + "/v1/embeddings", json=body).json()["error"]  # noqa: E731
    assert post({"input": SHORT, "dimensions": 7})["param"] == "dimensions"
    assert post({"input": SHORT, "encoding_format": "hex"})["param"] == "encoding_format"
    assert post({"input": []})["param"] == "input" and post({})["message"] == "'input' is required"
    assert post({"input": [5, 10**6]})["param"] == "input"
    too_long = post({"input": list(range(64))})
    assert (
        too_long["message"] == "'input' 0 holds 64 tokens; an embedding here takes at most 63"
        and too_long["param"] == "input"
    )
    plain = AutoModelForSampling.from_pretrained(ckpt, batch_size=1, n_positions=32, continuous_batching=True)
    engine = Engine(plain).start()
    try:
        r = TestClient(create_app(engine, tok, "m")).post("/v1/embeddings", json={"input": SHORT})
    finally:
        engine.shutdown(timeout=5)
    assert r.status_code == 400 and "--embeddings" in r.json()["error"]["message"]
