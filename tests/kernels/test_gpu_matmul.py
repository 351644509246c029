"""The GPU decode rows' kernel (``aotlm.kernels.gpu_matmul``: bf16 / f16 and int8 weights), checked
where CI can: in Pallas' interpreter on CPU (its values against a float32 product of the same matrix),
its lowering for ``cuda`` (Triton IR: every block a power of two, no GPU needed), its switch and tiles,
and a model whose decode products take it (the interpreter standing in for the GPU) giving XLA's path's
tokens. On a GPU the compiled kernel and model are checked against the same references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from conformance import make_checkpoint

from aotlm import AutoModelForSampling
from aotlm.kernels import gpu_matmul as g

# rows, w's logical shape (K dims, N dims), axes, nt, tiles (None: the picked ones), w's dtype
CASES = [
    (1, (256,), (512,), 1, False, None, "int8"),
    (1, (256,), (512,), 1, False, None, "bf16"),
    (5, (512,), (192,), 1, False, g.Tiles(64, 64, 2), "int8"),
    (16, (4, 64), (128,), 2, False, None, "int8"),  # an o_proj: w [H, Dh, D]
    (16, (4, 64), (128,), 2, False, None, "f16"),
    (7, (128,), (4, 32), 1, False, None, "int8"),  # a q_proj: w [D, H, Dh]
    (33, (2048,), (128,), 1, True, None, "int8"),  # a tied lm_head's embed_q [V, D]
    (9, (512,), (256,), 1, True, None, "bf16"),  # a tied lm_head's table
    (64, (1024,), (96,), 1, True, g.Tiles(32, 128, 4, 2, 2), "int8"),
    (64, (1024,), (96,), 1, False, g.Tiles(32, 128, 4, 2, 2), "bf16"),
    (1, (256,), (512,), 1, False, None, "f8"),  # quant="fp8": e4m3 rows times an e4m3 weight
    (16, (4, 64), (128,), 2, False, None, "f8"),
    (33, (2048,), (128,), 1, True, None, "f8"),  # a tied lm_head's e4m3 copy
]
FLOATS = {"bf16": jnp.bfloat16, "f16": jnp.float16}


def operands(rows, kd, nd, nt, wtype="int8", seed=0):
    """x in bf16 (f16 with f16 weights, e4m3 with e4m3 ones), w and its scale (None for a float weight)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, *kd)), FLOATS.get(wtype, jnp.bfloat16))
    shape = (*nd, *kd) if nt else (*kd, *nd)
    if wtype == "f8":  # values over e4m3's range, subnormals included
        x = jnp.asarray(rng.normal(size=x.shape) * 50, jnp.float8_e4m3fn)
        w = jnp.asarray(np.clip(rng.normal(size=shape) * 100, -448, 448), jnp.float8_e4m3fn)
        return x, w, jnp.asarray(rng.uniform(1e-3, 1e-2, nd), jnp.float32)
    if wtype != "int8":
        return x, jnp.asarray(rng.normal(size=shape) * 0.05, x.dtype), None
    w = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    return x, w, jnp.asarray(rng.uniform(1e-3, 1e-2, nd), jnp.float32)


def reference(x, w, s, axes, nt):
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    y = (
        jnp.dot(xf, wf.T, precision="highest")
        if nt
        else jnp.tensordot(xf, wf, axes=axes, precision="highest")
    )
    return y if s is None else y * s


def cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("rows,kd,nd,axes,nt,tiles,wtype", CASES)
def test_interpreted_kernel_equals_the_float32_product(rows, kd, nd, axes, nt, tiles, wtype):
    x, w, s = operands(rows, kd, nd, nt, wtype)
    y = g.matmul(x, w, s, axes, nt, interpret=True, tiles=tiles)
    ref = reference(x, w, s, axes, nt)
    assert y.shape == ref.shape and y.dtype == jnp.float32
    # bf16 / f16 x times int8 codes or bf16 / f16 weights are exact in f32: only the sums' order differs
    assert float(jnp.abs(y - ref).max() / jnp.abs(ref).max()) < 1e-6
    t = tiles or g.config(x, w, axes, nt)
    text = cuda_text(lambda x, w, s: g.matmul(x, w, s, axes, nt, tiles=t), x, w, s)
    assert text.count("xla.gpu.triton") == 1 and "aotlm_gpu_rows" in text


