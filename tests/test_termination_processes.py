"""SIGTERM path with real processes and real signals: torchrun (2 CPU ranks, gloo), Lightning's popen
``ddp`` launcher, and a single-process Trainer. Each test has a hard timeout; nothing here asserts
on timings -- "exited in time" means "exited before the wait deadline".
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from lightning_ft.checkpoint import SnapshotStore
from lightning_ft.exit_codes import ExitCode
from lightning_ft.termination.exit_records import read_exit_records

from proc_utils import REPO_ROOT, child_env, kill_pids, wait_for

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "graceful_train.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
RUN_ID = "graceful-test"
NOT_SAVED = 128 + signal.SIGTERM

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def worker_pids():
    """Worker pids read from the ready markers; torchrun starts workers in their own sessions."""
    pids: list[int] = []
    yield pids
    kill_pids(pids)


class Run:
    """Paths of one scenario: script outputs, snapshots, exit records."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.out, self.snap, self.exit = root / "out", root / "snap", root / "exit"

    def args(self, *extra: str) -> list[str]:
        return ["--out", str(self.out), "--snapshot-dir", str(self.snap), "--run-id", RUN_ID,
                "--exit-dir", str(self.exit), *extra]

    def marker(self, kind: str, rank: int) -> dict | None:
        path = self.out / f"{kind}.rank{rank}"
        return json.loads(path.read_text()) if path.exists() else None

    def snapshot_steps(self, rank: int) -> list[int]:
        return sorted(info.step for info in SnapshotStore(self.snap, RUN_ID, rank=rank).list())

    def records(self) -> dict[int, dict]:
        # a wrapper writes into a launch directory of its own inside --dir; a plain launcher
        # (LIGHTNING_FT_EXIT_RECORD_DIR / --exit-dir) into the directory itself
        launches = sorted(self.exit.glob("launch-*"))
        return {r["rank"]: r for r in read_exit_records(launches[-1] if launches else self.exit)}


def torchrun_argv(*script_args: str) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, "--strategy", "ddp", "--devices", "2",
            "--pg-timeout", "20", *script_args]


def wait_ready(run: Run, ranks: list[int], proc, processes, pids: list[int], timeout: float = 90) -> dict[int, int]:
    """Wait for every rank's "ready at step k" marker; returns rank -> pid."""
    def ready() -> bool:
        return all(run.marker("ready", r) for r in ranks) or proc.popen.poll() is not None

    assert wait_for(ready, timeout), "workers never got ready\n" + processes.dump_logs()
    assert proc.popen.poll() is None, "launcher exited before the signal\n" + processes.dump_logs()
    found = {r: run.marker("ready", r)["pid"] for r in ranks}
    pids.extend(found.values())
    return found


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def torchrun_reported_codes(log: str) -> list[int]:
    """Worker exit codes from torchrun's failure summary (printed when a worker fails, not when it is signalled)."""
    return [int(code) for code in re.findall(r"^\s+exitcode\s+:\s*(-?\d+)", log, re.MULTILINE)]


def assert_stopped_together_and_saved(run: Run, processes) -> int:
    stops = {r: run.marker("stop", r) for r in (0, 1)}
    assert all(stops.values()), processes.dump_logs()
    assert stops[0]["step"] == stops[1]["step"], stops
    assert stops[0]["digest"] == stops[1]["digest"], stops
    assert stops[0]["code"] == stops[1]["code"] == ExitCode.PREEMPTED
    step = stops[0]["step"]
    records = run.records()
    assert {r: records[r]["exit_code"] for r in (0, 1)} == {0: ExitCode.PREEMPTED, 1: ExitCode.PREEMPTED}
    for rank in (0, 1):
        assert step in run.snapshot_steps(rank), (rank, run.snapshot_steps(rank))
    return step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", ["rank1", "rank0", "both", "agent"])
