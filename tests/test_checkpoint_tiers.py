"""Pure decisions of the checkpoint tiers (lightning_ft.checkpoint.tiers), on plain values."""

from __future__ import annotations

import pytest

from lightning_ft.checkpoint.durable.settings import DurableSettings
from lightning_ft.checkpoint.pacing import UploadPacer, bucket_delay, next_upload_rate, slowdown_estimate
from lightning_ft.checkpoint.policy import plan_write
from lightning_ft.checkpoint.tiers import (
    FETCH_DAMAGED,
    FETCH_FAILED,
    FETCH_OK,
    ResumeChoice,
    Schedule,
    ScheduleProposal,
    ShardMarker,
    abandoned_manifests,
    agree_schedule,
    calibration_due,
    choose_resume_source,
    complete_steps,
    daly_interval_seconds,
    damage_message,
    durable_copy_seconds,
    every_copy_damaged,
    flush_fits,
    judge_downloads,
    persist_due,
    persist_interval_steps,
    plan_durable_retention,
    propose_schedule,
    shard_rank_to_fetch,
    snapshot_interval_for_budget,
    space_shortfall,
    upload_decision,
    with_damage,
)


def marker(step, rank, world=2, timeline="a", nbytes=10):
    return ShardMarker(step, timeline, rank, world, nbytes, f"sum{rank}")


def test_a_step_is_complete_only_with_every_ranks_marker_of_one_timeline():
    assert complete_steps([marker(10, 0)]) == {}
    done = complete_steps([marker(10, 0), marker(10, 1)])
    assert list(done) == [10] and done[10].shards == ((0, 10, "sum0"), (1, 10, "sum1"))
    # rank 1's shard came from another stretch of training: the step is not complete
    assert complete_steps([marker(10, 0, timeline="a"), marker(10, 1, timeline="b")]) == {}
    # disagreeing world sizes never complete
    assert complete_steps([marker(10, 0, world=2), marker(10, 1, world=3)]) == {}
    # nor shards of different models; the complete step names its model
    other_model = ShardMarker(10, "a", 1, 2, 10, "sum1", model="m2")
    assert complete_steps([ShardMarker(10, "a", 0, 2, 10, "sum0", model="m1"), other_model]) == {}
    assert complete_steps([ShardMarker(10, "a", 0, 2, 10, "sum0", model="m2"), other_model])[10].model == "m2"


def test_when_two_timelines_completed_a_step_every_caller_picks_the_same():
    markers = [marker(10, r, timeline=s) for s in ("b", "a") for r in (0, 1)]
    assert complete_steps(markers)[10].timeline == "b"
    assert complete_steps(list(reversed(markers)))[10].timeline == "b"


def test_retention_keeps_the_newest_complete_steps_and_what_they_name():
    plan = plan_durable_retention({10: "a", 20: "a", 30: "b"}, step_dirs=[5, 10, 20, 25, 30, 40],
                                  timelines_of_kept={20: ["a", "x"], 30: ["b"]}, keep_last=2)
    assert plan.manifests == [10]
    # 5 (torn), 10 (beyond keep_last), 25 (an incomplete step older than the newest complete one)
    assert plan.step_dirs == [5, 10, 25]
    assert plan.timeline_dirs == [(20, "x")]
    # 40 is newer than every complete step: its upload may still be running
    assert 40 not in plan.step_dirs


def test_retention_removes_nothing_before_a_step_is_complete():
    plan = plan_durable_retention({}, step_dirs=[10, 20], timelines_of_kept={}, keep_last=1)
    assert (plan.manifests, plan.step_dirs, plan.timeline_dirs) == ([], [], [])
    with pytest.raises(ValueError):
        plan_durable_retention({10: "a"}, [10], {}, keep_last=0)


def test_abandoned_manifests_are_newer_steps_of_other_timelines():
    manifests = {10: "a", 20: "a", 30: "b", 40: "c"}
    # resumed from step 15 (e.g. an older checkpoint) in timeline "c": 20 and 30 are a history the job left
    assert abandoned_manifests(manifests, resumed_step=15, current_timeline="c") == [20, 30]
    assert abandoned_manifests(manifests, resumed_step=40, current_timeline="c") == []
    assert abandoned_manifests(manifests, resumed_step=20, current_timeline="b") == [40]  # its own 30 stays
    assert abandoned_manifests({}, resumed_step=0, current_timeline="c") == []


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


