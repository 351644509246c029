"""The pipeline's new-token counts (``aotlm.text.lengths``): transformers' order of length settings."""

from __future__ import annotations

import pytest

from aotlm.text.lengths import DEFAULT_MAX_NEW_TOKENS, Lengths


def test_counts_follow_the_call_then_the_checkpoint_then_256():
    plain = Lengths(n_positions=512)
    assert plain.new_tokens(0, 10, 7) == 7  # the call's max_new_tokens
    assert plain.new_tokens(0, 10, None, length=30) == 20  # its max_length counts the prompt
    assert plain.new_tokens(0, 10, None) == DEFAULT_MAX_NEW_TOKENS  # transformers' pipeline default
    assert plain.new_tokens(0, 500, None) == 12  # capped to the room the window leaves
    assert Lengths(512, default_new=40).new_tokens(0, 10, None) == 40
    assert Lengths(512, default_length=50).new_tokens(0, 10, None) == 40
    assert Lengths(512, default_length=50).new_tokens(0, 10, None, offset=3) == 43  # a prefix's tokens
    assert Lengths(512, default_length=50).new_tokens(0, 60, None) == 1  # one at least, as transformers


def test_counts_that_do_not_fit_are_refused_naming_the_prompt():
    m = Lengths(n_positions=64)
    with pytest.raises(ValueError, match="prompt 2 has 10 tokens, max_length=10 leaves no new one"):
        m.new_tokens(2, 10, None, length=10)
    with pytest.raises(ValueError, match="max_length=70 needs 70 positions .* n_positions=64"):
        m.new_tokens(0, 10, None, length=70)
    with pytest.raises(ValueError, match="prompt 1 has 64 tokens, which fills n_positions=64"):
        m.new_tokens(1, 64, None)
    with pytest.raises(ValueError, match="with max_new_tokens=60 it needs 70 positions"):
        m.new_tokens(0, 10, 60)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        m.new_tokens(0, 10, 0)
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        m.new_tokens(0, 10, 2.5)


def test_wanted_is_not_capped_by_the_room():
    m = Lengths(n_positions=64)
    assert m.wanted(0, 70, None, None) == DEFAULT_MAX_NEW_TOKENS
    assert m.wanted(0, 70, 6, None) == 6
    assert m.wanted(0, 70, None, 80) == 10
    assert Lengths(64, default_length=100).wanted(0, 70, None, None, offset=2) == 32
    with pytest.raises(ValueError, match="max_length=70 leaves no new one"):
        m.wanted(0, 70, None, 70)
