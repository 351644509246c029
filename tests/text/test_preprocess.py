"""The pipeline's prompt options (``prefix``, ``handle_long_generation``, ``truncation``, ``padding``,
``tokenizer_encode_kwargs``, ``documents``) against transformers' text-generation pipeline, and
the helpers of ``aotlm.text.preprocess`` on their own."""

from __future__ import annotations

import pytest
from textkit import chat_checkpoint, text_pipes

from aotlm.text import preprocess

PROMPT = "def fibonacci(n):\n    return"


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    return text_pipes(*chat_checkpoint(tmp_path_factory))


def fresh(ref):
    """A transformers pipeline of its own per call: one keeps the keywords of every call for the next."""
    import transformers

    return transformers.pipeline("text-generation", model=ref.model, tokenizer=ref.tokenizer)


def test_prefix_as_transformers(pipes, monkeypatch):
    ours, ref = pipes
    prefix = "import os\n"
    n = len(ours.tokenizer(prefix + PROMPT)["input_ids"])
    for kw in (
        dict(max_new_tokens=5),
        dict(max_new_tokens=5, return_tensors=True),  # the ids hold the prefix's tokens
        dict(max_length=n + 3),  # a total length counts the prefix too
        dict(max_new_tokens=4, return_full_text=False),
    ):
        want = fresh(ref)([PROMPT, "x ="], prefix=prefix, do_sample=False, **kw)
        assert ours([PROMPT, "x ="], prefix=prefix, **kw) == want, kw
    own = len(ours.tokenizer(PROMPT)["input_ids"])  # max_length counts the prompt as given, then new tokens
    (g,) = ours.generate([PROMPT], prefix=prefix, max_length=own + 3)
    assert len(g.tokens) == 3 and g.prompt == PROMPT and g.prompt_tokens == n
    seen = []
    real = ours.model.sample
    monkeypatch.setattr(ours.model, "sample", lambda ids, **k: seen.append(k["min_length"]) or real(ids, **k))
    (g,) = ours.generate([PROMPT], prefix=prefix, min_length=9, max_new_tokens=2)
    assert seen == [9 + n - own]
    with pytest.raises(ValueError, match="prefix goes before a text prompt; begin a chat with a system"):
        ours([{"role": "user", "content": "hi"}], prefix=prefix, max_new_tokens=2)
    with pytest.raises(TypeError, match="prefix must be a string, got int"):
        ours(PROMPT, prefix=3, max_new_tokens=2)


