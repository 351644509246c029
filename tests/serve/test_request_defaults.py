"""The server's request defaults (``aotlm.serve.request_defaults``): the fields vLLM takes from a checkpoint's
``generation_config.json`` (its difference from transformers' defaults), what reaches the engine when a
request leaves them out or sets them, the default ``max_tokens`` bound, and the flags' errors."""

from __future__ import annotations

import json

import pytest
import transformers
from scripted import ScriptedEngine
from starlette.testclient import TestClient
from textkit import CHAT_TEMPLATE, make_text_checkpoint, make_tokenizer

from aotlm.cli.app import main
from aotlm.serve import request_defaults as defaults
from aotlm.serve.app import create_app

CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0,
          "max_new_tokens": 8, "bos_token_id": 1}  # fmt: skip


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def test_the_fields_vllm_reads_from_the_file(ckpt):
    """vLLM reads ``GenerationConfig.to_diff_dict()`` (every value the file sets), not ``do_sample``."""
    got = defaults.load("auto", str(ckpt))
    diff = transformers.GenerationConfig.from_pretrained(ckpt).to_diff_dict()
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0}
    assert got.sampling == {k: diff[k] for k in defaults.FIELDS if k in diff} == want
    assert got.max_tokens == diff["max_new_tokens"] == 8
    assert defaults.load("vllm", str(ckpt)) == defaults.Defaults()
    assert defaults.load("auto", str(ckpt / "none")) == defaults.Defaults()  # no file: nothing
    assert defaults.load(str(ckpt), "elsewhere").sampling == got.sampling  # a folder's file
    over = defaults.load("vllm", str(ckpt), '{"top_k": 50, "temperature": 0.3}')
    assert over.sampling == {"temperature": 0.3, "top_k": 50}  # an override is taken as given
    assert defaults.load("auto", str(ckpt), '{"temperature": 0.2}').sampling == {**want, "temperature": 0.2}


@pytest.mark.parametrize(
    ("source", "override", "message"),
    [
        ("nowhere", None, "--generation-config nowhere: no generation_config.json there"),
        ("vllm", "{temperature", "--override-generation-config is not JSON"),
        ("vllm", "[1]", "must be a JSON object"),
        ("vllm", '{"temperature": 9}', "generation config: 'temperature' must be between 0 and 2, got 9"),
        ("vllm", '{"max_new_tokens": 0}', "generation config: max_new_tokens must be an integer >= 1, got 0"),
    ],
)
def test_bad_sources_are_named(source, override, message):
    with pytest.raises(ValueError, match=message):
        defaults.load(source, ".", override)


def test_requests_get_the_defaults_under_their_own_fields(tmp_path, ckpt):
    tok = make_tokenizer(tmp_path / "tok")
    tok.chat_template = CHAT_TEMPLATE
    engine = ScriptedEngine(tok.encode("x y"), n_positions=64)
    app = create_app(engine, tok, "m", request_defaults=defaults.load("auto", str(ckpt)))
    client = TestClient(app)
    chat = [{"role": "user", "content": "hi"}]
    asks = [
        ("/v1/completions", {"prompt": "a"}, (0.6, 0.9, 8)),
        ("/v1/completions", {"prompt": "a", "temperature": 0, "max_tokens": 30}, (0.0, 0.9, 30)),
        ("/v1/completions", {"prompt": "a", "top_p": None}, (0.6, 0.9, 8)),  # null: not given
        ("/v1/chat/completions", {"messages": chat}, (0.6, 0.9, 8)),
        ("/v1/chat/completions", {"messages": chat, "max_completion_tokens": 3, "top_p": 1}, (0.6, 1.0, 3)),
    ]
    for path, body, want in asks:
        assert client.post(path, json=body).status_code == 200, body
        p = engine.seen[-1].params
        assert (p.temperature, p.top_p, p.max_tokens) == want, body
    app = create_app(
        engine, tok, "m", request_defaults=defaults.load("vllm", str(ckpt), '{"max_new_tokens": 40}')
    )
    TestClient(app).post("/v1/completions", json={"prompt": "a"})
    assert (
        engine.seen[-1].params.max_tokens == 16 and engine.seen[-1].params.temperature == 1.0
    )  # OpenAI's 16


def test_serve_names_a_bad_generation_config_flag(tmp_path, capsys):
    ckpt = make_text_checkpoint(tmp_path / "gpt2", family="gpt2")
    code = main(["serve", str(ckpt), "--port", "0", "--generation-config", str(ckpt / "gone")])
    assert code == 2 and "no generation_config.json there" in capsys.readouterr().err
