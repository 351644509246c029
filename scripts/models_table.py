"""Render models/README.md's "Supported families" table with status columns taken from the test results.

    python scripts/models_table.py                        # run the conformance tests, then print the table
    python scripts/models_table.py --junit-out r.xml      # ... and keep their junit xml
    python scripts/models_table.py --from-junit r.xml     # render from an existing junit file (no test run)

Status columns come from pytest's junit xml: every test id is mapped to a ``model_type`` (the
longest supported model_type that prefixes the test function's name after ``test_``, else its
parameter id, else ``OVERRIDES``); tests that name no family (registry, errors...) are counted in
a footnote only. "fp32 conformance" = tests/families/test_conformance_gpt_style.py,
test_conformance_llama_style.py and tests/core/test_model.py (aotlm vs transformers PyTorch fp32:
last-position logits <= 1e-4, identical greedy tokens);
"tp=2" = tests/families/test_conformance_tp.py (tp=2 on 2 forced CPU devices vs tp=1). A column says
``pass (n)`` only when all n tests of that family passed. The other columns are static (``STATIC``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE_FILES = (
    "tests/families/test_conformance_gpt_style.py",
    "tests/families/test_conformance_llama_style.py",
    "tests/core/test_model.py",
)
TP_FILES = ("tests/families/test_conformance_tp.py",)
COLUMNS = {"fp32 conformance": CONFORMANCE_FILES, "tp=2": TP_FILES}

# model_type -> (example public checkpoints, attention, positions, MoE, notes); row order = table order
STATIC: dict[str, tuple[str, str, str, str, str]] = {
    "gpt2": ("gpt2, gpt2-medium, distilgpt2", "MHA", "learned", "-", "GPT-3-style checkpoints saved as gpt2"),
    "llama": (
        "meta-llama/Llama-2-7b-hf, Meta-Llama-3-8B, Llama-3.1-8B",
        "GQA",
        "RoPE (incl. llama3 rope_scaling, linear)",
        "-",
        "",
    ),
    "mistral": ("mistralai/Mistral-7B-v0.1", "GQA", "RoPE", "-", "sliding window (masking)"),
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1", "GQA", "RoPE", "top-2 of 8", "dense expert compute, exact"),
    "qwen2": (
        "Qwen/Qwen2-0.5B, Qwen2.5-7B-Instruct",
        "GQA",
        "RoPE",
        "-",
        "q/k/v biases; per-layer sliding window",
    ),
    "qwen3": ("Qwen/Qwen3-0.6B, Qwen3-8B", "GQA", "RoPE", "-", "q/k RMSNorm; explicit head_dim"),
    "gemma": ("google/gemma-2b, gemma-7b", "MQA / MHA", "RoPE", "-", "embed x sqrt(d), (1+w) RMSNorm"),
    "gemma2": (
        "google/gemma-2-2b, gemma-2-9b",
        "GQA",
        "RoPE",
        "-",
        "local/global layers, softcaps, pre+post norms",
    ),
    "gemma3_text": (
        "google/gemma-3-270m, gemma-3-1b",
        "GQA",
        "RoPE (local / global bases, linear scaling)",
        "-",
        "Gemma2 + q/k RMSNorm; multimodal gemma3 refused",
    ),
    "phi3": (
        "microsoft/Phi-3-mini-4k-instruct",
        "MHA / GQA",
        "RoPE",
        "-",
        "fused qkv/gate_up; longrope unsupported",
    ),
    "gptj": (
        "EleutherAI/gpt-j-6b",
        "MHA",
        "rotary (interleaved, partial)",
        "-",
        "parallel residual; lm_head bias",
    ),
    "gpt_neox": (
        "EleutherAI/pythia-*, gpt-neox-20b",
        "MHA",
        "rotary (partial)",
        "-",
        "parallel or sequential residual",
    ),
    "opt": (
        "facebook/opt-125m ... opt-66b",
        "MHA",
        "learned (offset 2)",
        "-",
        "OPT-350m post-norm + project_in/out",
    ),
    "bloom": ("bigscience/bloom-560m ... bloom", "MHA", "ALiBi", "-", "embedding LayerNorm"),
    "mpt": ("mosaicml/mpt-7b, mpt-30b", "MHA", "ALiBi", "-", "clip_qkv; no biases"),
    "falcon": (
        "tiiuae/falcon-7b, falcon-40b, falcon-rw-1b",
        "MQA / GQA / MHA",
        "rotary or ALiBi",
        "-",
        "parallel attention",
    ),
    "gpt_bigcode": ("bigcode/santacoder, starcoder", "MQA / MHA", "learned", "-", "fused c_attn"),
}

# test function -> model_type, for family tests whose name and parameters do not say it
OVERRIDES = {"test_moe_routing_matches_transformers_router": "mixtral"}


def family_of(test_name: str) -> str | None:
    """``test_conformance[gpt_neox_parallel]`` -> ``gpt_neox``; ``test_registry_lists...`` -> None."""
    m = re.fullmatch(r"(test_\w+?)(?:\[(.*)\])?", test_name)
    if m is None:
        return None
    func, param = m.group(1), m.group(2) or ""
    if func in OVERRIDES:
        return OVERRIDES[func]
    for text in (func.removeprefix("test_"), param):
        # longest first, so gemma2_... is gemma2 not gemma; a letter may not follow (llama3 is llama)
        for mt in sorted(STATIC, key=len, reverse=True):
            if text.startswith(mt) and not text[len(mt) : len(mt) + 1].isalpha():
                return mt
    return None


def read_junit(path: str | Path) -> list[tuple[str, str, str]]:
    """``(file, test name, outcome)`` for every testcase; outcome: passed / failed / skipped."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        kids = {child.tag for child in case}
        outcome = "failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"
        out.append((file, case.get("name", ""), outcome))
    return out


