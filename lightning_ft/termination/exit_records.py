"""Per-rank exit records, and a wrapper that turns them into a truthful exit code for a node.

Why: torchrun exits 1 whenever a worker exits non-zero (``ChildFailedError``) and
whenever the agent itself is signalled (``SignalException``), so a scheduler that sees
only torchrun's status can never tell "preempted, state saved" (81) or "unhealthy
node" (82) from a crash. ``GracefulTermination`` writes ``rank-<R>.json`` into
``$LIGHTNING_FT_EXIT_RECORD_DIR`` (or its ``exit_record_dir`` argument) right before it
exits; this module's wrapper runs the launcher, forwards termination signals to it,
and exits with the code the records imply::

    python -m lightning_ft.termination.exit_records --dir "$(mktemp -d)" -- torchrun ... train.py

Every run of the wrapper gives its launcher a directory of its own inside ``--dir``
(``launch-<job>-<host>-<random>``, mode 0700) and reads only that one, so jobs sharing
``--dir`` -- or an earlier attempt of the same job -- never speak for each other.

A record is only as trustworthy as its directory: another local user who created ``--dir``
(a fixed name in a shared ``/tmp``), made it a symbolic link, or could rename it could put
records of its making where the wrapper reads, and make a crashed launcher's node exit 0 or 81.
So ``--dir`` must be a private directory of this user (:mod:`lightning_ft.private_dirs`),
checked before the launcher starts and again, with the launch directory, before the records are
read. A directory that fails either check ends the wrapper with ``NO_RESTART`` (83) and a message
naming it (a launcher that succeeded still ends it with 0: its success needs no record).

No Lightning import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_ft.exit_codes import ExitCode, stopped_by
from lightning_ft.private_dirs import DirPurpose, make_private_dir, require_private_dir
from lightning_ft.settings.environment import child_environment, environ, job_label

log = logging.getLogger(__name__)

ENV_EXIT_RECORD_DIR = "LIGHTNING_FT_EXIT_RECORD_DIR"
#: set by the wrapper for its launcher: the directory it reads. Records go there too when a
#: script names another ``exit_record_dir``, so the wrapper never misses them.
ENV_EXIT_RECORD_LAUNCH_DIR = "LIGHTNING_FT_EXIT_RECORD_LAUNCH_DIR"
_PATTERN = "rank-*.json"
#: the exit record directories, in the words of their errors
EXIT_RECORD_DIRS = DirPurpose(
    "exit records", f"another directory (--dir of lightning-ft exit-code, exit_record_dir= or {ENV_EXIT_RECORD_DIR})")


def write_exit_record(directory: str | os.PathLike, rank: int, exit_code: int, action: str,
                      reasons: Sequence[str], step: int) -> Path:
    """Atomically write this rank's record (``rank-<R>.json``) into ``directory``, a private
    directory of this user (created 0700; ValueError naming it if it is not private)."""
    make_private_dir(os.fspath(directory), "exit record directory", EXIT_RECORD_DIRS, parents=True)
    directory = Path(directory)
    path = directory / f"rank-{rank}.json"
    tmp = directory / f".rank-{rank}.{os.getpid()}.tmp"
    data = json.dumps({
        "rank": rank, "exit_code": int(exit_code), "action": action, "reasons": list(reasons), "step": step,
        "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
    }).encode()
    # a file of our own: a planted link or another user's file at this name is not written through
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class LaunchDirectory:
    """The records directory of one launch: ``path``, new inside ``base``, and what it was when made."""

    base: str
    path: Path
    #: (st_dev, st_ino) of ``path`` when it was made: a directory put in its place is another one
    made_as: tuple[int, int]


def open_launch_directory(base: str | os.PathLike, env: Mapping[str, str] | None = None) -> LaunchDirectory:
    """A new directory for one launch's records inside ``base`` (created 0700; see the module doc).
    ValueError naming ``base``, its owner and mode unless it is a private directory of this user."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{job_label(env)}-{socket.gethostname()}")[:80]
    base = os.fspath(base)
    make_private_dir(base, "exit record directory", EXIT_RECORD_DIRS, parents=True)
    path = Path(tempfile.mkdtemp(prefix=f"launch-{safe}-", dir=base))
    st = os.lstat(path)
    return LaunchDirectory(base, path, (st.st_dev, st.st_ino))


def launch_directory_problem(launch: LaunchDirectory) -> str | None:
    """Why the records in ``launch`` cannot be trusted now (``base`` or the launch directory
    replaced, a symbolic link, another user's or writable by others); None if they can."""
    try:
        require_private_dir(launch.base, "exit record directory", EXIT_RECORD_DIRS)
        st = require_private_dir(str(launch.path), "launch directory", EXIT_RECORD_DIRS)
    except (OSError, ValueError) as exc:
        return str(exc)
    if (st.st_dev, st.st_ino) != launch.made_as:
        return f"launch directory {str(launch.path)!r} is not the directory made for this launch (it was replaced)"
    return None