def test_only_a_damaged_copy_lets_the_ranks_try_an_older_step_an_unknown_failure_stops_them():
    assert judge_downloads([(FETCH_OK, ""), (FETCH_DAMAGED, "crc")]) == ([], [(1, "crc")])
    # unreachable on one rank, damaged on another: unknown wins, every rank that lacks the step is named
    assert judge_downloads([(FETCH_FAILED, "refused"), (FETCH_DAMAGED, "crc")]) == ([0, 1], [(1, "crc")])
    assert judge_downloads([(FETCH_OK, ""), (FETCH_OK, "")]) == ([], [])


def test_a_choice_below_damaged_steps_names_them_and_the_line_says_what_happens_instead():
    below = with_damage(ResumeChoice(5, "durable", "the newest step every rank can get"), {10: "rank 1: crc"})
    assert below.damaged == ((10, "rank 1: crc"),) and "newer durable step(s) 10 damaged" in below.reason
    assert with_damage(below, {}) is below
    assert damage_message(below.damaged, 5, taken=True) == (
        "durable step 10 is damaged (rank 1: crc); resuming from step 5, the newest intact copy before it")
    none = with_damage(ResumeChoice(None, "none", "no snapshot in memory or durable storage"), {5: "b", 10: "a"})
    assert none.damaged == ((10, "a"), (5, "b"))
    assert damage_message(none.damaged, None, taken=False) == (
        "durable steps 10, 5 are damaged (step 10: a; step 5: b); no intact copy before them is left")
    not_taken = damage_message(below.damaged, 5, taken=False)
    assert "every rank can get is 5, not newer than the checkpoint loaded" in not_taken
    error = every_copy_damaged(none.damaged, "s3://bucket/runs")
    assert "under s3://bucket/runs is damaged (steps 10, 5)" in error and "to start over from step 0" in error


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


def test_the_budget_interval_keeps_saves_within_the_share_of_training_time():
    # a 1.2 ms save, 3.4 ms steps, 0.5 %: at least 70.6 steps -> 128 (a power of two)
    assert snapshot_interval_for_budget(0.0012, 0.0034, 0.005) == 128
    # a 150 ms save (1 GiB) and 1 s steps: 30 steps -> 32; saving then costs 0.47 %
    every = snapshot_interval_for_budget(0.15, 1.0, 0.005)
    assert every == 32 and 0.15 / (every * 1.0) <= 0.005
    assert snapshot_interval_for_budget(0.0001, 1.0, 0.005) == 1  # cheaper than the budget per step
    with pytest.raises(ValueError):
        snapshot_interval_for_budget(0.1, 1.0, 0)


def test_daly_interval_and_the_durable_default():
    # C = 1 s, M = 4 h: Young's sqrt(2CM) = 169.7 s; Daly's higher-order terms and "- C" give 169.0 s
    assert daly_interval_seconds(1.0, 14400) == pytest.approx(169.04, abs=0.01)
    assert daly_interval_seconds(100.0, 10.0) == 200.0  # C >= 2M: M, but never below 2C
    daly = daly_interval_seconds(1.0, 14400)
    assert DurableSettings(persist_to="x", persist_mtbf_seconds=14400).interval_seconds(1.0) == daly
    assert DurableSettings(persist_to="x", persist_every_n_seconds=5.0).interval_seconds(1.0) == 5.0
    assert durable_copy_seconds(2**30, None, 512 * 2**20) == pytest.approx(2.0)  # the bound until measured
    assert durable_copy_seconds(2**30, 2**29, 512 * 2**20) == pytest.approx(2.0)
    assert durable_copy_seconds(2**30, None, None) == pytest.approx(1.0)


def test_calibration_steps_are_8_16_32_after_the_start():
    assert [s for s in range(0, 200) if calibration_due(s, 0)] == [8, 16, 32, 64, 128]
    assert [s for s in range(100, 150) if calibration_due(s, 100)] == [108, 116, 132]


def test_ranks_agree_on_one_schedule_whatever_each_measured():
    fast = propose_schedule(seconds_per_step=0.004, save_seconds=0.001, every_n_steps=None, every_n_seconds=None,
                            max_overhead=0.005, persist_seconds=None)
    slow = propose_schedule(seconds_per_step=0.004, save_seconds=0.003, every_n_steps=None, every_n_seconds=None,
                            max_overhead=0.005, persist_seconds=None)
    assert (fast.budget_steps, slow.budget_steps) == (64, 256)
    # the budget: the largest (no rank over budget); a rank without a measurement has no say
    assert agree_schedule([fast, slow, ScheduleProposal()], None) == Schedule(256, None)
    # every_n_seconds: the smallest window (no rank's loss window longer than asked)
    windows = [propose_schedule(seconds_per_step=sps, save_seconds=0.001, every_n_steps=None, every_n_seconds=1.0,
                                max_overhead=0.005, persist_seconds=None) for sps in (0.01, 0.03)]
    assert [w.window_steps for w in windows] == [64, 32] and [w.budget_steps for w in windows] == [0, 0]
    assert agree_schedule(windows, None).snapshot_interval == 32
    assert agree_schedule([ScheduleProposal()], None) == Schedule(None, None)


