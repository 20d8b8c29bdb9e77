"""Stragglers (issue 28): the policy on plain numbers, and real ``ddp_ft`` processes in which one
participant's steps become slower (``FT_TRAIN_SLOW``: its step sleep multiplied from a step on)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_ft.stragglers.policy import NEVER_BELOW, StragglerAction, WorkSummary, decide, judge, summarize

from proc_utils import REPO_ROOT, child_env

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster

WINDOW = 25


def _ranks(*medians: float, lows: tuple[float, ...] | None = None, count: int = WINDOW) -> dict[int, WorkSummary]:
    lows = lows or medians
    return {rank: WorkSummary(100, count, m, low, 0.0) for rank, (m, low) in enumerate(zip(medians, lows, strict=True))}


def test_a_rank_persistently_twice_as_slow_as_its_peers_is_the_straggler():
    verdict = judge(_ranks(1.0, 1.0, 4.0, 1.1), 2.0, WINDOW)
    assert verdict.straggler == 2 and verdict.scores[2] == pytest.approx(4.0)
    assert "4.00x its peers' median" in verdict.reason


def test_ranks_within_the_floor_are_never_stragglers_whatever_the_factor():
    assert judge(_ranks(1.0, 1.25), 1.0, WINDOW).straggler is None
    assert judge(_ranks(1.0, 1.0, NEVER_BELOW * 1.01), 1.0, WINDOW).straggler == 2


def test_spikes_in_a_few_steps_are_not_a_straggler():
    """A median that is high but a low quantile near the peers': slow in under 80 % of the steps."""
    summary = summarize(100, [1.0] * 15 + [5.0] * 10, [0.0] * 25)
    assert summary.median == 1.0 and summary.low == 1.0
    assert judge({0: summary, 1: WorkSummary(100, WINDOW, 1.0, 1.0, 0.0)}, 2.0, WINDOW).straggler is None
    # slow in 16 of 25 steps: median slow, but the fast 9 (> 20 %) keep the low quantile fast
    mostly = summarize(100, [1.0] * 9 + [5.0] * 16, [0.0] * 25)
    assert mostly.median == 5.0
    assert judge({0: mostly, 1: WorkSummary(100, WINDOW, 1.0, 1.0, 0.0)}, 2.0, WINDOW).straggler is None
    steady = summarize(100, [1.0] * 4 + [5.0] * 21, [0.0] * 25)
    assert judge({0: steady, 1: WorkSummary(100, WINDOW, 1.0, 1.0, 0.0)}, 2.0, WINDOW).straggler == 0


def test_a_window_not_yet_full_decides_nothing_and_ties_go_to_the_lower_rank():
    verdict = judge(_ranks(1.0, 4.0, count=WINDOW - 1), 2.0, WINDOW)
    assert verdict.straggler is None and "fewer than 25 steps" in verdict.reason
    assert judge(_ranks(1.0, 1.0, 4.0, 4.0, 1.0), 2.0, WINDOW).straggler == 2
    assert judge(_ranks(1.0), 2.0, WINDOW).straggler is None  # one rank has no peers


def test_eviction_needs_a_spare_and_comes_at_most_once_per_window():
    verdict = judge(_ranks(1.0, 4.0), 2.0, WINDOW)
    assert decide(verdict, spares=1, step=100, last_eviction_step=None, window=WINDOW)[0] is StragglerAction.EVICT
    action, reason = decide(verdict, spares=0, step=100, last_eviction_step=None, window=WINDOW)
    assert action is StragglerAction.WARN and "no hot spare" in reason
    assert decide(verdict, 1, 110, 90, WINDOW)[0] is StragglerAction.WARN
    assert decide(verdict, 1, 115, 90, WINDOW)[0] is StragglerAction.EVICT
    calm = judge(_ranks(1.0, 1.1), 2.0, WINDOW)
    assert decide(calm, 1, 100, None, WINDOW)[0] is StragglerAction.NONE


def _meter_steps(micro_batches: list[list[tuple[float, float]]], step_end_wait: float) -> tuple[float, float]:
    """A WorkMeter on a scripted clock: each step is micro-batches of (work, wait before it); the
    last one synchronises (its wait lies between its last gradient and the closure's return)."""
    from lightning_ft.stragglers.meter import WorkMeter

    now = [0.0]
    meter = WorkMeter(window=len(micro_batches))
    meter.clock = lambda: now[0]
    meter.begin()
    for step, batches in enumerate(micro_batches):
        for index, (work, wait_before) in enumerate(batches):
            now[0] += wait_before  # Lightning's per-batch broadcast, before the batch's hooks
            meter.micro_batch_started()
            now[0] += work
            if index < len(batches) - 1:
                meter.backward_done()
                continue
            meter._gradient_ready(None)  # the last gradient of the synchronised backward
            now[0] += step_end_wait
            meter.timed_closure(lambda: None)()
            meter.backward_done()
        meter.step_finished(step)
    summary = meter.summary()
    return summary.median, summary.wait


