"""Per-backend choices (``aotlm.core.backend``): the decode loop's step groups give the tokens of a
step-by-step loop, and XLA compile options reach the executable and its compile-cache key.

The GPU runs steps in groups (no host round trip inside a group) and picks the sampler's path once
per call; these tests run those loop shapes on CPU (``AOTLM_DECODE_GROUP``), where they must be
token-for-token the CPU loop's: greedy, sampled, rows of unequal budgets, eos in the middle of a
group, and a streamer (one token per call); their log-probs equal to an ulp or two (the same f32
ops in two graphs: the suite's XLA flags, tests/conftest.py, can round a fusion differently).
"""

from __future__ import annotations

import numpy as np
import pytest

from aotlm import AutoModelForSampling
from aotlm.core import backend
from aotlm.core.compile_cache import environment_fields


def runs(path, group: str, monkeypatch) -> list:
    monkeypatch.setenv("AOTLM_DECODE_GROUP", group)
    m = AutoModelForSampling.from_pretrained(path, batch_size=2, n_positions=64, compile_cache=False)
    assert m.decode_group == int(group) and m.fingerprint()["decode_group"] == int(group)
    ids = np.random.default_rng(0).integers(3, 90, (2, 10))
    greedy = m.sample(ids, max_new_tokens=37)
    out = [greedy]
    out.append(m.sample(ids, max_new_tokens=[37, 20], do_sample=True, temperature=0.9, top_p=0.8, seed=3))
    eos = [int(greedy[0, 15]), int(greedy[1, 21])]  # each row ends inside a group of 8
    res = m.sample(ids, max_new_tokens=30, eos_token_id=eos, return_dict=True)
    out += [res.sequences, res.num_generated, np.asarray(res.finish_reason), res.logprobs]
    out.append(
        m.sample(
            ids, max_new_tokens=12, repetition_penalty=1.3, top_logprobs=2, return_dict=True
        ).top_logprobs
    )
    out.append(m.sample(ids, max_new_tokens=12, sequence_bias=[[[7], 9.0]]))  # greedy with a bias
    toks = []
    m.sample(
        ids,
        max_new_tokens=9,
        streamer=type("S", (), {"put": lambda s, t: toks.append(t), "end": lambda s: 0})(),
    )
    out.append(np.concatenate([np.asarray(t).reshape(2, -1) for t in toks[1:]], axis=1))
    return out


def test_step_groups_give_the_step_by_step_tokens(llama_path, monkeypatch):
    ref = runs(llama_path, "0", monkeypatch)
    for group in ("1", "8"):
        got = runs(llama_path, group, monkeypatch)
        for a, b in zip(ref, got, strict=True):
            for x, y in zip(
                a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True
            ):
                x, y = np.asarray(x), np.asarray(y)
                if np.issubdtype(x.dtype, np.floating):  # log-probs: two graphs' f32 ops, equal to 1 ulp
                    np.testing.assert_allclose(x, y, rtol=2.5e-7, atol=0)
                else:  # tokens, counts, finish reasons: identical
                    np.testing.assert_array_equal(x, y)


def test_compile_options_reach_the_key_and_bad_ones_are_one_line(monkeypatch):
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    base = environment_fields(mesh)["compiler_options"]
    monkeypatch.setenv(backend.ENV, '{"xla_cpu_enable_fast_math": true}')
    assert environment_fields(mesh)["compiler_options"] == {**base, "xla_cpu_enable_fast_math": True}
    monkeypatch.setenv(backend.ENV, "{not json")
    with pytest.raises(ValueError, match="AOTLM_XLA_OPTIONS is not JSON"):
        backend.compiler_options("cpu")
    monkeypatch.setenv(backend.ENV, "[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        backend.compiler_options("cpu")
    monkeypatch.setenv(backend.GROUP_ENV, "eight")
    with pytest.raises(ValueError, match="AOTLM_DECODE_GROUP"):
        backend.decode_group("gpu")


def test_gpu_defaults_group_steps_and_cpu_checks_every_step(monkeypatch):
    monkeypatch.delenv(backend.GROUP_ENV, raising=False)
    assert backend.decode_group("cpu") == 0
    assert backend.decode_group("cuda") == backend.decode_group("gpu") > 1


def test_a_compile_option_is_applied_to_the_executable(llama_path, monkeypatch):
    """An XLA option given through AOTLM_XLA_OPTIONS changes what XLA builds: dumping the HLO
    (``xla_dump_to``) writes files only when the option reached the compiler."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        monkeypatch.setenv(backend.ENV, f'{{"xla_dump_to": "{d}"}}')
        m = AutoModelForSampling.from_pretrained(
            llama_path, batch_size=1, n_positions=64, compile_cache=False
        )
        m.compile_graph(("decode", 64))
        assert any(Path(d).iterdir()), "the option did not reach XLA"