def test_the_work_at_risk_bounds_the_budget_interval_for_sharded_state():
    # save 0.003 s at 4 ms a step: the budget alone says 256 steps (1.02 s of work at risk)
    kwargs = dict(seconds_per_step=0.004, save_seconds=0.003, every_n_steps=None, every_n_seconds=None,
                  max_overhead=0.005, persist_seconds=None)
    bounded = propose_schedule(**kwargs, max_seconds_at_risk=0.5)
    assert (bounded.budget_steps, bounded.risk_steps) == (256, 64)  # 125 steps in 0.5 s, rounded down
    assert agree_schedule([bounded], None) == Schedule(64, None, bounded_by_risk=True)
    # the smallest bound of any rank wins over the largest budget
    other = propose_schedule(**{**kwargs, "seconds_per_step": 0.002}, max_seconds_at_risk=0.5)
    assert agree_schedule([bounded, other], None).snapshot_interval == 64
    # a bound above the budget's interval changes nothing; no bound: the budget alone
    assert agree_schedule([propose_schedule(**kwargs, max_seconds_at_risk=60)], None) == Schedule(256, None)
    assert propose_schedule(**kwargs).risk_steps == 0
    # an explicit schedule is the user's: the bound does not apply to it
    assert propose_schedule(**{**kwargs, "every_n_seconds": 2.0}, max_seconds_at_risk=0.5).risk_steps == 0


def test_durable_copies_fall_on_steps_every_rank_snapshots():
    # budget interval 256, durable wanted every 0.5 s = 128 steps: raised to 256
    proposal = propose_schedule(seconds_per_step=0.004, save_seconds=0.003, every_n_steps=None, every_n_seconds=None,
                                max_overhead=0.005, persist_seconds=0.5)
    assert proposal.persist_steps == 128 and agree_schedule([proposal], None) == Schedule(256, 256)
    # with every_n_steps=5: a multiple of 5 by a power of two, the largest of the ranks
    a = propose_schedule(seconds_per_step=0.1, save_seconds=None, every_n_steps=5, every_n_seconds=None,
                         max_overhead=0.005, persist_seconds=6)
    b = propose_schedule(seconds_per_step=0.2, save_seconds=None, every_n_steps=5, every_n_seconds=None,
                         max_overhead=0.005, persist_seconds=6)
    assert (a.budget_steps, a.persist_steps, b.persist_steps) == (0, 80, 40)
    assert agree_schedule([a, b], 5) == Schedule(None, 80)
    assert propose_schedule(seconds_per_step=None, save_seconds=0.1, every_n_steps=None, every_n_seconds=None,
                            max_overhead=0.005, persist_seconds=1) == ScheduleProposal()


MiB = 2**20


def test_the_upload_rate_aims_at_three_quarters_of_the_budget_within_limits():
    # inside [budget/2, budget]: unchanged
    assert next_upload_rate(128 * MiB, 0.015, 0.02, 16 * MiB, 512 * MiB) == 128 * MiB
    # 3 % slower at 128 MiB/s: proportional to 1.5 % -> 64 MiB/s
    assert next_upload_rate(128 * MiB, 0.03, 0.02, 16 * MiB, 512 * MiB) == pytest.approx(64 * MiB)
    # far over: at most 4x down, never below the floor
    assert next_upload_rate(128 * MiB, 0.5, 0.02, 16 * MiB, 512 * MiB) == 32 * MiB
    assert next_upload_rate(32 * MiB, 0.5, 0.02, 16 * MiB, 512 * MiB) == 16 * MiB
    # no measurable slowdown (or noise below zero): at most 2x up, never above the ceiling
    assert next_upload_rate(128 * MiB, -0.01, 0.02, 16 * MiB, 512 * MiB) == 256 * MiB
    assert next_upload_rate(400 * MiB, 0.0, 0.02, 16 * MiB, 512 * MiB) == 512 * MiB
    # a ceiling below the floor wins (a user's small bound is never exceeded)
    assert next_upload_rate(8 * MiB, 0.5, 0.02, 16 * MiB, 8 * MiB) == 8 * MiB


