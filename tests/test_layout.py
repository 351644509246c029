"""The package's house rules, checked on the source (``ast``, nothing imported or executed).

Layers, lowest first: the top-level utilities (``progress``, ``durable``, ``tiny``), ``kernels``,
``models``, ``core``, ``generate``, ``batching``, ``api``, ``text`` / ``tune``, ``jobs`` / ``serve``
/ ``eval``, ``cli``, and
the public ``aotlm`` namespace (``__init__``) above everything. A module may import its own layer or
lower ones, never a higher one; the module graph has no circles; a function-local import says
why on its line (an optional or slow dependency kept out of ``import aotlm``).

Tests mirror the rooms: ``tests/<room>/test_<module>.py`` (or ``test_<module>_<topic>.py``) where a
module has tests of its own, else an entry of ``COVERED`` naming the file that covers it and how.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"aotlm": REPO / "engine", "aotlm.models": REPO / "models"}
LAYERS = {  # package (or top-level module) -> rank
    "aotlm.progress": 0,
    "aotlm.durable": 0,
    "aotlm.tiny": 0,
    "aotlm.kernels": 1,
    "aotlm.models": 2,
    "aotlm.core": 3,
    "aotlm.generate": 4,
    "aotlm.batching": 5,
    "aotlm.api": 6,
    "aotlm.text": 7,
    "aotlm.tune": 7,
    "aotlm.jobs": 8,
    "aotlm.serve": 8,
    "aotlm.eval": 8,
    "aotlm.cli": 9,
    "aotlm": 10,
}


def modules() -> dict[str, Path]:
    found = {}
    for prefix, root in ROOTS.items():
        for f in root.rglob("*.py"):
            parts = f.relative_to(root).with_suffix("").parts
            name = ".".join((prefix, *parts))
            found[name.removesuffix(".__init__")] = f
    return found


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, ast.AST, bool]]:
    """(imported aotlm module, node, inside a function) for every import of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    local = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(f)
        if isinstance(n, ast.Import | ast.ImportFrom)
    }
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(head + ([node.module] if node.module else []))
            for a in node.names:  # ``from pkg import submodule`` imports the submodule
                targets.append(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        out += [(t, node, id(node) in local) for t in dict.fromkeys(targets) if t in known and t != name]
    return out


def graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    mods = modules()
    edges = {m: {t for t, _, _ in imports(m, p, set(mods))} for m, p in mods.items()}
    return mods, edges


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in edges.items() for t in ts if layer(t) > layer(m))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def unexplained_local_imports(mods: dict[str, Path]) -> list[str]:
    """Function-local imports without a ``# local: <why>`` comment, and any of an aotlm module."""
    bad = []
    for name, path in mods.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        for f in ast.walk(tree):
            if not isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for n in ast.walk(f):
                if not isinstance(n, ast.Import | ast.ImportFrom):
                    continue
                if "# local:" not in " ".join(lines[max(n.lineno - 2, 0) : n.lineno]):  # its line or above
                    bad.append(f"{path.name}:{n.lineno}")
        bad += [f"{name} -> {t}" for t, _, local in imports(name, path, set(mods)) if local]
    return bad


# ``obj._name`` uses allowed across modules, each with its reason
FOREIGN_PRIVATE_OK = {
    "os._exit": "the standard library's documented exit without cleanup (a test fault injection)",
}


def owned_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: functions, classes, module globals and ``self.x`` / ``cls.x``."""
    own = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                own.add(n.attr)
    return own


def foreign_private_uses(mods: dict[str, Path]) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self`` / ``cls`` and the module does not define ``_name``:
    one module reaching into another's private attributes (read, written or called)."""
    bad = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = owned_names(tree)
        for n in ast.walk(tree):
            if not isinstance(n, ast.Attribute) or not n.attr.startswith("_") or n.attr.startswith("__"):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if n.attr not in own and ast.unparse(n) not in FOREIGN_PRIVATE_OK:
                bad.append(f"{name}:{n.lineno} {ast.unparse(n)}")
    return sorted(bad)


