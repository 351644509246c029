"""``aotlm.pipeline`` with chats (lists of role/content messages) against transformers' pipeline:
the same rendered prompts, the same answers, the same output shapes."""

from __future__ import annotations

import pytest
from textkit import PIPE_SHAPES, chat_checkpoint, text_pipes

import aotlm

CHATS = [
    [{"role": "user", "content": "def fibonacci(n):"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}],
    [{"role": "user", "content": "x ="}, {"role": "assistant", "content": "1 + "}],  # continued
]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    return text_pipes(*chat_checkpoint(tmp_path_factory))


def test_chats_equal_transformers(pipes):
    ours, ref = pipes
    kw = dict(max_new_tokens=6)
    for full in (None, False, True):
        opt = {} if full is None else {"return_full_text": full}
        want = ref(CHATS, do_sample=False, **kw, **opt)
        assert ours(CHATS, **kw, **opt) == want
        assert ours(CHATS[0], **kw, **opt) == ref(CHATS[0], do_sample=False, **kw, **opt)  # one chat
    (answer,) = ours(CHATS[:1], **kw)[0]
    assert answer["generated_text"][:-1] == CHATS[0] and answer["generated_text"][-1]["role"] == "assistant"
    (prefilled,) = ours(CHATS[2], **kw)
    assert len(prefilled["generated_text"]) == 2
    assert prefilled["generated_text"][-1]["content"].startswith("1 + ")
    # continue_final_message=False answers the assistant's message with a new one, as transformers does
    opt = dict(continue_final_message=False, **kw)
    assert ours(CHATS[2], **opt) == ref(CHATS[2], do_sample=False, **opt)
    assert ours(iter(CHATS), **kw) == ours(CHATS, **kw)  # a generator of chats
    copies = ours(CHATS[:2], num_return_sequences=2, do_sample=True, seed=1, **kw)  # each chat, twice
    assert [[r["generated_text"][:-1] for r in rs] for rs in copies] == [[c, c] for c in CHATS[:2]]


def test_text_prompts_default_to_the_full_text_as_transformers(pipes):
    ours, ref = pipes
    kw = dict(max_new_tokens=5)
    got = ours(["def f(x):", "import os"], **kw)
    assert got == ref(["def f(x):", "import os"], do_sample=False, **kw)
    assert got[0][0]["generated_text"].startswith("def f(x):")
    assert ours((p for p in ["def f(x):", "import os"]), **kw) == got  # a generator of prompts


def test_bad_chat_inputs_say_what_to_give(pipes, tmp_path_factory):
    ours, _ = pipes
    with pytest.raises(ValueError, match=r"message 1 is not a \{'role', 'content'\} dict"):
        ours([{"role": "user", "content": "hi"}, {"role": "assistant"}], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"message 0 of chat 1 is not a"):
        ours([CHATS[0], [{"content": "hi"}]], max_new_tokens=2)
    with pytest.raises(TypeError, match="text_inputs must be a string, .* got int"):
        ours(5, max_new_tokens=2)
    with pytest.raises(TypeError, match="got a list holding NoneType"):
        ours(["a", None], max_new_tokens=2)
    from textkit import shared_text_checkpoint

    base, cache = shared_text_checkpoint(tmp_path_factory)  # the same model without a template
    plain = aotlm.pipeline("text-generation", model=str(base), compile_cache=str(cache), **PIPE_SHAPES)
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        plain(CHATS[0], max_new_tokens=2)
