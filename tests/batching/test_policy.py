"""The scheduler's policy (``aotlm.batching.policy``) on plain values: no engine, thread, runner or
clock. Each rule the serving engine applies is checked here as a function of a snapshot; the
engine's own tests (``test_engine``) drive the same rules through a fake runner."""

from __future__ import annotations

from aotlm.batching import policy
from aotlm.batching.policy import Limits, PrefillCall, RoundState, RowView
from aotlm.core.buckets import PrefillStep

LIMITS = Limits(
    prefill_budget=8, max_prompts=4, prompt_buckets=(4, 8), decode_chunk=8, solo_chunk=32, step_rows=4
)


def whole(bucket: int, n: int) -> tuple[PrefillStep, ...]:
    """A prompt of ``n`` tokens that is one whole chunk of ``bucket`` from slot 0."""
    return (PrefillStep(0, bucket, bucket, n),)


def chunks(k: int, bucket: int = 4, width: int = 64) -> tuple[PrefillStep, ...]:
    """A long prompt in ``k`` chunks of ``bucket`` (attending a ``width``-slot window)."""
    return tuple(PrefillStep(j * bucket, bucket, width, bucket) for j in range(k))


def row(key: int, plan=(), live: bool = False, submitted: float | None = None, constrained: bool = False):
    return RowView(key, float(key) if submitted is None else submitted, tuple(plan), live, constrained)


def test_admissions_fill_free_rows_from_the_queue():
    assert policy.admissions(RoundState((None, None, row(1, live=True)), waiting=5)) == 2
    assert policy.admissions(RoundState((None, None, None), waiting=1)) == 1
    assert policy.admissions(RoundState((row(1, live=True),), waiting=3)) == 0


def test_prefill_oldest_first_within_the_budget():
    # the oldest pending request goes first whatever its row; a long prompt takes what the budget
    # allows and ends the round's prefill (the younger one waits for the next round)
    state = RoundState((row(7, chunks(1), submitted=2.0), row(3, chunks(3), submitted=1.0)), waiting=0)
    assert policy.prefill_calls(state, LIMITS) == (PrefillCall((3,), 2, 4),)
    # budget left after a short prompt goes to the next one
    state = RoundState((row(7, chunks(1), submitted=2.0), row(3, chunks(1), submitted=1.0)), waiting=0)
    assert policy.prefill_calls(state, LIMITS) == (PrefillCall((3,), 1, 4), PrefillCall((7,), 1, 4))
    # a one-chunk budget: one chunk a round, never none
    one = Limits(4, 1, (4,), 8, None, 4)
    assert policy.prefill_calls(RoundState((row(1, chunks(3)),), 0), one) == (PrefillCall((1,), 1, 4),)


def test_whole_prompts_of_one_bucket_share_a_call():
    rows = (row(1, whole(4, 3)), row(2, whole(8, 5)), row(3, whole(4, 2)), row(4, whole(4, 4)))
    calls = policy.prefill_calls(RoundState(rows, 0), LIMITS)
    # bucket 4 (the oldest one's): two fit the budget of 8 in one call; the rest next round
    assert calls == (PrefillCall((1, 3), 1, 4),)
    big = Limits(32, 4, (4, 8), 8, None, 4)
    calls = policy.prefill_calls(RoundState(rows, 0), big)
    assert calls == (PrefillCall((1, 3, 4), 1, 4), PrefillCall((2,), 1, 8))
    # a bucket the runner cannot take whole prompts in, or one prompt a call: one by one
    assert policy.prefill_calls(RoundState(rows[:1] + rows[2:3], 0), Limits(32, 4, (8,), 8, None, 4)) == (
        PrefillCall((1,), 1, 4),
        PrefillCall((3,), 1, 4),
    )
    # an oldest prompt resuming after a reused prefix is not whole: it goes alone
    resumed = (PrefillStep(2, 4, 8, 2),)
    calls = policy.prefill_calls(RoundState((row(1, resumed), row(2, whole(4, 3))), 0), big)
    assert calls == (PrefillCall((1,), 1, 4), PrefillCall((2,), 1, 4))