def long_functions(mods: dict[str, Path], limit: int = 80) -> list[str]:
    """Functions (methods too) of ``engine/`` and ``models/`` longer than ``limit`` lines,
    decorators and docstring included."""
    bad = []
    for name, path in mods.items():
        for f in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([f.lineno] + [d.lineno for d in f.decorator_list])
                if f.end_lineno - first + 1 > limit:
                    bad.append(f"{name}.{f.name}: {f.end_lineno - first + 1} lines")
    return sorted(bad)


def test_no_module_reaches_another_modules_private_attributes():
    assert foreign_private_uses(modules()) == []


def test_no_upward_imports():
    mods, edges = graph()
    assert len(mods) > 60 and "aotlm.core.model" in mods and "aotlm.models.decoder" in mods
    assert upward_imports(edges) == []


def test_no_import_circles():
    assert circles(graph()[1]) == []


def test_local_imports_say_why():
    assert unexplained_local_imports(modules()) == []


def test_detector_sees_a_planted_upward_import_circle_and_local_import(tmp_path, monkeypatch):
    """The rules are not vacuous: a core module importing cli, two modules importing each
    other and unexplained function-local imports are all reported."""
    eng = tmp_path / "engine"
    (eng / "core").mkdir(parents=True)
    (eng / "cli").mkdir()
    (tmp_path / "models").mkdir()
    for f in ("__init__.py", "core/__init__.py", "cli/__init__.py"):
        (eng / f).write_text("")
    (eng / "core" / "a.py").write_text("from aotlm.cli import app\nfrom aotlm.core import b\n")
    (eng / "core" / "b.py").write_text("from aotlm.core import a\n")
    (eng / "cli" / "app.py").write_text(
        "def f():\n    import json\n    from aotlm.core import b  # local: x\n"
    )
    monkeypatch.setitem(ROOTS, "aotlm", eng)
    monkeypatch.setitem(ROOTS, "aotlm.models", tmp_path / "models")
    mods, edges = graph()
    assert upward_imports(edges) == ["aotlm.core.a -> aotlm.cli.app"]
    assert circles(edges) == [["aotlm.cli.app", "aotlm.core.a", "aotlm.core.b"]]
    assert unexplained_local_imports(mods) == ["app.py:2", "aotlm.cli.app -> aotlm.core.b"]


def test_private_and_length_detectors_see_planted_cases(tmp_path, monkeypatch):
    """A module using another's ``obj._x`` (read or written) is reported, its own ``self._x``,
    its own helpers and the allow-list are not; a function of 81 lines is reported, one of 80 not."""
    eng = tmp_path / "engine"
    eng.mkdir()
    (tmp_path / "models").mkdir()
    (eng / "a.py").write_text(
        "import os\nclass A:\n    def __init__(self):\n        self._x = 1\ndef _h(a):\n    return a._x\n"
    )
    (eng / "b.py").write_text(
        "def f(m):\n    m._bcast = 1\n    os._exit(0)\n    return m._lock, m.__class__\n"
        "def g():\n" + "    pass\n" * 80 + "def h():\n" + "    pass\n" * 79
    )
    monkeypatch.setitem(ROOTS, "aotlm", eng)
    monkeypatch.setitem(ROOTS, "aotlm.models", tmp_path / "models")
    mods = modules()
    assert foreign_private_uses(mods) == ["aotlm.b:2 m._bcast", "aotlm.b:4 m._lock"]
    assert long_functions(mods) == ["aotlm.b.g: 81 lines"]


def test_file_sizes_and_top_level():
    """At most a handful of modules at the package top; no module over ~450 lines."""
    top = sorted(p.name for p in (REPO / "engine").glob("*.py"))
    assert len(top) <= 8, top
    big = {
        str(p.relative_to(REPO)): n
        for root in ROOTS.values()
        for p in root.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450
    }
    assert big == {}


def test_no_test_module_imports_another_test_modules_private_names():
    """Shared test builders live in ``tests/support/`` / ``conftest.py``, not in test modules."""
    bad = []
    for f in (REPO / "tests").rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("test_"):
                bad += [f"{f.name}: {n.module}.{a.name}" for a in n.names if a.name.startswith("_")]
    assert bad == []


