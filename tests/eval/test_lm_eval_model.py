"""The lm-evaluation-harness backend (``aotlm.eval``) against lm-eval's own ``hf`` backend.

One tiny random-init Llama with a BPE tokenizer (``textkit``), one offline multiple-choice task
(``lm_eval_task``), both backends on the same checkpoint in float32: the same accuracy and the same
per-choice log-likelihoods, rolling log-likelihoods over a text longer than the model, greedy
``generate_until`` equal to transformers' greedy ``generate`` cut at the stop string, the command
line end to end, and no compilation while requests are scored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_DATASETS_OFFLINE"] = "1"  # nothing is fetched: the task is a local JSON file
os.environ["HF_HUB_OFFLINE"] = "1"

lm_eval = pytest.importorskip("lm_eval")

from compile_counter import count_compiles  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval_task import TASK, write_task  # noqa: E402
from textkit import CORPUS, shared_text_checkpoint  # noqa: E402

import aotlm.eval  # noqa: E402
from aotlm.eval import LMEvalModel  # noqa: E402

N_POS, BATCH = 64, 4
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, Path]:
    return shared_text_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    return write_task(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def cli_run(ckpt, tasks, tmp_path_factory):
    """``python -m aotlm.eval`` on the task, started before the in-process backend is built: lm-eval's
    command line always indexes its thousands of built-in task files first (~17 s of one core),
    which then overlaps the other tests instead of adding to them."""
    (path, cache), out = ckpt, tmp_path_factory.mktemp("lm_eval_cli")
    env = {**os.environ, "XLA_FLAGS": os.environ.get("AOTLM_TEST_XLA_FLAGS", ""), "AOTLM_PROGRESS": "0"}
    model_args = f"pretrained={path},batch_size={BATCH},n_positions={N_POS},cache_dir={cache}"
    cmd = f"-m aotlm.eval --model aotlm --tasks {TASK} --include_path {tasks} --output_path {out / 'results'}"
    with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
        cmd = [sys.executable, *cmd.split(), "--model_args", model_args]
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=env)
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def aot(ckpt, cli_run) -> LMEvalModel:
    path, cache = ckpt  # every value a string, as lm-eval's --model_args hands them over
    return LMEvalModel(
        pretrained=str(path), batch_size=str(BATCH), n_positions=str(N_POS), cache_dir=str(cache)
    )


@pytest.fixture(scope="module")
def hf(ckpt):
    """lm-eval's own transformers backend, its context as long as aotlm's."""
    pytest.importorskip("accelerate")  # the hf backend imports it (lm-eval's [hf] extra)
    return get_model("hf")(
        pretrained=str(ckpt[0]), dtype="float32", device="cpu", max_length=N_POS, batch_size=BATCH
    )


def _evaluate(lm, tasks: Path) -> dict:
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_registered_next_to_lm_evals_own_models():
    """``--model aotlm`` resolves, and lm-eval's own models still do (its registry adds them only
    when it is empty, so registering first would hide them)."""
    assert get_model("aotlm") is LMEvalModel and aotlm.eval.MODEL_NAME == "aotlm"
    assert get_model("hf").__name__ == "HFLM"


def test_multiple_choice_task_equals_hf_backend(aot, hf, tasks):
    """Same accuracy, same log-likelihood of every choice (1e-4), same is_greedy flags."""
    ours, ref = _evaluate(aot, tasks), _evaluate(hf, tasks)
    assert ours["results"][TASK]["acc,none"] == ref["results"][TASK]["acc,none"]
    a, b = ours["samples"][TASK], ref["samples"][TASK]
    assert [s["arguments"] for s in a] == [s["arguments"] for s in b]
    for sa, sb in zip(a, b, strict=True):
        for (lp_a, g_a), (lp_b, g_b) in zip(sa["filtered_resps"], sb["filtered_resps"], strict=True):
            assert lp_a == pytest.approx(lp_b, abs=TOL) and g_a == g_b


def test_loglikelihood_requests_equal_hf_backend(aot, hf):
    """Edge cases of tokenizing a request, a pair longer than the model (left truncation) and a
    greedy continuation (is_greedy true), against the hf backend's numbers."""
    starts = ["def f", "import os\n", "class Point:", "for i in range(", "x = "]
    gen = _requests("generate_until", [(c, {"until": [], "max_gen_toks": 2}) for c in starts])
    greedy = list(zip(starts, aot.generate_until(gen), strict=True))  # some re-tokenize the same
    long_context = CORPUS[0] * 3  # > N_POS tokens: both backends keep the last ones
    args = greedy + [
        ("import os\n", "import sys"),
        ("for i in  ", "range(10):"),
        ("", "naïve café"),
        ("x", "\n"),
        (long_context, " return n"),
        ("import os\n", "import sys"),  # a duplicate is scored once and answered twice
    ]
    reqs = _requests("loglikelihood", args)
    ours, ref = aot.loglikelihood(reqs), hf.loglikelihood(reqs)
    for (lp_a, g_a), (lp_b, g_b) in zip(ours, ref, strict=True):
        assert lp_a == pytest.approx(lp_b, abs=TOL) and g_a == g_b
    assert any(g for _, g in ours) and ours[len(greedy)] == ours[-1]


