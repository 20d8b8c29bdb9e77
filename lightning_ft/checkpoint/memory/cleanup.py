"""``lightning-ft snapshots``: list and remove the snapshots runs left in a node's memory.

A job that finishes removes its own snapshots (unless told to keep them); a job that was
cancelled, lost every node or ran out of requeues leaves them in ``/dev/shm`` -- the node's RAM
-- until someone removes them. This lists what lies under a snapshot root, run by run, and
removes one run's snapshots (with its later fits' ``<run>-fitN``) or every run untouched for a
given time. Only this user's directories that hold ``rank<N>`` directories, never through a link,
never a run a live process holds (a job still running, however idle, or stopped with SIGSTOP:
see :mod:`.holders`); a run id is made a directory name as the job makes it (``exp/42`` is
``exp_42``), and entries a running job removes meanwhile are passed over.

    lightning-ft snapshots [--root DIR] list
    lightning-ft snapshots [--root DIR] remove RUN_ID
    lightning-ft snapshots [--root DIR] remove --older-than 2d
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass

from lightning_ft.checkpoint.memory.holders import live_holders
from lightning_ft.checkpoint.memory.roots import resolve_root, safe_run_id
from lightning_ft.settings.environment import is_later_fit_of

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class RunSnapshots:
    """One run's directory under a snapshot root."""

    name: str
    path: str
    bytes: int
    files: int
    #: seconds since anything in it was last written
    idle_seconds: float


def _holds_rank_dirs(path: str) -> bool:
    """A run's snapshot directory holds ``rank<N>`` directories; nothing else under a root is
    listed or removed (``--root`` pointed at a home or a project directory must not cost its files)."""
    try:
        return any(re.fullmatch(r"rank\d+", entry.name) and entry.is_dir(follow_symlinks=False)
                   for entry in os.scandir(path))
    except OSError:
        return False


def runs_under(root: str, now: float | None = None) -> list[RunSnapshots]:
    """The run directories of this user under ``root`` (links, other users' entries and directories
    that hold no ``rank<N>`` directory skipped)."""
    now = time.time() if now is None else now
    found = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    for name in names:
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:  # a job removed it meanwhile
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or not _holds_rank_dirs(path):
            continue
        size = files = 0
        newest = info.st_mtime
        for folder, _dirs, names_here in os.walk(path):  # os.walk does not follow links
            for file_name in names_here:
                try:
                    entry = os.lstat(os.path.join(folder, file_name))
                except FileNotFoundError:  # a job replaced its older snapshot meanwhile
                    continue
                if stat.S_ISREG(entry.st_mode):
                    size, files, newest = size + entry.st_size, files + 1, max(newest, entry.st_mtime)
        found.append(RunSnapshots(name, path, size, files, max(0.0, now - newest)))
    return found


def holding_pids(root: str, name: str) -> list[int]:
    """The live processes holding the run whose directory is ``name`` (a later fit's, too)."""
    run_id = re.sub(r"-fit\d+$", "", name)
    return sorted({int(h["pid"]) for run in {name, run_id} for h in live_holders(root, run)})


def _remove_tree(path: str) -> None:
    def vanished_is_fine(_function: object, _path: str, exc_info: tuple[type, BaseException, object]) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            raise exc_info[1]

    shutil.rmtree(path, onerror=vanished_is_fine)


def remove_runs(root: str, runs: list[RunSnapshots]) -> tuple[list[str], list[str]]:
    """Remove ``runs``' directories, except those a live process holds; returns (removed paths,
    a line per run kept for a live holder)."""
    removed, kept = [], []
    for run in runs:
        pids = holding_pids(root, run.name)
        if pids:
            kept.append(f"kept {run.path}: held by the live process(es) {', '.join(map(str, pids))} of its job")
            continue
        _remove_tree(run.path)
        removed.append(run.path)
    return removed, kept


def parse_age(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``2d`` (or plain seconds) -> seconds; ValueError otherwise."""
    text = text.strip()
    unit = _UNITS.get(text[-1:], None)
    number = text[:-1] if unit else text
    if not number.replace(".", "", 1).isdigit() or not number.isascii():
        raise ValueError(f"not an age: {text!r} (e.g. 90s, 30m, 12h, 2d)")
    return float(number) * (unit or 1)


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-ft snapshots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="the snapshot root (default: LIGHTNING_FT_SNAPSHOT_DIR, else "
                                       "/dev/shm/lightning_ft-<uid>)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="each run's snapshots: size, files, time since the last write")
    remove = commands.add_parser("remove", help="remove one run's snapshots, or every run idle for a time")
    remove.add_argument("run_id", nargs="?", help="the run (its later fits' directories go with it)")
    remove.add_argument("--older-than", metavar="AGE", help="every run not written for AGE (90s, 30m, 12h, 2d)")
    args = parser.parse_args(argv)
    root = resolve_root(args.root)
    if args.command == "list":
        runs = runs_under(root)
        if not runs:
            print(f"no snapshots under {root}")
        for run in runs:
            print(f"{run.name:<40} {_human(run.bytes):>10} {run.files:>6} file(s)  last written "
                  f"{run.idle_seconds / 60:.0f} min ago")
        return 0
    if (args.run_id is None) == (args.older_than is None):
        parser.error("remove takes a RUN_ID or --older-than AGE (one of them)")
    if args.run_id is not None:
        try:
            name = safe_run_id(args.run_id)
        except ValueError as exc:
            parser.error(str(exc))
        chosen = [run for run in runs_under(root) if run.name == name or is_later_fit_of(run.name, name)]
    else:
        try:
            age = parse_age(args.older_than)
        except ValueError as exc:
            parser.error(str(exc))
        chosen = [run for run in runs_under(root) if run.idle_seconds >= age]
    removed, kept = remove_runs(root, chosen)
    for line in [*(f"removed {path}" for path in removed), *kept]:
        print(line)
    if not removed and not kept:
        print(f"nothing to remove under {root}")
    return 0