def test_tests_folder_holds_tests_and_support_holds_the_rest():
    """``tests/`` holds ``conftest.py``, the tests of the top-level modules and of the repository
    (docs, layout, quick start, scripts) and a folder per room (``tests/<room>/test_<module>.py``),
    ``families/`` (every family's conformance, by topic) and ``support/`` (builders, fakes and
    subprocess workers: no test module). No ``__init__.py``: pytest imports each test module by its
    file name, so the names are unique across the tree."""
    folders = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    assert [f for f in folders if f not in TEST_FOLDERS] == []
    tests = [f for f in TESTS.rglob("*.py") if f.relative_to(TESTS).parts[0] != "support"]
    assert [str(f.relative_to(TESTS)) for f in tests if not f.name.startswith(("test_", "conftest"))] == []
    assert [f.relative_to(TESTS).parts[0] for f in tests if f.name == "conftest.py"] == ["conftest.py"]
    names = [f.name for f in tests]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    assert sorted(f.name for f in (TESTS / "support").glob("test_*.py")) == []


def test_no_function_over_80_lines_in_engine_or_models():
    assert long_functions(modules()) == []


def test_every_public_name_resolves():
    """``aotlm``'s lazily loaded names point at modules that exist (a room move must update them)."""
    import aotlm  # local: the other checks here read the source without importing anything

    assert [n for n in aotlm.__all__ if getattr(aotlm, n, None) is None] == []


def test_former_import_paths_still_work():
    """Modules that moved rooms keep the import paths users wrote (the serving engine and its types)."""
    from aotlm.batching import engine, types  # local: see test_every_public_name_resolves
    from aotlm.serve import engine as old_engine  # local: the former path under test
    from aotlm.serve import types as old_types  # local: the former path under test

    assert old_engine.Engine is engine.Engine
    assert all(getattr(old_types, n) is getattr(types, n) for n in old_types.__all__)


# ---------------------------------------------------------------- tests mirror the rooms

TESTS = REPO / "tests"
# folders of tests/: a room each (aotlm's subpackages; ``models`` and its ``checkpoint``), the families'
# conformance by topic, and the shared builders, fakes and subprocess workers
TEST_FOLDERS = {p.parent.name for p in (REPO / "engine").glob("*/__init__.py")} | {
    "models",
    "checkpoint",
    "families",
    "support",
}

