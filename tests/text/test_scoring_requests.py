"""Scoring requests (``aotlm.text.scoring``) and ``aotlm score``: lm-eval's definitions, transformers'
numbers, the batch front ends' conventions, and the bundled model's held-out loss."""

import json
import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conformance import hf_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from textkit import shared_text_checkpoint

from aotlm import AutoModelForSampling
from aotlm.cli import main
from aotlm.models.checkpoint.bundled import DEFAULT_MODEL, bundled_path
from aotlm.text import scoring
from aotlm.text.tokens import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def hf_pair_logprob(model, ctx, cont) -> float:
    ids = torch.tensor([list(ctx) + list(cont)])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float(), -1)[0]
    n = len(cont)
    return float(lp[-n - 1 : -1].gather(-1, ids[0, -n:, None]).sum())


@pytest.mark.parametrize(
    "n,max_len,stride", [(1, 8, 8), (8, 8, 8), (9, 8, 8), (50, 8, 8), (50, 8, 3), (31, 16, 1)]
)
def test_rolling_windows_are_lm_evals(n, max_len, stride):
    toks = list(range(100, 100 + n))
    ref = [make_disjoint_window(w) for w in get_rolling_token_windows(toks, 7, max_len, max_len - stride + 1)]
    assert scoring.rolling_windows(toks, 7, max_len, stride) == [(list(a), list(b)) for a, b in ref]
    with pytest.raises(ValueError, match="stride"):
        scoring.rolling_windows(toks, 7, max_len, max_len + 1)


@pytest.fixture(scope="module")
def gpt2_scorer(gpt2_path):
    return AutoModelForSampling.from_pretrained(
        gpt2_path, batch_size=3, n_positions=64, context_length_estimate=[16, 32], scoring=True
    )


def test_loglikelihood_and_rolling_equal_transformers(gpt2_scorer, gpt2_path):
    hf = hf_model(gpt2_path)
    rng = np.random.default_rng(1)
    pairs = [(rng.integers(0, 101, c).tolist(), rng.integers(0, 101, k).tolist()) for c, k in
             [(5, 3), (1, 1), (30, 10), (70, 20), (3, 64)]]  # fmt: skip
    got = scoring.loglikelihood(gpt2_scorer, pairs)
    for (ctx, cont), (lp, _) in zip(pairs, got, strict=True):
        full = (ctx + cont)[-65:]  # n_positions + 1: left truncation, as lm-eval's hf backend
        assert lp == pytest.approx(hf_pair_logprob(hf, full[: len(full) - len(cont)], cont), abs=1e-3)
    text = rng.integers(0, 101, 150).tolist()
    for stride in (64, 24):
        want = sum(hf_pair_logprob(hf, a, b) for a, b in scoring.rolling_windows(text, 0, 64, stride))
        (lp,) = scoring.loglikelihood_rolling(gpt2_scorer, [text], 0, stride=stride)
        assert lp == pytest.approx(want, abs=2e-3)
    with pytest.raises(ValueError, match="request 0: empty context"):
        scoring.loglikelihood(gpt2_scorer, [([], [1])])
    with pytest.raises(ValueError, match="65 tokens does not fit"):
        scoring.loglikelihood(gpt2_scorer, [([1], [2] * 65)])


def test_encode_pair_moves_context_whitespace(tmp_path_factory):
    tok = load_tokenizer(str(shared_text_checkpoint(tmp_path_factory)[0]))
    ctx, cont = scoring.encode_pair(tok, "import os ", "import sys")
    assert tok.decode(ctx) == "import os" and tok.decode(cont) == " import sys"
    assert ctx + cont == tok("import os import sys")["input_ids"]
    assert scoring.encode_pair(tok, "", "x") == ([tok.eos_token_id], tok("x")["input_ids"])


