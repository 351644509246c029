"""Long sequences: blocked (flash-style) prefill attention, ``aotlm.models.flash``.

Default run (small sizes, the blocked path forced by patching ``flash.MIN_SCORES`` and shrinking
the blocks so every call visits many of them): the blocked attention equals ``layers.attend``
feature by feature; greedy tokens on the blocked path equal transformers' (chunked prefill,
left padding); blocked and whole-block prefill give the same logits for a sliding-window family
(Mistral), an ALiBi family (BLOOM) and softcaps with per-layer windows (Gemma2); a long prefill
executable's scratch memory is far below the whole-block path's score block.
Slow (``python -m pytest -m slow tests/models/test_flash_long_context.py``): a 20,000-token prompt in a
32,768-position window, tokens equal to transformers', peak RSS under 4 GB.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from conformance import (
    gemma3_config,
    hf_generate,
    hf_last_logits,
    hf_model,
    left_padded_batch,
    make_checkpoint,
)

from aotlm import AutoModelForSampling
from aotlm.models import decoder, flash
from aotlm.models import layers as L

REPO = Path(__file__).resolve().parents[2]
V = 101
TINY = dict(vocab_size=V, num_hidden_layers=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
# one token bucket of 256 and context bucket 64: a 200-token prompt is four chunks, (64, 64)
# then three (64, 256) continuations, the last shifted back over cached tokens
BUCKETS = dict(n_positions=[256], context_length_estimate=[64], compile_cache=False)


def _force_blocked(monkeypatch, on: bool = True):
    """Prefill graphs (64 x 64 and more) blocked, decode (1 x 257) not; blocks of 16 queries and
    24 old keys (not a divisor of the widths: the last old block is read shifted back)."""
    monkeypatch.setattr(flash, "MIN_SCORES", 4000 if on else 2**40)
    monkeypatch.setattr(flash, "Q_BLOCK", 16)
    monkeypatch.setattr(flash, "K_BLOCK", 24)


# --------------------------------------------------------------------------- attention level
class _Cfg:
    def __init__(self, dh: int, softcap):
        self.scale, self.attn_softcap = dh**-0.5, softcap


def _case(per_row: bool, width: int, s: int, t: int = 40, b: int = 2, h: int = 4, kh: int = 2, dh: int = 8):
    """Random q/k/v and cache; row 1 left-padded by 5 slots and its last 3 tokens padding."""
    rng = np.random.default_rng(0)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    base = width - t if width else 0
    w_idx = np.array([base - 7, base], np.int32) if per_row else np.array([base, base], np.int32)
    kv_pos, positions = np.full((b, s), -1, np.int32), np.zeros((b, t), np.int32)
    for r in range(b):
        kv_pos[r, 5 * r : w_idx[r]] = np.arange(w_idx[r] - 5 * r)
        positions[r] = np.arange(t) + w_idx[r] - 5 * r
    positions[1, -3:] = -1
    write_idx = jnp.asarray(w_idx) if per_row else jnp.int32(base)
    q, k, v, kv = (
        arr(b, t, h, dh),
        arr(b, t, kh, dh),
        arr(b, t, kh, dh),
        (arr(b, kh, s, dh), arr(b, kh, dh, s)),
    )
    return q, k, v, kv, jnp.asarray(kv_pos), jnp.asarray(positions), write_idx


@pytest.mark.parametrize(
    "window, softcap, alibi, per_row, width, slots",
    [
        (None, None, False, False, 0, 64),  # one prompt from slot 0: the new segment only
        (None, None, False, False, 100, 128),  # a chunk continuation
        (13, None, False, True, 100, 128),  # sliding window (block skipping), per-row write slots
        (13, 2.0, True, False, 100, 128),  # ALiBi + softcap + window
        (None, 2.0, True, True, 100, 100),  # widths not a multiple of K_BLOCK, slots == width
    ],
)
def test_blocked_attention_equals_whole(monkeypatch, window, softcap, alibi, per_row, width, slots):
    _force_blocked(monkeypatch)
    q, k, v, kv, kv_pos, positions, write_idx = _case(per_row, width, slots)
    cfg, h = _Cfg(q.shape[-1], softcap), q.shape[2]
    slopes = L.alibi_slopes(h) if alibi else None

    @jax.jit
    def whole(q, k, v, kv, kv_pos, positions, write_idx):
        mask = L.attention_mask(kv_pos, positions, write_idx, width, window)
        bias = None
        if alibi:
            kb = lambda kp: jnp.asarray(slopes)[None, :, None, None] * jnp.maximum(kp, 0)[:, None, None, :]
            bias = (kb(kv_pos[:, :width]) if width else None, kb(positions))
        return decoder.whole_attention(cfg, q, k, v, kv, write_idx, mask, bias)

    want = whole(q, k, v, kv, kv_pos, positions, write_idx)
    keys = flash.Keys(kv_pos, positions, write_idx, width, window)
    got = jax.jit(lambda *a: flash.attend(*a, cfg.scale, softcap, slopes))(q, k, v, kv, keys)
    real = np.asarray(positions) >= 0  # padding queries' outputs are never used
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5, rtol=1e-5)


def test_use_blocked_keeps_decode_and_small_graphs():
    assert not flash.use_blocked(1, 1 << 20)  # decode, even at a million slots
    assert not flash.use_blocked(256, 0) and not flash.use_blocked(128, 1024)
    assert flash.use_blocked(16384, 32768) and flash.use_blocked(512, 0)


# --------------------------------------------------------------------------- model level
@pytest.fixture(scope="module")
def llama(ckpt_dir):
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, **TINY
    )
    return make_checkpoint(ckpt_dir / "long_llama", cfg, scale=2.0)


def test_greedy_tokens_equal_transformers_on_the_blocked_path(llama, monkeypatch):
    """A 200-token prompt (chunked), then a left-padded batch of 2 (200 and 170 tokens)."""
    _force_blocked(monkeypatch)
    ref, rng = hf_model(llama), np.random.default_rng(3)
    model = AutoModelForSampling.from_pretrained(llama, batch_size=2, **BUCKETS)
    ids = rng.integers(0, V, (1, 200))
    np.testing.assert_array_equal(model.sample(ids, max_new_tokens=16), hf_generate(ref, ids, 16))
    ids, mask = left_padded_batch(rng, [200, 170], V)
    out = model.sample(ids, max_new_tokens=16, attention_mask=mask, pad_token_id=0)
    np.testing.assert_array_equal(out, hf_generate(ref, ids, 16, mask=mask))
    texts = {k: exe.as_text() for k, exe in model._executables.items()}
    assert {k for k in texts if k[0] == "prefill"} == {("prefill", 64, 64), ("prefill", 64, 256)}
    assert all(" while(" in t for k, t in texts.items() if k[0] == "prefill")  # the key-block loops


FAMILIES = {
    # window 40: every chunk's queries see part of the old cache and part of their own chunk
    "mistral": lambda: transformers.MistralConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        sliding_window=40,
        **TINY,
    ),
    "bloom": lambda: transformers.BloomConfig(hidden_size=96, n_head=6, n_layer=2, **TINY),
    # softcap 1.5, window 40 on layer 0 and none on layer 1
    "gemma2": lambda: transformers.Gemma2Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=4.0,
        sliding_window=40,
        pad_token_id=0,
        **TINY,
    ),
    # q/k norms, window 40 on layer 0 with its own rope base, layer 1 global with linear x8
    "gemma3_text": lambda: gemma3_config(head_dim=16, sliding_window=40, **TINY),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_blocked_and_whole_prefill_give_the_same_logits(ckpt_dir, monkeypatch, family):
    """Chunked prefill of a left-padded batch (200 and 130 tokens): blocked == whole == transformers."""
    path = make_checkpoint(ckpt_dir / f"long_{family}", FAMILIES[family](), scale=2.0)
    ids, mask = left_padded_batch(np.random.default_rng(5), [200, 130], V)
    logits, loops = {}, {}
    for on in (True, False):  # the constants are read while a graph is traced: one model each
        _force_blocked(monkeypatch, on)
        model = AutoModelForSampling.from_pretrained(path, batch_size=2, **BUCKETS)
        logits[on] = model.forward(ids, attention_mask=mask)
        loops[on] = [e.as_text().count(" while(") for k, e in model._executables.items() if k[0] == "prefill"]
    # the blocked path adds its key-block loops (every rope graph has one more: the rotary tables)
    assert loops[True] and len(loops[True]) == len(loops[False])
    assert all(b > w for b, w in zip(loops[True], loops[False], strict=True)), loops
    np.testing.assert_allclose(logits[True], logits[False], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[True], hf_last_logits(hf_model(path), ids, mask), atol=1e-4, rtol=0)


def test_long_prefill_scratch_memory_is_bounded(llama, monkeypatch):
    """A (2048, 4096) chunk graph at the default threshold and blocks: XLA's scratch for the
    call is far below one float32 score block ``T x W x H`` of the whole-block path, which it
    needs (and more: the mask, softmax copies) when forced back to it."""
    model = AutoModelForSampling.from_pretrained(
        llama, n_positions=[4096], context_length_estimate=[2048], compile_cache=False
    )
    t, w, h = 2048, 4096, model.cfg.n_heads
    scores = t * w * h * 4
    temp = model.compile_graph(("prefill", t, w)).memory_analysis().temp_size_in_bytes
    assert flash.use_blocked(t, w) and temp < scores / 16, (temp, scores)
    monkeypatch.setattr(flash, "MIN_SCORES", 2**40)
    whole = AutoModelForSampling.from_pretrained(
        llama, n_positions=[4096], context_length_estimate=[2048], compile_cache=False
    )
    assert whole.compile_graph(("prefill", t, w)).memory_analysis().temp_size_in_bytes > scores


# --------------------------------------------------------------------------- full size (slow)
@pytest.mark.slow
def test_20k_prompt_in_a_32k_window(tmp_path):
    """The reported failure: a tiny Llama, n_positions=32768, a 20,000-token prompt (default
    buckets: chunks of 16384, the second a (16384, 32768) graph). Each engine runs in its own
    process (``scripts/bench_long_context.py``'s children); aotlm's peak RSS stays under 4 GB."""
    script = REPO / "scripts" / "bench_long_context.py"
    sys.path.insert(0, str(script.parent))
    try:
        import bench_long_context as bench  # local: a script, not part of the package
    finally:
        sys.path.remove(str(script.parent))
    path = bench.make_checkpoint(tmp_path / "llama")
    run = lambda engine: json.loads(
        subprocess.run(
            [sys.executable, str(script), "--child", engine, "--window", "32768", "--prompt", "20000"]
            + ["--new", "16", "--runs", "1", "--checkpoint", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()[-1]
    )
    got, want = run("aotlm"), run("hf")
    assert got["tokens"] == want["tokens"]
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-3, rtol=0)
    assert got["rss_gb"] < 4.0, got["rss_gb"]
    assert ["prefill", "16384", "32768"] in got["graphs"]