def statuses(results: list[tuple[str, str, str]]) -> tuple[dict, dict]:
    """(model_type -> column -> [outcomes], column -> [outcomes of tests naming no family])."""
    per: dict[str, dict[str, list[str]]] = {mt: {c: [] for c in COLUMNS} for mt in STATIC}
    generic: dict[str, list[str]] = {c: [] for c in COLUMNS}
    for file, name, outcome in results:
        col = next((c for c, files in COLUMNS.items() if file in files), None)
        if col is None:
            continue
        mt = family_of(name)
        (per[mt][col] if mt else generic[col]).append(outcome)
    return per, generic


def cell(outcomes: list[str]) -> str:
    if not outcomes:
        return "not tested"
    n, bad = len(outcomes), outcomes.count("failed")
    if bad:
        return f"**FAIL** ({bad}/{n})"
    if outcomes.count("skipped") == n:
        return "skipped"
    return f"pass ({n - outcomes.count('skipped')})"


def render(results: list[tuple[str, str, str]]) -> str:
    per, generic = statuses(results)
    head = ["model_type", "example public checkpoints", "attention", "positions", "MoE", *COLUMNS, "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mt, (ckpts, attn, pos, moe, notes) in STATIC.items():
        status = [cell(per[mt][c]) for c in COLUMNS]
        lines.append("| " + " | ".join([f"`{mt}`", ckpts, attn, pos, moe, *status, notes]) + " |")
    foot = ", ".join(f"{c} {g.count('passed')}/{len(g)} pass" for c, g in generic.items() if g)
    lines += [
        "",
        "fp32 conformance: aotlm vs transformers PyTorch fp32 on tiny random-init checkpoints "
        f"({', '.join(CONFORMANCE_FILES)}); tp=2: 2 CPU devices vs tp=1, greedy tokens identical and "
        f"logits within 1e-4 ({', '.join(TP_FILES)}). (n) = number of tests."
        + (f" Tests not tied to one family: {foot}." if foot else ""),
    ]
    return "\n".join(lines)


def run_tests(junit: Path, files: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-junit", metavar="FILE", help="render from this junit xml; do not run tests")
    ap.add_argument("--junit-out", metavar="FILE", help="keep the junit xml of the test run here")
    ap.add_argument("--files", nargs="+", default=[*CONFORMANCE_FILES, *TP_FILES], help="test files to run")
    args = ap.parse_args(argv)
    if args.from_junit:
        print(render(read_junit(args.from_junit)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(args.junit_out).resolve() if args.junit_out else Path(tmp) / "junit.xml"
        code = run_tests(junit, args.files)
        if not junit.is_file():
            print(f"pytest wrote no junit xml (exit code {code})", file=sys.stderr)
            return code or 1
        print(render(read_junit(junit)))
    return 0 if code in (0, 1) else code  # 1 = some tests failed: the table shows which


if __name__ == "__main__":
    sys.exit(main())