# Modules without a test file of their own: the file that covers each, and how (what it runs).
COVERED = {
    "aotlm.api.extensions": "tests/generate/test_beam.py: beam search, num_return_sequences via sample()",
    "aotlm.api.families": "tests/api/test_neuron_config.py: test_family_class_checks_the_checkpoint",
    "aotlm.batching.rows": "tests/batching/test_slots.py: test_prefix_reuse_gives_the_same_tokens",
    "aotlm.batching.slot_graphs": "tests/batching/test_slots.py: warm-up runs every graph_keys() graph",
    "aotlm.batching.types": "tests/batching/test_engine.py: requests, tokens, finishes, errors",
    "aotlm.cli.batch": "tests/jobs/test_batch.py: aotlm run --artifacts after compile",
    "aotlm.cli.common": "tests/cli/test_app_commands.py: the model flags every command shares",
    "aotlm.cli.h5": "tests/jobs/test_batch.py: aotlm run-h5 in subprocesses (the test_h5_* tests)",
    "aotlm.cli.jsonl": "tests/jobs/test_batch.py: aotlm batch-generate / batch-merge in subprocesses",
    "aotlm.cli.score": "tests/text/test_scoring_requests.py: test_score_cli, test_score_cli_errors",
    "aotlm.cli.serve": "tests/serve/test_app.py: test_cli_serve_starts_answers_and_exits_0_on_sigterm",
    "aotlm.cli.tune": "tests/tune/test_optimise.py: aotlm tune's bad inputs, bucket config and plot",
    "aotlm.config": "tests/api/test_neuron_config.py: transformers-neuronx's config names (GenerationConfig)",
    "aotlm.core.artifacts": "tests/jobs/test_batch.py: compile --output-artifacts then run",
    "aotlm.core.bucket_config": "tests/tune/test_optimise.py: test_bucket_config_round_trip",
    "aotlm.core.contract": "tests/core/test_model.py: GraphHost, CompiledModel's side of every sample()",
    "aotlm.core.distributed": "tests/core/test_sharding.py: test_two_processes_form_one_tp4_mesh",
    "aotlm.core.graphs": "tests/core/test_model.py: prefill / select / decode graphs against transformers",
    "aotlm.core.handoff": "tests/api/test_pipelined.py: stage outputs across devices and processes",
    "aotlm.core.inputs": "tests/api/test_causal_lm_errors.py: test_bad_sample_inputs",
    "aotlm.core.pipeline": "tests/api/test_pipelined.py: stages on their own devices give one stage's tokens",
    "aotlm.core.spec": "tests/core/test_compile_cache.py: changed buckets / amp recompile only theirs",
    "aotlm.core.state": "tests/core/test_model.py: the decode graphs' state, through every sample() there",
    "aotlm.core.weight_load": "tests/checkpoint/test_streaming_load.py: loads tensor by tensor, weight cache",
    "aotlm.durable": "tests/jobs/test_batch.py: kill + --resume completes outputs with each record once",
    "aotlm.generate.broadcast": "tests/generate/test_beam.py: num_return_sequences: one prefill a prompt",
    "aotlm.generate.generation": "tests/generate/test_sampler.py: sample(): seeds, stops, streamers, scores",
    "aotlm.generate.params": "tests/text/test_defaults.py: generation_config.json's FIELDS",
    "aotlm.generate.pp_run": "tests/api/test_pipelined.py: sample() on a pipelined model (tokens, streaming)",
    "aotlm.generate.rows": "tests/jobs/test_batch.py: prompts of any length in fixed batches, order kept",
    "aotlm.generate.spec_graphs": "tests/generate/test_speculative.py: greedy equals the target's greedy",
    "aotlm.generate.stopping": "tests/generate/test_sampler.py: test_streamers_and_stopping_criteria",
    "aotlm.generate.strategies": "tests/generate/test_speculative.py: a draft attached via model.strategies",
    "aotlm.jobs.artifact_run": "tests/jobs/test_batch.py: test_compile_artifacts_then_run_compiles_nothing",
    "aotlm.jobs.dryrun": "tests/jobs/test_batch.py: test_dry_run_plan_sees_the_compile_cache",
    "aotlm.jobs.h5": "tests/jobs/test_batch.py: the test_h5_* tests (predictions, stops, resume, shards)",
    "aotlm.jobs.model_refs": "tests/jobs/test_batch.py: pre-flight finds checkpoints, loads nothing",
    "aotlm.jobs.plan": "tests/jobs/test_batch.py: test_preflight_errors_name_the_line_and_load_nothing",
    "aotlm.jobs.ray_jobs": "tests/jobs/test_ray_data.py: --ray for batch-generate and run-h5 on a local Ray",
    "aotlm.jobs.score": "tests/text/test_scoring_requests.py: test_score_cli (aotlm score's JSONL records)",
    "aotlm.kernels.argmax": "tests/kernels/test_kernels.py: test_argmax_kernel_matches_jnp_argmax",
    "aotlm.kernels.build": "tests/kernels/test_kernels.py: test_build_hash_covers_every_included_source",
    "aotlm.kernels.context": "tests/kernels/test_kernels.py: tp=2 shards in kernels_tp_child.py",
    "aotlm.kernels.layout": "tests/kernels/test_kernels.py: test_packed_kernel_matches_numpy (panel layout)",
    "aotlm.kernels.lora": "tests/core/test_lora_slots.py: the kernel vs NumPy (f32, bf16), vs PEFT in graphs",
    "aotlm.models.adapter_factors": "tests/core/test_lora_slots.py: Llama and GPT-2 Conv1D adapters vs PEFT",
    "aotlm.models.adapters": "tests/core/test_lora_slots.py: gathered and stacked slots, rows vs PEFT",
    "aotlm.models.arch": "tests/families/test_conformance_llama_style.py: every ArchConfig vs transformers",
    "aotlm.models.axes": "tests/models/test_quant.py: int8 scales along CONTRACT_AXES, per output channel",
    "aotlm.models.bloom": "tests/families/test_conformance_gpt_style.py: BLOOM variants against transformers",
    "aotlm.models.checkpoint.gguf_file": "tests/checkpoint/test_gguf_notorch.py: inspect() of tiny GGUFs",
    "aotlm.models.checkpoint.gguf_meta": "tests/checkpoint/test_gguf_notorch.py: no torch, same config",
    "aotlm.models.checkpoint.gguf_names": "tests/checkpoint/test_gguf.py: renamed tensors vs HF's",
    "aotlm.models.checkpoint.gguf_weights": "tests/checkpoint/test_streaming_load.py: a GGUF read in place",
    "aotlm.models.checkpoint.resolve": "tests/text/test_pipeline.py: resolution of run dirs and variables",
    "aotlm.models.decoder": "tests/families/test_conformance_gpt_style.py: every family's decoder vs HF",
    "aotlm.models.falcon": "tests/families/test_conformance_gpt_style.py: Falcon variants vs transformers",
    "aotlm.models.fusing": "tests/models/test_quant.py: fuse_qkv exact for every family, regrouped heads",
    "aotlm.models.gemma": "tests/families/test_conformance_llama_style.py: Gemma / Gemma2 vs transformers",
    "aotlm.models.gpt2": "tests/core/test_model.py: test_gpt2_conformance",
    "aotlm.models.gpt_bigcode": "tests/families/test_conformance_gpt_style.py: GPTBigCode vs transformers",
    "aotlm.models.gpt_neox": "tests/families/test_conformance_gpt_style.py: GPT-NeoX against transformers",
    "aotlm.models.gptj": "tests/families/test_conformance_gpt_style.py: GPT-J against transformers",
    "aotlm.models.layers": "tests/models/test_flash_long_context.py: blocked attention equals layers.attend",
    "aotlm.models.llama": "tests/core/test_model.py: test_llama_gqa_conformance, llama3 rope_scaling",
    "aotlm.models.lookup": "tests/checkpoint/test_gguf_lookup.py: rows rebuilt from a file's codes",
    "aotlm.models.kscales": "tests/kernels/test_q4.py: Q4_K's own scales, kernel and XLA path",
    "aotlm.models.codes4": "tests/checkpoint/test_gguf_q4k.py: a file's codes kept, both loader paths alike",
    "aotlm.models.q5scales": "tests/checkpoint/test_gguf_q5.py: Q5_0 / Q5_1 kept bit for bit, kernel and XLA",
    "aotlm.models.quant8": "tests/kernels/test_group8.py: Q8_0's groups found again, kernel and XLA path",
    "aotlm.models.mixtral": "tests/families/test_conformance_llama_style.py: Mixtral against transformers",
    "aotlm.models.moe": "tests/families/test_conformance_llama_style.py: Mixtral's top-2 experts vs HF",
    "aotlm.models.mpt": "tests/families/test_conformance_gpt_style.py: MPT (ALiBi slopes, clip_qkv) vs HF",
    "aotlm.models.opt": "tests/families/test_conformance_gpt_style.py: OPT (pre- and post-norm) vs HF",
    "aotlm.models.packing": "tests/kernels/test_kernels.py: packed weights against NumPy products, pack_if",
    "aotlm.models.projections": "tests/families/test_conformance_gpt_style.py: every family's projections",
    "aotlm.models.phi3": "tests/families/test_conformance_llama_style.py: Phi-3 against transformers",
    "aotlm.models.quant4": "tests/kernels/test_q4.py: quantize_int4, the packed layout, names",
    "aotlm.models.rounding": "tests/models/test_quant.py: quantize_int8's formula (fp8: test_quant_fp8.py)",
    "aotlm.models.qwen": "tests/families/test_conformance_llama_style.py: Qwen2 / Qwen3 against transformers",
    "aotlm.models.weights": "tests/checkpoint/test_formats.py: safetensors shards and .bin load alike",
    "aotlm.serve.chat": "tests/serve/test_app.py: test_chat_fallback_template_and_no_model_field",
    "aotlm.serve.detok": "tests/serve/test_app.py: test_stop_string_text_is_held_back_then_cut (ChoiceText)",
    "aotlm.serve.engine": "tests/test_layout.py: test_former_import_paths_still_work (a re-export)",
    "aotlm.serve.types": "tests/test_layout.py: test_former_import_paths_still_work (a re-export)",
    "aotlm.serve.handlers": "tests/serve/test_app.py: completions and chat, streamed or not",
    "aotlm.serve.metrics": "tests/serve/test_app.py: test_metrics_and_health",
    "aotlm.serve.protocol": "tests/serve/test_app.py: test_bad_requests_get_the_openai_error_shape",
    "aotlm.serve.runs": "tests/serve/test_echo.py: test_a_stream_echoes_what_the_whole_answer_says (events)",
    "aotlm.serve.responses": "tests/serve/test_app.py: response shapes, SSE framing, logprobs",
    "aotlm.speculation": "tests/api/test_tnx_guide.py: test_12_speculative_equals_target_greedy",
    "aotlm.stopping_criteria": "tests/api/test_tnx_guide.py: test_11_time_limit_stops_the_loop",
    "aotlm.text.tokens": "tests/text/test_pipeline.py: test_incremental_decoder_never_splits_characters",
    "aotlm.tiny": "tests/cli/test_app_commands.py: make_tiny_gpt2, the checkpoint the commands compile",
    "aotlm.tune.lengths": "tests/tune/test_optimise.py: test_length_loaders",
    "aotlm.tune.measure": "tests/tune/test_optimise.py: test_measure_fits_a_usable_cost_model",
}


