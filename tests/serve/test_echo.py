"""``echo`` and ``prompt_logprobs`` (``aotlm.serve.echo``) on a real server started as ``aotlm serve
--prompt-logprobs`` starts one: the prompt's log-probabilities equal transformers' log-softmax of the same
checkpoint, lm-eval's ``local-completions`` reads its log-likelihoods from them, the text and offsets
put the prompt first, a stream says what the whole answer says; and each refusal names its field."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from conformance import hf_model
from http_server import tiny_engine_server
from scripted import ScriptedEngine
from starlette.testclient import TestClient
from textkit import make_text_checkpoint

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.batching.engine import Engine
from aotlm.serve import echo
from aotlm.serve.app import create_app
from aotlm.serve.structured import FieldError
from aotlm.text.tokens import tokenizer_for

TEXT = "the cat sat on the mat and the dog"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with tiny_engine_server(tmp_path_factory.mktemp("echo"), "gpt2", prompt_logprobs=True) as (
        url,
        ckpt,
        tok,
    ):
        yield url, tok, hf_model(ckpt)


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def log_softmax(hf, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()


def test_lm_eval_local_completions_reads_transformers_loglikelihoods(srv):
    """lm-eval's payload (token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``) and its own
    parser: the continuation's log-likelihood and greedy flag are transformers'."""
    lm_eval_api = pytest.importorskip("lm_eval.models.openai_completions")
    url, tok, hf = srv
    ids = tok.encode(TEXT)
    body = {"model": "m", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}
    out = post(url, body).json()
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids) + 1 and out["usage"]["completion_tokens"] == 1
    want = log_softmax(hf, ids)
    for ctx in (1, 4, len(ids) - 2):
        got = lm_eval_api.LocalCompletionsAPI.parse_logprobs(out, ctxlens=[ctx])[0]
        rows = [want[t - 1] for t in range(ctx, len(ids))]
        assert got[0] == pytest.approx(
            sum(r[ids[t]] for r, t in zip(rows, range(ctx, len(ids)), strict=True)), abs=1e-4
        )
        assert got[1] == all(
            int(np.argmax(r)) == ids[t] for r, t in zip(rows, range(ctx, len(ids)), strict=True)
        )


def test_lm_eval_tokenizes_through_the_server(srv):
    """lm-eval's API backends detect the server's tokenizer (``/tokenizer_info`` + ``/tokenize``) and
    then need no ``tokenizer=``: its remote tokenizer gives the checkpoint tokenizer's ids."""
    utils = pytest.importorskip("lm_eval.utils")
    url, tok, _ = srv
    assert utils.check_remote_tokenizer_support(url + "/v1/completions")
    remote = utils.RemoteTokenizer(url + "/v1/completions")
    assert remote.encode(TEXT) == tok.encode(TEXT, add_special_tokens=False)
    assert remote.eos_token_id == tok.eos_token_id and remote.decode(tok.encode(TEXT)) == TEXT


