import pytest

from aotlm.core import buckets as bk


def test_token_buckets_powers_of_two_ending_at_n_positions():
    assert bk.token_buckets(128) == (128,)
    assert bk.token_buckets(100) == (100,)
    assert bk.token_buckets(1024) == (128, 256, 512, 1024)
    assert bk.token_buckets(600) == (128, 256, 512, 600)
    assert bk.token_buckets([256, 64, 64]) == (64, 256)


def test_context_buckets_default_half_of_token_buckets():
    assert bk.context_buckets(None, (128, 256, 512)) == (64, 128, 256)
    assert bk.context_buckets(32, (128,)) == (32,)
    assert bk.context_buckets([64, 16], (128,)) == (16, 64)
    with pytest.raises(ValueError, match="larger than n_positions"):
        bk.context_buckets([256], (128,))
    with pytest.raises(ValueError, match="positive"):
        bk.token_buckets(0)


def test_bucket_lengths_are_ints_as_given():
    """A string was read character by character ("64" -> buckets 4 and 6) and a float truncated."""
    import numpy as np

    assert bk.token_buckets(np.int64(300)) == (128, 256, 300)
    assert bk.token_buckets((np.int32(64), 32)) == (32, 64)
    assert bk.context_buckets(np.int64(16), (64,)) == (16,)
    for bad in ("64", 64.5, [64.0, 32], True, None, ["32"]):
        with pytest.raises(TypeError, match="n_positions takes an int or a list of ints, got"):
            bk.token_buckets(bad)
    with pytest.raises(TypeError, match=r"context_length_estimate takes an int .* got 8.5 \(float\)"):
        bk.context_buckets([16, 8.5], (64,))
    with pytest.raises(ValueError, match="positive"):
        bk.context_buckets(-3, (64,))


def test_prefill_plan_single_bucket_and_chunks():
    assert bk.prefill_plan(10, (16, 32), (64, 128)) == (bk.PrefillStep(0, 16, 16, 10),)
    assert bk.prefill_plan(17, (16, 32), (64, 128)) == (bk.PrefillStep(0, 32, 32, 17),)
    # 70 > 32: chunks of 32 at 0 and 32, the last one shifted back to end at 70
    plan = bk.prefill_plan(70, (16, 32), (64, 128))
    assert plan == (
        bk.PrefillStep(0, 32, 32, 32),
        bk.PrefillStep(32, 32, 64, 32),
        bk.PrefillStep(38, 32, 128, 32),
    )
    for step in plan:
        assert (step.bucket, step.width) in bk.prefill_graph_shapes((16, 32), (64, 128))
    with pytest.raises(ValueError, match="empty"):
        bk.prefill_plan(0, (16,), (64,))


def test_decode_bucket_is_smallest_covering_slot():
    assert bk.decode_bucket((64, 128), 0) == 64
    assert bk.decode_bucket((64, 128), 63) == 64
    assert bk.decode_bucket((64, 128), 64) == 128
    with pytest.raises(ValueError):
        bk.decode_bucket((64, 128), 128)