def room_of(module: str) -> str:
    """The ``tests/`` folder of a module's tests: its subpackage of ``aotlm`` (``aotlm.core.state`` ->
    ``core``), ``models`` / ``checkpoint`` for ``aotlm.models`` (``.checkpoint``), ``""`` (``tests/``
    itself) for a top-level module."""
    parts = module.split(".")[1:-1]
    return "checkpoint" if parts[:2] == ["models", "checkpoint"] else (parts[0] if parts else "")


def own_test_files(module: str) -> list[Path]:
    """``tests/<room>/test_<module>.py`` and ``tests/<room>/test_<module>_<topic>.py``."""
    folder, name = TESTS / room_of(module), module.rpartition(".")[2]
    return sorted({*folder.glob(f"test_{name}.py"), *folder.glob(f"test_{name}_*.py")})


def leaf_modules() -> list[str]:
    """Every module of ``aotlm`` / ``aotlm.models`` but the packages' ``__init__`` and ``__main__``."""
    return sorted(m for m, p in modules().items() if p.stem not in ("__init__", "__main__"))


def test_every_module_has_its_test_file_or_says_which_file_covers_it():
    mods = leaf_modules()
    assert len(mods) > 60 and room_of("aotlm.models.checkpoint.gguf") == "checkpoint"
    assert [m for m in mods if not own_test_files(m) and m not in COVERED] == []
    assert [m for m in COVERED if m not in mods] == []  # no entry for a module renamed or removed
    assert [m for m in COVERED if own_test_files(m)] == []  # nor for one that has its own file now
    bad = {m: why for m, why in COVERED.items() if not why.partition(": ")[2]}
    bad |= {m: why for m, why in COVERED.items() if not (REPO / why.partition(":")[0]).is_file()}
    assert bad == {}


def test_room_of_and_own_test_files(tmp_path, monkeypatch):
    assert [room_of(m) for m in ("aotlm.core.state", "aotlm.models.decoder", "aotlm.config")] == [
        "core",
        "models",
        "",
    ]
    monkeypatch.setitem(globals(), "TESTS", tmp_path)
    (tmp_path / "core").mkdir()
    for f in (
        "core/test_model.py",
        "core/test_model_compile_count.py",
        "core/test_models.py",
        "test_model.py",
    ):
        (tmp_path / f).write_text("")
    assert own_test_files("aotlm.core.model") == [
        tmp_path / "core" / "test_model.py",
        tmp_path / "core" / "test_model_compile_count.py",
    ]
    assert own_test_files("aotlm.core.state") == []
