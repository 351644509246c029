"""The GPU decode-attention kernel (``aotlm.kernels.gpu_attention``), checked where CI can: in Pallas'
interpreter on CPU against a float64 softmax over the slots each row may see (mask holes, per-row
limits, a row that sees nothing, a cache longer and wider than the step's), its lowering for ``cuda``
(Triton IR, no GPU needed) at Llama-3.2-1B / 3.1-8B decode shapes, its switch, and a model whose decode
steps take it (the interpreter standing in for the GPU) giving XLA's path's tokens. On a GPU the
compiled kernel and model are checked against the same references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gpu_matmul import switched_on, tiny_llama

from aotlm import AutoModelForSampling
from aotlm.kernels import gpu_attention as ga

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# batch rows, kv heads, query heads per kv head, head size, cache slots, bucket width, cache rows
SHAPES = [(3, 2, 4, 16, 80, 64, 4), (1, 8, 4, 64, 640, 256, 1), (2, 1, 7, 32, 96, 96, 2)]


def operands(b, kh, g, dh, s, w, rb, dtype="f32", seed=0):
    """q, the cache's keys / values (``rb`` rows), the step's own k / v, the mask (holes; of two rows or
    more, the last sees nothing) and per-row limits (the first under the bucket, others up to past it)."""
    rng, dt = np.random.default_rng(seed), DTYPES[dtype]
    i = b * kh
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dt)
    mask = rng.random((b, w + 1)) > 0.3
    mask[-1] = b == 1  # with two rows or more the last one sees nothing
    limit = np.repeat(rng.integers(1, w + 8, b), kh)
    limit[0] = w // 2 + 3
    return (arr(i, g, dh), arr(rb * kh, s, dh), arr(rb * kh, dh, s), arr(i, dh), arr(i, dh),
            jnp.asarray(mask), jnp.asarray(limit, jnp.int32))  # fmt: skip


def reference(q, keys, values, kn, vn, mask, limit, scale):
    f = lambda x: np.asarray(x, np.float64)
    q, keys, values, kn, vn, mask, limit = map(f, (q, keys, values, kn, vn, mask, limit))
    rows, g, dh = q.shape
    b, w1 = mask.shape
    out = np.zeros((rows, g, dh))
    for i in range(rows):
        seen = [j for j in range(w1 - 1) if mask[i * b // rows, j] and j < limit[i]]
        ks, vs = [keys[i, j] for j in seen], [values[i, :, j] for j in seen]
        if mask[i * b // rows, -1]:
            ks, vs = [*ks, kn[i]], [*vs, vn[i]]
        if ks:
            s = q[i] @ np.array(ks).T * scale
            p = np.exp(s - s.max(1, keepdims=True))
            out[i] = (p / p.sum(1, keepdims=True)) @ np.array(vs)
    return out


def cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "dtype,blocks",
    [("f32", None), ("f32", ga.Blocks(16, 2)), ("bf16", None), ("f16", None)],
)
def test_interpreted_kernel_equals_softmax_attention(shape, dtype, blocks):
    args = operands(*shape, dtype)
    b = blocks or ga.blocks(args[0].shape[0], shape[5])  # (config() refuses f32: TF32 on a GPU)
    y = ga.attend(*args, 0.3, interpret=True, blocks=b)
    ref = reference(*args, 0.3)
    assert y.shape == ref.shape and y.dtype == jnp.float32
    assert shape[0] == 1 or not np.asarray(y)[-shape[1] :].any()  # a row that sees nothing: zeros
    # f32: f32 rounding (exp, sums in another order); bf16 / f16: the probabilities rounded for the values
    tol = 1e-5 if dtype == "f32" else 1e-2
    err = float(np.abs(np.asarray(y) - ref).max() / np.abs(ref).max())
    assert err < tol, err
    if dtype != "f32":
        assert ga.config(args[0], args[1], shape[5]) == b
        text = cuda_text(lambda *a: ga.attend(*a, 0.3, blocks=b), *args)
        assert text.count("xla.gpu.triton") == 1 and "aotlm_gpu_dattn" in text


@pytest.mark.parametrize("h,kh,dh", [(32, 8, 64), (32, 8, 128)])  # Llama-3.2-1B, Llama-3.1-8B
@pytest.mark.parametrize("b,width", [(1, 128), (1, 640), (16, 1024), (64, 256), (1, 8192)])
def test_llama_steps_get_blocks_that_lower_for_cuda(h, kh, dh, b, width):
    rows, bf = b * kh, jnp.bfloat16
    args = (
        jax.ShapeDtypeStruct((rows, h // kh, dh), bf),
        jax.ShapeDtypeStruct((rows, 8192, dh), bf),
        jax.ShapeDtypeStruct((rows, dh, 8192), bf),
        jax.ShapeDtypeStruct((rows, dh), bf),
        jax.ShapeDtypeStruct((rows, dh), bf),
        jax.ShapeDtypeStruct((b, width + 1), jnp.bool_),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
    )
    blocks = ga.config(args[0], args[1], width)
    assert blocks is not None and width % (blocks.bs * blocks.splits) == 0
    assert rows * blocks.splits <= max(rows, ga.TARGET_PROGRAMS)
    text = cuda_text(lambda *a: ga.attend(*a, 0.125, blocks=blocks), *args)
    assert text.count("xla.gpu.triton") == 1


def test_setting_and_cache_tag(monkeypatch):
    monkeypatch.delenv(ga.ENV, raising=False)
    assert ga.setting() == "xla" and ga.cache_tag() == "xla"
    monkeypatch.setenv(ga.ENV, "pallas")
    assert ga.setting() == "pallas" and ga.cache_tag() == "pallas"
    monkeypatch.setenv(ga.ENV, "pallas:bs=32,splits=3,warps=8")
    assert ga.setting() == ga.Blocks(32, 3, 8) and ga.cache_tag() == "pallas-32-3-8-2"
    for bad in ("cudnn", "pallas:", "pallas:bs=24", "pallas:bs=8", "pallas:splits=0,bs=16", "pallas:x=1"):
        monkeypatch.setenv(ga.ENV, bad)
        with pytest.raises(ValueError, match=ga.ENV):
            ga.setting()


def test_takes_only_gpu_bf16_decode_steps(monkeypatch):
    q = jax.ShapeDtypeStruct((2, 1, 8, 64), jnp.bfloat16)
    keys = jax.ShapeDtypeStruct((2, 2, 256, 64), jnp.bfloat16)
    monkeypatch.setenv(ga.ENV, "pallas")
    assert not ga.takes(q, keys, 128)  # not on a GPU
    monkeypatch.setattr(ga, "on_gpu", lambda: True)
    assert ga.takes(q, keys, 128)
    f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
    assert not ga.takes(f32(q), f32(keys), 128)  # float32 keeps XLA's exact path
    assert not ga.takes(q, f32(keys), 128)  # a cache of another dtype
    assert not ga.takes(jax.ShapeDtypeStruct((2, 2, 8, 64), jnp.bfloat16), keys, 128)  # two tokens a row
    assert not ga.takes(jax.ShapeDtypeStruct((2, 1, 8, 80), jnp.bfloat16), keys, 128)  # head size 80
    assert not ga.takes(q, keys, 100)  # no block divides the bucket
    monkeypatch.setenv(ga.ENV, "xla")
    assert not ga.takes(q, keys, 128)


def prompts(seed: int = 0):
    """Two prompts of 9 and 4 tokens, the shorter one left-padded (holes in its rows' masks)."""
    ids = np.random.default_rng(seed).integers(3, 90, (2, 9))
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def run_bf16(path, ids, mask):
    m = AutoModelForSampling.from_pretrained(
        path, batch_size=2, n_positions=64, amp="bf16", compile_cache=False
    )
    out = m.sample(ids, max_new_tokens=14, attention_mask=mask, return_dict=True, top_logprobs=4)
    return out.sequences, out.top_logprobs[1]


def as_on_a_gpu(monkeypatch, simulate: bool = True) -> list:
    """The attention kernel switched on (``test_gpu_matmul.switched_on``); its calls' shapes and blocks."""
    record = lambda lim, q, keys, values, mask, *rest: (q.shape, keys.shape, mask.shape, rest[1])
    return switched_on(monkeypatch, ga, record, simulate)


def test_model_decode_through_the_kernel_gives_xlas_tokens(tmp_path, monkeypatch):
    """amp bf16 as on a GPU (the CPU kernels off), two prompts of unequal length (the shorter one
    left-padded: mask holes): with the kernel (interpreted) every decode step's attention goes through
    it, and the greedy tokens and their top log-probabilities are XLA's path's."""
    monkeypatch.setenv("AOTLM_KERNELS", "0")
    path = tiny_llama(tmp_path, 96, False)
    tokens, scores = run_bf16(path, *prompts())
    calls = as_on_a_gpu(monkeypatch)
    tokens2, scores2 = run_bf16(path, *prompts())
    assert calls and all(q == (4, 16, 16) for q, _, _, _ in calls)  # 2 rows x 2 kv heads, 2 heads -> 16
    np.testing.assert_array_equal(tokens, tokens2)
    assert np.abs(scores - scores2).max() <= 2e-2 * np.abs(scores).max()  # bf16 probabilities, other order


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the compiled Triton kernel")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_compiled_kernel_on_a_gpu(shape, dtype):
    args = operands(*shape, dtype)
    b = ga.config(args[0], args[1], args[5].shape[1] - 1)
    y = jax.jit(lambda *a: ga.attend(*a, 0.3, interpret=False, blocks=b))(*args)
    ref = reference(*args, 0.3)
    err = float(np.abs(np.asarray(y) - ref).max() / np.abs(ref).max())
    assert err < 1e-2, err


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the compiled Triton kernel")
def test_model_on_a_gpu_through_the_compiled_kernel(tmp_path, monkeypatch):
    """On a GPU, ``AOTLM_GPU_ATTENTION=pallas``: the same greedy tokens as XLA's path, log-probabilities
    close."""
    path = tiny_llama(tmp_path, 96, False)
    monkeypatch.setenv(ga.ENV, "xla")
    tokens, scores = run_bf16(path, *prompts())
    calls = as_on_a_gpu(monkeypatch, simulate=False)
    tokens2, scores2 = run_bf16(path, *prompts())
    assert calls
    np.testing.assert_array_equal(tokens, tokens2)
    assert np.abs(scores - scores2).max() <= 2e-2 * np.abs(scores).max()