@pytest.mark.parametrize(
    "k,n",
    [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (4096, 14336), (14336, 4096), (4096, 128256)],
)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_llama_shapes_get_tiles_that_lower_for_cuda(k, n, rows):
    """Llama-3.2-1B / -3.1-8B decode products (vocab 128,256 included) all take the kernel, and the
    picked tiles lower to Triton (a block that is not a power of two fails right there)."""
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    w, s = jax.ShapeDtypeStruct((k, n), jnp.int8), jax.ShapeDtypeStruct((n,), jnp.float32)
    t = g.config(x, w)
    assert t is not None and n % t.bn == 0 and k % (t.bk * t.splits) == 0
    assert (n // t.bn) * t.splits >= 32  # enough programs to spread over the SMs
    assert 4 * t.splits * g.padded_rows(rows) * n <= k * n / 8 or t.splits == 1  # partial sums stay small
    assert cuda_text(lambda x, w, s: g.matmul(x, w, s), x, w, s).count("xla.gpu.triton") == 1


def test_lowering_rejects_rows_that_are_not_a_power_of_two():
    """Why rows are padded: the Triton lowering refuses a 24-row block (so the check above can fail)."""
    x, w, s = operands(24, (256,), (128,), False)
    with pytest.raises(ValueError, match="power of 2"):
        cuda_text(lambda x, w, s: g._call(x, w, g.Tiles(64, 128), False, False), x, w, s)


def test_setting_and_cache_tag(monkeypatch):
    monkeypatch.delenv(g.ENV, raising=False)
    assert g.setting() == "xla" == g.cache_tag()
    monkeypatch.setenv(g.ENV, "pallas")
    assert g.setting() == "pallas" == g.cache_tag()
    monkeypatch.setenv(g.ENV, "pallas:bn=32,bk=256,splits=2,warps=8,stages=2")
    assert g.setting() == g.Tiles(32, 256, 2, 8, 2) and g.cache_tag() == "pallas-32-256-2-8-2"
    for bad in ("triton", "pallas:", "pallas:bn=48", "pallas:bn=64,bq=2", "pallas:bn=8", "pallas:bn=x"):
        monkeypatch.setenv(g.ENV, bad)
        with pytest.raises(ValueError, match=f"{g.ENV}="):
            g.setting()


def test_takes_only_gpu_matmul_decode_rows(monkeypatch):
    x, w, s = operands(4, (256,), (128,), False)
    monkeypatch.setenv(g.ENV, "pallas")
    assert not g.takes(x, w, s)  # this is a CPU
    monkeypatch.setattr(g, "on_gpu", lambda: True)
    assert g.takes(x, w, s)
    assert not g.takes(x, w, None)  # no scale: not an int8 matrix of quant.py
    assert not g.takes(x.astype(jnp.float32), w, s)  # f32 x keeps XLA's exact dot
    assert not g.takes(jnp.zeros((65, 256), jnp.bfloat16), w, s)  # prefill rows
    assert g.takes(x, w.astype(jnp.bfloat16), None)  # bf16 weights (amp="bf16")
    assert not g.takes(x, w.astype(jnp.bfloat16), s)
    assert not g.takes(x, w.astype(jnp.float16), None)  # weights in another dtype than x
    assert not g.takes(jnp.zeros((4, 200), jnp.bfloat16), jnp.zeros((200, 128), jnp.int8), s)  # no tile
    x8, w8 = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
    assert g.takes(x8, w8, s)  # quant="fp8": e4m3 rows and weight
    assert not g.takes(x8, w8, None) and not g.takes(x, w8, s) and not g.takes(x8, w, s)
    monkeypatch.setenv(g.ENV, "xla")
    assert not g.takes(x, w, s)


def tiny_llama(root, vocab: int, tied: bool):
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=tied,
    )  # fmt: skip
    return make_checkpoint(root / f"llama-{vocab}-{tied}", cfg)


def run_bf16(path, ids, quant: str | None = "int8"):
    m = AutoModelForSampling.from_pretrained(
        path, batch_size=2, n_positions=64, amp="bf16", quant=quant, compile_cache=False
    )
    return m, m.sample(ids, max_new_tokens=12), np.asarray(m.forward(ids), np.float32)


def switched_on(monkeypatch, mod, record, simulate: bool = True) -> list:
    """Kernel module ``mod``'s kernel switched on (``simulate``: the backend taken for a GPU, Pallas
    interpreting); the list ``record(*args)`` of each of its calls goes to."""
    calls, real = [], mod._call

    def counted(*args):
        calls.append(record(*args))
        return real(*args)

    monkeypatch.setattr(mod, "_call", counted)
    if simulate:
        monkeypatch.setattr(mod, "on_gpu", lambda: True)
        monkeypatch.setattr(mod, "INTERPRET", True)
    monkeypatch.setenv(mod.ENV, "pallas")
    return calls


