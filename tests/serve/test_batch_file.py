"""OpenAI batch files (``aotlm.serve.batch_file``): the input checked whole (each bad line named), records
in input order whatever order the answers come in, a refused request as its record's error, the output
of an earlier run read back for a resume; over a scripted engine (no model)."""

from __future__ import annotations

import asyncio
import json

import pytest
from scripted import ScriptedEngine
from textkit import CHAT_TEMPLATE, make_tokenizer

from aotlm.durable import JsonlAppender, read_jsonl
from aotlm.jobs.plan import json_records
from aotlm.serve import batch_file
from aotlm.serve.app import build_served

CHAT = [{"role": "user", "content": "hi"}]


def write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def req(cid: str, url: str = "/v1/completions", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body or {"prompt": "x", "max_tokens": 2}}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: invalid JSON"),
        ({"url": "/v1/completions", "body": {}}, "line 2: each line needs a 'custom_id' string"),
        ({**req("b"), "method": "GET"}, "line 2: 'method' must be POST"),
        (req("b", "/v1/audio/speech"), "line 2: 'url' must be one of /v1/completions, /v1/chat/completions"),
        ({**req("b"), "body": "x"}, "line 2: 'body' must be the request object"),
        (req("a"), "line 2: custom_id 'a' repeats line 1"),
    ],
)
def test_a_bad_line_is_named(tmp_path, line, message):
    path = write(tmp_path / "in.jsonl", [req("a"), line])
    with pytest.raises(ValueError, match=message):
        batch_file.read_requests(json_records(path, None))


def test_records_in_input_order_errors_in_their_record_and_a_resume(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    tok.chat_template = CHAT_TEMPLATE
    engine = ScriptedEngine(tok.encode("ok then"), reason="eos")
    served = build_served(engine, tok, "m")
    lines = batch_file.read_requests(json_records(write(tmp_path / "in.jsonl", [
        req("c1"),
        req("c2", "/v1/chat/completions", messages=CHAT),
        req("c3", "/v1/responses", input="hi"),
        req("bad", prompt="x", temperature=9),
        req("streamed", prompt="x", stream=True),
        "",
    ]), None))  # fmt: skip
    out_path = tmp_path / "out.jsonl"
    out = JsonlAppender(out_path)
    seen = []
    asyncio.run(batch_file.run(served, lines, out, 2, seen.append))
    out.close()
    recs = list(read_jsonl(out_path))
    assert [r["custom_id"] for r in recs] == ["c1", "c2", "c3", "bad", "streamed"]
    assert sorted(r["custom_id"] for r in seen) == sorted(r["custom_id"] for r in recs)
    assert [r["response"]["status_code"] for r in recs] == [200, 200, 200, 400, 400]
    assert recs[0]["response"]["body"]["choices"][0]["text"] == "ok then"
    assert recs[1]["response"]["body"]["choices"][0]["message"]["content"] == "ok then"
    assert recs[2]["response"]["body"]["output"][0]["content"][0]["text"] == "ok then"
    assert recs[3]["response"]["body"]["error"]["param"] == "temperature"
    assert "leave 'stream' out" in recs[4]["response"]["body"]["error"]["message"]
    assert all(r["error"] is None and r["id"].startswith("batch_req_") for r in recs)
    with open(out_path, "a") as f:
        f.write('{"custom_id": "c6", "resp')  # a record cut by a crash
    assert batch_file.done_ids(out_path) == {"c1", "c2", "c3", "bad", "streamed"}
    assert out_path.read_text().endswith("}\n")  # the cut line is gone
    assert batch_file.done_ids(tmp_path / "none.jsonl") == set()
