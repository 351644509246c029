"""The pipeline's call arguments: each read as transformers reads it, each wrong value named."""

from __future__ import annotations

import numpy as np
import pytest

from aotlm.text import call_args


def test_return_flags_exclude_each_other_as_transformers():
    assert call_args.return_type(None, None, None) == "full"
    assert call_args.return_type(False, None, None) == "new"
    assert call_args.return_type(None, True, None) == "full"
    assert call_args.return_type(None, None, True) == "ids"
    with pytest.raises(ValueError, match="return_full_text is mutually exclusive with return_tensors"):
        call_args.return_type(True, None, True)
    with pytest.raises(ValueError, match="return_text is mutually exclusive with return_tensors"):
        call_args.return_type(None, True, True)


def test_prompts_must_be_text():
    assert call_args.text_prompts(("a", "b")) == ["a", "b"]
    with pytest.raises(TypeError, match="got a list holding NoneType"):
        call_args.text_prompts(["a", None])
    with pytest.raises(TypeError, match="got int"):
        call_args.text_prompts(5)


def test_token_ids_and_counts_take_ints_only():
    assert call_args.token_ids(None, "eos_token_id", [2]) == [2]
    assert call_args.token_ids(np.int64(7), "eos_token_id", [2]) == [7]
    assert call_args.token_ids([3, 4], "eos_token_id", [2]) == [3, 4]
    for bad in ("3", [1.5], True, [True]):
        with pytest.raises(TypeError, match="eos_token_id must be a token id"):
            call_args.token_ids(bad, "eos_token_id", [2])
    assert call_args.pad_id(None) is None and call_args.pad_id(np.int32(0)) == 0
    with pytest.raises(TypeError, match="pad_token_id must be a token id"):
        call_args.pad_id([0])
    assert call_args.new_tokens(np.int64(3)) == 3 and call_args.new_tokens(None) is None
    for bad in (3.5, "3", True):
        with pytest.raises(TypeError, match="max_new_tokens must be an int"):
            call_args.new_tokens(bad)
    assert call_args.max_length(12) == 12
    for bad in (0, "12", 1.0):
        with pytest.raises(TypeError, match="max_length must be an int >= 1"):
            call_args.max_length(bad)


def test_copies_repeat_per_prompt_values_and_get_seeds_of_their_own():
    kw = {"max_new_tokens": [4, 5], "temperature": 0.7, "seed": 9}
    assert call_args.repeated(kw, 2, 1, sampling=False) is kw
    got = call_args.repeated(kw, 2, 3, sampling=True)
    assert got["max_new_tokens"] == [4, 4, 4, 5, 5, 5] and got["temperature"] == 0.7
    assert got["seed"] == [9, 10, 11, 9, 10, 11]  # copy j: seed + j, as sample(num_return_sequences=k)
    assert call_args.repeated({"seed": [1, 2**32 - 1]}, 2, 2, sampling=True)["seed"] == [1, 2, 2**32 - 1, 0]
    assert "seed" not in call_args.repeated({}, 1, 2, sampling=True)  # none given: each row draws one
    with pytest.raises(ValueError, match="greedy search does not support num_return_sequences"):
        call_args.repeated(kw, 2, 2, sampling=False)
    with pytest.raises(ValueError, match="max_new_tokens has 1 values for 2 prompts"):
        call_args.repeated({"max_new_tokens": [4]}, 2, 2, sampling=True)
    assert call_args.return_sequences({}) == 1
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="num_return_sequences must be an int >= 1"):
            call_args.return_sequences({"num_return_sequences": bad})


def test_a_generation_config_becomes_keywords_under_the_ones_given():
    import transformers

    from aotlm import GenerationConfig

    assert call_args.with_config({"top_k": 3}) == {"top_k": 3}
    ours = GenerationConfig(max_new_tokens=5, do_sample=True, seed=2)
    got = call_args.with_config({"generation_config": ours, "seed": 7, "top_p": None})
    assert got == {"max_new_tokens": 5, "do_sample": True, "seed": 7}
    theirs = transformers.GenerationConfig(max_new_tokens=5, num_beams=2, output_scores=True)
    assert call_args.with_config({"generation_config": theirs}) == {"max_new_tokens": 5, "num_beams": 2}
    with pytest.raises(
        TypeError, match="generation_config must be an aotlm.GenerationConfig or a transformers"
    ):
        call_args.with_config({"generation_config": {"max_new_tokens": 5}})
