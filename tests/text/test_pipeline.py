"""Text in, text out: checkpoint resolution, tokenizers, streaming detokenization and
``aotlm.pipeline`` against transformers' own text-generation pipeline."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from textkit import PIPE_SHAPES, make_tokenizer, shared_text_checkpoint, text_pipes

import aotlm
from aotlm.models.checkpoint import CheckpointError
from aotlm.models.checkpoint.resolve import resolve
from aotlm.text.tokens import IncrementalDecoder, TextStreamer, left_pad

PROMPTS = [
    "def fibonacci(n):",
    "import os",
    "for i in range(10):\n    print(i, 'héllo wörld')",
    "x",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x",
    "# 日本語のコメント",
    "value = {'key': [1,",
    "naïve café",
    "return fibonacci(n - 1) + fibonacci(n - 2)",
    "if n < 2:",
]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return shared_text_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def pipes(shared):
    return text_pipes(*shared)


@pytest.mark.parametrize("n", [1, 10])
def test_pipeline_equals_transformers(pipes, n):
    ours, ref = pipes
    prompts = PROMPTS[:n]
    for full in (False, True):
        kw = dict(max_new_tokens=12, return_full_text=full)
        want = ref(prompts, do_sample=False, **kw)
        got = ours(prompts, **kw)
        assert got == want
        floor = [len(p) if full else 0 for p in prompts]
        assert all(len(g[0]["generated_text"]) > f for g, f in zip(got, floor, strict=True))
    # a single string is one list of candidates, as transformers returns it
    assert ours(PROMPTS[0], max_new_tokens=5) == ref(PROMPTS[0], max_new_tokens=5, do_sample=False)


def test_prompts_grouped_by_length_and_returned_in_order(pipes, monkeypatch):
    ours, _ = pipes
    calls = []
    real = ours.model.sample

    def spy(ids, **kw):
        calls.append(np.asarray(kw["attention_mask"]).sum(1).tolist())
        return real(ids, **kw)

    monkeypatch.setattr(ours.model, "sample", spy)
    gens = ours.generate(PROMPTS, max_new_tokens=3)
    assert [g.prompt for g in gens] == PROMPTS
    lengths = [len(ours.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert [g.prompt_tokens for g in gens] == lengths
    assert len(calls) == 3 and sum(map(len, calls)) == 10  # batches of the compiled size 4
    flat = [x for c in calls for x in c]
    assert flat == sorted(lengths)  # sorted by length: each batch spans the fewest buckets
    padding = sum(max(c) * len(c) - sum(c) for c in calls)
    in_order = [lengths[s : s + 4] for s in range(0, 10, 4)]
    assert padding < sum(max(c) * len(c) - sum(c) for c in in_order)


def test_pipeline_errors_name_the_prompt(pipes):
    ours, _ = pipes
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        ours(["ok", ""], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0 has .* n_positions=64"):
        ours(["def " * 40], max_new_tokens=40)
    with pytest.raises(ValueError, match="max_new_tokens has 1 values for 2 prompts"):
        ours(["a", "b"], max_new_tokens=[3])
    with pytest.raises(TypeError, match=r"does not take \['bogus'\]; it takes: \[.*'top_p'"):
        ours("a", max_new_tokens=2, bogus=1)
    with pytest.raises(TypeError, match=r"\['num_beams'\]; beam search: model.sample\(ids, num_beams=N\)"):
        ours("a", max_new_tokens=2, num_beams=2)
    with pytest.raises(
        TypeError, match=r"\['batch_size'\]; the batch size is compiled: .*pipeline\(\.\.\., batch_size=N\)"
    ):
        ours("a", max_new_tokens=2, batch_size=8)
    for bad in (3.5, "3", True):
        with pytest.raises(TypeError, match="max_new_tokens must be an int"):
            ours("a", max_new_tokens=bad)
    (g,) = ours.generate(["a"], max_new_tokens=np.int64(3))
    assert len(g.tokens) <= 3
    first = g.text[0]  # one stop string, not its characters (the first of which starts the text)
    (g,) = ours.generate(["a"], max_new_tokens=3, stop=first + "\u2603")
    assert g.finish_reason == "length" and g.text.startswith(first)


def test_max_length_counts_the_prompt_as_transformers(pipes):
    import transformers

    ours, shared_ref = pipes
    # its own transformers pipeline: a transformers pipeline keeps the keywords of every call for the next
    ref = transformers.pipeline("text-generation", model=shared_ref.model, tokenizer=shared_ref.tokenizer)
    n = len(ours.tokenizer(PROMPTS[0])["input_ids"])
    for length in (n + 1, n + 7):
        got = ours(PROMPTS[0], max_length=length)
        assert got == ref(PROMPTS[0], max_length=length, do_sample=False), length
    for fn in (ours, ref):  # no room left for a new token: refused by both
        with pytest.raises(ValueError, match="max_length"):
            fn(PROMPTS[0], max_length=n, do_sample=False)
    (g,) = ours.generate([PROMPTS[0]], max_length=n + 7)
    assert len(g.tokens) == 7
    with pytest.raises(ValueError, match="max_length=65 needs 65 positions .* n_positions=64"):
        ours(PROMPTS[0], max_length=65)
    with pytest.raises(TypeError, match="max_length must be an int >= 1"):
        ours(PROMPTS[0], max_length="12")


def test_incremental_decoder_never_splits_characters(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    text = "# 日本語のコメント ✓ — ünïcödé ∑ λ → ok\nvalue = 'naïve café'\n"
    ids = tok(text)["input_ids"]
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens hold part of a character
    dec = IncrementalDecoder(tok)
    pieces = [dec.push([t]) for t in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    assert sum(bool(p) for p in pieces) > 10  # text arrives as it is generated, not at the end

    seen = []
    streamer = TextStreamer(tok, on_text=seen.append)
    streamer.put(np.asarray([ids[:3]]))  # the prompt, as generate passes it: skipped
    for t in ids[3:]:
        streamer.put(np.asarray([t]))
    streamer.end()
    assert "".join(seen) == tok.decode(ids[3:]) == streamer.text


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_resolution_run_dirs_vars_and_validate(tmp_path, monkeypatch, shared):
    ckpt, _ = shared
    run = tmp_path / "run"
    for n in (2, 9, 10):
        shutil.copytree(ckpt, run / "checkpoints" / f"checkpoint-{n}")
    for f in (run / "checkpoints" / "checkpoint-10").glob("*token*"):
        shutil.move(str(f), run / f.name)  # the tokenizer only at the run root
    (run / "checkpoints" / "checkpoint-9" / "model.safetensors").unlink()
    monkeypatch.setenv("AOTLM_TEST_RUN", str(run))
    monkeypatch.setenv("HOME", str(tmp_path))
    latest = run / "checkpoints" / "checkpoint-10"  # numeric order: 10 after 9
    assert resolve("$AOTLM_TEST_RUN") == latest
    assert (
        resolve("~/run") == latest
        and resolve("${AOTLM_TEST_RUN}/checkpoints/checkpoint-2").name == "checkpoint-2"
    )
    files = aotlm.validate_checkpoint("~/run")
    assert files.checkpoint == latest and files.tokenizer == run and files.run == run
    assert files.config == latest / "config.json" and files.weights == (latest / "model.safetensors",)
    assert files.model_type == "llama"

    with pytest.raises(CheckpointError, match="AOTLM_NOT_SET_VAR, which is not set"):
        resolve("$AOTLM_NOT_SET_VAR/x")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no weights in .*checkpoint-9"):
        aotlm.validate_checkpoint(run / "checkpoints" / "checkpoint-9")
    for f in run.glob("*token*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no tokenizer found in .*checkpoint-10 or the run root"):
        aotlm.validate_checkpoint(run)
    assert (
        aotlm.validate_checkpoint(run, tokenizer="~/run/checkpoints/checkpoint-2").tokenizer.name
        == "checkpoint-2"
    )
    assert aotlm.validate_checkpoint(latest, require_tokenizer=False).tokenizer is None
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        resolve(tmp_path)
    idx = latest / "model.safetensors.index.json"
    idx.write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors .* is missing"):
        aotlm.validate_checkpoint(latest, require_tokenizer=False)


def test_model_accepts_a_run_dir(tmp_path, shared):
    ckpt, cache = shared
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / "checkpoint-3")
    model = aotlm.AutoModelForSampling.from_pretrained(run, compile_cache=str(cache), **PIPE_SHAPES)
    assert model.path == str(run / "checkpoints" / "checkpoint-3")


def test_bundled_name():
    try:
        import aotlm.models.checkpoint.bundled  # noqa: F401
    except ImportError:
        with pytest.raises(CheckpointError, match="bundled model 'aotlm/tiny-py' not installed"):
            resolve("aotlm/tiny-py")
    else:
        assert (resolve("aotlm/tiny-py") / "config.json").is_file()
    with pytest.raises(CheckpointError, match="not installed"):
        resolve("aotlm/no-such-model")


def test_pipeline_sampling_and_stop_text(pipes):
    ours, _ = pipes
    prompts = PROMPTS[:6]
    kw = dict(max_new_tokens=10, do_sample=True, top_k=20)
    a = ours(prompts, seed=7, temperature=[0.7, 0.8, 0.9, 1.0, 1.1, 1.2], **kw)
    assert a == ours(prompts, seed=7, temperature=[0.7, 0.8, 0.9, 1.0, 1.1, 1.2], **kw)  # seeded: repeatable
    assert a != ours(prompts, seed=8, temperature=1.5, **kw)
    # a stop text cuts the completion right after it (kept, as transformers' stop_strings do)
    tok = ours.tokenizer
    (greedy,) = ours.generate([PROMPTS[0]], max_new_tokens=12)
    g = greedy.tokens
    cut = next(i for i in range(3, len(g) - 1) if tok.encode(tok.decode(g[i : i + 2])) == g[i : i + 2])
    stop = tok.decode(g[cut : cut + 2])
    (stopped,) = ours.generate([PROMPTS[0]], max_new_tokens=12, stop=[stop])
    first = next(j for j in range(len(g)) if g[j : j + 2] == g[cut : cut + 2])  # its first occurrence
    assert stopped.finish_reason == "stop_sequence" and stopped.tokens == g[: first + 2]
    assert stopped.text.endswith(stop) and greedy.text.startswith(stopped.text)


def test_return_flags_and_stop_sequence_as_transformers(pipes):
    ours, ref = pipes
    kw = dict(max_new_tokens=6)
    for flags in (dict(return_tensors=True), dict(return_text=True), dict(return_full_text=False)):
        got = ours(PROMPTS[0], **kw, **flags)
        assert got == ref(PROMPTS[0], do_sample=False, **kw, **flags), flags
    (ids,) = ours(PROMPTS[0], return_tensors=True, **kw)
    assert (
        ids["generated_token_ids"][: len(ours.tokenizer(PROMPTS[0])["input_ids"])]
        == (ours.tokenizer(PROMPTS[0])["input_ids"])
    )
    (greedy,) = ours.generate([PROMPTS[0]], max_new_tokens=12)
    tok = ours.tokenizer
    for start in range(2, 9):  # stop texts across token boundaries and inside tokens, as transformers matches
        stop = greedy.text[start : start + 2]
        stopped = ours(PROMPTS[0], max_new_tokens=12, stop_sequence=stop)
        assert stopped == ref(PROMPTS[0], do_sample=False, max_new_tokens=12, stop_sequence=stop), stop
        assert len(stopped[0]["generated_text"]) < len(PROMPTS[0] + greedy.text)  # it did stop
    g = list(greedy.tokens)

    def spelt_alike(ids):  # the tokens hold the stop text's own encoding: a token match finds it
        return any(g[i : i + len(ids)] == ids for i in range(len(g)))

    assert not all(spelt_alike(tok.encode(greedy.text[s : s + 2])) for s in range(2, 9))
    with pytest.raises(ValueError, match="return_full_text is mutually exclusive with return_tensors"):
        ours(PROMPTS[0], return_full_text=True, return_tensors=True, **kw)
    with pytest.raises(ValueError, match="return_text is mutually exclusive with return_tensors"):
        ours(PROMPTS[0], return_text=True, return_tensors=True, **kw)
    with pytest.raises(TypeError, match="give stop or stop_sequence, not both"):
        ours(PROMPTS[0], stop=["a"], stop_sequence="b", **kw)


def test_a_stream_stops_at_a_stop_string_spelt_by_other_tokens(pipes):
    ours, _ = pipes
    (greedy,) = ours.generate([PROMPTS[0]], max_new_tokens=12)
    seen = []
    for start in range(2, 9):
        stop = greedy.text[start : start + 2]
        streamer = TextStreamer(ours.tokenizer, on_text=lambda _t: None)
        calls = []
        (g,) = ours.generate(
            [PROMPTS[0]],
            max_new_tokens=12,
            stop=[stop],
            streamer=streamer,
            stopping_criteria=lambda ids, scores, calls=calls: calls.append(len(ids[0])),
        )
        assert stop in g.text and g.finish_reason == "stop_sequence", stop
        assert streamer.text == g.text, stop  # the stream ended where the result is cut
        assert len(calls) <= len(g.tokens), stop  # the user's criterion ran too, no step past the stop
        seen.append(len(calls))
    assert max(seen) > 0


def test_prompt_lookup_gives_the_pipelines_text(pipes):
    ours, ref = pipes
    kw = dict(max_new_tokens=12)
    assert ours(PROMPTS[:4], prompt_lookup_num_tokens=3, **kw) == ours(PROMPTS[:4], **kw)
    lookup = dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=1)
    assert ours(PROMPTS[2], **lookup, **kw) == ref(PROMPTS[2], do_sample=False, **lookup, **kw)
    assert ours.model.last_speculative_stats["accepted"] > 0  # rounds took proposals
    # a stop text, a stream and finish reasons as without lookup
    (g,) = ours.generate([PROMPTS[2]], **kw)
    stop = g.text[len(g.text) // 2 :][:2]
    streamer = TextStreamer(ours.tokenizer, on_text=lambda _t: None)
    (a,) = ours.generate([PROMPTS[2]], stop=[stop], streamer=streamer, **lookup, **kw)
    (b,) = ours.generate([PROMPTS[2]], stop=[stop], **kw)
    assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)
    assert streamer.text == a.text and a.finish_reason == "stop_sequence"
    assert ours.model.last_speculative_stats["rounds"] > 0


def test_num_return_sequences_as_transformers(pipes):
    import transformers

    ours, shared_ref = pipes
    # its own transformers pipeline: a transformers pipeline keeps the keywords of every call for the next
    ref = transformers.pipeline("text-generation", model=shared_ref.model, tokenizer=shared_ref.tokenizer)
    for fn in (ours, ref):  # greedy copies would all be the same: refused by both
        with pytest.raises(ValueError, match="num_return_sequences"):
            fn(PROMPTS[0], num_return_sequences=2, max_new_tokens=4, do_sample=False)
    kw = dict(max_new_tokens=8, do_sample=True, seed=3)
    one = ours(PROMPTS[0], num_return_sequences=3, **kw)
    assert len(one) == 3 and len({r["generated_text"] for r in one}) == 3  # each copy its own seed
    theirs = ref(PROMPTS[0], num_return_sequences=3, max_new_tokens=8, do_sample=True)
    assert [sorted(r) for r in one] == [sorted(r) for r in theirs]  # the same shape: a record per copy
    many = ours(PROMPTS[:3], num_return_sequences=3, **kw)  # 9 rows over batches of the compiled size
    assert [len(r) for r in many] == [3, 3, 3] and many[0] == one  # seeded: the same per prompt
    assert all(r["generated_text"].startswith(p) for p, rs in zip(PROMPTS[:3], many, strict=True) for r in rs)
    assert ours(PROMPTS[:3], num_return_sequences=1, **kw) == [
        rs[:1] for rs in many
    ]  # copy 0: the seed given
    with pytest.raises(ValueError, match="num_return_sequences must be an int >= 1, got 0"):
        ours(PROMPTS[0], num_return_sequences=0, **kw)


def test_an_eos_given_to_a_call_ends_generation_as_transformers(pipes):
    import transformers

    ours, shared_ref = pipes
    ref = transformers.pipeline("text-generation", model=shared_ref.model, tokenizer=shared_ref.tokenizer)
    (greedy,) = ours.generate([PROMPTS[0]], max_new_tokens=8)
    t = greedy.tokens
    k = next(i for i in range(1, len(t)) if t[i] not in t[:i])
    eos = int(t[k])  # an ordinary token of the greedy text, first seen at k (it was silently ignored)
    for given in (eos, [999, eos]):
        got = ours(PROMPTS[0], max_new_tokens=8, eos_token_id=given)
        assert got == ref(PROMPTS[0], max_new_tokens=8, eos_token_id=given, do_sample=False), given
    (g,) = ours.generate([PROMPTS[0]], max_new_tokens=8, eos_token_id=eos, pad_token_id=1)
    assert g.tokens == t[: k + 1] and g.finish_reason == "eos"
    with pytest.raises(TypeError, match="eos_token_id must be a token id"):
        ours(PROMPTS[0], max_new_tokens=2, eos_token_id="2")


def test_a_generation_config_applies_as_transformers(pipes):
    import transformers

    ours, shared_ref = pipes
    ref = transformers.pipeline("text-generation", model=shared_ref.model, tokenizer=shared_ref.tokenizer)
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False)
    assert ours(PROMPTS[:2], generation_config=config) == ref(PROMPTS[:2], generation_config=config)
    (g,) = ours.generate([PROMPTS[0]], generation_config=aotlm.GenerationConfig(max_new_tokens=3))
    assert len(g.tokens) == 3  # it was overridden by the pipeline's default length
    (h,) = ours.generate(
        [PROMPTS[0]], max_new_tokens=4, generation_config=aotlm.GenerationConfig(max_new_tokens=3)
    )
    assert len(h.tokens) == 4  # a keyword given wins
