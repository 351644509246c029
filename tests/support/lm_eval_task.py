"""A tiny multiple-choice lm-eval task made offline: a JSONL file and a task YAML in a directory.

Nothing comes from a hub: ``dataset_path: json`` reads the local file (the caller sets
``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE``). The documents exercise what the tokenization of a
request has to get right: a context with trailing whitespace (moved into the continuation), an
empty context (the prefix token stands in) and non-ASCII text.
"""

from __future__ import annotations

import json
from pathlib import Path

TASK = "aotlm_tiny_mc"
DOCS = [
    {"question": "def add(a, b):\n    return", "choices": ["a + b", "print(i)", "self.x"], "label": 0},
    {"question": "import", "choices": ["os", "sys", "héllo"], "label": 1},
    {"question": "for i in ", "choices": ["range(10):", "self", "café"], "label": 0},
    {
        "question": "class Point:\n    def",
        "choices": ["__init__(self, x, y):", "fibonacci", "3]"],
        "label": 0,
    },
    {"question": "", "choices": ["import os", "value = {", "# 日本語"], "label": 2},
    {"question": "value = {'key': [1, 2,", "choices": ["3]}", "4]}", " 3]}"], "label": 0},
]


def write_task(directory: Path) -> Path:
    """Write the data and the YAML under ``directory``; returns it (lm-eval's ``include_path``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in DOCS), encoding="utf-8")
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n",
        encoding="utf-8",
    )
    return directory
