"""End to end: ``Trainer(strategy="ddp_ft")`` in real processes on 127.0.0.1.

Every test runs a standalone ``lightning-ft store`` (killing a participant never kills the
store) and participants of ``tests/scripts/ft_train.py``, each with its own node identity
and snapshot root, so a hot spare really lacks the snapshot and must receive it.
"""

from __future__ import annotations

import csv
import json
import re
import signal
import sys
from pathlib import Path

import pytest

from proc_utils import REPO_ROOT, ProcessSet, child_pids, kill_pids, wait_for, write_secret

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import SCRIPT, Cluster, base_env, in_order, ordered_start, release

pytestmark = [pytest.mark.multiprocess]

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]


def snapshot_steps(schedules: list[dict], until: int) -> set[int]:
    """Steps the default schedule snapshots up to ``until``, from the ``snapshot_schedule`` events:
    the first calibration step (it measures the save), then each agreed interval from the step
    it was agreed at until the next agreement."""
    steps = {schedules[0]["step"]}
    ends = [e["step"] for e in schedules[1:]] + [until + 1]
    for event, end in zip(schedules, ends, strict=True):
        every = event["snapshot_every_n_steps"]
        steps |= {s for s in range(event["step"], end) if s % every == 0}
    return steps


@pytest.mark.timeout(180)
def test_no_failure_matches_plain_ddp_and_the_spare_exits_zero(processes, tmp_path):
    # the same script under plain DDP (torchrun, 2 workers) as the reference, at the same time
    ref_out = tmp_path / "ref"
    reference = processes.start("ref", [TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, "--out", str(ref_out),
                                        "--strategy", "ddp", "--devices", "2", "--max-steps", "40"],
                                env=base_env(LIGHTNING_FT_SNAPSHOT_DIR=str(tmp_path / "ref-shm"),
                                             LIGHTNING_FT_RUN_ID="reference"))
    try:
        cluster = Cluster(processes, tmp_path / "ft", "2:3")
        cluster.out.mkdir(parents=True)
        cluster.start_store()
        # training waits until the spare is standby: on a loaded machine a spare that starts late
        # would otherwise arrive after these 40 steps (and leave as "not needed", not as a spare)
        hold = ordered_start(cluster, "AB")
        for name in "ABC":
            cluster.start_participant(name, ["--max-steps", "40", *hold])
            in_order(cluster, name, actives="AB")
        release(hold)
        codes = cluster.wait(["A", "B", "C"], 75)
        assert codes == {"A": 0, "B": 0, "C": 0}, cluster.logs()
        assert wait_for(lambda: reference.popen.poll() is not None, 60), reference.log()
        assert reference.popen.returncode == 0, reference.log()
    finally:  # torchrun's workers lead sessions of their own: the fixture would not reach them
        kill_pids(child_pids(reference.pid))

    results = {name: cluster.result(name) for name in "ABC"}
    trained = [r for r in results.values() if r["trained"]]
    spares = [r for r in results.values() if not r["trained"]]
    assert len(trained) == 2 and len(spares) == 1, results
    assert sorted(r["rank"] for r in trained) == [0, 1]
    assert spares[0]["rank"] == -1 and spares[0]["step"] == 0  # a spare never acts as rank 0 after fit()
    spare = next(name for name in "ABC" if results[name] is spares[0])
    assert cluster.left_cleanly(spare), cluster.procs[spare].log()  # exit 0, not SIGABRT at interpreter exit
    assert all(r["step"] == 40 for r in trained)
    ref_results = [json.loads(p.read_text()) for p in ref_out.glob("result-*.json")]
    assert len(ref_results) == 2
    expected = ref_results[0]["weights"]
    for result in trained:
        assert result["weights"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert len(cluster.events_of("finished")) == 2
    assert len(cluster.events_of("spare_exit")) == 1
    # the job finished: the actives removed their snapshots from memory (/dev/shm is RAM)
    left = sorted(str(p.relative_to(cluster.root)) for p in cluster.root.glob(f"shm-*/{cluster.run_id}*"))
    assert left == [], left


def assert_resumed_at_the_step_in_flight(cluster: Cluster, victim: str, spare: str) -> int:
    """The survivor and the spare resumed from the survivor's live state: the last step the victim
    completed (or one more: its share of the next step's all-reduce may have arrived before it
    died); returns that step."""
    killed_at = max(r["step"] for r in cluster.steps()[victim])
    restored = {e["step"] for e in cluster.events_of("restored") if e.get("round", 0) > 0}
    assert len(restored) == 1 and killed_at <= min(restored) <= killed_at + 1, (restored, killed_at)
    step = min(restored)
    saved = [e for e in cluster.events_of("live_state") if e.get("saved")]
    assert saved and {e["step"] for e in saved} <= {killed_at, killed_at + 1}, cluster.events_of("live_state")
    assert [e["step"] for e in cluster.events_of("snapshot_received")] == [step]  # the spare got the live state
    assert [s["step"] for s in cluster.starts(spare)] == [step]
    return step


@pytest.mark.timeout(180)
def test_sigkill_active_the_survivor_and_the_spare_resume_at_the_step_in_flight(processes, tmp_path):
    """The strategy's defaults (its own EmergencyCheckpoint, snapshots on the cost schedule): a
    peer's death costs the step in flight, not the steps since the last periodic snapshot."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.start(["A", "B", "C"], ["--max-steps", "100", "--step-sleep", "0.03", "--snapshot-every", "0"])
    cluster.wait_for_step(35, 60)
    actives = cluster.active_names()
    victim = actives[-1]
    spare = next(n for n in "ABC" if n not in actives)
    cluster.kill(victim)
    survivors = [n for n in "ABC" if n != victim]
    codes = cluster.wait(survivors, 60)
    assert codes == {n: 0 for n in survivors}, cluster.logs()
    assert cluster.procs[victim].popen.poll() == -signal.SIGKILL
    step = assert_resumed_at_the_step_in_flight(cluster, victim, spare)
    assert step >= 35
    # the schedule kept its first calibration step (the first snapshot at step 8)
    assert cluster.events_of("snapshot_schedule")[0]["step"] == 8, cluster.events_of("snapshot_schedule")
    for name in survivors:
        assert cluster.result(name)["step"] == 100 and cluster.result(name)["trained"]
    assert cluster.events_of("first_step_after_recovery")
    assert [e["detector"] for e in cluster.events_of("failure_detected")] == ["collective"]


@pytest.mark.timeout(180)
def test_explicit_callbacks_batchnorm_and_accumulation_resume_at_the_step_in_flight(processes, tmp_path):
    """A user's EmergencyCheckpoint() and GracefulTermination() without arguments (they used to
    protect nothing: no periodic snapshot), a model with BatchNorm, two batches per optimizer
    step; rank 0 is killed: the survivor and the spare resume at the step in flight."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.start(["A", "B", "C"], ["--max-steps", "90", "--step-sleep", "0.02", "--explicit-callbacks",
                                    "--batchnorm", "--accumulate", "2"])
    cluster.wait_for_step(30, 60)
    ranks = {r["rank"]: name for name, records in cluster.steps().items() for r in records[-1:]}
    victim, other = ranks[0], ranks[1]
    spare = next(n for n in "ABC" if n not in (victim, other))
    cluster.kill(victim)
    codes = cluster.wait([other, spare], 60)
    assert codes == {other: 0, spare: 0}, cluster.logs()
    assert assert_resumed_at_the_step_in_flight(cluster, victim, spare) >= 30
    assert cluster.result(other)["step"] == cluster.result(spare)["step"] == 90
    assert cluster.result(other)["weights"] == cluster.result(spare)["weights"]


