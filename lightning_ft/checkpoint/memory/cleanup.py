"""``lightning-ft snapshots``: list and remove the snapshots runs left in a node's memory.

A job that finishes removes its own snapshots (unless told to keep them); a job that was
cancelled, lost every node or ran out of requeues leaves them in ``/dev/shm`` -- the node's RAM
-- until someone removes them. This lists what lies under a snapshot root, run by run, and
removes one run's snapshots (with its later fits' ``<run>-fitN``) or every run untouched for a
given time. Only this user's directories, never through a link.

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

from lightning_ft.checkpoint.memory.roots import remove_run_snapshots, resolve_root

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
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or not _holds_rank_dirs(path):
            continue
        size = files = 0
        newest = info.st_mtime
        for folder, _dirs, names_here in os.walk(path):  # os.walk does not follow links
            for file_name in names_here:
                entry = os.lstat(os.path.join(folder, file_name))
                if stat.S_ISREG(entry.st_mode):
                    size, files, newest = size + entry.st_size, files + 1, max(newest, entry.st_mtime)
        found.append(RunSnapshots(name, path, size, files, max(0.0, now - newest)))
    return found


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
        removed = remove_run_snapshots(root, args.run_id)
    else:
        try:
            age = parse_age(args.older_than)
        except ValueError as exc:
            parser.error(str(exc))
        removed = []
        for run in runs_under(root):
            if run.idle_seconds >= age:
                shutil.rmtree(run.path)
                removed.append(run.path)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print(f"nothing to remove under {root}")
    return 0
