"""``kv_cache_dtype``: a bf16 / f16 KV cache independent of ``amp`` (``aotlm.core.precision``).

What is checked: the ``bdot`` kernel reading bf16 / f16 caches in their two layouts (keys
``[B*K, S, Dh]``, values ``[B*K, Dh, S]``) against float64 NumPy on odd shapes; logits error and
greedy agreement against the f32 cache on a tiny Llama and a tiny GPT-2, with prompts long enough
that later prefill chunks and every decode step read the cache; the forced fallback
(``AOTLM_KERNELS=0``) giving the kernel path's tokens; the memory plan; the compile cache (a
second model object loads every graph with zero traces / lowerings / compiles); tp=2 on forced
devices; the one-line error for a bad value.

Bounds (relative to the f32-cache model's largest logit), ~3-5x the measured errors: bf16 cache
1.6e-4 to 3.2e-4 (tiny Llama) and 1.1e-4 (tiny GPT-2, int8 weights) -> 1.5e-3; f16 (Llama)
1.9e-5 to 3.5e-5 -> 2e-4. The peaked
Llama (``test_quant``: top-1 margins >= 20% of max|logit|) must give identical greedy
tokens; the random GPT-2 too, as measured (its margins along the path exceed the error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import PROMPTS
from compile_counter import count_compiles

from aotlm import AutoModelForSampling, kernels
from aotlm.core import memory, precision
from aotlm.models import family_for
from aotlm.models.checkpoint import load_hf_config

ON = pytest.mark.skipif(not kernels.enabled(), reason="aotlm kernels unavailable on this machine")
REL = {"bf16": 1.5e-3, "f16": 2e-4}
NEW = 12
LONG = np.random.default_rng(5).integers(0, 101, (2, 19))  # 3 prefill chunks of 8: chunks 2, 3 read the cache


def _load(path, kv, **kw):
    kw = dict(dict(batch_size=2, n_positions=32, context_length_estimate=[8], compile_cache=False), **kw)
    return AutoModelForSampling.from_pretrained(path, kv_cache_dtype=kv, **kw).compile()


def _run(m):
    return m.forward(LONG), m.sample(PROMPTS, max_new_tokens=NEW), m.sample(LONG, max_new_tokens=NEW)


@pytest.fixture(scope="module")
def tp_proc(peaked):
    """One device, tp=2 and pp=2 with a bf16 cache on 2 forced CPU devices, in a subprocess started
    first: ``{name: [tokens, cache dtype, devices of one cache buffer]}``."""
    code = (
        "import json, sys, numpy as np\nfrom aotlm import AutoModelForSampling\n"
        "ids = np.arange(2 * 19).reshape(2, 19) % 101\nout = {}\n"
        "for name, kw in (('1', {}), ('tp2', {'tp_degree': 2}), ('pp2', {'pp_degree': 2})):\n"
        "    m = AutoModelForSampling.from_pretrained(sys.argv[1], batch_size=2, n_positions=32,"
        " context_length_estimate=[8], compile_cache=False, kv_cache_dtype='bf16', **kw)\n"
        "    c = (m.stages[0].cache if name == 'pp2' else m.cache)['k'][0]\n"
        "    out[name] = [m.sample(ids, max_new_tokens=8).tolist(), str(c.dtype),"
        " len(c.sharding.device_set)]\n"
        "print(json.dumps(out))\n"
    )
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, "-c", code, str(peaked)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv_cc")


@pytest.fixture(scope="module")
def llama_runs(peaked, tp_proc, cache_dir):
    """Outputs per cache dtype; the bf16 model's graphs go to ``cache_dir`` (the cold start of
    ``test_compile_cache_reload_compiles_nothing``)."""
    cc = lambda kv: {"compile_cache": str(cache_dir)} if kv == "bf16" else {}
    return {kv: _run(_load(peaked, kv, **cc(kv))) for kv in (None, "bf16", "f16")}


def test_bad_value_is_a_one_line_error(peaked):
    for bad in ("int4", "fp8", 16, "int8"):
        with pytest.raises(ValueError) as e:
            precision.kv_cache_name(bad)
        msg = str(e.value)
        assert "\n" not in msg and all(c in msg for c in ("'f32'", "'bf16'", "'f16'", "None"))
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat8'.*'bf16'"):
        AutoModelForSampling.from_pretrained(peaked, kv_cache_dtype="bfloat8", compile_cache=False)
    assert precision.kv_cache_name("BFloat16") == "bf16" and precision.kv_cache_name(None) is None
    assert precision.resolve("bf16", None, False, "f32").kv == jnp.float32  # apart from amp, either way
    assert precision.resolve("f32", "int8", True, "bf16").kv == jnp.bfloat16


@ON
@pytest.mark.parametrize("cdt", [jnp.bfloat16, jnp.float16, "bf16 bits"])
def test_bdot_reads_low_precision_caches_like_numpy(cdt):
    """Scores ``q . k`` over a keys cache [I, S, Dh] and ``p . v`` over a values cache [I, Dh, S],
    odd shapes, only the written slots (a traced limit); NaN wherever the kernel must not read.
    "bf16 bits": the cache as CPU models store a bf16 one (uint16, ``layers.cache_view``)."""
    rng = np.random.default_rng(7)
    bits = cdt == "bf16 bits"
    cdt = jnp.bfloat16 if bits else cdt
    dev = lambda a: jnp.asarray(a.view(np.uint16) if bits else a)
    f = jax.jit(kernels.bdot, static_argnames=("n",))
    for i, g, s, dh, w, lim in [(3, 1, 37, 17, 29, 23), (4, 5, 70, 64, 64, 41), (2, 3, 130, 40, 129, 129)]:
        for adt in (jnp.float32, jnp.bfloat16):
            keys = np.array(jnp.asarray(rng.standard_normal((i, s, dh)), cdt))
            keys[:, lim:] = np.nan  # slots not written yet
            q = jnp.asarray(rng.standard_normal((i, g, dh)), adt)
            sc = f(q, dev(keys), n=w, n_limit=jnp.int32(lim))
            k64 = np.nan_to_num(np.asarray(keys, np.float64)[:, :w])
            ref = np.einsum("imd,ind->imn", np.asarray(q, np.float64), k64)
            np.testing.assert_allclose(
                np.asarray(sc, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
            )
            vals = np.array(jnp.asarray(rng.standard_normal((i, dh, s)), cdt))
            vals[:, :, lim:] = np.nan
            p = jnp.asarray(rng.random((i, g, w)), adt)
            o = f(p, dev(vals), n=dh, l_limit=jnp.int32(lim))
            p64, v64 = np.asarray(p, np.float64)[..., :lim], np.asarray(vals, np.float64)[:, :, :lim]
            ref = np.einsum("iml,inl->imn", p64, v64)
            np.testing.assert_allclose(
                np.asarray(o, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
            )


def _err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("kv", ["bf16", "f16"])
def test_llama_logits_and_greedy_tokens_vs_f32_cache(llama_runs, kv):
    ref, got = llama_runs[None], llama_runs[kv]
    err = _err(got[0], ref[0])
    print(f"tiny Llama, {kv} cache: max|dz| / max|z| = {err:.2e}")
    assert 0 < err <= REL[kv]  # > 0: the cache really is read at the lower precision
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_array_equal(got[2], ref[2])


@ON
def test_gpt2_greedy_agreement_and_cache_dtype(gpt2_path):
    runs = {kv: (_run(m), m) for kv in (None, "bf16") for m in [_load(gpt2_path, kv, quant="int8")]}
    (ref, m32) = runs[None]
    assert m32.cache["k"][0].dtype == jnp.float32  # int8 weights with the kernels: f32 cache by default
    for kv, dt in (("bf16", jnp.uint16),):  # bf16 on CPU: its bits (aotlm.models.layers.cache_view)
        got, m = runs[kv]
        assert all(c.dtype == dt for c in m.cache["k"] + m.cache["v"])
        assert f"{kv} KV" in m.precision.describe()
        err = _err(got[0], ref[0])
        print(f"tiny GPT-2 int8, {kv} cache: max|dz| / max|z| = {err:.2e}")
        assert 0 < err <= REL[kv]
        np.testing.assert_array_equal(got[1], ref[1])
        np.testing.assert_array_equal(got[2], ref[2])
        decode = [e.as_text() for k, e in m._executables.items() if k[0] == "decode"]
        assert decode and all("aotlm_dattn" in t for t in decode)
        b, kh, s, dh = m.cache["k"][0].shape  # no whole-cache f32 copy around the writes (cache_view)
        assert not any(f"f32[{b},{kh},{x}]" in t for t in decode for x in (f"{s},{dh}", f"{dh},{s}"))


@ON
def test_forced_fallback_gives_the_kernel_paths_tokens(peaked, llama_runs, monkeypatch):
    monkeypatch.setenv("AOTLM_KERNELS", "0")
    m = _load(peaked, "bf16")
    assert m.cache["k"][0].dtype == jnp.uint16  # bf16 bits, read through layers.cache_view
    assert all("aotlm_" not in e.as_text() for e in m._executables.values())
    lg, *tokens = _run(m)
    on = llama_runs["bf16"]
    assert _err(lg, on[0]) <= 1e-4
    for a, b in zip(tokens, on[1:], strict=True):
        np.testing.assert_array_equal(a, b)


def test_memory_plan_counts_the_cache_dtype(peaked, capsys):
    cfg = family_for("llama").arch_config(load_hf_config(peaked))
    f32 = memory.memory_plan(cfg, 8, 1024, kv_cache_dtype="f32")
    bf16 = memory.memory_plan(cfg, 8, 1024, kv_cache_dtype="bf16")
    pos = 8 * 1024 * 4  # the slot positions (int32) are not part of the keys and values
    assert bf16["kv_cache_bytes"] * 2 == f32["kv_cache_bytes"]
    assert (bf16["kv_cache_bytes_per_device"] - pos) * 2 == f32["kv_cache_bytes_per_device"] - pos
    assert bf16["weights_bytes"] == f32["weights_bytes"] and "kv=bfloat16" in memory.format_plan(bf16)
    plan = memory.plan_for_checkpoint(peaked, 4, 32, kv_cache_dtype="f16")
    assert plan["kv_dtype"] == "float16"
    from aotlm.cli.app import main  # local: the CLI is only needed here

    assert main(["compile", str(peaked), "--dry-run", "--batch-size", "8", "--kv-cache-dtype", "bf16"]) == 0
    assert "kv=bfloat16" in capsys.readouterr().out


@ON
def test_compile_cache_reload_compiles_nothing(peaked, llama_runs, cache_dir, tmp_path):
    """The bf16 model of ``llama_runs`` filled ``cache_dir`` (with kernel calls in every graph)."""
    kw = dict(batch_size=2, n_positions=32, context_length_estimate=[8], compile_cache=str(cache_dir))
    f32 = AutoModelForSampling.from_pretrained(peaked, **kw)
    with count_compiles() as c:
        warm = AutoModelForSampling.from_pretrained(peaked, kv_cache_dtype="bf16", **kw).compile()
        tokens = warm.sample(PROMPTS, max_new_tokens=NEW)
    assert c == {"backend": 0, "lowering": 0, "tracing": 0}
    assert all(r["hit"] for r in warm.compile_report)
    assert f32.fingerprint() != warm.fingerprint()  # the cache dtype is part of the key
    np.testing.assert_array_equal(tokens, llama_runs["bf16"][1])
    saved = tmp_path / "art"
    warm.save(saved)
    other = AutoModelForSampling.from_pretrained(peaked, kv_cache_dtype="f16", **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype: saved 'bf16', this model 'f16'"):
        other.load(saved)


def test_tp2_and_pp2_with_a_bf16_cache(tp_proc):
    out, err = tp_proc.communicate(timeout=600)
    assert tp_proc.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert {r[1] for r in res.values()} == {"uint16"} and res["tp2"][2] == 2  # bf16 bits
    assert res["1"][0] == res["tp2"][0] == res["pp2"][0]