@pytest.mark.timeout(180)
def test_two_failures_with_two_spares(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:4")
    names = ["A", "B", "C", "D"]
    cluster.start(names, ["--max-steps", "110", *SLOW])
    cluster.wait_for_step(25, 60)
    first = cluster.active_names()[0]
    cluster.kill(first)
    assert wait_for(lambda: len(cluster.events_of("first_step_after_recovery")) >= 1, 30), cluster.logs()
    # second failure: the spare that stepped in (it holds only the transferred snapshot) dies too
    stepped_in = [e["who"] for e in cluster.events_of("snapshot_received")]
    assert len(stepped_in) == 1
    pid = int(stepped_in[0].split(":")[1])
    second = next(n for n, p in cluster.procs.items() if p.pid == pid)
    # the event may come from the survivor before the spare recorded a step of its own (load)
    assert wait_for(lambda: cluster.steps()[second], 30), cluster.logs()
    reached = max(r["step"] for r in cluster.steps()[second])
    cluster.wait_for_step(reached + 15, 30, among=[second])
    cluster.kill(second)
    survivors = [n for n in names if n not in (first, second)]
    codes = cluster.wait(survivors, 60)
    assert codes == {n: 0 for n in survivors}, cluster.logs()
    for name in survivors:
        assert cluster.result(name)["step"] == 110 and cluster.result(name)["trained"]
    assert len(cluster.events_of("snapshot_received")) == 2
    assert {e["round"] for e in cluster.events_of("finished")} == {2}


@pytest.mark.timeout(180)
def test_failure_with_no_spare_left_saves_exits_81_and_a_relaunch_resumes(processes, tmp_path):
    """2:2, one node killed: the survivor saves its live step and, with no spare to form the next
    round, exits 81 (requeue: a relaunch resumes) -- not 83. Both nodes relaunched by hand resume at
    that step and finish."""
    cluster = Cluster(processes, tmp_path, "2:2", run_id="no-spare")
    logs = ["--csv-logs", str(tmp_path / "logs")]
    cluster.start(["A", "B"], ["--max-steps", "400", *SLOW, *logs])
    cluster.wait_for_step(15, 45)
    cluster.kill("B")
    codes = cluster.wait(["A"], 30)
    assert codes == {"A": 81}, cluster.logs()
    log = cluster.procs["A"].log()
    assert "no hot spare left" in log and "is saved: a relaunch resumes from it" in log and "PREEMPTED (81)" in log
    [event] = [e for e in cluster.events_of("stopped") if e.get("code") == 81]
    saved = int(re.search(r"snapshot of step (\d+)", event["reason"]).group(1))
    assert saved >= 15 and not cluster.events_of("no_restart")
    # The relaunch ends at a fixed step, not one after the kill's (which timing picks): the
    # characterization record keeps the step it finished at.
    final_step = 40
    assert saved < final_step, f"saved after step {final_step}: {saved}"

    (tmp_path / "relaunch").mkdir()
    relaunched = ProcessSet(log_dir=tmp_path / "relaunch")  # a store and participants of its own
    try:
        again = Cluster(relaunched, tmp_path / "relaunch", "2:2", run_id="no-spare")
        again.out.mkdir(parents=True)
        again.start_store()
        for name in ("A", "B"):  # the same nodes again: their snapshot roots and domains
            again.start_participant(name, ["--max-steps", str(final_step), *SLOW, *logs],
                                    LIGHTNING_FT_SNAPSHOT_DIR=str(tmp_path / f"shm-{name}"),
                                    LIGHTNING_FT_DOMAIN_ID=f"host-{name}")
        assert again.wait(["A", "B"], 90) == {"A": 0, "B": 0}, again.logs()
        assert [again.starts(name)[0]["step"] for name in ("A", "B")] == [saved, saved], again.logs()
        assert {again.result(name)["step"] for name in ("A", "B")} == {final_step}
    finally:
        relaunched.kill_all()
    # the Trainer's logger goes on with the run's figures: the relaunch (the stop, the gap, the
    # steps done again) is lost time, as lightning-ft report counts it -- no recovery
    with open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("ft/recoveries")]
    assert [float(r["ft/recoveries"]) for r in rows] == [0.0, 0.0], rows
    assert float(rows[0]["ft/goodput"]) == 1 and 0 < float(rows[1]["ft/goodput"]) < 1, rows
    assert float(rows[1]["ft/lost_seconds"]) > 0, rows