def launch_record_dir() -> str | None:
    """The record directory the exit-code wrapper reads, when this process runs under it."""
    return environ().get(ENV_EXIT_RECORD_LAUNCH_DIR) or None


def read_exit_records(directory: str | os.PathLike) -> list[dict]:
    records = []
    for path in sorted(Path(directory).glob(_PATTERN)):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            log.warning("unreadable exit record %s: %s", path, exc)
    return records


def summarize_exit_codes(record_codes: Sequence[int], launcher_code: int) -> int:
    """The exit code a node should report, from its ranks' records and the launcher's own code.

    * launcher succeeded, or no rank left a record: the launcher's code (nothing of ours happened);
    * any rank exited ``UNHEALTHY_NODE``: 82 -- health is a property of the node;
    * every rank saved (``PREEMPTED``): 81;
    * otherwise the first other code (e.g. 143: stopped by SIGTERM, nothing saved).
    """
    if launcher_code == 0 or not record_codes:
        return launcher_code
    if ExitCode.UNHEALTHY_NODE in record_codes:
        return int(ExitCode.UNHEALTHY_NODE)
    others = [c for c in record_codes if c != ExitCode.PREEMPTED]
    return int(ExitCode.PREEMPTED) if not others else int(others[0])


def launcher_status(returncode: int) -> int:
    """The launcher's exit status as a shell reports it: a death by signal N (``Popen`` says -N)
    is 128 + N -- an exit status the wrapper can itself exit with (``sys.exit(-15)`` exits 241,
    which no requeue rule matches)."""
    return stopped_by(-returncode) if returncode < 0 else returncode


def code_without_records(launcher_code: int) -> int:
    """The node code when the records cannot be trusted: the launcher's success stands (it needs
    no record), anything else is ``NO_RESTART`` -- never 0 or 81 for a launcher that failed."""
    return 0 if launcher_code == 0 else int(ExitCode.NO_RESTART)


def run_and_summarize(command: Sequence[str], directory: str | os.PathLike,
                      forward: Sequence[int] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                                                signal.SIGUSR2)) -> int:
    """Run ``command`` with a record directory of its own (inside ``directory``) in its
    environment; forward signals; return the node code. ``directory`` not private to this user:
    the command is not run, the code is ``NO_RESTART`` (see the module doc)."""
    try:
        launch = open_launch_directory(directory)
    except ValueError as exc:
        print(f"lightning_ft: {exc} Not running the launcher; exiting {int(ExitCode.NO_RESTART)} (NO_RESTART).",
              file=sys.stderr, flush=True)
        return int(ExitCode.NO_RESTART)
    directory = launch.path
    env = child_environment(**{ENV_EXIT_RECORD_DIR: str(directory), ENV_EXIT_RECORD_LAUNCH_DIR: str(directory)})
    # own session: a terminal's Ctrl-C reaches only us, and we forward it exactly once
    child = subprocess.Popen(list(command), env=env, start_new_session=True)

    def _forward(signum: int, frame: object) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for signum in forward:
        signal.signal(signum, _forward)
    while True:
        try:
            launcher_code = launcher_status(child.wait())
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
    problem = launch_directory_problem(launch)
    if problem is not None:
        code = code_without_records(launcher_code)
        print(f"lightning_ft: launcher exited {launcher_code}; its rank records are not read: {problem}; "
              f"exiting {code}", file=sys.stderr, flush=True)
        return code
    records = read_exit_records(directory)
    code = summarize_exit_codes([int(r["exit_code"]) for r in records], launcher_code)
    per_rank = ", ".join(f"rank {r['rank']}: {r['exit_code']} ({r['action']})" for r in records) or "none"
    print(f"lightning_ft: launcher exited {launcher_code}; rank records ({directory}): {per_rank}; exiting {code}",
          file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-ft exit-code",
        description="Run a launcher (e.g. torchrun), forward termination signals to it, and exit with the "
                    "code its ranks recorded (81 preempted+saved, 82 unhealthy node, 143 stopped unsaved) "
                    "instead of the launcher's own status.")
    parser.add_argument("--dir", default=environ().get(ENV_EXIT_RECORD_DIR),
                        help=f"directory for the per-rank records ({ENV_EXIT_RECORD_DIR}): one of yours that "
                             "nobody else can write (created 0700 if missing), e.g. \"$(mktemp -d)\"; each run "
                             "of this wrapper uses a new directory of its own inside it")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("missing the command to run (after --)")
    if not args.dir:
        parser.error(f"--dir or {ENV_EXIT_RECORD_DIR} is required")
    return run_and_summarize(command, args.dir)


if __name__ == "__main__":
    sys.exit(main())
