"""Pure decisions of the checkpoint tiers (lightning_ft.checkpoint.tiers), on plain values."""

from __future__ import annotations

import pytest

from lightning_ft.checkpoint.policy import plan_write
from lightning_ft.checkpoint.tiers import (
    ShardMarker,
    bucket_delay,
    choose_resume_source,
    complete_steps,
    flush_fits,
    persist_due,
    persist_interval_steps,
    plan_durable_retention,
    shard_rank_to_fetch,
    space_shortfall,
    upload_decision,
)


def marker(step, rank, world=2, segment="a", nbytes=10):
    return ShardMarker(step, segment, rank, world, nbytes, f"sum{rank}")


def test_a_step_is_complete_only_with_every_ranks_marker_of_one_segment():
    assert complete_steps([marker(10, 0)]) == {}
    done = complete_steps([marker(10, 0), marker(10, 1)])
    assert list(done) == [10] and done[10].shards == ((0, 10, "sum0"), (1, 10, "sum1"))
    # rank 1's shard came from another stretch of training: the step is not complete
    assert complete_steps([marker(10, 0, segment="a"), marker(10, 1, segment="b")]) == {}
    # disagreeing world sizes never complete
    assert complete_steps([marker(10, 0, world=2), marker(10, 1, world=3)]) == {}


def test_when_two_segments_completed_a_step_every_caller_picks_the_same():
    markers = [marker(10, r, segment=s) for s in ("b", "a") for r in (0, 1)]
    assert complete_steps(markers)[10].segment == "b"
    assert complete_steps(list(reversed(markers)))[10].segment == "b"


def test_retention_keeps_the_newest_complete_steps_and_what_they_name():
    plan = plan_durable_retention({10: "a", 20: "a", 30: "b"}, step_dirs=[5, 10, 20, 25, 30, 40],
                                  segments_of_kept={20: ["a", "x"], 30: ["b"]}, keep_last=2)
    assert plan.manifests == [10]
    # 5 (torn), 10 (beyond keep_last), 25 (an incomplete step older than the newest complete one)
    assert plan.step_dirs == [5, 10, 25]
    assert plan.segment_dirs == [(20, "x")]
    # 40 is newer than every complete step: its upload may still be running
    assert 40 not in plan.step_dirs


def test_retention_removes_nothing_before_a_step_is_complete():
    plan = plan_durable_retention({}, step_dirs=[10, 20], segments_of_kept={}, keep_last=1)
    assert (plan.manifests, plan.step_dirs, plan.segment_dirs) == ([], [], [])
    with pytest.raises(ValueError):
        plan_durable_retention({10: "a"}, [10], {}, keep_last=0)


def test_resume_prefers_memory_and_falls_back_to_durable_per_rank():
    # rank 1 is a new node: empty memory; durable storage has step 20 for both
    choice0 = choose_resume_source([[20, 30], []], [[20], [20]], rank=0)
    choice1 = choose_resume_source([[20, 30], []], [[20], [20]], rank=1)
    assert (choice0.step, choice0.tier) == (20, "memory")
    assert (choice1.step, choice1.tier) == (20, "durable")
    assert "new node" in choice1.reason
    # every memory wiped: durable
    choice = choose_resume_source([[], []], [[10, 20], [10, 20]], rank=0)
    assert (choice.step, choice.tier) == (20, "durable")
    # memory newer than durable everywhere: memory
    assert choose_resume_source([[30], [30]], [[20], [20]], rank=1).step == 30
    nothing = choose_resume_source([[], []], [[], []], rank=0)
    assert nothing.step is None and nothing.tier == "none"


def test_a_rank_that_cannot_reach_durable_storage_limits_the_choice_to_memory():
    choice = choose_resume_source([[10], [10]], [[20], []], rank=0)
    assert (choice.step, choice.tier) == (10, "memory") and "durable storage has newer 20" in choice.reason


def test_the_token_bucket_waits_for_what_is_missing():
    assert bucket_delay(tokens=100, elapsed_s=0, rate=10, burst=100, nbytes=50) == (0.0, 50)
    wait, left = bucket_delay(tokens=0, elapsed_s=0, rate=10, burst=100, nbytes=50)
    assert wait == pytest.approx(5.0) and left == 0
    # refill is capped at the burst
    assert bucket_delay(tokens=0, elapsed_s=1000, rate=10, burst=100, nbytes=100) == (0.0, 0)
    with pytest.raises(ValueError):
        bucket_delay(0, 0, 0, 1, 1)


def test_a_new_snapshot_supersedes_and_never_queues():
    assert upload_decision(busy_with=None, offered=10, last_uploaded=None) == "start"
    assert upload_decision(busy_with=10, offered=20, last_uploaded=None) == "supersede"
    assert upload_decision(busy_with=10, offered=10, last_uploaded=None) == "skip"
    assert upload_decision(busy_with=None, offered=10, last_uploaded=10) == "skip"


def test_the_file_being_uploaded_is_never_recycled():
    # keep_last=2, steps 10 and 20 committed, step 10 held by the upload: a fresh file for 30
    plan = plan_write([10, 20], 30, keep_last=2, held=[10])
    assert plan.recycle is None and plan.delete_after_commit == [10]
    assert plan_write([10, 20], 30, keep_last=2).recycle == 10


def test_durable_schedule_lines_up_with_snapshot_steps():
    assert persist_interval_steps(60, 0.0, base_steps=5) == 5  # unmeasured: every snapshot
    assert persist_interval_steps(0, 0.1, base_steps=5) == 5
    assert persist_interval_steps(6, 0.1, base_steps=5) == 80  # 60 steps wanted: 5 * 16, a multiple of 5
    assert persist_due(20, 20) and not persist_due(10, 20) and not persist_due(0, 1)


def test_flush_fits_the_grace_budget_by_the_measured_rate():
    assert flush_fits(100 * 2**20, None, 5.0)[0]
    assert not flush_fits(100 * 2**20, 10 * 2**20, 5.0)[0]
    assert flush_fits(10 * 2**20, 100 * 2**20, 5.0)[0]
    assert not flush_fits(1, 1e9, 0.0)[0]


def test_shard_to_fetch_and_space_shortfall():
    assert shard_rank_to_fetch(1, 2) == 1 and shard_rank_to_fetch(3, 2) == 0
    assert space_shortfall(free_bytes=100, reusable_bytes=0, snapshot_bytes=40, copies=3) == 20
    assert space_shortfall(free_bytes=100, reusable_bytes=40, snapshot_bytes=40, copies=3) == 0
