"""Real-process helpers for tests: every process started here is killed by pid at the end."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "examples"))
import procs  # noqa: E402  (the demo's process helper; the demo must not import from tests)
from prefork import Launcher  # noqa: E402
from procs import Proc, free_port, write_secret  # noqa: E402,F401

#: this test process's fork servers (see prefork.py); stopped when it exits
_LAUNCHER = Launcher(Path(tempfile.mkdtemp(prefix="lightning-ft-prefork-")))
atexit.register(lambda: (_LAUNCHER.stop(), shutil.rmtree(_LAUNCHER.root, ignore_errors=True)))


def launcher() -> Launcher:
    """This test process's fork servers (prefork.py)."""
    return _LAUNCHER


#: Straggler eviction judges each rank's own work against its peers'; the participants of a test
#: share this machine's two cores with everything else the suite runs, so one of them can be
#: persistently slower for reasons that are not its node's (seen: 2.9x for 25 steps at a load
#: average of 7). Off for every test process; tests/test_stragglers.py turns it on explicitly.
STRAGGLERS_OFF = {"LIGHTNING_FT_STRAGGLER_FACTOR": "off"}


def child_env(**overrides: str) -> dict[str, str]:
    """Environment for a child process: a user's own (nothing that quiets it), unbuffered, no
    inherited rank variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_WORLD_SIZE", "JOB_COMPLETION_INDEX", "LIGHTNING_FT_INFRA_RANK"):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # one intra-op thread per process, as torchrun sets for its workers: a test's processes share
    # two cores (and one start-up environment for most of them: one fork server, prefork.py)
    env["OMP_NUM_THREADS"] = "1"
    env.update(STRAGGLERS_OFF)
    env.update(overrides)
    return env


class ProcessSet(procs.ProcessSet):
    """The demo's process set plus what tests need: python(), wait_all() and dump_logs()."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir, cwd=REPO_ROOT)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: str | Path | None = None) -> Proc:
        """Start ``argv`` in a session of its own, its output in ``<log_dir>/<name>.log``: forked
        from a preloaded interpreter when it runs a Python script or module (prefork.py), else
        the ordinary way."""
        env = env if env is not None else child_env()
        if name not in self.procs:
            log_path = self.log_dir / f"{name}.log"
            popen = _LAUNCHER.start(list(map(str, argv)), env, str(cwd or self.cwd), log_path)
            if popen is not None:
                proc = Proc(name, popen, log_path)
                self.procs[name] = proc
                return proc
        return super().start(name, argv, env=env, cwd=cwd)

    def python(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        return self.start(name, [sys.executable, *args], env=env)

    def wait_all(self, timeout: float) -> dict[str, int | None]:
        """Wait for every process until the deadline; returns name -> exit code (None = still running)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            remaining = max(0.0, deadline - time.monotonic())
            try:
                codes[name] = proc.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def dump_logs(self) -> str:
        return "\n".join(f"===== {p.name} (pid {p.pid}, rc {p.popen.poll()}) =====\n{p.log()[-6000:]}"
                         for p in self.procs.values())


def child_pids(pid: int) -> set[int]:
    """Direct children of ``pid`` (torchrun starts its workers in sessions of their own, out of
    reach of a session kill)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def kill_pids(pids) -> None:
    """SIGKILL each pid; those already gone are skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def session_alive(pgid: int) -> bool:
    """True while any process of the session/process group still exists."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
