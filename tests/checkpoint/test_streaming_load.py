"""Loading streams: peak host memory stays near the stored weights, measured in a child process.

A checkpoint's file is read one tensor at a time through a memory map whose pages are dropped as
each tensor is converted (``checkpoint.SafetensorsFile``, ``gguf_weights.GGUFWeights``); a GGUF file
is read in place, never expanded into a float32 copy. Each case loads a model (8 layers x 512,
113 MB of float32 weights) in a fresh process and compares the growth of its peak RSS during
``from_pretrained`` (``/proc/self/clear_refs`` restarts the peak) with the bytes of the weights it
keeps (int8: 30 MB). Read whole, the float32 file alone would add 113 MB on top of those (with the
pages kept: +163 MB measured; dropped: +52 MB; the GGUF file read in place: +57 MB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys
import jax, jax.numpy as jnp
jnp.zeros(4).block_until_ready()
from aotlm import AutoModelForSampling, kernels
import aotlm.api.causal_lm, aotlm.models.checkpoint.gguf_weights
from aotlm.models.checkpoint.resolve import resolve
from aotlm.models.checkpoint import load_hf_config
path, kw = sys.argv[1], json.loads(sys.argv[2])
load_hf_config(resolve(path)), kernels.enabled()  # imports and the GGUF conversion before the baseline
field = lambda k: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(k))
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from the present RSS
before = field("VmRSS:")
m = AutoModelForSampling.from_pretrained(path, batch_size=1, n_positions=64, compile_cache=False, **kw)
peak = field("VmHWM:")
stored = sum(a.nbytes for a in jax.tree.leaves(m.params))
print(json.dumps({"growth": peak - before, "stored": stored, "before": before, "peak": peak}))
"""
FIXED = 64e6  # interpreter, XLA and numpy working memory that any load adds (28-36 MB measured)
LARGEST = 512 * 1536 * 4  # the largest float32 tensor (an MLP matrix): a few copies of it in flight


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import transformers
    from conformance import make_checkpoint
    from gguf import GGMLQuantizationType as T
    from gguf_builders import tokenizer_fields, write_gguf

    root = tmp_path_factory.mktemp("streaming")
    cfg = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=len(tokenizer_fields()["tokens"]), max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    ckpt = make_checkpoint(root / "hf", cfg)
    return ckpt, write_gguf(ckpt, "llama", T.Q8_0, root / "model-Q8_0.gguf")


def growth(path: Path, tmp: Path, **kw) -> dict:
    env = dict(os.environ, AOTLM_GGUF_CACHE=str(tmp / "gguf-cache"), TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "support"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), json.dumps(kw)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_peak_memory_of_a_load_stays_near_the_stored_weights(files, tmp_path, source):
    path = files[0] if source == "safetensors" else files[1]
    got = growth(path, tmp_path, quant="int8")
    f32_file = (files[0] / "model.safetensors").stat().st_size
    bound = got["stored"] + 4 * LARGEST + FIXED
    assert got["growth"] <= bound, (got, bound)
    assert bound < got["stored"] + f32_file, "the bound would not catch a whole float32 copy"
