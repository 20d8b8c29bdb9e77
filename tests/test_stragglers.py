"""Stragglers (issue 28): the policy on plain numbers, and real ``ddp_ft`` processes in which one
participant's steps become slower (``FT_TRAIN_SLOW``: its step sleep multiplied from a step on).
Issue 37: an eviction counts only with a job secret, sealed and bound to this run, incarnation,
round and launch; without a secret eviction only warns, whatever a store client writes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from lightning_ft.schema.round import EVICT_KEY, EvictionScope, encode_eviction
from lightning_ft.schema.run import RunKeys
from lightning_ft.schema.signing import Signer
from lightning_ft.stragglers.policy import NEVER_BELOW, StragglerAction, WorkSummary, decide, judge, summarize

from proc_utils import REPO_ROOT, child_env, write_secret

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, base_env, in_order, ordered_start, release

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


def test_without_a_job_secret_eviction_only_warns():
    verdict = judge(_ranks(1.0, 4.0), 2.0, WINDOW)
    action, reason = decide(verdict, spares=1, step=100, last_eviction_step=None, window=WINDOW, authenticated=False)
    assert action is StragglerAction.WARN and "no secret" in reason
    calm = judge(_ranks(1.0, 1.1), 2.0, WINDOW)
    assert decide(calm, 1, 100, None, WINDOW, authenticated=False)[0] is StragglerAction.NONE


def test_an_eviction_counts_only_for_the_run_incarnation_round_and_launch_it_names():
    from lightning_ft.schema.round import Eviction, EvictionScope, decode_eviction, encode_eviction

    scope = EvictionScope("slurm-42", 0, 3, "ab" * 16)
    raw = encode_eviction(scope, 1, 120, "slow").encode()
    assert decode_eviction(raw, scope) == Eviction(1, 120, "slow")
    for other in (scope._replace(run_id="other"), scope._replace(incarnation=1), scope._replace(round_id=4),
                  scope._replace(launch_id="cd" * 16)):  # the last: an earlier launch, same job id and secret
        assert decode_eviction(raw, other) is None
        assert decode_eviction(encode_eviction(other, 1, 120, "slow").encode(), scope) is None
    for garbage in (b"", b"1\x1f120\x1fslow", b"[]", b'{"run": "slurm-42"}',
                    encode_eviction(scope, True, 120, "slow").encode(), b"\xff"):
        assert decode_eviction(garbage, scope) is None, garbage


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
                              env: dict[str, str] | None = None, **env_a: str) -> None:
    """A and B train (A possibly slow); C, started once they train, waits as the hot spare; ``env``
    for every process (the store's included)."""
    env = env or {}
    cluster.start_store(**env)
    cluster.out.mkdir(parents=True, exist_ok=True)
    cluster.start_participant("A", args, **({"FT_TRAIN_SLOW": slow} if slow else {}), **env_a, **env)
    cluster.start_participant("B", args, **env)
    cluster.wait_for_step(2, 90, among=["A", "B"])
    if spare:
        cluster.start_participant("C", args, **env)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_4x_straggler_is_evicted_and_the_spare_takes_its_place(processes, tmp_path):
    """A 4x slower from step 30 (window 10): evicted with 84, its marker written -- the health
    check then reports its node unhealthy (82) --, the spare steps in, no step is trained again.
    With a job secret: without one, eviction only warns (issue 37)."""
    marker = tmp_path / "node-a-suspect"
    cluster = Cluster(processes, tmp_path, "2:3", run_id="straggler-evict")
    _start_actives_then_spare(cluster, [*ARGS, "--max-steps", "120"], slow="30:4", spare=True,
                              env={"LIGHTNING_FT_SECRET_FILE": write_secret(tmp_path)},
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


FORGE_EVICTION = str(REPO_ROOT / "tests" / "scripts" / "forge_eviction.py")
#: an earlier launch of the same job id (a resubmission keeps the run id and the secret file)
EARLIER_LAUNCH = "e0" * 16


def _wait_for_output(proc, text: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log():
        assert proc.popen.poll() is None and time.monotonic() < deadline, proc.log()
        time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("secret", ["no-secret", "job-secret"])
def test_a_forged_eviction_makes_no_healthy_node_leave(processes, tmp_path, secret):
    """Issue 37 finding 6. A store client without the job secret sets the ``evict`` key of every
    round, naming healthy ranks (each participant has a straggler marker configured, and there is
    a hot spare to take a place). Without a secret eviction only warns: the evictions -- bound to
    this run, incarnation, round and launch as a participant's would be -- are ignored with a
    warning. With a secret, unsealed evictions fail their seal, and then the sealed eviction of an
    earlier launch of the job id under the same secret (the key is the same) names another launch:
    both ignored with a warning. Either way nobody exits 84, no marker is written, the job finishes 0."""
    env = {"LIGHTNING_FT_SECRET_FILE": write_secret(tmp_path)} if secret == "job-secret" else {}
    cluster = Cluster(processes, tmp_path, "2:3", run_id="straggler-forged")
    cluster.out.mkdir(parents=True)
    cluster.start_store(**env)
    hold = ordered_start(cluster, "AB")
    markers = {name: tmp_path / f"suspect-{name}" for name in "ABC"}
    for name in "ABC":
        cluster.start_participant(name, [*ARGS, "--max-steps", "60", *hold],
                                  LIGHTNING_FT_STRAGGLER_MARKER=str(markers[name]), **env)
        in_order(cluster, name, actives="AB")
    then = tmp_path / "replay-now"
    replays = []
    if env:
        sealer = Signer(open(env["LIGHTNING_FT_SECRET_FILE"], "rb").read().strip())
        keys = RunKeys(cluster.run_id, 0)
        for round_id in range(4):
            key = f"{keys.round_store_prefix(round_id)}/{EVICT_KEY}"
            earlier = encode_eviction(EvictionScope(cluster.run_id, 0, round_id, EARLIER_LAUNCH), round_id % 2, 1,
                                      "an eviction of an earlier launch")
            replays += ["--replay", f"{round_id}:{sealer.seal(key, earlier).hex()}"]
    forger = processes.start("forger", [sys.executable, FORGE_EVICTION, "--endpoint", f"127.0.0.1:{cluster.port}",
                                        "--run-id", cluster.run_id, "--then", str(then), *replays],
                             env=base_env())
    _wait_for_output(forger, "forging")
    # while the actives hold their first step, their watchdogs read the forged evictions
    if env:
        cluster.wait_for_log("A", "ignored the value of store key lightning_ft/straggler-forged/i0/r0/job/evict")
        then.touch()
        _wait_for_output(forger, "replaying")
        cluster.wait_for_log("A", "ignored the eviction in store key")
        cluster.wait_for_log("B", "ignored the eviction in store key")
    else:
        for name in "AB":
            cluster.wait_for_log(name, "ignored the eviction in store key")
    release(hold)
    codes = cluster.wait(["A", "B", "C"], 150)
    assert codes == {"A": 0, "B": 0, "C": 0}, cluster.logs() + forger.log()
    assert cluster.events_of("evicted") == [] and "EVICTED" not in cluster.logs()
    assert [m for m in markers.values() if m.exists()] == []
    why = "bound to another run, incarnation, round or launch" if env else "this job has no secret"
    assert why in cluster.procs["A"].log() and why in cluster.procs["B"].log()
    assert cluster.result("A")["step"] == 60 and cluster.result("B")["step"] == 60
    forger.popen.send_signal(signal.SIGTERM)
