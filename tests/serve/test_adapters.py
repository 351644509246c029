"""LoRA adapters over HTTP (``aotlm.serve.adapters``), driven by the official ``openai`` client on a
real server (uvicorn in a thread, the real engine, a tiny Llama with a trained tokenizer and PEFT
adapters): a request's ``model`` picks an adapter and gets the tokens ``sample(adapter=...)`` gives,
concurrent requests under different adapters share the batch, ``/v1/models`` lists the adapters,
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` change them at run time without compiling;
prefixes are not reused across adapters. Also ``aotlm batch-generate --lora NAME=DIR`` records."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from conformance import hf_model
from http_server import serving
from textkit import make_text_checkpoint

from aotlm.api.causal_lm import AutoModelForSampling
from aotlm.batching.engine import Engine
from aotlm.cli.app import main
from aotlm.serve.adapters import Adapters
from aotlm.serve.app import create_app
from aotlm.serve.protocol import APIError
from aotlm.text.tokens import cut_at_eos, eos_ids, tokenizer_for

peft = pytest.importorskip("peft", reason="the adapters are made with peft (the [test] extra)")
NAME = "tiny-llama"
SHAPES = dict(n_positions=64, context_length_estimate=[16, 32])


def make_adapter(base, out, seed, targets=("q_proj", "v_proj", "o_proj", "down_proj"), r=4):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(target_modules=list(targets), init_lora_weights=False, r=r, lora_alpha=2 * r)
    model = peft.get_peft_model(hf_model(base), cfg)
    with torch.no_grad():  # strong enough to change greedy tokens of a random model
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(20.0)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    ckpt = make_text_checkpoint(root / "llama", family="llama")
    paths = {k: make_adapter(ckpt, root / k, seed) for k, seed in (("sql", 1), ("poet", 2), ("late", 3))}
    cache = str(root / "compile_cache")
    lora = dict(max_loras=3, max_lora_rank=8)
    model = AutoModelForSampling.from_pretrained(
        ckpt, batch_size=4, continuous_batching=True, compile_cache=cache, **SHAPES, **lora,
        lora_adapters={"sql": str(paths["sql"]), "poet": str(paths["poet"])},
    )  # fmt: skip
    model.compile()
    ref = AutoModelForSampling.from_pretrained(
        ckpt, batch_size=1, compile_cache=cache, **SHAPES, **lora,
        lora_adapters={k: str(v) for k, v in paths.items()},
    )  # fmt: skip
    tok = tokenizer_for(ckpt)
    eos = eos_ids(ckpt, model.hf_config, tok)
    engine = Engine(model, eos_token_id=eos, max_queue=32).start()
    app = create_app(engine, tok, NAME, adapters=Adapters(model, engine, NAME))
    with serving(app) as url:
        yield dict(url=url, model=model, ref=ref, eos=eos, paths=paths, ckpt=ckpt, tok=tok)
    engine.shutdown(timeout=5)


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s["url"] + "/v1", api_key="none", max_retries=0)


def expected(s, ids, adapter, n=12) -> str:
    """The text of greedy ``sample(adapter=...)`` on the batch-1 model."""
    out = s["ref"].sample([ids], max_new_tokens=n, eos_token_id=s["eos"], adapter=adapter)[0][len(ids) :]
    new = cut_at_eos(out, s["eos"])
    return s["tok"].decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def completion(s, ids, model, n=12) -> tuple[str, str]:
    r = client(s).completions.create(model=model, prompt=ids, max_tokens=n, temperature=0)
    return r.choices[0].text, r.model


def test_each_requests_model_picks_its_adapter_in_one_batch(served):
    s, prompt = served, list(range(20, 36))
    graphs = len(s["model"].compile_report)
    want = {m: expected(s, prompt, None if m == NAME else m) for m in (NAME, "sql", "poet")}
    assert len(set(want.values())) == 3, "the adapters should change the greedy tokens"
    with ThreadPoolExecutor(6) as ex:  # two of each at once: rows of one batch under three adapters
        got = list(ex.map(lambda m: (m, completion(s, prompt, m)), [NAME, "sql", "poet"] * 2))
    for m, (text, model_field) in got:
        assert text == want[m] and model_field == m
    assert len(s["model"].compile_report) == graphs


def test_models_list_and_adapters_load_and_unload_at_run_time(served):
    s = served
    ids = [m.id for m in client(s).models.list().data]
    assert ids == [NAME, "sql", "poet"]
    assert client(s).models.retrieve("sql").id == "sql"
    sql = client(s).models.retrieve("sql").model_dump()  # loaded with the model (serve --lora sql=DIR)
    assert (sql["parent"], sql["root"]) == (NAME, str(s["paths"]["sql"]))
    graphs = len(s["model"].compile_report)
    r = httpx.post(
        s["url"] + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(s["paths"]["late"])}
    )
    assert r.status_code == 200 and "added" in r.text, r.text
    card = next(m for m in client(s).models.list().data if m.id == "late")
    assert (card.model_dump()["parent"], card.model_dump()["root"]) == (NAME, str(s["paths"]["late"]))
    prompt = [5, 6, 7, 8, 9]
    assert completion(s, prompt, "late")[0] == expected(s, prompt, "late")
    full = httpx.post(
        s["url"] + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(s["paths"]["sql"])}
    )
    assert full.status_code == 400 and "slots are taken" in full.json()["error"]["message"]
    again = {"lora_name": "late", "lora_path": str(s["paths"]["sql"])}  # a loaded name, as vLLM: 400
    r = httpx.post(s["url"] + "/v1/load_lora_adapter", json=again)
    assert r.status_code == 400 and "set 'load_inplace' to true" in r.json()["error"]["message"], r.text
    assert completion(s, prompt, "late")[0] == expected(s, prompt, "late")  # still the first adapter
    r = httpx.post(s["url"] + "/v1/load_lora_adapter", json={**again, "load_inplace": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"
    r = httpx.post(s["url"] + "/v1/load_lora_adapter", json={**again, "load_inplace": True})
    assert r.status_code == 200 and completion(s, prompt, "late")[0] == expected(s, prompt, "sql")
    r = httpx.post(s["url"] + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200 and [m.id for m in client(s).models.list().data] == [NAME, "sql", "poet"]
    with pytest.raises(openai.NotFoundError, match="the model 'late' does not exist"):
        client(s).completions.create(model="late", prompt=prompt, max_tokens=2)
    bad = httpx.post(s["url"] + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "lora_name"
    assert len(s["model"].compile_report) == graphs


def test_a_prefix_is_not_reused_under_another_adapter(served):
    s, prompt = served, [(3 * i) % 200 + 4 for i in range(30)]
    assert completion(s, prompt, NAME)[0] == expected(s, prompt, None)  # the row keeps its K/V for reuse
    assert completion(s, prompt, "sql")[0] == expected(s, prompt, "sql")
    assert completion(s, prompt, NAME)[0] == expected(s, prompt, None)


def test_batch_generate_records_name_their_adapter(served, tmp_path, capsys):
    s = served
    records = [{"id": "a", "prompt": "hello world", "adapter": "sql"}, {"id": "b", "prompt": "hello world"}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    lora = ["--lora", f"sql={s['paths']['sql']}", "--max-lora-rank", "8"]
    args = ["batch-generate", "--input", str(src), "--output", str(out), "--model", str(s["ckpt"]),
            "--batch-size", "2", "--max-new-tokens", "8", *lora]  # fmt: skip
    assert main(args) == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    ids = list(s["tok"]("hello world", add_special_tokens=False)["input_ids"])
    for rid, adapter in (("a", "sql"), ("b", None)):
        new = s["ref"].sample([ids], max_new_tokens=8, eos_token_id=s["eos"], adapter=adapter)[0][len(ids) :]
        assert got[rid]["completion"] == s["tok"].decode(cut_at_eos(new, s["eos"]), skip_special_tokens=True)
    assert got["a"]["completion"] != got["b"]["completion"]
    src.write_text(json.dumps({"prompt": "x", "adapter": "nope"}) + "\n")
    assert (
        main(
            [
                "batch-generate",
                "--input",
                str(src),
                "--output",
                str(tmp_path / "o2.jsonl"),
                "--model",
                str(s["ckpt"]),
            ]
        )
        == 2
    )
    assert "adapter 'nope' is not given; add --lora nope=DIR" in capsys.readouterr().err


def test_run_batch_lines_name_their_adapter(served, tmp_path):
    """``aotlm run-batch --lora NAME=DIR``: a line's body ``model`` picks the adapter, as on the server."""
    s, prompt = served, list(range(20, 36))
    body = lambda m: {"model": m, "prompt": prompt, "max_tokens": 8, "temperature": 0}  # noqa: E731
    url = "/v1/completions"
    lines = [{"custom_id": m, "method": "POST", "url": url, "body": body(m)} for m in ("sql", "x")]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in lines))
    args = ["run-batch", str(s["ckpt"]), "-i", str(src), "-o", str(out), "--served-model-name", "x",
            "--lora", f"sql={s['paths']['sql']}", "--max-lora-rank", "8", "--batch-size", "2",
            "--n-positions", "64", "--no-warmup", "--quiet"]  # fmt: skip
    assert main(args) == 0
    got = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    for m, adapter in (("sql", "sql"), ("x", None)):
        assert got[m]["status_code"] == 200 and got[m]["body"]["model"] == m
        assert got[m]["body"]["choices"][0]["text"] == expected(s, prompt, adapter, n=8)
    assert got["sql"]["body"]["choices"][0]["text"] != got["x"]["body"]["choices"][0]["text"]