def test_rolling_loglikelihood_equals_hf_backend(aot, hf):
    """Whole-text log-likelihood in windows (a text several times n_positions, a short one and
    an empty one), as lm-eval's rolling windows define it."""
    texts = ["".join(CORPUS), "import os", ""]
    assert len(aot.tok_encode(texts[0])) > 2 * N_POS
    reqs = _requests("loglikelihood_rolling", [(t,) for t in texts])
    ours, ref = aot.loglikelihood_rolling(reqs), hf.loglikelihood_rolling(reqs)
    assert ours == pytest.approx(ref, abs=1e-3)


def test_generate_until_equals_transformers_greedy(aot, ckpt):
    """Greedy text cut before the first ``until`` string, as transformers' greedy ``generate``
    gives it; rows of one call may have different stops and lengths."""
    import torch
    import transformers

    tok = aot.tokenizer
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt[0]), dtype=torch.float32)
    contexts, n_new = ["def fibonacci(n):", "import os\nimport", "class Point:"], 12
    full = []
    for c in contexts:
        ids = torch.tensor([tok(c)["input_ids"]])
        out = ref_model.generate(ids, max_new_tokens=n_new, do_sample=False, pad_token_id=tok.pad_token_id)
        full.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    stops = [t[3:5] if len(t) >= 5 else "never" for t in full]  # a stop inside the reference text
    gen = [{"until": [s], "max_gen_toks": n_new, "do_sample": False} for s in stops]
    gen[2] = {"until": "never seen", "max_gen_toks": n_new - 4}  # a string, and a shorter limit
    got = aot.generate_until(_requests("generate_until", list(zip(contexts, gen, strict=True))))
    assert got[0] == full[0].split(stops[0])[0] and got[1] == full[1].split(stops[1])[0]
    assert len(got[0]) < len(full[0])  # the stop did cut
    ids = torch.tensor([tok(contexts[2])["input_ids"]])
    short = ref_model.generate(ids, max_new_tokens=n_new - 4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert got[2] == tok.decode(short[0, ids.shape[1] :], skip_special_tokens=True)


def test_scoring_compiles_nothing(aot):
    """Every graph is compiled when the backend is built: scoring new lengths, batch fills and
    rolling windows afterwards traces, lowers and compiles nothing."""
    with count_compiles() as c:
        aot.loglikelihood(_requests("loglikelihood", [("a", "b"), ("def f(x):\n   ", " return x * 2")] * 3))
        aot.loglikelihood(_requests("loglikelihood", [(CORPUS[1], "x")]))
        aot.loglikelihood_rolling(_requests("loglikelihood_rolling", [(CORPUS[2] * 4,)]))
    assert c == {"backend": 0, "lowering": 0, "tracing": 0}


def test_command_line_runs_a_task(ckpt, tasks, cli_run, aot):
    """``python -m aotlm.eval`` is lm-eval's command line with ``--model aotlm``; batch_size in
    ``--model_args`` wins over the harness-wide default of 1. Same accuracy as in-process."""
    proc, out = cli_run
    assert proc.wait(timeout=300) == 0, (out / "stderr").read_text()[-3000:]
    (result,) = (out / "results").rglob("results_*.json")
    got = json.loads(result.read_text())
    assert got["config"]["model"] == "aotlm" and got["config"]["batch_sizes"] == [BATCH]
    assert (got["config"]["model_path"], got["config"]["n_positions"]) == (str(ckpt[0]), N_POS)
    expected = _evaluate(aot, tasks)["results"][TASK]["acc,none"]
    assert got["results"][TASK]["acc,none"] == expected


def test_bad_arguments_are_one_clear_line(ckpt, aot):
    path = str(ckpt[0])
    with pytest.raises(ValueError, match=r"dtype='float8' is not supported; use one of"):
        LMEvalModel(pretrained=path, dtype="float8")
    with pytest.raises(TypeError, match=r"unknown model argument\(s\) \['max_lenght'\]"):
        LMEvalModel(pretrained=path, max_lenght=64)
    with pytest.raises(ValueError, match=r"batch_size='four' must be an integer"):
        LMEvalModel(pretrained=path, batch_size="four")
    with pytest.raises(ValueError, match=r"request 0: the continuation '' encodes to no tokens"):
        aot.loglikelihood(_requests("loglikelihood", [("def", "")]))
    with pytest.raises(ValueError, match=r"max_gen_toks=64 leaves no room for a context in n_positions=64"):
        aot.generate_until(_requests("generate_until", [("def", {"max_gen_toks": 64})]))
    with pytest.raises(ValueError, match=r"\['num_beams'\] are not supported by aotlm"):
        aot.generate_until(_requests("generate_until", [("def", {"num_beams": 2})]))


def test_model_args_win_over_harness_defaults(ckpt):
    """lm-eval passes its own batch_size (default 1) and device next to --model_args; a value
    given in --model_args is used instead of being a duplicate keyword argument."""
    path = str(ckpt[0])
    lm = LMEvalModel.create_from_arg_string(
        f"pretrained={path},batch_size=4,n_positions=64,compile=false", {"batch_size": 1, "device": "cuda:0"}
    )
    assert (lm.batch_size, lm.max_length, lm.prefix_token_id) == (4, 64, lm.tokenizer.bos_token_id)


def test_import_aotlm_does_not_import_lm_eval():
    code = "import aotlm, sys; aotlm.AutoModelForSampling; assert 'lm_eval' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