def write(path: Path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def read(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


RECORDS = [
    {"text": "def fibonacci(n):\n    return n\n" * 6, "id": "a"},
    {"context": "import os\n", "continuation": "import sys\n"},
    {"input_ids": [0, 5, 6, 7, 8], "meta": {"k": 1}},
    {"text": ""},
    {"context_ids": [0, 1], "continuation_ids": [2] * 80},
    {"text": "class Point:\n    pass\n"},
]


def test_score_cli(tmp_path, tmp_path_factory, capsys):
    ckpt, cache = shared_text_checkpoint(tmp_path_factory)
    inp = write(tmp_path / "in.jsonl", RECORDS)
    flags = ["--model", str(ckpt), "--cache-dir", str(cache), "--batch-size", "2", "--max-length", "32"]
    out = tmp_path / "out.jsonl"
    assert main(["score", "--input", inp, "--output", str(out), "--dry-run", *flags]) == 0
    assert "records to score; nothing loaded" in capsys.readouterr().out and not out.exists()
    assert main(["score", "--input", inp, "--output", str(out), *flags, "--quiet"]) == 0
    recs = read(out)
    assert [r["input_line"] for r in recs] == [1, 2, 3, 4, 5, 6] and recs[0]["id"] == "a"
    assert recs[3]["error"] == "ValueError: empty text: nothing to score"
    assert "does not fit n_positions=64" in recs[4]["error"] and recs[2]["meta"] == {"k": 1}
    # the numbers are the Python API's
    model = AutoModelForSampling.from_pretrained(ckpt, batch_size=2, compile_cache=cache, scoring=True)
    tok = load_tokenizer(str(ckpt))
    text = scoring.perplexity(model, tok, [RECORDS[0]["text"]], max_len=32)[0]
    assert recs[0]["tokens"] == text.tokens > 32 and recs[0]["logprob"] == pytest.approx(
        text.logprob, abs=1e-6
    )
    assert recs[0]["perplexity"] == pytest.approx(text.perplexity)
    pair = scoring.loglikelihood(model, [scoring.encode_pair(tok, "import os\n", "import sys\n")])[0]
    assert (recs[1]["logprob"], recs[1]["is_greedy"]) == pytest.approx(pair)
    (ids,) = scoring.loglikelihood(model, [([0], [5, 6, 7, 8])])
    assert recs[2]["tokens"] == 4 and recs[2]["logprob"] == pytest.approx(ids[0])
    full = out.read_bytes()
    # resume: a torn tail and missing records are completed; the result is the same file
    lines = full.splitlines(keepends=True)
    out.write_bytes(lines[0] + lines[2] + lines[3][:10])
    assert main(["score", "--input", inp, "--output", str(out), *flags, "--resume", "--quiet"]) == 0
    assert out.read_bytes() == full
    # shards re-joined by batch-merge equal the whole run
    parts = [str(tmp_path / f"part{i}.jsonl") for i in range(2)]
    for i, part in enumerate(parts):
        assert main(["score", "--input", inp, "--output", part, *flags, "--shard", f"{i}/2", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["batch-merge", "--output", str(tmp_path / "merged.jsonl"), *parts]) == 0
    assert (tmp_path / "merged.jsonl").read_bytes() == full
    assert "6 records from 2 files written" in capsys.readouterr().out
    one = write(tmp_path / "one.jsonl", RECORDS[:1])
    assert main(["score", "--input", one, "--output", str(tmp_path / "one_out.jsonl"), *flags]) == 0
    printed = capsys.readouterr().out  # counts with their nouns: no "1 records"
    assert "1 record scored into" in printed and "texts: 1 record, " in printed, printed


def test_score_cli_errors(tmp_path, tmp_path_factory, capsys):
    ckpt, cache = shared_text_checkpoint(tmp_path_factory)
    flags = ["--model", str(ckpt), "--cache-dir", str(cache)]
    out = str(tmp_path / "out.jsonl")
    cases = [
        (['{"text": "a"}', "{not json"], "line 2: invalid JSON"),
        ([{"text": "a", "prompt": "b"}], "unknown field(s) ['prompt']"),
        ([{"context": "a"}], "exactly one of"),
        ([{"input_ids": [1, 99999]}], "outside the vocabulary"),
        ([{"text": 3}], "'text' must be a string"),
    ]
    for records, msg in cases:
        assert (
            main(["score", "--input", write(tmp_path / "bad.jsonl", records), "--output", out, *flags]) == 2
        )
        assert msg in capsys.readouterr().err
    inp = write(tmp_path / "in.jsonl", [{"text": "a b"}])
    Path(out).write_text('{"x": 1}\n')
    assert main(["score", "--input", inp, "--output", out, *flags]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(["score", "--input", inp, "--output", out, *flags, "--overwrite", "--stride", "999"]) == 2
    assert "--stride must be in" in capsys.readouterr().err
    for flag in ("--max-length", "--stride"):  # 0 is not "the default"
        assert main(["score", "--input", inp, "--output", out, *flags, "--overwrite", flag, "0"]) == 2
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(
    platform.python_version() != "3.11.7", reason="the model card's stdlib is Python 3.11.7's"
)
def test_bundled_model_heldout_loss_reproduced(tmp_path):
    """``aotlm score`` over the model card's held-out windows gives its held-out loss (0.01 nats)."""
    import score_heldout

    info = json.loads((bundled_path(DEFAULT_MODEL) / "training.json").read_text())
    w = score_heldout.windows(score_heldout.heldout_texts(info), info["eval_tokens"] // score_heldout.SEQ)
    inp = write(tmp_path / "w.jsonl", [{"input_ids": x.tolist()} for x in w])
    assert (
        main(["score", "--input", inp, "--output", str(tmp_path / "s.jsonl"), "--batch-size", "8", "--quiet"])
        == 0
    )
    recs = read(tmp_path / "s.jsonl")
    assert sum(r["tokens"] for r in recs) == info["eval_tokens"]
    assert score_heldout.mean_nats(recs) == pytest.approx(info["heldout_loss"], abs=0.01)
