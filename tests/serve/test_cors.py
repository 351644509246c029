"""Cross-origin requests (``aotlm.serve.cors``): a browser's preflight and the request after it, with
vLLM's defaults (any origin) and with the flags narrowing them; bad flag values named (exit 2)."""

from __future__ import annotations

import argparse

import pytest
from starlette.testclient import TestClient

from aotlm.cli.app import main
from aotlm.serve.app import create_app
from aotlm.serve.cors import Cors, add_flags, from_flags

pytest.importorskip("fastapi")
PAGE = "https://chat.example"
KEY = "sk-cors"


class Idle:
    """An engine that is never asked to generate (the routes here read models and health)."""

    n_positions, vocab_size, running = 64, 320, True

    def stats(self):
        return {"queue_depth": 0, "active_slots": 0, "slots": 1}


def preflight(client, origin=PAGE, method="POST"):
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    return client.options("/v1/chat/completions", headers=headers)


def test_any_origin_by_default_and_the_key_still_guards_requests():
    client = TestClient(create_app(Idle(), None, "m", api_key=KEY))
    r = preflight(client)
    assert r.status_code == 200, r.text  # answered before the key is checked
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = client.get("/v1/models", headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = client.get("/v1/models", headers={"Origin": PAGE})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # the page reads why


def test_named_origins_only_and_credentials():
    cors = Cors(allowed_origins=[PAGE], allow_credentials=True)
    client = TestClient(create_app(Idle(), None, "m", cors=cors))
    ok = preflight(client)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert preflight(client, origin="https://other.example").status_code == 400
    r = client.get("/health", headers={"Origin": "https://other.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    narrow = TestClient(create_app(Idle(), None, "m", cors=Cors(allowed_methods=["GET"])))
    assert preflight(narrow).status_code == 400 and preflight(narrow, method="GET").status_code == 200


def test_flags_read_json_lists():
    p = argparse.ArgumentParser()
    add_flags(p)
    assert from_flags(p.parse_args([])) == Cors()
    got = from_flags(p.parse_args(["--allowed-origins", f'["{PAGE}"]', "--allowed-headers", '["x-a"]']))
    assert got == Cors(allowed_origins=[PAGE], allowed_headers=["x-a"])
    for bad in ("*", '"*"', "[1]", "[oops"):
        with pytest.raises(ValueError, match="--allowed-origins takes a JSON list of strings"):
            from_flags(p.parse_args(["--allowed-origins", bad]))


def test_serve_names_a_bad_cors_flag_before_loading(tmp_path, capsys):
    code = main(["serve", str(tmp_path / "no-model"), "--port", "0", "--allowed-methods", "GET,POST"])
    err = capsys.readouterr().err
    assert code == 2 and "--allowed-methods takes a JSON list of strings" in err and "Traceback" not in err
