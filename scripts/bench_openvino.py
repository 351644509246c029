"""OpenVINO GenAI peer for ``scripts/bench.py`` (``--peers ov-int8 ov-int4 ov-default``).

The bench's checkpoint is exported once per weight format by optimum-intel's ``optimum-cli export
openvino`` (nncf compresses the weights) into ``WORK/ov-FORMAT-<checkpoint dir name>`` (temp dir +
rename), then run by ``openvino_genai.LLMPipeline(ir, "CPU")`` on the bench's own prompt ids
(``TokenizedInputs``), greedy, ``ignore_eos`` so every row makes all the new tokens. Prefix caching
is off (``SchedulerConfig.enable_prefix_caching = False``, otherwise LLMPipeline's default
scheduler: no limit on tokens per step): the bench sends the same prompts each round, which a
prefix cache would answer from memory.

optimum-intel pins an older transformers than aotlm's, so it usually lives in its own venv: set
``AOTLM_OPENVINO_PYTHON`` to that interpreter. The export always runs in a child process (this
interpreter's when it has ``optimum.intel``, else that one's); the timing runs in this process when
``openvino_genai`` imports here, else in a child of ``AOTLM_OPENVINO_PYTHON`` running this file,
which answers ``prefill`` / ``generate`` lines on stdin with ``ok`` (the bench times the round trip).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "AOTLM_OPENVINO_PYTHON"
# ov-MODE -> optimum-cli arguments; int8: nncf's default, asymmetric per output channel
FORMATS = {
    "int8": ["--weight-format", "int8"],
    "int4": ["--weight-format", "int4", "--group-size", "64", "--sym", "--ratio", "1.0"],
    "default": [],  # optimum-cli's own choice (float weights for models under 1B parameters)
}


def _has(python: str | None, module: str) -> bool:
    """Whether ``module`` imports in ``python`` (None: this interpreter)."""
    try:
        if python is None:
            return importlib.util.find_spec(module) is not None
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
    except (ImportError, OSError):  # a missing parent package / interpreter
        return False


def _interpreter(module: str, what: str) -> str | None:
    """None when ``module`` imports here, else ``$AOTLM_OPENVINO_PYTHON`` when it imports there."""
    from bench_peers import Skip

    if _has(None, module):
        return None
    other = os.environ.get(ENV)
    if other and _has(other, module):
        return other
    where = f"{ENV}={other} lacks it too" if other else f"set {ENV} to a Python that has it"
    raise Skip(f"{what} not installed here ({module}); {where} (scripts/README.md, OpenVINO)")


def export_ir(ckpt: Path, work: Path, fmt: str) -> Path:
    """The checkpoint as OpenVINO IR of weight format ``fmt`` (``FORMATS``), exported once."""
    from bench_peers import Skip, write_byte_vocab

    out = work / f"ov-{fmt}-{ckpt.name}"
    if (out / "openvino_model.xml").is_file():
        return out
    if not any((ckpt / f).is_file() for f in ("tokenizer.json", "vocab.json")):  # random init: no vocab
        write_byte_vocab(ckpt, json.loads((ckpt / "config.json").read_text())["vocab_size"])
    python = _interpreter("optimum.intel", "optimum-intel[openvino]") or sys.executable
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=work))
    cli = "from optimum.commands.optimum_cli import main; main()"
    args = ["export", "openvino", "--model", str(ckpt), "--task", "text-generation-with-past"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # a local directory: never ask the hub
    print(f"exporting {ckpt} to OpenVINO IR ({fmt}) with {python}", file=sys.stderr, flush=True)
    p = subprocess.run(
        [python, "-c", cli, *args, *FORMATS[fmt], str(tmp)], capture_output=True, text=True, env=env
    )
    (tmp / "export.log").write_text(p.stdout + p.stderr)  # nncf's table of the formats it chose
    if p.returncode or not (tmp / "openvino_model.xml").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise Skip(f"optimum-cli export openvino ({fmt}) failed: {(p.stderr or p.stdout).strip()[-300:]}")
    tmp.rename(out)
    return out


def pipeline(ir: Path, ids, new: int):
    """(prefill, generate) callables: ``LLMPipeline`` on ``ids`` ([batch, prompt] ints), 1 and
    ``new`` greedy tokens per row; each returns the new tokens as an int array [batch, n]."""
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    sched = genai.SchedulerConfig()  # LLMPipeline's own default (no token limit per step), minus
    sched.max_num_batched_tokens = 2**63 - 1  # the prefix cache it turns on
    sched.enable_prefix_caching = False
    pipe = genai.LLMPipeline(str(ir), "CPU", scheduler_config=sched)
    x = np.asarray(ids, dtype=np.int64)
    prompts = genai.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x)))

    def run(n: int) -> np.ndarray:
        cfg = genai.GenerationConfig(max_new_tokens=n, min_new_tokens=n, ignore_eos=True, do_sample=False)
        out = pipe.generate(prompts, cfg).tokens
        if [len(t) for t in out] != [n] * len(x):
            raise RuntimeError(f"OpenVINO GenAI made {[len(t) for t in out]} tokens per row, not {n}")
        return np.array(out)

    return (lambda: run(1)), (lambda: run(new))


def _child(python: str, ir: Path, ids, new: int):
    """(prefill, generate) that ask a child ``python`` running this file's ``serve`` to call them."""
    import numpy as np

    with tempfile.NamedTemporaryFile(suffix=".npy", delete=False) as f:
        np.save(f, np.asarray(ids, dtype=np.int64))
    cmd = [python, str(Path(__file__).resolve()), str(ir), f.name, str(new)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    atexit.register(proc.kill)

    def call(what: str) -> None:
        proc.stdin.write(what + "\n")
        proc.stdin.flush()
        if (reply := proc.stdout.readline().strip()) != "ok":
            raise RuntimeError(f"OpenVINO child ({python}) answered {reply or 'nothing'!r} to {what}")

    try:
        call("ready")
    finally:
        os.unlink(f.name)
    return (lambda: call("prefill")), (lambda: call("generate"))


def kv_cache_bytes(python: str | None) -> int:
    """Bytes per cached key / value: the CPU plugin's ``KV_CACHE_PRECISION`` (u8 by default)."""
    code = "import openvino as ov; print(ov.Core().get_property('CPU', 'KV_CACHE_PRECISION').size)"
    if python is None:
        import openvino as ov

        return ov.Core().get_property("CPU", "KV_CACHE_PRECISION").size
    return int(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def openvino_runner(ckpt: Path, work: Path, fmt: str, ids, new: int):
    """(prefill, generate, weight bytes, KV bytes per cached value) of OpenVINO GenAI on the
    checkpoint exported as ``fmt``. Weight bytes: the IR's ``openvino_model.bin``."""
    from bench_peers import Skip

    if fmt not in FORMATS:
        raise Skip(f"unknown OpenVINO mode ov-{fmt}; one of {', '.join('ov-' + f for f in FORMATS)}")
    python = _interpreter("openvino_genai", "openvino-genai")  # before the minute-long export
    ir = export_ir(ckpt, work, fmt)
    pre, gen = pipeline(ir, ids, new) if python is None else _child(python, ir, ids, new)
    return pre, gen, (ir / "openvino_model.bin").stat().st_size, kv_cache_bytes(python)


def serve(ir: str, ids_npy: str, new: str) -> int:
    """The child's loop: ``ready`` / ``prefill`` / ``generate`` lines on stdin, ``ok`` after each."""
    import numpy as np

    pre, gen = pipeline(Path(ir), np.load(ids_npy), int(new))
    calls = {"ready": lambda: None, "prefill": pre, "generate": gen}
    for line in sys.stdin:
        calls[line.strip()]()
        print("ok", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: bench_openvino.py IR_DIR IDS.npy NEW (the bench starts it; see the docstring)")
    sys.exit(serve(*sys.argv[1:]))
