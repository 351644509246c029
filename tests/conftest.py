import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The suite compiles hundreds of tiny graphs, where XLA's code generation costs more than the graphs
# then run: -O0 in XLA's CPU backend (the HLO passes still run) made test_compile_cache + test_model
# (core) 21% faster (175 -> 138 s), and the older loop emitters instead of the fusion emitters halve what
# is left of a tiny model's compiles (the whole suite 20:51 -> 14:28 on 2 cores; same math, a fusion may
# round differently by an ulp). The README's quick start in a fresh environment runs on XLA's defaults,
# as users do (tests/test_quickstart.py). Subprocess workers that set their own XLA_FLAGS append
# AOTLM_TEST_XLA_FLAGS.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("AOTLM_TEST_XLA_FLAGS", TEST_XLA_FLAGS)
if "jax" not in sys.modules:  # XLA reads its flags once, when jax starts its backend
    flags = (os.environ.get("XLA_FLAGS", ""), os.environ["AOTLM_TEST_XLA_FLAGS"])
    os.environ["XLA_FLAGS"] = " ".join(flags).strip()

sys.path[:0] = [str(Path(__file__).parent / "support"), str(Path(__file__).parent)]  # builders, workers
# converted weights of the suite's models go to a temporary directory, not the user's ~/.cache (weight_cache),
# removed when the process that made it exits (xdist workers inherit the variable and make none)
if "AOTLM_WEIGHT_CACHE" not in os.environ:
    os.environ["AOTLM_WEIGHT_CACHE"] = tempfile.mkdtemp(prefix="aotlm-test-weights-")
    atexit.register(shutil.rmtree, os.environ["AOTLM_WEIGHT_CACHE"], ignore_errors=True)

from conformance import make_checkpoint  # noqa: E402

# The suite writes a few GB under the temporary directory (checkpoints, converted weights, compiled graphs);
# on a fuller disk its writes fail from some fixture on and every later test errors: refuse at the start.
MIN_FREE_GB = 5.0

_AOTLM_LOG = logging.getLogger("aotlm")
_PRISTINE_LOG = (list(_AOTLM_LOG.handlers), _AOTLM_LOG.propagate, _AOTLM_LOG.level)


def pytest_sessionstart(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # xdist workers: the controller has checked
        return
    tmp = tempfile.gettempdir()
    free = shutil.disk_usage(tmp).free / 1e9
    if free < MIN_FREE_GB:
        raise pytest.UsageError(
            f"{free:.1f} GB free under {tmp}, the tests need {MIN_FREE_GB:g}: free disk space or set TMPDIR"
        )


@pytest.fixture(autouse=True)
def _restore_aotlm_logger():
    """CLI commands run in-process (``aotlm.cli.main``, also from module-scoped fixtures) give the
    ``aotlm`` logger a handler and stop its propagation; put back the state of the session's start
    after each test, so later tests' ``caplog`` still sees aotlm's logs."""
    yield
    _AOTLM_LOG.handlers[:] = _PRISTINE_LOG[0]
    _AOTLM_LOG.propagate = _PRISTINE_LOG[1]
    _AOTLM_LOG.setLevel(_PRISTINE_LOG[2])


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def peaked(ckpt_dir):
    """The peaked Llama checkpoint (``builders.peaked_checkpoint``)."""
    from builders import peaked_checkpoint  # torch + transformers: only for the tests that use it

    return peaked_checkpoint(ckpt_dir)


@pytest.fixture(scope="session")
def gpt2_path(ckpt_dir):
    import transformers

    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=256)
    return make_checkpoint(ckpt_dir / "gpt2", cfg)


@pytest.fixture(scope="session")
def llama_path(ckpt_dir):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=101,
        max_position_embeddings=256,
    )
    return make_checkpoint(ckpt_dir / "llama", cfg)
