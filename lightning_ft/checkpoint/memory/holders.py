"""One live job per run id and snapshot root on a host.

Two jobs started with one run id on one host write the same snapshot files (``<root>/<run_id>``),
and the first to finish removes the other's. So before a process of a job trains it claims the
run's directory: ``<root>/.held-<run_id>`` holds a line per live process that claimed it (its pid,
its start tick -- a pid the kernel gave to a later process is not the same process -- and the
identity of its job: the rendezvous endpoint its launch names). A process of *another* job that
finds a live process there is refused at once, with that process's pid; processes of one job
(``devices=N``, an active and a spare on one host, a replacement, a relaunch while a process of
the launch before is still leaving) share the claim, and dead processes drop out at the next
claim. Linux only (``/proc``): elsewhere no process can be told alive and nothing is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from typing import Any

from lightning_ft.settings.environment import file_name_of_run


class RunHeldError(ValueError):
    """Another live job holds this run id's snapshot directory on this host."""


def process_start_tick(pid: int) -> str | None:
    """When process ``pid`` started, in the kernel's ticks since boot (None: no such process, or
    no ``/proc``): with the pid, it tells one process from a later one the pid was reused for."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holders_path(root: str, run_id: str) -> str:
    return os.path.join(root, ".held-" + file_name_of_run(run_id))


def live_holders(root: str, run_id: str) -> list[dict[str, Any]]:
    """The live processes that hold ``run_id`` under ``root`` (each ``{"pid", "tick", "job"}``);
    reads only, creates nothing."""
    try:
        fd = os.open(holders_path(root, run_id), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # none (or not a file this package wrote): nobody holds it
        return []
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return _live_holders(fd, os.getpid())
    finally:
        os.close(fd)


def _is_file_at(fd: int, path: str) -> bool:
    """Whether the file open as ``fd`` is still the one named ``path`` (not unlinked or replaced)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[int]:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # released with the descriptor, also when this process dies
        # the last holder to release unlinks the file under the lock: one who opened it before and
        # waited for the lock holds a file nobody else will open again -- a claim written there
        # would be seen by nobody. Open the file that is there now instead.
        if _is_file_at(fd, path):
            break
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _live_holders(fd: int, pid: int) -> list[dict[str, Any]]:
    """The file's holders that are alive (by pid and start tick), this process left out."""
    with os.fdopen(os.dup(fd), "r") as f:
        f.seek(0)
        lines = f.read().splitlines()
    holders = []
    for line in lines:
        try:
            holder = json.loads(line)
            alive = holder["pid"] != pid and process_start_tick(int(holder["pid"])) == holder["tick"]
        except (ValueError, KeyError, TypeError):
            continue  # a damaged line: nobody's claim
        if alive:
            holders.append(holder)
    return holders


def _write(fd: int, holders: list[dict[str, Any]]) -> None:
    data = "".join(json.dumps(h, sort_keys=True) + "\n" for h in holders).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def claim_run(root: str, run_id: str, job: str) -> None:
    """Claim ``run_id``'s snapshot directory under ``root`` for this process of job ``job``.

    Raises :class:`RunHeldError` naming the holder when a live process of another job holds it."""
    pid = os.getpid()
    with _locked(holders_path(root, run_id)) as fd:
        holders = _live_holders(fd, pid)
        other = next((h for h in holders if h.get("job") != job), None)
        if other is not None:
            raise RunHeldError(
                f"run id {run_id!r} is held on this host by another live job: pid {other['pid']} (its rendezvous "
                f"at {other.get('job')!r}, this one's at {job!r}) writes its snapshots under {root}; two jobs of "
                "one run id would overwrite each other's snapshots and the first to finish would remove the "
                "other's. Give this job another run id (LIGHTNING_FT_RUN_ID), or end the other first")
        _write(fd, [*holders, {"pid": pid, "tick": process_start_tick(pid), "job": job}])


def release_run(root: str, run_id: str) -> None:
    """This process no longer holds ``run_id``'s directory (the file goes with the last holder)."""
    path = holders_path(root, run_id)
    with _locked(path) as fd:
        holders = _live_holders(fd, os.getpid())
        _write(fd, holders)
        if not holders:
            os.unlink(path)
