"""Kill-and-compare runs of ``lightning_user.py`` for the recovery-fidelity tests.

* :func:`run_ft`: a standalone store + participants A, B, C (``2:3``: A and B train, C is the
  hot spare; infra ranks 0/1/2 make A rank 0), each with its own domain and snapshot dir, logs
  and checkpoints in one shared root. The process that is global rank 0 when it reports the
  chosen moment (``Moment``) is SIGKILLed; the survivor and the spare recover.
* :func:`run_reference`: "Lightning's own resume from the same snapshot step": the same job
  with ``2:2`` runs until its snapshot of step ``S`` exists, both processes are frozen and
  killed (nothing of theirs runs after the "node loss"), then two fresh processes resume with
  ``fit(ckpt_path="mem://S")`` -- what a requeue of the job does.
* :func:`metric_points` / :func:`final_checkpoints` read what both left on disk.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ft_cluster import Cluster, base_env

HERE = Path(__file__).resolve().parent
NAMES = ("A", "B", "C")


@dataclass(frozen=True)
class Moment:
    """Kill when rank 0 reports event ``ev`` (setup, train_start, step, val_batch, save) at step >= ``step``."""

    ev: str
    step: int = 0
    batch: int | None = None

    def matches(self, record: dict) -> bool:
        # by arrival, not by name: on a loaded machine a slow A becomes the spare (B and C train),
        # and DataModule.setup already runs after the rendezvous, so its record carries the rank
        return (record.get("rank") == 0 and record.get("ev") == self.ev and record.get("step", 0) >= self.step
                and (self.batch is None or record.get("batch") == self.batch))


@dataclass
class Run:
    root: Path
    procs: dict[str, Any] = field(default_factory=dict)
    killed: str | None = None

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def logs_root(self) -> Path:
        return self.root / "logs"

    def codes(self) -> dict[str, int | None]:
        return {name: proc.popen.poll() for name, proc in self.procs.items()}

    def result(self, name: str) -> dict | None:
        path = self.out / f"result-{self.procs[name].pid}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def digests(self) -> set[str]:
        return {r["weights"] for r in map(self.result, self.codes()) if r and r.get("trained")}

    def events(self, name: str | None = None) -> list[dict]:
        records = []
        for path in sorted((self.root / "events").glob("events-*.jsonl")):
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        records.sort(key=lambda e: e.get("t", 0))
        return [e for e in records if name is None or e.get("event") == name]

    def logs(self) -> str:
        return "\n".join(f"===== {n} (pid {p.pid}, rc {p.popen.poll()}) =====\n{p.log()[-6000:]}"
                         for n, p in self.procs.items())


def _argv(root: Path, cli: str | None, extra: list[str]) -> list[str]:
    if cli is not None:
        argv = [sys.executable, str(HERE / "lightning_user_cli.py"), "fit", "--config", str(HERE / "user_cli.yaml"),
                "--trainer.default_root_dir", str(root / "logs"),
                "--trainer.logger.init_args.save_dir", str(root / "logs")]
        if cli == "config":
            argv += ["--config", str(HERE / "user_cli_ft.yaml")]
        else:
            argv.append(f"--trainer.strategy={cli}")
        return argv + extra
    return [sys.executable, str(HERE / "lightning_user.py"), "--out", str(root / "out"), "--root",
            str(root / "logs"), *extra]


def _start(processes, root: Path, names: tuple[str, ...], nnodes: str, args: list[str], cli: str | None,
           knobs: dict[str, str], tag: str = "") -> tuple[Cluster, dict[str, Any]]:
    cluster = Cluster(processes, root, nnodes, run_id="lu-job")
    (root / "out").mkdir(parents=True, exist_ok=True)
    cluster.events.mkdir(parents=True, exist_ok=True)
    cluster.start_store(f"store{tag}")
    procs = {}
    for name in names:
        env = base_env(**{"LIGHTNING_FT_ENDPOINT": f"127.0.0.1:{cluster.port}", "LIGHTNING_FT_RUN_ID": "lu-job",
                          "LIGHTNING_FT_NNODES": nnodes, "LIGHTNING_FT_DOMAIN_ID": f"host-{name}",
                          "LIGHTNING_FT_SNAPSHOT_DIR": str(root / f"shm-{name}"),
                          "LIGHTNING_FT_EVENTS_DIR": str(cluster.events),
                          "LIGHTNING_FT_INFRA_RANK": str(NAMES.index(name)), "LU_OUT": str(root / "out"),
                          **knobs})
        env["PYTHONPATH"] = str(HERE) + os.pathsep + env["PYTHONPATH"]
        env.pop("PYTHONWARNINGS", None)  # Lightning's warnings (e.g. "log files ... deleted") are evidence
        procs[name] = processes.start(f"{name}{tag}", _argv(root, cli, args), env=env, cwd=str(HERE))
    return cluster, procs


def wait_for_moment(root: Path, procs: dict[str, Any], moment: Moment, timeout: float) -> str:
    """Name of the participant that reported ``moment`` (as rank 0); raises TimeoutError."""
    deadline = time.monotonic() + timeout
    offsets: dict[str, int] = {}
    while time.monotonic() < deadline:
        # polled before reading: what a process wrote before it exited is read in this pass
        all_exited = all(p.popen.poll() is not None for p in procs.values())
        for name, proc in procs.items():
            path = root / "out" / f"progress-{proc.pid}.jsonl"
            if not path.exists():
                continue
            with open(path) as f:
                f.seek(offsets.get(name, 0))
                chunk = f.read()
            cut = chunk.rfind("\n") + 1
            offsets[name] = offsets.get(name, 0) + cut
            for line in chunk[:cut].splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if moment.matches(record):
                    return name
        if all_exited:
            break
        time.sleep(0.005)
    raise TimeoutError(f"{moment} was not reached")


def _wait(procs: dict[str, Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.popen.poll() is None for p in procs.values()):
        time.sleep(0.05)


def run_ft(processes, root: Path, args: list[str], moment: Moment | None, *, cli: str | None = None,
           knobs: dict[str, str] | None = None, timeout: float = 90.0) -> Run:
    """Three participants (2:3); SIGKILL whoever is rank 0 at ``moment``; wait for the others."""
    _, procs = _start(processes, root, NAMES, "2:3", args, cli, knobs or {}, tag=f"-{root.name}")
    run = Run(root, procs)
    if moment is not None:
        run.killed = wait_for_moment(root, procs, moment, timeout)
        procs[run.killed].signal(signal.SIGKILL)
    _wait(procs, timeout)
    return run


def run_reference(processes, root: Path, args: list[str], resume_step: int, *, cli: str | None = None,
                  knobs: dict[str, str] | None = None, timeout: float = 90.0,
                  kill_at: tuple[Moment, list[str]] | None = None) -> Run:
    """Lightning's own resume from the snapshot of ``resume_step`` (see the module docstring).

    The first launch is killed in step S+1, or at ``kill_at`` (a moment after the snapshot of S
    exists, and the arguments that hold the run there): the job lost during what followed the
    step's end (its validation, a checkpoint save), as the recovered run was."""
    names = NAMES[:2]
    # the first launch waits at step S+1 (4 s in each of its two accumulated batches, inside the
    # 10-s hang floor) to be killed there: a test process slow to notice (a loaded machine) must
    # not let it run on until the snapshot of S has been pruned
    hold = str(resume_step + 1)
    if kill_at is not None:
        first_args, first_knobs = [*args, *kill_at[1]], knobs or {}
    elif cli is None:
        first_args = [*args, "--step-sleep", "4", "--sleep-from-step", hold, "--sleep-until-step", hold]
        first_knobs = knobs or {}
    else:
        first_args = args
        first_knobs = {**(knobs or {}), "LU_STEP_SLEEP": "4", "LU_SLEEP_FROM_STEP": hold, "LU_SLEEP_UNTIL_STEP": hold}
    _, first = _start(processes, root, names, "2:2", first_args, cli, first_knobs, tag=f"-{root.name}-1")
    reached = kill_at[0] if kill_at is not None else Moment("step", resume_step + 1)
    wait_for_moment(root, first, reached, timeout)
    for proc in first.values():  # freeze both first: neither runs a line after the "node loss"
        proc.signal(signal.SIGSTOP)
    for proc in first.values():
        proc.signal(signal.SIGKILL)
    _wait(first, 10)
    resume = [f"--ckpt_path=mem://{resume_step}", "--trainer.plugins=lightning_ft.checkpoint.MemoryCheckpointIO"] \
        if cli is not None else ["--ckpt-path", f"mem://{resume_step}"]
    _, second = _start(processes, root, names, "2:2", [*args, *resume], cli, knobs or {}, tag=f"-{root.name}-2")
    _wait(second, timeout)
    return Run(root, second)


