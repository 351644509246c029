"""``--chat-template`` and ``--chat-template-kwargs`` (``aotlm.cli.templates``): files, inline
templates and JSON variables, each refused with one line when it cannot work."""

from __future__ import annotations

import pytest
from textkit import CHAT_TEMPLATE, make_tokenizer

from aotlm.cli.templates import template_variables, use_template


@pytest.fixture()
def tok(tmp_path):
    return make_tokenizer(tmp_path / "tok")


def test_a_template_from_a_file_or_its_text(tok, tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    path = tmp_path / "t.jinja"
    path.write_text(CHAT_TEMPLATE, encoding="utf-8")
    use_template(tok, str(path))
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == "u:hi\na:"
    use_template(tok, "{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert tok.apply_chat_template(chat, tokenize=False) == "<hi>"
    use_template(tok, None)  # no flag: the tokenizer's stays
    assert tok.apply_chat_template(chat, tokenize=False) == "<hi>"


def test_bad_templates_are_one_line(tok, tmp_path):
    with pytest.raises(ValueError, match="'no-such.jinja': no such file, nor a Jinja template"):
        use_template(tok, "no-such.jinja")
    with pytest.raises(ValueError, match="does not render a one-message chat"):
        use_template(tok, "{% for m in messages %}")  # unclosed
    with pytest.raises(ValueError, match="does not render a one-message chat: .*no"):
        use_template(tok, "{{ raise_exception('no') }}")
    assert tok.chat_template is None  # a refused template is not kept


def test_template_variables():
    assert template_variables(None) == {}
    assert template_variables('{"enable_thinking": false}') == {"enable_thinking": False}
    for bad, why in [
        ("[1]", "must be a JSON object"),
        ("{x", "is not JSON"),
        ('{"tools": 1}', r"\['tools'\]"),
    ]:
        with pytest.raises(ValueError, match=why):
            template_variables(bad)
