"""Pure decision functions of the snapshot layer."""

from __future__ import annotations

import pytest

from lightning_ft.checkpoint.policy import (
    choose_resume_step,
    parse_mem_url,
    pick_disk_checkpoint,
    plan_shard_replicas,
    plan_write,
    snapshot_due,
    snapshots_to_delete,
    steps_between_snapshots,
)


@pytest.mark.parametrize("steps, keep, protect, expected", [
    ([], 2, None, []),
    ([10], 2, None, []),
    ([10, 20, 30], 2, None, [10]),
    ([30, 10, 20, 40], 1, None, [10, 20, 30]),
    ([10, 20, 30], 2, 30, [10]),
    ([20, 30, 5], 2, 5, [20]),  # after a resume from step 5, the new snapshot is kept
    ([20, 30, 5], 1, 5, [20, 30]),
])
def test_snapshots_to_delete(steps, keep, protect, expected):
    assert snapshots_to_delete(steps, keep, protect) == expected


@pytest.mark.parametrize("existing, step, keep, recycle, delete", [
    ([], 10, 2, None, []),
    ([10], 20, 2, None, []),            # nothing is doomed yet
    ([10, 20], 30, 2, 10, []),          # oldest is overwritten in place
    ([10, 20, 30], 40, 2, 10, [20]),    # extra leftovers still pruned
    ([10], 20, 1, None, [10]),          # keep_last=1: never destroy the only snapshot first
    ([10, 20], 20, 2, 20, []),          # same step saved again: rewrite that file
    ([20], 20, 1, None, []),            # ...unless it is the only one
    ([20, 30], 5, 2, 20, []),           # resumed from 5: doomed 20 is recycled, 30 stays during the write
])
def test_plan_write(existing, step, keep, recycle, delete):
    plan = plan_write(existing, step, keep)
    assert (plan.recycle, plan.delete_after_commit) == (recycle, delete)


def test_plan_write_always_leaves_a_committed_snapshot_during_the_write():
    for keep in (1, 2, 3):
        for existing in ([], [1], [1, 2], [1, 2, 3], [5, 9]):
            for step in (0, 2, 4, 10):
                plan = plan_write(existing, step, keep)
                if plan.recycle is not None:
                    assert set(existing) - {plan.recycle}


@pytest.mark.parametrize("per_rank, expected", [
    ([[10, 20]], 20),
    ([[10, 20], [10, 20]], 20),
    ([[10, 20], [10]], 10),           # rank 1 lost step 20: fall back to the newest common
    ([[10, 20], [20, 30]], 20),
    ([[10], [20]], None),             # nothing in common: no snapshot
    ([[10, 20], []], None),           # a fresh rank (e.g. a spare) has nothing
    ([], None),
])
def test_choose_resume_step(per_rank, expected):
    assert choose_resume_step(per_rank) == expected


@pytest.mark.parametrize("seconds, per_step, expected", [
    (10.0, 1.0, 8), (10.0, 0.1, 64), (1.0, 2.0, 1), (10.0, 0.0, 1), (8.0, 1.0, 8), (1.99, 1.0, 1),
])
def test_steps_between_snapshots(seconds, per_step, expected):
    assert steps_between_snapshots(seconds, per_step) == expected


def test_time_schedules_of_ranks_with_different_clocks_share_steps():
    # two ranks whose step-time estimates differ by up to 2x still save at common steps
    for per_step in (0.01, 0.013, 0.02, 0.05, 0.3):
        a = steps_between_snapshots(5.0, per_step)
        b = steps_between_snapshots(5.0, per_step * 1.9)
        assert max(a, b) % min(a, b) == 0
        assert a * per_step <= 5.0


@pytest.mark.parametrize("step, last, n, interval, expected", [
    (0, None, 5, None, False),
    (5, None, 5, None, True),
    (5, 5, 5, None, False),      # already saved at this step (gradient accumulation)
    (6, 5, 5, None, False),
    (8, None, None, 4, True),
    (9, None, None, 4, False),
    (9, None, 3, 4, True),
    (7, None, None, None, False),
])
def test_snapshot_due(step, last, n, interval, expected):
    assert snapshot_due(step, last, n, interval) is expected


def test_parse_mem_url():
    assert parse_mem_url("mem://latest") == "latest"
    assert parse_mem_url("mem://") == "latest"
    assert parse_mem_url("mem://120") == 120
    assert parse_mem_url("/tmp/last.ckpt") is None
    assert parse_mem_url(None) is None
    with pytest.raises(ValueError, match="mem://"):
        parse_mem_url("mem://newest")


def test_pick_disk_checkpoint():
    assert pick_disk_checkpoint([]) is None
    assert pick_disk_checkpoint([("a.ckpt", 1.0), ("last.ckpt", 3.0), ("b.ckpt", 2.0)]) == "last.ckpt"


@pytest.mark.parametrize(("domains", "factor", "expected"), [
    (["a", "b"], 1, ((1,), (0,))),  # two hosts: each holds the other's
    (["a", "b", "c"], 1, ((1,), (2,), (0,))),  # a ring over the domains
    (["a", "b", "c"], 2, ((1, 2), (2, 0), (0, 1))),
    (["a", "b", "c"], 5, ((1, 2), (2, 0), (0, 1))),  # no more copies than other domains
    (["a", "a", "b", "b"], 1, ((2,), (3,), (0,), (1,))),  # same position in the next domain: evenly
    (["a", "b", "a", "b"], 1, ((1,), (0,), (3,), (2,))),  # domains in order of their first rank
    (["a", "a", "a", "b"], 1, ((3,), (3,), (3,), (0,))),  # a small domain holds for a large one
    (["a", "a"], 1, ((), ())),  # one domain: a copy there protects nothing
    (["a", "b"], 0, ((), ())),  # off
])
def test_plan_shard_replicas(domains, factor, expected):
    holders = plan_shard_replicas(domains, factor)
    assert holders == expected
    assert all(domains[h] != domains[r] for r, held in enumerate(holders) for h in held)