class _SlowSlots:
    """A model's adapter slots whose changes take a while; an engine that runs changes one at a time."""

    def __init__(self):
        self.adapters: dict[str, str] = {}
        self._lock = threading.Lock()

    def load_adapter(self, name, path):
        time.sleep(0.3)
        self.adapters[name] = path

    def unload_adapter(self, name):
        time.sleep(0.3)
        del self.adapters[name]

    def change_adapter(self, name, change):
        with self._lock:
            return change()


def _try(fn, body):
    try:
        return fn(body)
    except APIError as e:
        return e


def test_concurrent_changes_of_one_name_check_each_others_result(tmp_path):
    slots = _SlowSlots()
    adapters = Adapters(slots, slots, "base")
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with ThreadPoolExecutor(2) as pool:
        bodies = [{"lora_name": "new", "lora_path": str(tmp_path / d)} for d in "ab"]
        got = list(pool.map(lambda b: _try(adapters.load, b), bodies))
    errors = [r for r in got if isinstance(r, APIError)]
    assert len(errors) == 1 and "already loaded" in errors[0].message, got
    winner = "a" if errors[0] is got[1] else "b"
    assert slots.adapters == {"new": str(tmp_path / winner)}  # the second did not replace the first
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: _try(adapters.unload, {"lora_name": "new"}), range(2)))
    assert sorted(getattr(r, "status", 200) for r in got) == [200, 404] and slots.adapters == {}