def test_under_accumulation_the_wait_between_micro_batches_is_not_own_work():
    """Two micro-batches of 0.05 s, waiting 0.1 s before the second (a 3x slower peer) and 0.1 s
    in the synchronised backward: own work 0.1, wait 0.2 -- not 0.2 / 0.1 (it scored 1.5, not 3)."""
    own, wait = _meter_steps([[(0.05, 0.0), (0.05, 0.1)]] * 4, step_end_wait=0.1)
    assert own == pytest.approx(0.1) and wait == pytest.approx(0.2)
    # without accumulation the synchronised backward's wait alone is the wait
    own, wait = _meter_steps([[(0.05, 0.0)]] * 4, step_end_wait=0.1)
    assert own == pytest.approx(0.05) and wait == pytest.approx(0.1)


ARGS = ["--step-sleep", "0.05", "--snapshot-every", "10", "--ft-option", "straggler_window=10",
        "--ft-option", "straggler_factor=2.0"]  # on here; the test harness turns it off elsewhere


def _start_actives_then_spare(cluster: Cluster, args: list[str], slow: str | None, spare: bool,
                              **env_a: str) -> None:
    """A and B train (A possibly slow); C, started once they train, waits as the hot spare."""
    cluster.start_store()
    cluster.out.mkdir(parents=True, exist_ok=True)
    cluster.start_participant("A", args, **({"FT_TRAIN_SLOW": slow} if slow else {}), **env_a)
    cluster.start_participant("B", args)
    cluster.wait_for_step(2, 90, among=["A", "B"])
    if spare:
        cluster.start_participant("C", args)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_4x_straggler_is_evicted_and_the_spare_takes_its_place(processes, tmp_path):
    """A 4x slower from step 30 (window 10): evicted with 84, its marker written -- the health
    check then reports its node unhealthy (82) --, the spare steps in, no step is trained again."""
    marker = tmp_path / "node-a-suspect"
    cluster = Cluster(processes, tmp_path, "2:3", run_id="straggler-evict")
    _start_actives_then_spare(cluster, [*ARGS, "--max-steps", "120"], slow="30:4", spare=True,
                              LIGHTNING_FT_STRAGGLER_MARKER=str(marker))
    codes = cluster.wait(["A", "B", "C"], 150)
    assert codes == {"A": 84, "B": 0, "C": 0}, cluster.logs()
    [straggler] = [e for e in cluster.events_of("straggler") if e["action"] == "evict"]
    # judged on the median of the window's steps: it turns once about half of the 10 are slow
    # (step 36 or later, when the watchdog next looks), never before A slowed down at step 30
    assert straggler["score"] >= 2.0 and straggler["step"] > 30, straggler
    [evicted] = cluster.events_of("evicted")
    assert "evicted as a straggler" in evicted["reason"]
    assert "EVICTED (84)" in cluster.procs["A"].log()
    assert "evicted as a straggler from run straggler-evict" in marker.read_text()
    health = subprocess.run([sys.executable, "-m", "lightning_ft.cli", "health", "--marker", str(marker)],
                            capture_output=True, text=True, timeout=60, env=child_env())
    assert health.returncode == 82 and "evicted as a straggler" in health.stdout + health.stderr, health
    assert all(cluster.result(name)["step"] == 120 for name in ("B", "C"))
    # no work redone: the round after the eviction resumed from the survivor's live state
    [restored] = [e for e in cluster.events_of("restored") if e.get("round") == 1][:1]
    assert restored["step"] >= straggler["step"], (restored, straggler)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_straggler_without_a_spare_is_warned_about_and_kept(processes, tmp_path):
    """Under gradient accumulation (2 micro-batches a step): a 4x slower rank scores about 4,
    not the 1.5 it scored when the wait between micro-batches counted as own work."""
    cluster = Cluster(processes, tmp_path, "2:2", run_id="straggler-warn")
    _start_actives_then_spare(cluster, [*ARGS, "--max-steps", "50", "--accumulate", "2"], slow="20:4",
                              spare=False)
    assert cluster.wait(["A", "B"], 150) == {"A": 0, "B": 0}, cluster.logs()
    actions = {e["action"] for e in cluster.events_of("straggler")}
    assert actions == {"warn"}, cluster.events_of("straggler")
    assert min(e["score"] for e in cluster.events_of("straggler")) >= 2.0, cluster.events_of("straggler")
    assert "no hot spare to replace it" in cluster.logs()
    assert cluster.events_of("evicted") == []


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_rank_a_quarter_slower_is_kept(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:3", run_id="straggler-keep")
    _start_actives_then_spare(cluster, [*ARGS, "--max-steps", "80"], slow="5:1.25", spare=True)
    assert cluster.wait(["A", "B", "C"], 150) == {"A": 0, "B": 0, "C": 0}, cluster.logs()
    assert cluster.events_of("straggler") == [] and cluster.events_of("evicted") == []
    assert len(cluster.events_of("work")) >= 4  # measured and reported all along