def test_echo_puts_the_prompt_first_in_text_logprobs_and_offsets(srv):
    url, tok, hf = srv
    ids = tok.encode(TEXT)
    plain = post(url, {"prompt": TEXT, "max_tokens": 3, "temperature": 0, "logprobs": 2}).json()
    echoed = post(
        url, {"prompt": TEXT, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    ).json()
    a, b = plain["choices"][0], echoed["choices"][0]
    assert b["text"] == TEXT + a["text"] and b["finish_reason"] == a["finish_reason"]
    n = len(ids)
    assert b["logprobs"]["tokens"][n:] == a["logprobs"]["tokens"]
    # the same tokens; their log-probabilities within f32 rounding (the scoring prefill is another graph)
    assert b["logprobs"]["token_logprobs"][n:] == pytest.approx(a["logprobs"]["token_logprobs"], abs=1e-5)
    assert b["logprobs"]["text_offset"][n:] == [o + len(TEXT) for o in a["logprobs"]["text_offset"]]
    offsets = b["logprobs"]["text_offset"][:n]
    assert offsets[0] == 0
    assert all(TEXT.startswith(t, o) for t, o in zip(b["logprobs"]["tokens"][:n], offsets, strict=True))
    want = log_softmax(hf, ids)
    for t in range(1, n):
        assert b["logprobs"]["token_logprobs"][t] == pytest.approx(want[t - 1][ids[t]], abs=1e-4)
        top = b["logprobs"]["top_logprobs"][t]
        assert 1 <= len(top) <= 2 and max(
            top.values()
        )  # keyed by text: two may read alike == pytest.approx(want[t - 1].max(), abs=1e-4)
    counts = lambda r: (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"])  # noqa: E731
    assert counts(echoed) == counts(plain) == (n, 3)


def test_max_tokens_zero_echoes_the_prompt_alone(srv):
    url, tok, _ = srv
    out = post(url, {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    c = out["choices"][0]
    assert c["text"] == TEXT and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(tok.encode(TEXT))
    assert all(top in (None, {}) for top in c["logprobs"]["top_logprobs"])
    assert out["usage"]["completion_tokens"] == 0
    full = post(url, {"prompt": list(range(64)), "max_tokens": 0, "echo": True}).json()["error"]
    assert (
        full["message"] == "with 'max_tokens' 0 a prompt may hold 63 tokens, got 64"
        and full["param"] == "prompt"
    )
    # no logprobs: nothing scored, the text alone; the openai client reads it too
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got = client.completions.create(model="m", prompt=TEXT, max_tokens=0, echo=True)
    assert got.choices[0].text == TEXT and got.choices[0].logprobs is None


def test_vllm_prompt_logprobs_on_completions_and_chats(srv):
    url, tok, hf = srv
    ids = tok.encode(TEXT)
    want = log_softmax(hf, ids)
    out = post(url, {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 3, "n": 2, "temperature": 0}).json()
    for c in out["choices"]:
        plp = c["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for t in range(1, len(ids)):
            row, entry = want[t - 1], plp[t]
            mine = entry[str(ids[t])]
            assert mine["logprob"] == pytest.approx(row[ids[t]], abs=1e-4)
            assert mine["rank"] == 1 + int(np.sum(row > row[ids[t]] + 1e-9))
            assert mine["decoded_token"] == tok.decode([ids[t]])
            top3 = np.argsort(-row, kind="stable")[:3]
            assert {str(i) for i in top3} <= set(entry) and len(entry) in (3, 4)
        assert "logprobs" in c and c["logprobs"] is None
    msgs = [{"role": "user", "content": "hi"}]
    tok_chat = httpx.post(url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    chat = httpx.post(
        url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "prompt_logprobs": 0}
    )
    plp = chat.json()["prompt_logprobs"]
    assert len(plp) == len(tok_chat) and plp[0] is None and all(len(e) == 1 for e in plp[1:])


def test_a_stream_echoes_what_the_whole_answer_says(srv):
    url, _, _ = srv
    body = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
    whole = post(url, body).json()["choices"][0]
    text, tokens, lps = "", [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == TEXT  # the prompt comes first, whole
    for e in events:
        c = e["choices"][0]
        text += c["text"]
        if c["logprobs"]:
            tokens += c["logprobs"]["tokens"]
            lps += c["logprobs"]["token_logprobs"]
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    assert lps == whole["logprobs"]["token_logprobs"]


def test_refusals_name_their_field(tmp_path):
    asks = [
        ({"echo": "yes"}, False, "'echo' must be true or false"),
        ({"echo": True}, True, "'echo' belongs to /v1/completions"),
        ({"prompt_logprobs": 9}, False, "between 0 and 5, got 9"),
        ({"prompt_logprobs": 1, "stream": True}, False, "is not sent in a stream"),
        ({"max_tokens": 0}, False, "needs 'echo': true"),
    ]
    for body, chat, message in asks:
        with pytest.raises(FieldError, match=message):
            echo.parse(body, chat, None, bool(body.get("stream")))
    assert echo.parse({"echo": True}, False, 2, False) == echo.Echo(True, None, False, 2)
    assert echo.parse({"echo": True, "prompt_logprobs": 4, "max_tokens": 0}, False, 1, False).engine == 4
    assert echo.parse({"echo": True}, False, None, False).engine is None  # no logprobs: nothing to score


def test_a_server_without_score_graphs_names_the_flag(tmp_path):
    ckpt = make_text_checkpoint(tmp_path / "gpt2", family="gpt2")
    model = AutoModelForSampling.from_pretrained(ckpt, batch_size=1, n_positions=32, continuous_batching=True)
    engine = Engine(model).start()
    try:
        client = TestClient(create_app(engine, tokenizer_for(ckpt), "m"))
        body = {"prompt": "the cat", "echo": True, "logprobs": 1, "max_tokens": 1}
        r = client.post("/v1/completions", json=body)
    finally:
        engine.shutdown(timeout=5)
    assert r.status_code == 400 and "--prompt-logprobs" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt_logprobs"
    # echo alone needs no score graphs (a scripted engine: nothing compiles)
    tok = tokenizer_for(ckpt)
    client = TestClient(create_app(ScriptedEngine(tok.encode(" on")), tok, "m"))
    r = client.post("/v1/completions", json={"prompt": "the cat", "echo": True, "max_tokens": 1})
    assert r.json()["choices"][0]["text"] == "the cat on"