def as_on_a_gpu(monkeypatch, simulate: bool = True) -> list:
    """The products' kernel switched on; its calls' ``(w shape, nt)``."""
    return switched_on(monkeypatch, g, lambda x2, w2, t, nt, interpret: (w2.shape, nt), simulate)


@pytest.mark.parametrize("quant,vocab,tied", [("int8", 96, False), (None, 128, True), ("fp8", 128, True)])
def test_model_decode_through_the_kernel_gives_xlas_tokens(tmp_path, monkeypatch, quant, vocab, tied):
    """amp bf16 as on a GPU (the CPU kernels off), int8, bf16 or fp8 weights, a Llama whose vocabulary is
    whole tiles: with the kernel (interpreted) every product of up to 64 rows, the lm_head's (the tied
    table's) too, goes through it, and the greedy tokens are XLA's path's."""
    monkeypatch.setenv("AOTLM_KERNELS", "0")
    path, ids = tiny_llama(tmp_path, vocab, tied), np.random.default_rng(0).integers(3, 90, (2, 9))
    _, tokens, logits = run_bf16(path, ids, quant)
    calls = as_on_a_gpu(monkeypatch)
    _, tokens2, logits2 = run_bf16(path, ids, quant)
    head = ((vocab, 64), True) if tied else ((64, vocab), False)
    assert head in calls and len(set(calls)) >= 4  # the lm_head and the layers' matrices
    np.testing.assert_array_equal(tokens, tokens2)
    assert np.abs(logits - logits2).max() <= 2e-2 * np.abs(logits).max()  # bf16 x, sums in another order


def test_tied_lm_head_reads_an_int8_copy_through_the_kernel(tmp_path, monkeypatch):
    """A tied lm_head on a GPU reads the bf16 embedding through XLA; with the kernel on, the loader
    makes its int8 copy (``embed_q``, as the CPU kernels' load does) and the logits read that (``nt``);
    the memory plan counts the copy."""
    from aotlm.core import memory

    monkeypatch.setenv("AOTLM_KERNELS", "0")
    path, ids = tiny_llama(tmp_path, 128, True), np.random.default_rng(1).integers(3, 120, (2, 9))
    m, _, logits = run_bf16(path, ids)
    assert "embed_q" not in m.params
    calls = as_on_a_gpu(monkeypatch)
    m2, _, logits2 = run_bf16(path, ids)
    assert m2.params["embed_q"].shape == (128, 64) and m2.params["embed_q"].dtype == jnp.int8
    assert ((128, 64), True) in calls
    assert np.abs(logits - logits2).max() <= 5e-2 * np.abs(logits).max()  # the lm_head rounded to int8
    plan = memory.plan_for_checkpoint(path, batch_size=2, n_positions=64, amp="bf16", quant="int8")
    assert plan["weights_bytes"] == sum(a.nbytes for a in jax.tree.leaves(m2.params))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the compiled Triton kernel")
@pytest.mark.parametrize("rows,kd,nd,axes,nt,tiles,wtype", CASES)
def test_compiled_kernel_on_a_gpu(rows, kd, nd, axes, nt, tiles, wtype):
    x, w, s = operands(rows, kd, nd, nt, wtype)
    y = jax.jit(lambda x, w, s: g.matmul(x, w, s, axes, nt, interpret=False, tiles=tiles))(x, w, s)
    ref = reference(x, w, s, axes, nt)
    assert float(jnp.abs(y - ref).max() / jnp.abs(ref).max()) < 1e-5


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the compiled Triton kernel")
@pytest.mark.parametrize("quant", ["int8", None, "fp8"])
def test_model_on_a_gpu_through_the_compiled_kernel(tmp_path, monkeypatch, quant):
    """On a GPU, ``AOTLM_GPU_MATMUL=pallas``: the same greedy tokens as XLA's path, logits close."""
    path, ids = tiny_llama(tmp_path, 96, False), np.random.default_rng(0).integers(3, 90, (2, 9))
    monkeypatch.setenv(g.ENV, "xla")
    _, tokens, logits = run_bf16(path, ids, quant)
    calls = as_on_a_gpu(monkeypatch, simulate=False)
    _, tokens2, logits2 = run_bf16(path, ids, quant)
    assert ((64, 96), False) in calls and len(set(calls)) >= 4
    np.testing.assert_array_equal(tokens, tokens2)
    assert np.abs(logits - logits2).max() <= 2e-2 * np.abs(logits).max()