@pytest.mark.timeout(180)
def test_second_failure_after_the_only_spare_was_used_ends_with_a_requeue(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.start(["A", "B", "C"], ["--max-steps", "400", *SLOW])
    cluster.wait_for_step(15, 45)
    first, last = sorted(cluster.active_names())
    [spare] = [n for n in "ABC" if n not in (first, last)]
    cluster.kill(first)
    assert wait_for(lambda: len(cluster.events_of("first_step_after_recovery")) >= 1, 30), cluster.logs()
    survivors = [spare, last]
    reached = max(r["step"] for name in survivors for r in cluster.steps()[name])
    cluster.wait_for_step(reached + 5, 30, among=survivors)
    # the spare that stepped in is lost next, the other active of round 0 stays (by role, not by
    # name: which process arrives as the spare is the machine's choice, and the record holds roles)
    cluster.kill(spare)
    codes = cluster.wait([last], 40)
    assert codes == {last: 81}, cluster.logs()  # its state is saved: a requeue resumes (see above)
    assert "no hot spare left" in cluster.procs[last].log()
    [event] = [e for e in cluster.events_of("stopped") if e.get("code") == 81]
    assert "min_nodes" in event["reason"]


@pytest.mark.timeout(150)
def test_bug_in_training_step_fails_the_job_without_using_the_spare(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.start(["A", "B", "C"], ["--max-steps", "400", "--raise-at-step", "15", "--raise-on-rank", "1", *SLOW,
                                     "--hang-floor", "2"])
    codes = cluster.wait(["A", "B", "C"], 45)
    logs = cluster.logs()
    # the buggy rank 1, its peer and the spare: the job cannot go on (the spare was not "finished")
    assert sorted(codes.values()) == [1, 83, 83], logs
    assert "deliberate bug at step 15" in logs
    assert not cluster.events_of("snapshot_received"), "the spare must not be used for a bug"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("callback", ["added by the strategy", "given by the user"])
def test_sigterm_to_every_active_takes_the_graceful_termination_path(processes, tmp_path, callback):
    """Every active signalled (scancel, a time limit, a preempted job): the whole job stops at one
    step although a spare waits (one active signalled hands over: tests/test_handover.py)."""
    cluster = Cluster(processes, tmp_path, "2:3")
    graceful = ["--graceful"] if callback == "given by the user" else []
    cluster.start(["A", "B", "C"], ["--max-steps", "400", *graceful, *SLOW])
    cluster.wait_for_step(20, 45)
    actives = cluster.active_names()
    spare = next(n for n in "ABC" if n not in actives)
    for name in actives:
        cluster.kill(name, signal.SIGTERM)
    codes = cluster.wait(["A", "B", "C"], 40)
    # the spare stops with the job: 143, nothing of its own to save (0 would claim "finished")
    assert codes == {actives[0]: 81, actives[1]: 81, spare: 143}, cluster.logs()
    stops = []
    for name in actives:
        stop_step = max(r["step"] for r in cluster.steps()[name])
        stops.append(stop_step)
        snapshots = list((tmp_path / f"shm-{name}").rglob(f"step-{stop_step:012d}.snap"))
        assert snapshots, f"no committed snapshot of the stop step {stop_step} on {name}"
    assert stops[0] == stops[1]
    assert cluster.events_of("stopped")
    verdicts = cluster.events_of("hand_over_verdict")
    assert verdicts and all(not e["hands_over"] and "every active" in e["reason"] for e in verdicts), verdicts


@pytest.mark.timeout(150)
def test_sigterm_events_go_to_the_events_dir_given_to_the_strategy(processes, tmp_path):
    # events_dir as an argument, LIGHTNING_FT_EVENTS_DIR unset: the SIGTERM path's events must
    # land in the same run directory (and the same per-process file) as the strategy's
    events_dir = tmp_path / "given-events"
    cluster = Cluster(processes, tmp_path, "1:1")
    cluster.out.mkdir(parents=True, exist_ok=True)
    cluster.start_store()
    cluster.start_participant("A", ["--max-steps", "400", *SLOW, "--ft-option", f"events_dir={events_dir}"],
                              LIGHTNING_FT_EVENTS_DIR="")
    cluster.wait_for_step(5, 45)
    cluster.kill("A", signal.SIGTERM)
    assert cluster.wait(["A"], 40) == {"A": 81}, cluster.logs()
    files = list(events_dir.glob("events-*.jsonl"))
    assert len(files) == 1, files
    names = [json.loads(line)["event"] for line in files[0].read_text().splitlines()]
    for name in ("join", "round_complete", "termination_signal", "health_report", "termination_decision"):
        assert name in names, names
    assert not cluster.events.exists() or not list(cluster.events.glob("*.jsonl"))


@pytest.mark.timeout(150)
def test_sigterm_to_a_waiting_spare_withdraws_it_and_training_goes_on(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.start(["A", "B", "C"], ["--max-steps", "80", *SLOW])
    cluster.wait_for_step(10, 45)
    spare = next(n for n in "ABC" if n not in cluster.active_names())
    # waiting, not still starting: on a loaded machine the spare may still be importing torch
    cluster.wait_for_log(spare, "standby in round")
    cluster.kill(spare, signal.SIGTERM)
    # stopped by SIGTERM, nothing of its own to save: 143 (a spare that was simply not needed exits 0)
    assert cluster.wait([spare], 15) == {spare: 143}, cluster.logs()
    actives = [n for n in "ABC" if n != spare]
    assert cluster.wait(actives, 40) == {n: 0 for n in actives}, cluster.logs()
    assert "SIGTERM while waiting" in cluster.procs[spare].log()
    assert all(cluster.result(n)["step"] == 80 for n in actives)


@pytest.mark.timeout(180)
def test_sigstopped_active_is_detected_as_hung_and_replaced(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.start(["A", "B", "C"], ["--max-steps", "100", "--hang-floor", "2", *SLOW])
    cluster.wait_for_step(30, 60)
    actives = cluster.active_names()
    frozen = actives[0]
    cluster.kill(frozen, signal.SIGSTOP)
    survivors = [n for n in "ABC" if n != frozen]
    try:
        codes = cluster.wait(survivors, 60)
    finally:
        cluster.kill(frozen, signal.SIGKILL)
    assert codes == {n: 0 for n in survivors}, cluster.logs()
    hangs = [e for e in cluster.events_of("failure_detected") if e["detector"] == "hang"]
    assert hangs, cluster.logs()
    frozen_rank = cluster.steps()[frozen][-1]["rank"]
    assert hangs[0]["stalled"] == [frozen_rank]
    for name in survivors:
        assert cluster.result(name)["step"] == 100


@pytest.mark.timeout(150)
def test_sole_active_lost_the_spare_resumes_from_its_replica(processes, tmp_path):
    # 1 active + 1 spare on different "hosts": each snapshot is replicated to the spare through
    # the store (encrypted: replicas need a job secret), because the active alone holds it; when
    # the active dies nobody is left to send it, and the spare (which opens the next round
    # itself) resumes from its own copy
    secret = {"LIGHTNING_FT_SECRET_FILE": write_secret(tmp_path)}
    cluster = Cluster(processes, tmp_path, "1:2")
    cluster.out.mkdir(parents=True)
    cluster.start_store(**secret)
    for name in "AB":
        cluster.start_participant(name, ["--max-steps", "80", *SLOW], **secret)
    cluster.wait_for_step(35, 45)
    [active] = cluster.active_names()
    spare = "B" if active == "A" else "A"
    assert wait_for(lambda: any(e["step"] >= 30 for e in cluster.events_of("replica_received")), 10), cluster.logs()
    cluster.kill(active)
    codes = cluster.wait([spare], 40)
    assert codes == {spare: 0}, cluster.logs()
    assert cluster.result(spare)["step"] == 80 and cluster.result(spare)["trained"]
    restored = cluster.events_of("restored")[-1]["step"]
    assert restored >= 30 and restored % 10 == 0
    assert not cluster.events_of("snapshot_received")  # nobody could send it: the replica was used
    assert any("silent" in e["reason"] for e in cluster.events_of("round_open"))


@pytest.mark.timeout(240)  # torchrun agents and their workers are fresh interpreters: 91 s seen
def test_under_torchrun_the_new_worker_receives_the_snapshot(processes, tmp_path):
    # torchrun --rdzv-backend=lightning_ft: torchrun's agents do the node rendezvous and restart
    # workers; the strategy behaves like DDP and hands the in-memory snapshot to the worker of
    # the spare node, which has none
    from ft_cluster import _read_jsonl
    from proc_utils import free_port

    port, out = free_port(), tmp_path / "out"
    agents = {}
    workers: set[int] = set()
    conf = "last_call_timeout=0.3,previous_active_grace=3,heartbeat_interval=0.1"
    try:
        for index, name in enumerate("ABC"):
            argv = [TORCHRUN, "--nnodes=2:3", "--nproc-per-node=1", "--rdzv-backend=lightning_ft",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic", f"--rdzv-conf={conf}",
                    "--max-restarts=3", "--monitor-interval=0.1", SCRIPT, "--out", str(out), "--max-steps", "60",
                    "--csv-logs", str(tmp_path / "logs"), *SLOW]
            env = base_env(LIGHTNING_FT_SNAPSHOT_DIR=str(tmp_path / f"shm-{name}"),
                           LIGHTNING_FT_EVENTS_DIR=str(tmp_path / "events"), LIGHTNING_FT_INFRA_RANK=str(index))
            agents[name] = processes.start(name, argv, env=env)
            if index == 0:
                assert wait_for(lambda: "hosting the rendezvous store" in agents["A"].log(), 30)

        def reached(step):
            return any(r and r[-1]["step"] >= step for r in map(_read_jsonl, out.glob("steps-*.jsonl")))

        assert wait_for(lambda: reached(25), 60), processes.dump_logs()
        # an active node that does not host the store (A, started first, hosts it and is active;
        # B or C, whichever arrived after round 0 closed, is the spare)
        victim = next(n for n in ("B", "C") if child_pids(agents[n].pid))
        for agent in agents.values():
            workers.update(child_pids(agent.pid))
        victim_workers = child_pids(agents[victim].pid)
        agents[victim].signal_group(signal.SIGKILL)
        kill_pids(victim_workers)
        survivors = [n for n in "ABC" if n != victim]
        codes = {n: agents[n].popen.wait(timeout=80) for n in survivors}
        assert codes == {n: 0 for n in survivors}, processes.dump_logs()
        events = [e for p in (tmp_path / "events").glob("*.jsonl") for e in _read_jsonl(p)]
        received = [e for e in events if e["event"] == "snapshot_received"]
        # the workers torchrun restarted resume from the survivor's live state: the step in flight
        killed_at = max(r["step"] for pid in victim_workers for r in _read_jsonl(out / f"steps-{pid}.jsonl"))
        saved = [e for e in events if e["event"] == "live_state" and e.get("saved")]
        assert saved and received and received[0]["step"] >= 25, events
        assert killed_at <= received[0]["step"] == max(e["step"] for e in saved) <= killed_at + 1, \
            (received, saved, killed_at)
        finals = [json.loads(p.read_text()) for p in out.glob("result-*.json")]
        assert sorted(r["step"] for r in finals if r["trained"]) == [60, 60]
        # torchrun's restart is a launch: the logs continue its version, every step's row once
        logs = tmp_path / "logs" / "lightning_logs"
        assert sorted(p.name for p in logs.iterdir()) == [".lightning_ft-run-elastic", "version_0"], \
            processes.dump_logs()
        with open(logs / "version_0" / "metrics.csv", newline="") as f:
            steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("loss")]
        assert steps == list(range(60)), steps
        # the outcome is in the event log as in rendezvous mode (lightning-ft report --exit-code reads it)
        assert sorted(e["step"] for e in events if e["event"] == "finished") == [60, 60]
    finally:
        for agent in agents.values():
            workers.update(child_pids(agent.pid))
        kill_pids(workers)