def test_the_pacer_acts_only_on_clear_evidence_and_ignores_the_slowest_tenth():
    pacer = UploadPacer(ceiling=512 * MiB, budget=0.02, min_steps=10, start=128 * MiB)
    assert UploadPacer(ceiling=512 * MiB).rate == 64 * MiB  # the default start
    for i in range(10):
        assert pacer.observe(1.0 + 0.001 * (i % 2), busy=False) is None
    # 10 % slower, one outlier (validation inside a step) among them: clear
    for seconds in [1.1, 1.101] * 4 + [1.1]:
        assert pacer.observe(seconds, busy=True) is None
    verdict = pacer.observe(30.0, busy=True)
    assert verdict.slowdown == pytest.approx(0.1, abs=0.002) and (verdict.busy_steps, verdict.idle_steps) == (10, 10)
    assert verdict.rate_before == 128 * MiB and verdict.rate_after == 32 * MiB == pacer.rate
    # 1.5 % slower: within the budget, no verdict however many steps
    for i in range(10):
        pacer.observe(1.0 + 0.001 * (i % 2), busy=False)
    assert all(pacer.observe(1.015 + 0.001 * (i % 2), busy=True) is None for i in range(200))
    # noisy steps around a 3 % slowdown are not clear evidence yet
    noisy = UploadPacer(ceiling=512 * MiB, budget=0.02, min_steps=10)
    for i in range(10):
        noisy.observe(1.0 + 0.1 * (i % 2), busy=False)
    assert all(noisy.observe(1.03 + 0.1 * (i % 2), busy=True) is None for i in range(10))
    # no slowdown, measured cleanly: up, 2x at most
    clean = UploadPacer(ceiling=512 * MiB, budget=0.02, min_steps=10)
    verdicts = [clean.observe(1.0, busy=busy) for busy in [False] * 10 + [True] * 10]
    assert verdicts[:-1] == [None] * 19 and verdicts[-1].rate_after == 128 * MiB
    assert pacer.observe(0.0, busy=True) is None and pacer.observe(float("nan"), busy=False) is None


def test_the_slowdown_estimate_trims_the_slowest_tenth_and_gives_its_error():
    import statistics

    assert slowdown_estimate([1.1] * 18 + [50.0] * 2, [1.0] * 20) == (pytest.approx(0.1), 0.0)
    noisy = [1.0, 1.2] * 50
    kept = sorted(noisy)[:90]
    expected = (2 * statistics.variance(kept) / 90) ** 0.5 / statistics.fmean(kept)
    assert slowdown_estimate(noisy, noisy) == (pytest.approx(0.0), pytest.approx(expected))


def test_the_pacer_compares_with_recent_idle_steps_only_and_keeps_copies_ahead_of_the_next():
    pacer = UploadPacer(ceiling=512 * MiB, budget=0.02, min_steps=4, idle_window=20)
    for _ in range(4):
        pacer.observe(1.0, busy=False)
    assert all(pacer.observe(1.015, busy=True) is None for _ in range(20))  # within the budget
    # the idle steps are more than 20 steps old now: nothing to compare with, however slow
    assert all(pacer.observe(2.0, busy=True) is None for _ in range(8))
    # fresh idle steps: much slower, but a copy must finish in half the interval between copies
    verdicts = [pacer.observe(1.0, busy=False, keep_up=48 * MiB) for _ in range(4)]
    assert verdicts[:3] == [None] * 3
    assert verdicts[3].rate_before == 64 * MiB and verdicts[3].rate_after == 48 * MiB == pacer.rate
    # at that limit, another such measurement changes nothing and says nothing
    assert all(pacer.observe(2.0, busy=True, keep_up=48 * MiB) is None for _ in range(8)) and pacer.rate == 48 * MiB
    # copies coming faster: raised at once, without evidence (back to back, no step would be idle)
    raised = pacer.observe(2.0, busy=True, keep_up=96 * MiB)
    assert raised.slowdown is None and (raised.rate_before, raised.rate_after) == (48 * MiB, 96 * MiB)
    assert pacer.observe(2.0, busy=True, keep_up=1024 * MiB).rate_after == 512 * MiB  # never above the ceiling


@pytest.mark.parametrize("bad", [dict(ceiling=0), dict(budget=0), dict(budget=1.5), dict(budget=float("nan")),
                                 dict(min_steps=1)])
def test_a_pacer_with_impossible_settings_is_refused(bad):
    with pytest.raises(ValueError, match="min_steps >= 2"):
        UploadPacer(**{"ceiling": 512 * MiB, "budget": 0.02, **bad})
