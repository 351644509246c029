"""The bundled model's ``generation_config.json``: transformers loads it, aotlm's sampler takes it,
and it does what ``scripts/tune_generation_defaults.py`` chose it for (on held-out prompts it
repeats itself less than greedy decoding does).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from aotlm import AutoModelForSampling
from aotlm.generate.params import FIELDS
from aotlm.models.checkpoint.bundled import DEFAULT_MODEL, bundled_path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import tune_generation_defaults as tune  # noqa: E402

PATH = bundled_path(DEFAULT_MODEL)
PROMPTS, PROMPT_TOKENS, NEW = 8, 32, 64
# keys of the file that are not sample() arguments: bos is only for prompts, the version is metadata
NOT_SAMPLER = {"transformers_version", "bos_token_id"}


def _shipped() -> dict:
    return json.loads((PATH / "generation_config.json").read_text())


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(PATH))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return AutoModelForSampling.from_pretrained(
        PATH,
        batch_size=2 * PROMPTS,
        n_positions=[PROMPT_TOKENS + NEW],
        context_length_estimate=[PROMPT_TOKENS],
        compile_cache=str(tmp_path_factory.mktemp("gen_defaults_cache")),
    )


def test_transformers_loads_it_without_warnings(tok):
    from transformers import AutoConfig, GenerationConfig

    from aotlm.text import tokens

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = GenerationConfig.from_pretrained(str(PATH))
        cfg.validate(strict=True)  # raises on anything transformers would otherwise only warn about
    assert cfg.to_diff_dict() != GenerationConfig().to_diff_dict()  # it does set something
    hf_config = AutoConfig.from_pretrained(str(PATH))
    # one eos everywhere: this file, config.json, the tokenizer, and what aotlm's text layer reads
    assert cfg.eos_token_id == hf_config.eos_token_id == tok.eos_token_id
    assert tokens.eos_ids(PATH, hf_config, tok) == [tok.eos_token_id]
    assert cfg.pad_token_id == tok.pad_token_id
    assert 0 < cfg.max_new_tokens < hf_config.max_position_embeddings


def test_aotlm_sampler_takes_the_values(model, tok):
    shipped = _shipped()
    kwargs = {k: v for k, v in shipped.items() if k not in NOT_SAMPLER}
    assert set(kwargs) <= FIELDS, sorted(set(kwargs) - FIELDS)
    kwargs["max_new_tokens"] = NEW  # the shipped value is longer than this small model's positions
    ids = np.array([tok("def fibonacci(n):")["input_ids"]] * 2, np.int32)
    out = model.sample(ids, seed=0, **kwargs)
    assert out.shape[0] == 2 and ids.shape[1] < out.shape[1] <= ids.shape[1] + NEW
    assert ((out >= 0) & (out < model.cfg.vocab_size)).all()
    np.testing.assert_array_equal(out[:, : ids.shape[1]], ids)


def test_defaults_repeat_less_than_greedy(model, tok):
    prompts = tune.heldout_prompts(tok, PATH, PROMPTS, PROMPT_TOKENS, NEW, seed=0)
    if len(prompts) < PROMPTS:
        pytest.skip("the held-out stdlib files are not on this Python")
    keys = {"do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "no_repeat_ngram_size"}
    chosen = tune.Setting("shipped", {k: v for k, v in _shipped().items() if k in keys})
    greedy = tune.Setting("greedy", {})
    rows = [(i, st, 1000 + i) for st in (greedy, chosen) for i in range(len(prompts))]
    eos = tok.eos_token_id
    out = tune.generate(model, prompts, rows, NEW, eos)
    rep = {
        st.name: np.mean([tune.rep_n(s, 4) for s, r in zip(out, rows, strict=True) if r[1] is st])
        for st in (greedy, chosen)
    }
    assert rep["shipped"] < rep["greedy"] - 0.1, rep


def test_a_checkpoints_token_bans_are_defaults(tmp_path):
    from aotlm.text.defaults import sampling_defaults

    bans = {"suppress_tokens": [5], "begin_suppress_tokens": [6], "bad_words_ids": [[3, 4]]}
    (tmp_path / "generation_config.json").write_text(json.dumps({**bans, "output_scores": True}))
    got = sampling_defaults(tmp_path)
    assert {k: got[k] for k in bans} == bans and "output_scores" not in got
