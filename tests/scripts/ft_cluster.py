"""A simulated ``ddp_ft`` cluster on 127.0.0.1, for the strategy tests and the recovery benchmark.

One standalone ``lightning-ft store`` process (so killing a participant never kills the
store) plus N participants running ``ft_train.py``, each with its own node identity
(``LIGHTNING_FT_DOMAIN_ID``) and snapshot root. Processes are started through a
``ProcessSet``-like object (``start(name, argv, env)``) that owns and kills them.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "ft_train.py")
#: how long processes may take to start and train their first step (imports on a loaded machine)
STARTUP_ALLOWANCE = 60.0
#: every Cluster made in this process, in order: the characterization record
#: (tests/characterization.py) reads those a test made; the tests clear it before each test
CREATED: list[Cluster] = []


sys.path.insert(0, str(REPO_ROOT / "examples"))
from procs import free_port  # noqa: E402  (ports outside the kernel's ephemeral range: see there)


def base_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "LIGHTNING_FT_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_WORLD_SIZE", "JOB_COMPLETION_INDEX"):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # one intra-op thread per process, as torchrun sets for its workers: several training
    # processes share this machine's cores
    env["OMP_NUM_THREADS"] = "1"
    # processes that share a machine are no stragglers of each other (see tests/proc_utils.py)
    env["LIGHTNING_FT_STRAGGLER_FACTOR"] = "off"
    env.update(overrides)
    return env


@dataclass
class Cluster:
    launcher: Any  # has start(name, argv, env) -> proc with .pid, .popen, .log()
    root: Path
    nnodes: str
    #: unique per cluster, as a job's is: the store's places (its endpoint and the next ports) of
    #: two tests' jobs side by side on this host may touch, and a newcomer joins a store of its run id
    run_id: str = field(default_factory=lambda: f"ft-test-{secrets.token_hex(3)}")
    port: int = field(default_factory=free_port)
    procs: dict[str, Any] = field(default_factory=dict)
    #: name -> store process started by :meth:`start_store` (not a participant)
    stores: dict[str, Any] = field(default_factory=dict)
    #: pid -> the reader of that process's steps file
    _tails: dict[int, _JsonlTail] = field(default_factory=dict)

    def __post_init__(self) -> None:
        CREATED.append(self)

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def events(self) -> Path:
        return self.root / "events"

    def start_store(self, name: str = "store", long_lived: bool = False, **env: str) -> Any:
        """A ``lightning-ft store`` for the run (``long_lived``: one that serves until killed,
        as a shared store outliving jobs would)."""
        scope = [] if long_lived else ["--run-id", self.run_id]
        proc = self.launcher.start(name, [sys.executable, "-m", "lightning_ft.cli", "store", "--host", "127.0.0.1",
                                          "--port", str(self.port), *scope, "--grace-timeout", "5"],
                                   env=base_env(**env))
        self.stores[name] = proc
        deadline = time.monotonic() + 30
        while "listening" not in proc.log():
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"store did not start:\n{proc.log()}")
            time.sleep(0.05)
        return proc

    def start_participant(self, name: str, args: list[str], **env: str) -> Any:
        environment = base_env(**{
            "LIGHTNING_FT_ENDPOINT": f"127.0.0.1:{self.port}", "LIGHTNING_FT_RUN_ID": self.run_id,
            "LIGHTNING_FT_NNODES": self.nnodes, "LIGHTNING_FT_DOMAIN_ID": f"host-{name}",
            "LIGHTNING_FT_SNAPSHOT_DIR": str(self.root / f"shm-{name}"), "LIGHTNING_FT_EVENTS_DIR": str(self.events),
            **env})
        proc = self.launcher.start(name, [sys.executable, SCRIPT, "--out", str(self.out), *args], env=environment)
        self.procs[name] = proc
        return proc

    def start(self, names: list[str], args: list[str], **env: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.start_store()
        for name in names:
            self.start_participant(name, args, **env)

    # ---------------------------------------------------------------- reading results

    def steps(self) -> dict[str, list[dict]]:
        """name -> completed-step records of that process (each file read from where the last call
        stopped: waits poll this every few ms while the files grow by a line a step)."""
        return {name: self._tails.setdefault(proc.pid, _JsonlTail(self.out / f"steps-{proc.pid}.jsonl")).records()
                for name, proc in self.procs.items()}

    def starts(self, name: str) -> list[dict]:
        return _read_jsonl(self.out / f"start-{self.procs[name].pid}.jsonl")

    def result(self, name: str) -> dict | None:
        path = self.out / f"result-{self.procs[name].pid}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def active_names(self) -> list[str]:
        return [name for name, records in self.steps().items() if records]

    def wait_for_step(self, step: int, timeout: float, among: list[str] | None = None) -> str:
        """Wait until some process (of ``among``) completed ``step``; returns its name.

        ``timeout`` counts from the first completed step of anyone: before it, processes are
        still importing torch and Lightning, which on a loaded 2-core machine can take tens of
        seconds; that part is bounded by ``STARTUP_ALLOWANCE`` on its own.
        """
        start = time.monotonic()
        deadline = start + STARTUP_ALLOWANCE + timeout
        trained_since = None
        while time.monotonic() < min(deadline, (trained_since or deadline) + timeout):
            for name, records in self.steps().items():
                if records and trained_since is None:
                    trained_since = time.monotonic()
                if (among is None or name in among) and records and records[-1]["step"] >= step:
                    return name
            time.sleep(0.02)
        raise TimeoutError(f"no process reached step {step} within {timeout}s of the first step "
                           f"(first step after {'-' if trained_since is None else round(trained_since - start, 1)}s)"
                           f"\n{self.logs()}")

    def wait_for_log(self, name: str, text: str, timeout: float = STARTUP_ALLOWANCE) -> None:
        """Wait until ``text`` is in the log of ``name``; raises TimeoutError with every log."""
        deadline = time.monotonic() + timeout
        while text not in self.procs[name].log():
            if time.monotonic() > deadline or self.procs[name].popen.poll() is not None:
                raise TimeoutError(f"{name} did not log {text!r}\n{self.logs()}")
            time.sleep(0.05)

    def left_cleanly(self, name: str) -> bool:
        """The log of ``name`` shows no death in C++: neither ``std::terminate``'s message (a
        thread back from a store call while the interpreter finalized: SIGABRT) nor a C++ stack."""
        log = self.procs[name].log()
        return "terminate called" not in log and "frame #" not in log

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        """Signal one participant; returns the wall-clock time of the kill."""
        t = time.time()
        os.kill(self.procs[name].pid, sig)
        return t

    def kill_together(self, names: list[str]) -> None:
        """SIGKILL several participants as one event: each is frozen (SIGSTOP) before any dies, so
        none sees another's death and starts a recovery first (which the machine's load would decide)."""
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for name in names:
                os.kill(self.procs[name].pid, sig)

    def wait(self, names: list[str], timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names:
            proc = self.procs[name]
            while proc.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            codes[name] = proc.popen.poll()
        return codes

    def events_of(self, event: str) -> list[dict]:
        records = []
        for path in sorted(self.events.glob("events-*.jsonl")):
            records += [r for r in _read_jsonl(path) if r.get("event") == event]
        return sorted(records, key=lambda r: r["t"])

    def logs(self) -> str:
        parts = []
        for name, proc in [("store", None), *self.procs.items()]:
            if proc is None:
                continue
            parts.append(f"===== {name} (pid {proc.pid}, rc {proc.popen.poll()}) =====\n{proc.log()[-5000:]}")
        return "\n".join(parts)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class _JsonlTail:
    """The records of a JSON-lines file that only grows, read incrementally (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._records: list[dict] = []

    def records(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        cut = chunk.rfind(b"\n") + 1
        self.offset += cut
        for line in chunk[:cut].splitlines():
            try:
                self._records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return list(self._records)


def ordered_start(cluster: Cluster, actives: str) -> list[str]:
    """ft_train arguments that hold the actives' first step until :func:`release`: the spares
    start one by one after round 0 formed (see :func:`in_order`), which on a loaded machine
    takes longer than the whole run would."""
    gate = cluster.root / "hold-first-step"
    gate.touch()
    return ["--hold-first-step-while", str(gate)]


def release(hold: list[str]) -> None:
    Path(hold[-1]).unlink()


def in_order(cluster: Cluster, name: str, actives: str) -> None:
    """Roles by arrival, whatever the machine's load: after the last of ``actives`` started,
    wait until round 0 formed with them; a spare waits until it is standby, so the next one
    queues behind it."""
    if name in actives and name != actives[-1]:
        return
    for member in (actives if name in actives else name):
        cluster.wait_for_log(member, "round 0 complete")