def test_torchrun_sigterm_stops_every_rank_at_the_same_step(target, processes, worker_pids, tmp_path):
    run = Run(tmp_path)
    agent = processes.start("torchrun", torchrun_argv(*run.args()))
    pids = wait_ready(run, [0, 1], agent, processes, worker_pids)

    if target == "agent":
        agent.signal(signal.SIGTERM)  # the Kubernetes / SLURM case: the agent forwards it to every worker
    else:
        for rank in {"rank0": [0], "rank1": [1], "both": [0, 1]}[target]:
            os.kill(pids[rank], signal.SIGTERM)

    codes = processes.wait_all(timeout=30)
    assert codes["torchrun"] is not None, "torchrun still running\n" + processes.dump_logs()
    assert wait_for(lambda: all(gone(p) for p in pids.values()), 10), "a worker outlived torchrun"
    step = assert_stopped_together_and_saved(run, processes)
    # torchrun itself exits 1 whatever its workers did (ChildFailedError / SignalException)
    assert codes["torchrun"] == 1
    reported = torchrun_reported_codes(agent.log())
    assert all(code == ExitCode.PREEMPTED for code in reported), reported
    if target != "agent":
        assert len(reported) == 2, agent.log()[-3000:]

    if target == "rank1":  # rerun: resumes at the stop step with identical weights and optimizer state
        processes.start("torchrun-resume", torchrun_argv(*run.args("--max-steps", str(step + 2))))
        # a fresh torchrun and two fresh workers: once over 60 s on CI's loaded 2 cores
        assert processes.wait_all(timeout=150)["torchrun-resume"] == 0, processes.dump_logs()
        starts = {r: run.marker("start", r) for r in (0, 1)}
        stop_digest = run.marker("stop", 0)["digest"]
        assert starts[0]["step"] == starts[1]["step"] == step
        assert starts[0]["digest"] == starts[1]["digest"] == stop_digest
        assert run.marker("done", 0)["step"] == step + 2


@pytest.mark.timeout(300)
def test_unhealthy_rank_exits_without_saving_and_the_healthy_one_saves(processes, worker_pids, tmp_path):
    run = Run(tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / "unhealthy.rank1").write_text("Xid 79: GPU has fallen off the bus")  # only rank 1 sees it
    # Kubernetes style: SIGTERM to the container's main process, here our exit-code wrapper around torchrun
    argv = [sys.executable, "-m", "lightning_ft.termination.exit_records", "--dir", str(run.exit), "--",
            *torchrun_argv(*run.args("--unhealthy-marker-dir", str(markers)))]
    wrapper = processes.start("wrapper", argv)
    pids = wait_ready(run, [0, 1], wrapper, processes, worker_pids)
    wrapper.signal(signal.SIGTERM)

    codes = processes.wait_all(timeout=30)
    assert codes["wrapper"] == ExitCode.UNHEALTHY_NODE, processes.dump_logs()  # torchrun said 1
    assert wait_for(lambda: all(gone(p) for p in pids.values()), 10)
    records = run.records()
    assert records[1]["exit_code"] == ExitCode.UNHEALTHY_NODE and records[1]["action"] == "exit-without-save"
    assert any("Xid 79" in reason for reason in records[1]["reasons"])
    assert records[0]["exit_code"] == ExitCode.PREEMPTED
    assert run.snapshot_steps(1) == []  # the unhealthy node wrote nothing
    saved = records[0]["step"]
    assert run.snapshot_steps(0) == [saved]
    assert run.marker("stop", 1) is None  # os._exit: no Lightning exception handling on rank 1
    healthy_stop = run.marker("stop", 0)

    for name in ("start.rank0", "start.rank1"):
        (run.out / name).unlink()
    processes.start("torchrun-resume", torchrun_argv(*run.args("--max-steps", str(saved + 2))))
    assert processes.wait_all(timeout=150)["torchrun-resume"] == 0, processes.dump_logs()
    starts = {r: run.marker("start", r) for r in (0, 1)}
    assert starts[0]["step"] == starts[1]["step"] == saved  # both from rank 0's snapshot
    assert starts[0]["digest"] == starts[1]["digest"] == healthy_stop["digest"]


@pytest.mark.timeout(180)
def test_single_process_sigterm_to_itself_saves_and_resumes(processes, tmp_path):
    run = Run(tmp_path)
    processes.python("train", [SCRIPT, *run.args("--self-signal-step", "5")])
    assert processes.wait_all(timeout=60)["train"] == ExitCode.PREEMPTED, processes.dump_logs()
    stop = run.marker("stop", 0)
    assert stop["step"] == 5 and run.snapshot_steps(0) == [5]
    assert run.records()[0]["exit_code"] == ExitCode.PREEMPTED

    processes.python("resume", [SCRIPT, *run.args("--max-steps", "7")])
    assert processes.wait_all(timeout=60)["resume"] == 0, processes.dump_logs()
    assert run.marker("start", 0) == {"step": 5, "digest": stop["digest"]}
    assert run.marker("done", 0)["step"] == 7