def test_hole_cuts_a_long_prompt_as_transformers(pipes):
    ours, ref = pipes
    long = PROMPT * 10  # 70 tokens, over the 64 positions
    theirs = fresh(ref)
    theirs.tokenizer.model_max_length, was = ours.model.n_positions, theirs.tokenizer.model_max_length
    try:
        for kw in (dict(max_new_tokens=6), dict(max_new_tokens=6, return_tensors=True)):
            want = theirs(long, handle_long_generation="hole", do_sample=False, **kw)
            assert ours(long, handle_long_generation="hole", **kw) == want, kw
    finally:
        theirs.tokenizer.model_max_length = was
    (g,) = ours.generate([long], handle_long_generation="hole", max_new_tokens=6)
    assert g.prompt_tokens == 58 and len(g.tokens) <= 6
    (g,) = ours.generate([long], handle_long_generation="hole", max_length=80)  # 10 new: the prompt's 54 last
    assert g.prompt_tokens == 54
    (g,) = ours.generate([PROMPT], handle_long_generation="hole", max_new_tokens=6)  # fits: not cut
    assert g.prompt_tokens == len(ours.tokenizer(PROMPT)["input_ids"])
    with pytest.raises(ValueError, match="prompt 0: handle_long_generation='hole' cannot fit 256 new tokens"):
        ours(long, handle_long_generation="hole")
    with pytest.raises(ValueError, match="handle_long_generation='left' is not a valid value; give None or"):
        ours(long, handle_long_generation="left", max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0 has 70 tokens; with max_new_tokens=2 it needs 72"):
        ours(long, max_new_tokens=2)  # without hole: refused


def test_tokenizer_options_as_transformers(pipes):
    ours, ref = pipes
    for kw in (
        dict(tokenizer_encode_kwargs={"truncation": True, "max_length": 4}, max_new_tokens=3),
        dict(padding="max_length", tokenizer_encode_kwargs={"max_length": 20}, max_new_tokens=3),  # no pads
        dict(padding=True, max_new_tokens=3),
        dict(tokenizer_encode_kwargs={"add_special_tokens": False}, max_new_tokens=3),
    ):
        assert ours(PROMPT, **kw) == fresh(ref)(PROMPT, do_sample=False, **kw), kw
    (g,) = ours.generate([PROMPT], tokenizer_kwargs={"truncation": True, "max_length": 4}, max_new_tokens=3)
    assert g.prompt_tokens == 4
    for fn in (ours, fresh(ref)):  # truncated to max_length itself: no room left, refused by both
        with pytest.raises(ValueError, match="max_length"):
            fn(PROMPT, truncation=True, max_length=4, do_sample=False)
    with pytest.raises(TypeError, match=r"tokenizer_encode_kwargs does not take \['return_tensors'\]"):
        ours(PROMPT, tokenizer_encode_kwargs={"return_tensors": "pt"}, max_new_tokens=2)


def test_documents_go_to_the_chat_template(pipes):
    ours, ref = pipes
    chat = [{"role": "user", "content": "def f(x):"}]
    docs = [{"title": "a", "text": "x = 1"}]
    kw = dict(documents=docs, max_new_tokens=4)
    assert ours(chat, **kw) == fresh(ref)(chat, do_sample=False, **kw)
    render = ours.tokenizer.apply_chat_template
    rendered = render(chat, tokenize=False, add_generation_prompt=True, documents=docs)
    assert rendered.startswith("d:x = 1\n")
    (g,) = ours.generate([rendered], add_special_tokens=False, max_new_tokens=4)
    assert ours(chat, return_full_text=False, **kw)[0]["generated_text"] == g.text
    kw = dict(tokenizer_encode_kwargs={"flag": True}, max_new_tokens=4)  # a template variable
    assert ours(chat, **kw) == fresh(ref)(chat, do_sample=False, **kw)
    flagged = render(chat, tokenize=False, add_generation_prompt=True, flag=True)
    assert flagged.endswith("a:F!")
    (g,) = ours.generate([flagged], add_special_tokens=False, max_new_tokens=4)
    assert ours(chat, return_full_text=False, **kw)[0]["generated_text"] == g.text
    with pytest.raises(ValueError, match="tools and documents go to a chat template: give the prompt as a"):
        ours(PROMPT, documents=docs, max_new_tokens=2)


def test_tokenizer_kwargs_as_transformers_builds_them():
    assert preprocess.tokenizer_kwargs(None, None, 12, None) == ({}, {})
    assert preprocess.tokenizer_kwargs(True, None, 12, None) == ({"truncation": True, "max_length": 12}, {})
    got, _ = preprocess.tokenizer_kwargs(False, "longest", 12, None)
    assert got == {"truncation": False, "padding": "longest"}
    got, _ = preprocess.tokenizer_kwargs(True, None, 12, {"max_length": 5, "split_special_tokens": True})
    assert got == {"truncation": True, "max_length": 5, "split_special_tokens": True}
    given = {"enable_thinking": False, "truncation": True}
    got = preprocess.tokenizer_kwargs(None, None, None, given, chat=True)
    assert got == ({"truncation": True}, {"enable_thinking": False})  # a chat template's variable
    with pytest.raises(TypeError, match="tokenizer_encode_kwargs must be a dict, got list"):
        preprocess.tokenizer_kwargs(None, None, None, ["truncation"])
    with pytest.raises(TypeError, match=r"does not take \['truncate'\] with text prompts; it takes: \['ad"):
        preprocess.tokenizer_kwargs(None, None, None, {"truncate": True})
    with pytest.raises(TypeError, match=r"may not set \['tools'\]: the pipeline's own arguments set them"):
        preprocess.tokenizer_kwargs(None, None, None, {"tools": []}, chat=True)


def test_hole_and_shifted():
    assert preprocess.hole_check(None) is False and preprocess.hole_check("hole") is True
    assert preprocess.hole([[1, 2, 3, 4, 5], [6, 7]], [3, 3], 6) == [[3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="prompt 1: handle_long_generation='hole' cannot fit 6 new tokens"):
        preprocess.hole([[1], [2]], [3, 6], 6)
    assert preprocess.shifted({"min_length": 5}, 2) == {"min_length": 7}
    assert preprocess.shifted({"min_length": [5, None, 6]}, 2) == {"min_length": [7, None, 8]}
    assert preprocess.shifted({"min_length": 5, "min_new_tokens": 1}, 2)["min_length"] == 5
    assert preprocess.shifted({"min_length": True}, 2) == {"min_length": True}  # left to sample()'s check
    assert preprocess.shifted({"top_k": 3}, 2) == {"top_k": 3}
