"""A recovered ``ddp_ft`` run equals Lightning's own resume from the same snapshot (issue 14).

The job is ``tests/scripts/lightning_user.py``, what a Lightning user writes: ``save_hyperparameters``,
a torchmetrics ``val_acc`` logged with ``sync_dist``, a DataModule, ``val_check_interval``,
``ModelCheckpoint(every_n_train_steps=50, save_last=True, monitor="val_acc", save_top_k=2)``,
``CSVLogger`` (+ ``TensorBoardLogger``), ``LearningRateMonitor``, an LR scheduler,
``accumulate_grad_batches=2``, ``gradient_clip_val``. Three participants (2:3); whoever is
global rank 0 is SIGKILLed at an interesting moment. The reference is the same job killed
whole and relaunched from the same snapshot step (``fidelity.run_reference``); recovered and
reference runs must end with the same weights, the same logged metrics at every step and the
same checkpoint files. What differs on purpose: the recovered run keeps one log version (the
reference writes a new one, Lightning's default for a relaunch) and moves the checkpoint
files the lost rank wrote after the snapshot into ``checkpoints/.abandoned/``.
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass, field

import pytest

from proc_utils import REPO_ROOT, ProcessSet

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from fidelity import Moment, Run, final_checkpoints, metric_points, metric_rows, run_ft, run_reference

pytestmark = [pytest.mark.multiprocess]

SNAPSHOTS_EVERY_20 = ["--snapshot-every", "20", "--pg-timeout", "60", "--hang-floor", "10"]
NO_PERIODIC_SNAPSHOTS = ["--ft-option", "snapshot_max_overhead=null", "--pg-timeout", "60", "--hang-floor", "10"]
#: recover from the newest snapshot, not from the survivors' live state (the path when the live
#: state cannot be used, or the whole job restarts)
FROM_SNAPSHOTS = ["--ft-option", "snapshot_live_state=false"]


def sleep_at(step: int, seconds: float = 0.5, what: str = "step") -> list[str]:
    """Hold the run at ``step`` long enough to kill it exactly there."""
    return [f"--{what}-sleep", str(seconds), "--sleep-from-step", str(step), "--sleep-until-step", str(step)]


@dataclass
class RecordedRun(Run):
    """A reference run that another pytest-xdist worker made: its processes are gone, their
    names, pids and exit codes were recorded; its files are read as a Run's."""

    recorded: dict[str, list[int]] = field(default_factory=dict)  # name -> [pid, exit code]

    def codes(self) -> dict[str, int | None]:
        return {name: code for name, (_, code) in self.recorded.items()}

    def result(self, name: str) -> dict | None:
        path = self.out / f"result-{self.recorded[name][0]}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def logs(self) -> str:
        return f"(a reference run recorded in {self.root})"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Lightning's own resume from step S (``None``: a fresh start, i.e. the uninterrupted run),
    computed once per (S, data loader) for the session: under pytest-xdist the first worker
    that needs one makes it in the session's shared directory while the others wait for it."""
    root = tmp_path_factory.mktemp("references")
    shared = tmp_path_factory.getbasetemp().parent / "fidelity-references" if os.environ.get("PYTEST_XDIST_WORKER") \
        else root
    shared.mkdir(exist_ok=True)
    processes = ProcessSet(root)
    cache: dict[tuple[int | None, str], Run] = {}

    def make(resume_step: int | None, data: str, where, kill_at) -> Run:
        # the reference needs a snapshot at S: every 20 steps, or every S steps for another S
        # (snapshots do not change what is trained)
        every = SNAPSHOTS_EVERY_20 if not resume_step or resume_step % 20 == 0 else \
            ["--snapshot-every", str(resume_step), *SNAPSHOTS_EVERY_20[2:]]
        args = [*every, "--tensorboard", "--data", data]
        if resume_step is None:
            return run_ft(processes, where, args, None)
        return run_reference(processes, where, args, resume_step, kill_at=kill_at)

    def get(resume_step: int | None, data: str = "plain", kill_at: tuple[str, Moment, list[str]] | None = None) -> Run:
        """``kill_at``: (its name, the moment, the arguments that hold the run there)."""
        key = (resume_step, data, kill_at[0] if kill_at else None)
        if key not in cache:
            name = f"uninterrupted-{data}" if resume_step is None else f"ref-{resume_step}-{data}"
            name += f"-{kill_at[0]}" if kill_at else ""
            record = shared / name / "recorded.json"
            with open(shared / f"{name}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, also if this worker dies
                if record.exists():
                    run = RecordedRun(shared / name, recorded=json.loads(record.read_text()))
                else:
                    run = make(resume_step, data, shared / name, kill_at[1:] if kill_at else None)
                    assert set(run.codes().values()) == {0}, run.logs()
                    record.write_text(json.dumps({n: [p.pid, p.popen.poll()] for n, p in run.procs.items()}))
            cache[key] = run
        return cache[key]

    try:
        yield get
    finally:
        processes.kill_all()


def assert_recovered(run: Run, restored: int) -> None:
    codes = run.codes()
    assert codes[run.killed] == -9 and [c for n, c in codes.items() if n != run.killed] == [0, 0], run.logs()
    assert {e["step"] for e in run.events("restored") if e.get("round", 0) > 0} == {restored}, run.events("restored")
    # the run's figures in the Trainer's own log: one point per round, the recovery counted and costed
    with open(run.logs_root / "lightning_logs" / "version_0" / "metrics.csv", newline="") as f:
        figures = [row for row in csv.DictReader(f) if row.get("ft/recoveries")]
    # (no point for the first round when the kill came before its first step)
    assert [(float(r["ft/world_size"]), float(r["ft/recoveries"])) for r in figures] in \
        ([(2.0, 0.0), (2.0, 1.0)], [(2.0, 1.0)]), figures
    *first, recovered = figures
    assert all(float(r["ft/lost_seconds"]) == 0 and float(r["ft/goodput"]) == 1 for r in first)
    assert float(recovered["ft/lost_seconds"]) > 0 and 0 < float(recovered["ft/goodput"]) < 1, recovered


def assert_equal_to(run: Run, reference: Run) -> None:
    assert run.digests() == reference.digests() and len(run.digests()) == 1, (run.digests(), reference.digests())
    ours, theirs = metric_points(run), metric_points(reference)
    assert ours == theirs, sorted(set(ours.items()) ^ set(theirs.items()))[:10]
    restored = {e["step"] for e in run.events("restored") if e.get("round", 0) > 0}
    after = min(restored) if restored else -1
    assert final_checkpoints(run, after) == final_checkpoints(reference, after)
    # one log version, every row once, in order; nothing deleted
    # (and the record of it for a relaunch of the run)
    assert sorted(p.name for p in (run.logs_root / "lightning_logs").iterdir()) == [".lightning_ft-run-lu-job",
                                                                                    "version_0"]
    steps = [int(row["step"]) for row in metric_rows(run)]
    assert steps == sorted(steps), steps
    # the reference's relaunch continued the same version too (a requeue's logs are not split)
    assert sorted(p.name for p in (reference.logs_root / "lightning_logs").iterdir()) == \
        [".lightning_ft-run-lu-job", "version_0"]
    steps = [int(row["step"]) for row in metric_rows(reference)]
    assert steps == sorted(steps), steps
    logs = run.logs()
    assert "Previous log files in this directory will be deleted" not in logs
    assert logs.count("GPU available") == 1, "rank-zero output must come from one process only"


def test_live_state_recovery_equals_a_relaunch_from_a_snapshot_of_the_step_in_flight(processes, tmp_path,
                                                                                    references):
    """Killed in step 77 (in the middle of an accumulation window): the survivor's live state is
    step 77's, so the job resumes there -- not at the step-60 snapshot -- and ends exactly as a
    relaunch from a snapshot of step 77 does (weights, every logged metric, checkpoints)."""
    run = run_ft(processes, tmp_path, [*SNAPSHOTS_EVERY_20, "--tensorboard", *sleep_at(77)], Moment("step", 77))
    assert_recovered(run, restored=77)
    saved = [e for e in run.events("live_state") if e.get("saved")]
    assert {e["step"] for e in saved} == {77}, run.events("live_state")
    assert_equal_to(run, references(77))


def test_a_redone_modelcheckpoint_step_neither_hangs_nor_differs(processes, tmp_path, references):
    # snapshot 60, kill 77: ModelCheckpoint's step 75 is done again -- by the survivor and the spare alike
    run = run_ft(processes, tmp_path, [*SNAPSHOTS_EVERY_20, *FROM_SNAPSHOTS, "--tensorboard", *sleep_at(77)],
                 Moment("step", 77))
    assert_recovered(run, restored=60)
    reference = references(60)
    assert_equal_to(run, reference)
    assert sorted(p.name for p in (run.logs_root / "lightning_logs" / "version_0" / "checkpoints" /
                                   ".abandoned").iterdir()) == ["epoch=1-step=75.ckpt"]
    # TensorBoard: the same version, continued; the reader hides what the lost rank logged after 60
    ours, theirs = tensorboard_scalars(run, "train_loss"), tensorboard_scalars(reference, "train_loss")
    assert [p for p, _ in ours] == sorted({p for p, _ in ours}) and ours == theirs


def test_a_kill_before_the_first_snapshot_restores_everything_from_the_start(processes, tmp_path, references):
    # no periodic snapshots: weights, optimizer, schedulers and step all come from the start
    # of the round, on every participant
    run = run_ft(processes, tmp_path, [*NO_PERIODIC_SNAPSHOTS, *FROM_SNAPSHOTS, *sleep_at(65)], Moment("step", 65))
    assert_recovered(run, restored=0)
    assert_equal_to(run, references(0))


def test_a_kill_during_validation_does_not_count_the_interrupted_validation(processes, tmp_path, references):
    # the live state of step 75 (validation runs after the step's end); as in Lightning's own
    # resume from a snapshot of that step, the interrupted validation is not run again
    during_validation = (Moment("val_batch", 75, 3), sleep_at(75, 0.3, "val"))
    run = run_ft(processes, tmp_path, [*SNAPSHOTS_EVERY_20, *during_validation[1]], during_validation[0])
    assert_recovered(run, restored=75)
    assert_equal_to(run, references(75, kill_at=("val", *during_validation)))
    survivor = next(n for n in ("A", "B") if n != run.killed)
    # every validation of the recovered round saw exactly this rank's half of the 512 samples
    assert set(run.result(survivor)["val_samples_at_end"]) == {256}


def test_a_kill_during_a_checkpoint_save(processes, tmp_path, references):
    # ModelCheckpoint saves in its on_train_batch_end, before that of the EmergencyCheckpoint the
    # strategy adds: the live state is past the captured boundary (the update of step 75 ran),
    # so the recovery falls back to the newest snapshot, and says why
    run = run_ft(processes, tmp_path, [*SNAPSHOTS_EVERY_20, *sleep_at(75, 1.0, "save")], Moment("save", 75))
    assert_recovered(run, restored=60)
    refused = [e for e in run.events("live_state") if not e.get("saved")]
    assert refused and "optimizer step ran after the boundary" in refused[0]["reason"], run.events("live_state")
    assert_equal_to(run, references(60))


def test_a_kill_during_setup(processes, tmp_path, references):
    # no snapshot exists yet: survivor and spare start afresh, as a relaunch would
    run = run_ft(processes, tmp_path, [*SNAPSHOTS_EVERY_20, "--setup-sleep", "2"], Moment("setup"))
    codes = run.codes()
    assert codes[run.killed] == -9 and sorted(c for n, c in codes.items() if n != run.killed) == [0, 0], run.logs()
    assert_equal_to(run, references(None))


def test_lightning_cli_with_a_config_file(processes, tmp_path, references):
    run = run_ft(processes, tmp_path, [], Moment("step", 77), cli="config", knobs=cli_sleep_at(77))
    assert_recovered(run, restored=77)
    assert_equal_to(run, references(77))
    assert (run.logs_root / "lightning_logs" / "version_0" / "config.yaml").is_file()


def test_lightning_cli_with_the_strategy_flag(processes, tmp_path, references):
    # the strategy's defaults: snapshots on the schedule from the measured save cost, and the
    # recovery from the survivor's live state of step 77
    run = run_ft(processes, tmp_path, [], Moment("step", 77), cli="ddp_ft", knobs=cli_sleep_at(77))
    assert run.events("snapshot_schedule"), run.logs()
    assert_recovered(run, restored=77)
    assert_equal_to(run, references(77))


def test_with_a_resumable_loader_recovery_equals_the_uninterrupted_run(processes, tmp_path, references):
    # with a plain DataLoader a resume restarts the epoch's iterator (what Lightning does: see
    # the tests above); a loader whose position is in the snapshot continues exactly
    args = [*SNAPSHOTS_EVERY_20, "--data", "resumable"]
    recovered = run_ft(processes, tmp_path, [*args, *sleep_at(77)], Moment("step", 77))
    assert_recovered(recovered, restored=77)
    uninterrupted = references(None, "resumable")
    assert recovered.digests() == uninterrupted.digests()
    train_loss = {k: v for k, v in metric_points(recovered).items() if k[1] == "train_loss"}
    assert train_loss == {k: v for k, v in metric_points(uninterrupted).items() if k[1] == "train_loss"}


@pytest.mark.timeout(240)
def test_with_dropout_a_recovery_equals_the_uninterrupted_run(processes, tmp_path):
    """Dropout(0.3): the spare that takes the killed rank 0's place draws that rank's masks, and the
    survivor redoes the step in flight with the masks it drew the first time (each batch's
    generators are seeded from seed, rank, step and batch: runtime/random_streams.py). It used to
    end 0.1-1 % away from the uninterrupted weights (every mask after the kill differed)."""
    args = [*SNAPSHOTS_EVERY_20, "--data", "resumable", "--dropout", "0.3"]
    recovered = run_ft(processes, tmp_path / "recovered", [*args, *sleep_at(77)], Moment("step", 77))
    assert_recovered(recovered, restored=77)
    uninterrupted = run_ft(processes, tmp_path / "uninterrupted", args, None)
    assert set(uninterrupted.codes().values()) == {0}, uninterrupted.logs()
    assert recovered.digests() == uninterrupted.digests()
    train_loss = {k: v for k, v in metric_points(recovered).items() if k[1] == "train_loss"}
    assert train_loss == {k: v for k, v in metric_points(uninterrupted).items() if k[1] == "train_loss"}


@pytest.mark.timeout(120)
def test_a_deadlock_is_detected_and_ends_in_bounded_time_with_no_restart(processes, tmp_path):
    # at step 30 ranks 0 and 1 wait to receive from each other: every rank alive, at the same
    # step, inside a collective. It comes back after every restore, so the job gives up (83).
    started = time.monotonic()
    run = run_ft(processes, tmp_path, ["--snapshot-every", "10", "--hang-floor", "3", "--pg-timeout", "600",
                                       "--deadlock-at-step", "30"], None, timeout=100)
    # the hot spare too: the run closed NO_RESTART, so it cannot take a place in a later round
    assert list(run.codes().values()) == [83, 83, 83], run.logs()
    assert time.monotonic() - started < 90  # never the process-group timeout (600 s here)
    detected = [e for e in run.events("failure_detected") if e.get("detector") == "deadlock"]
    assert detected and "recv" in detected[0]["error"], run.events("failure_detected")
    no_restart = run.events("no_restart")
    assert no_restart and "deadlock" in no_restart[0]["reason"], no_restart


def cli_sleep_at(step: int) -> dict[str, str]:
    return {"LU_STEP_SLEEP": "0.5", "LU_SLEEP_FROM_STEP": str(step), "LU_SLEEP_UNTIL_STEP": str(step)}


def tensorboard_scalars(run: Run, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    versions = sorted((run.logs_root / "tb_logs").glob("version_*"), key=lambda p: int(p.name[8:]))
    points: dict[int, float] = {}
    for version in versions:  # later versions win, as for the CSV
        accumulator = EventAccumulator(str(version))
        accumulator.Reload()
        points.update({event.step: round(event.value, 6) for event in accumulator.Scalars(tag)})
    return sorted(points.items())