@pytest.mark.timeout(180)
def test_ddp_ft_sigterm_then_relaunch_continues_one_log_version(processes, tmp_path):
    """SIGTERM -> 81 with the snapshot of the stop step; the relaunch resumes there and its logs
    continue the same version: one ``version_0``, every step's row once, in order."""
    import csv

    from examples.procs import free_port
    from lightning_ft.events.log import read_events
    from lightning_ft.report.timeline import summarize

    run, logs = Run(tmp_path), tmp_path / "logs"
    env = child_env(LIGHTNING_FT_ENDPOINT=f"127.0.0.1:{free_port()}", LIGHTNING_FT_NNODES="1:1",
                    LIGHTNING_FT_RUN_ID=RUN_ID, LIGHTNING_FT_EVENTS_DIR=str(tmp_path / "events"))
    args = run.args("--strategy", "ddp_ft", "--csv-logs", str(logs))
    processes.python("train", [SCRIPT, *args, "--self-signal-step", "5"], env=env)
    assert processes.wait_all(timeout=60)["train"] == ExitCode.PREEMPTED, processes.dump_logs()
    processes.python("resume", [SCRIPT, *args, "--max-steps", "9"], env=env)
    assert processes.wait_all(timeout=60)["resume"] == 0, processes.dump_logs()
    assert run.marker("start", 0)["step"] == 5
    assert sorted(p.name for p in (logs / "lightning_logs").iterdir()) == [f".lightning_ft-run-{RUN_ID}", "version_0"]
    with open(logs / "lightning_logs" / "version_0" / "metrics.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("loss")]
    assert steps == list(range(9)), steps
    # lightning-ft report on the shared events directory: the stop, the gap, the resume
    summary = summarize(read_events(tmp_path / "events"))
    [relaunch] = summary.relaunches
    assert (relaunch.stopped_step, relaunch.restored_step, relaunch.steps_redone) == (5, 5, 0), relaunch
    assert relaunch.lost_seconds > 0 and "exit 81" in relaunch.why, relaunch
    assert summary.status == "finished" and summary.goodput < 1, summary.status_detail


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("overrun_healthy", "expected"), [(False, ExitCode.UNHEALTHY_NODE),
                                                           (True, ExitCode.PREEMPTED)])
def test_a_hanging_probe_is_judged_by_the_overrun_policy_within_its_deadline(overrun_healthy, expected,
                                                                               processes, tmp_path):
    run = Run(tmp_path)
    args = run.args("--self-signal-step", "4", "--hang-probe", "--health-timeout", "1")
    processes.python("train", [SCRIPT, *args, *(["--overrun-healthy"] if overrun_healthy else [])])
    assert processes.wait_all(timeout=40)["train"] == expected, processes.dump_logs()
    record = run.records()[0]
    assert record["exit_code"] == expected
    assert run.snapshot_steps(0) == ([4] if overrun_healthy else [])
    if not overrun_healthy:
        assert any("hangs" in reason for reason in record["reasons"]), record


@pytest.mark.timeout(180)
def test_without_emergency_checkpoint_the_exit_code_says_nothing_was_saved(processes, tmp_path):
    run = Run(tmp_path)
    processes.python("train", [SCRIPT, *run.args("--self-signal-step", "3", "--no-emergency")])
    assert processes.wait_all(timeout=40)["train"] == NOT_SAVED, processes.dump_logs()
    assert run.marker("stop", 0)["step"] == 3
    assert not run.snap.exists() or run.snapshot_steps(0) == []


@pytest.mark.timeout(120)
def test_popen_ddp_launcher_sigterm_to_the_child_rank(processes, worker_pids, tmp_path):
    run = Run(tmp_path)
    main = processes.python("ddp", [SCRIPT, "--strategy", "ddp", "--devices", "2", "--pg-timeout", "20",
                                    *run.args()])
    pids = wait_ready(run, [0, 1], main, processes, worker_pids)
    os.kill(pids[1], signal.SIGTERM)
    codes = processes.wait_all(timeout=30)
    # rank 0 is the launcher process itself; its status is the job's
    assert codes["ddp"] == ExitCode.PREEMPTED, processes.dump_logs()
    assert wait_for(lambda: gone(pids[1]), 10)
    assert_stopped_together_and_saved(run, processes)
