"""``aotlm chat`` as a user runs it: one-shot, piped multi-turn, /reset, trimming, base models."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from textkit import chat_checkpoint, shared_text_checkpoint

READY = re.compile(r"aotlm: \d+ graphs? ready in [\d.]+s \(\d+ from the compile cache at ")
STATS = re.compile(r"\[(\d+) tokens, [\d.]+ tok/s, first token [\d.]+s, prompt (\d+) tokens, (\w+)\]")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The shared tiny text checkpoint with a chat template, and the shared compile cache."""
    return chat_checkpoint(tmp_path_factory)


def chat(
    model, cache, *args, stdin: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    cmd = [sys.executable, "-m", "aotlm.cli", "chat", "--model", str(model), "--cache-dir", str(cache)]
    return subprocess.run(
        [*cmd, "--greedy", *args], input=stdin or "", capture_output=True, text=True, env=env, timeout=600
    )


def test_one_shot_answer_is_the_greedy_generation_of_the_rendered_template(chat_model):
    from transformers import AutoTokenizer

    from aotlm.text.pipeline import pipeline

    path, cache = chat_model
    r = chat(path, cache, "--system", "Be brief.", "--max-new-tokens", "6", "def fibonacci(n):")
    assert r.returncode == 0, r.stderr
    tok = AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def fibonacci(n):"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pipe = pipeline(model=str(path), batch_size=1, n_positions=64, compile_cache=str(cache), progress=False)
    want = pipe.generate([prompt], max_new_tokens=6, add_special_tokens=False, do_sample=False)[0]
    assert r.stdout == want.text + "\n"
    (stats,) = STATS.findall(r.stderr)
    assert int(stats[1]) == len(tok(prompt, add_special_tokens=False)["input_ids"])


def test_piped_turns_keep_history_and_reset_forgets_it(chat_model):
    path, cache = chat_model
    r = chat(path, cache, "--max-new-tokens", "4", stdin="import os\nx = 1\n/reset\nimport os\n")
    assert r.returncode == 0, r.stderr
    stats = [(int(n), int(p)) for n, p, _ in STATS.findall(r.stderr)]
    assert len(stats) == 3 and "conversation reset" in r.stderr
    (new1, p1), (_, p2), (_, p3) = stats
    assert p2 > p1 + new1  # turn 2's prompt holds turn 1 and its answer
    assert p3 == p1  # after /reset the same message is the same prompt
    answers = r.stdout.splitlines()
    assert answers[0] == answers[-1]  # ... and greedy gives the same answer
    # a line when a turn compiles (or loads) graphs, none when it needs no new one (turn 3's are turn 1's)
    ready = [m.end() for m in READY.finditer(r.stderr)]
    second = [m.end() for m in STATS.finditer(r.stderr)][1]
    assert ready and ready[0] < r.stderr.index("[") and ready[-1] < second


def test_pipeline_stages_answer_as_one_stage(chat_model):
    path, cache = chat_model
    one = chat(path, cache, "--max-new-tokens", "4", "import os")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    two = chat(path, cache, "--max-new-tokens", "4", "--pp-degree", "2", "import os", env=env)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert two.stdout == one.stdout and READY.search(two.stderr)


def test_quiet_prints_only_the_answer(chat_model):
    path, cache = chat_model
    r = chat(path, cache, "--quiet", "--max-new-tokens", "4", "import os")
    assert r.returncode == 0 and r.stdout.strip()
    assert not READY.search(r.stderr) and not STATS.search(r.stderr)


def test_trims_the_oldest_turns_to_fit_the_window(chat_model):
    path, cache = chat_model
    turns = "".join(f"print({i})\n" for i in range(6))
    r = chat(path, cache, "--max-new-tokens", "4", stdin=turns)
    assert r.returncode == 0, r.stderr
    assert "dropped the oldest turn" in r.stderr
    prompts = [int(p) for _, p, _ in STATS.findall(r.stderr)]
    assert len(prompts) == 6 and max(prompts) + 4 <= 64


def test_message_longer_than_the_window_is_one_error_line(chat_model):
    path, cache = chat_model
    r = chat(path, cache, "--max-new-tokens", "4", "x = 1\n" * 40)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("aotlm chat: error: this message needs")


def test_base_model_without_template_points_at_generate(chat_model, tmp_path_factory):
    base, cache = shared_text_checkpoint(tmp_path_factory)  # the same model, no chat template
    r = chat(base, cache, "hello")
    assert r.returncode == 2
    assert "has no chat template" in r.stderr and "aotlm generate" in r.stderr
    assert "Traceback" not in r.stderr


def test_an_empty_system_prompt_is_a_message_and_survives_reset():
    from aotlm.cli.chat import Conversation

    assert Conversation().messages() == []
    c = Conversation("")  # --system '': an empty system message, as transformers renders it
    c.turns.append({"role": "user", "content": "hi"})
    c.reset()
    assert c.messages() == [{"role": "system", "content": ""}]


def test_chat_template_kwargs_are_the_templates_variables(chat_model):
    from transformers import AutoTokenizer

    from aotlm.text.pipeline import pipeline

    path, cache = chat_model
    r = chat(path, cache, "--chat-template-kwargs", '{"flag": true}', "--max-new-tokens", "5", "import os")
    assert r.returncode == 0, r.stderr
    tok = AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "user", "content": "import os"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, flag=True)
    assert prompt.endswith("a:F!")  # the variable reached the template
    pipe = pipeline(model=str(path), batch_size=1, n_positions=64, compile_cache=str(cache), progress=False)
    want = pipe.generate([prompt], max_new_tokens=5, add_special_tokens=False, do_sample=False)[0]
    assert r.stdout == want.text + "\n"
    r = chat(path, cache, "--chat-template-kwargs", "[1]", "hi")
    assert r.returncode == 2 and "must be a JSON object" in r.stderr and "Traceback" not in r.stderr


def test_a_chat_template_flag_makes_a_base_model_chat(chat_model, tmp_path_factory):
    from textkit import CHAT_TEMPLATE

    base, cache = shared_text_checkpoint(tmp_path_factory)  # no chat template of its own
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    path, _ = chat_model  # the same model with this template in its tokenizer
    got = chat(base, cache, "--chat-template", str(template), "--max-new-tokens", "5", "import os")
    want = chat(path, cache, "--max-new-tokens", "5", "import os")
    assert got.returncode == 0 and got.stdout == want.stdout, got.stderr
    r = chat(base, cache, "--chat-template", "{% for %}", "hi")
    assert r.returncode == 2 and "does not render" in r.stderr and "Traceback" not in r.stderr
