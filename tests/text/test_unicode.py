"""Lone UTF-16 surrogates (valid JSON escapes, or argv bytes that are not UTF-8) are named where
they are, before a tokenizer's TypeError that names neither the input nor the fix."""

import pytest
from textkit import make_tokenizer

from aotlm.text.tokens import encode
from aotlm.text.unicode import check_text, lone_surrogate


def test_lone_surrogate_names_the_path():
    assert lone_surrogate({"prompt": "ok", "stop": ["a", "b\ud800"]}) == "stop[1]"
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}
    assert lone_surrogate(body) == "messages[0].content[0].text"
    assert lone_surrogate("x\ud83d", "prompt") == "prompt"
    assert lone_surrogate({"prompt": "h\u00e9llo \U0001f600", "n": 2, "x": None}) is None  # JSON's pair


def test_encode_and_check_text_say_which_text(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError, match="prompt 1 holds a lone UTF-16 surrogate .* give valid Unicode"):
        encode(tok, ["fine", "bad \udcff bytes"])
    assert len(encode(tok, ["\U0001f600"])[0]) > 0
    with pytest.raises(ValueError, match="^stop string 0 holds"):
        check_text("\ud800", "stop string 0")