#: metrics the strategy logs about the run's timing (stragglers: own work and wait per rank), which
#: no two runs share; everything else a run logs must be equal
TIMING_METRICS = "ft/"


def metric_points(run: Run) -> dict[tuple[int, str], float]:
    """(step, metric) -> value over every version of the CSV logs; later versions win (a resumed
    run logs the steps after its snapshot again, into a new version under Lightning's default).
    Timing metrics (:data:`TIMING_METRICS`) are left out."""
    points: dict[tuple[int, str], float] = {}
    for version in sorted((run.logs_root / "lightning_logs").glob("version_*"), key=lambda p: int(p.name[8:])):
        path = version / "metrics.csv"
        if not path.exists():
            continue
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if key not in ("step", "epoch") and value and not key.startswith(TIMING_METRICS):
                        points[(int(row["step"]), key)] = float(value)
    return points


def metric_rows(run: Run, version: int = 0) -> list[dict[str, str]]:
    """The CSV log's rows without timing metrics (rows that held only those are left out)."""
    path = run.logs_root / "lightning_logs" / f"version_{version}" / "metrics.csv"
    with open(path, newline="") as f:
        rows = [{k: v for k, v in row.items() if not k.startswith(TIMING_METRICS)} for row in csv.DictReader(f)]
    return [row for row in rows if any(v for k, v in row.items() if k not in ("step", "epoch"))]


def final_checkpoints(run: Run, after_step: int = -1) -> list[str]:
    """Checkpoint file names of the newest log version (what a user finds after the run) that were
    written for a step after ``after_step``, and ``last.ckpt``. What came before the step training
    resumed from is history both runs share; the relaunch keeps it in an older version, whose files
    its ModelCheckpoint no longer manages, while a recovery keeps one version and manages them."""
    versions = sorted((run.logs_root / "lightning_logs").glob("version_*"), key=lambda p: int(p.name[8:]))
    directory = versions[-1] / "checkpoints"
    names = []
    for path in directory.iterdir():
        step = re.search(r"step=(\d+)", path.name)
        if path.is_file() and (step is None or int(step.group(1)) > after_step):
            names.append(path.name)
    return sorted(names)