def test_decode_steps_follow_rows_queue_and_company():
    live = lambda k: row(k, live=True)  # noqa: E731
    rows = lambda n: RoundState(tuple(live(k) for k in range(n)), 0)  # noqa: E731
    steps = [policy.decode_steps(rows(n), LIMITS) for n in (1, 2, 3, 4)]
    assert steps == [8, 6, 5, 4]  # 8 * 4 // (4 + n - 1)
    assert policy.decode_steps(RoundState((live(0),) * 16, 0), LIMITS) == 1
    assert policy.decode_steps(RoundState((live(0),), 0, solo=True), LIMITS) == 32
    assert policy.decode_steps(RoundState((live(0), live(1)), 0, solo=True), LIMITS) == 6  # not alone
    assert policy.decode_steps(RoundState((live(0),), waiting=1), LIMITS) == 1  # a newcomer waits
    assert policy.decode_steps(RoundState((live(0), row(1, chunks(2))), 0), LIMITS) == 1  # mid-prefill
    assert policy.decode_steps(RoundState((row(0, live=True, constrained=True),), 0), LIMITS) == 1
    assert policy.decode_steps(RoundState((None, row(1, chunks(2))), 0), LIMITS) == 0  # nothing live


def test_plan_round_decodes_the_rows_its_prefill_leaves():
    # the pending prompt finishes its prefill this round: two rows decode, 6 steps each
    plan = policy.plan_round(RoundState((row(1, live=True), row(2, chunks(2))), 0), LIMITS)
    assert plan == policy.RoundPlan((PrefillCall((2,), 2, 4),), 6)
    # it does not (3 chunks, budget 2): the live row decodes one step, the prompt goes on next round
    plan = policy.plan_round(RoundState((row(1, live=True), row(2, chunks(3))), 0), LIMITS)
    assert plan == policy.RoundPlan((PrefillCall((2,), 2, 4),), 1)
    assert policy.plan_round(RoundState((None, None), 0), LIMITS) == policy.RoundPlan((), 0)


def test_busy_rows_stay_compact():
    assert policy.move_down([True, False, True, True], 1) == 3  # the top request fills the gap
    assert policy.move_down([True, True, False, False], 2) is None  # the top row left: nothing moves
    assert policy.move_down([False, False], 0) is None


def test_warm_up_skips_the_prefills_whose_compute_dwarfs_a_first_run():
    # SmolLM2-135M's shape: 30 layers of 576, 9 heads (3 kv) of 64, gated mlp of 1536
    from aotlm.batching import slot_graphs
    from aotlm.models.arch import ArchConfig

    cfg = ArchConfig("llama", 49152, 576, 30, 9, 3, 64, 1536, 8192)
    per_token = 2 * 30 * (576 * 64 * 24 + 3 * 576 * 1536)  # q, k, v, o and the three mlp matrices
    assert policy.prefill_flops(cfg, ("slot_prefill", 512, 1024)) == 512 * (
        per_token + 30 * 4 * 9 * 64 * 1024
    )
    assert policy.prefill_flops(cfg, ("slot_prefill_rows", 128, 8)) == 1024 * (
        per_token + 30 * 4 * 9 * 64 * 128
    )
    assert (
        policy.prefill_flops(cfg, ("slot_decode", 4096, 8)) == policy.prefill_flops(cfg, ("slot_swap",)) == 0
    )
    keys = slot_graphs.graph_keys((64, 128, 256, 512, 1024, 2048), (128, 256, 512, 1024, 2048, 4096), 8)
    skipped = set(keys) - set(policy.warmed(cfg, keys, policy.warm_bound("cpu")))
    big = {k for k in keys if k[0] == "slot_prefill" and (k[1] >= 1024 or k[1:] == (512, 4096))}
    assert {k for k in skipped if k[0] == "slot_prefill"} == big  # long prompts' chunks
    assert skipped - {k for k in skipped if k[0] == "slot_prefill"} == {("slot_prefill_rows", 128, 8)}
    assert (
        policy.warmed(cfg, keys, None) == policy.warmed(cfg, keys, policy.warm_bound("cuda")) == keys
    )  # a GPU
    # a model so big that no prefill passes keeps the cheapest: its logits feed the insert graph
    assert policy.warmed(cfg, keys, 1.0) == [("slot_prefill", 64, 64)] + [
        k for k in keys if "prefill" not in k[0]
    ]
