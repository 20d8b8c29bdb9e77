"""Listing a run's snapshot directories on this host: which committed snapshot files there are.

Only regular files of this user in private directories count; anything else named like a
snapshot (a symlink, another user's file) is skipped with a logged reason, never followed.
What is listed is not verified (see :mod:`.reading`).
"""

from __future__ import annotations

import builtins
import logging
import os
import re
from dataclasses import dataclass

from lightning_ft.checkpoint.memory.files import listdir, snapshot_file_problem
from lightning_ft.checkpoint.memory.roots import SNAPSHOT_DIRS
from lightning_ft.private_dirs import private_dir_problem

log = logging.getLogger(__name__)

_COMMITTED = re.compile(r"^step-(\d+)\.snap$")
_RANK_DIR = re.compile(r"^rank(\d+)$")


@dataclass(frozen=True)
class SnapshotInfo:
    """One committed snapshot file (listed by name; use ``SnapshotStore.verify`` to check it)."""

    step: int
    rank: int
    run_id: str
    path: str
    nbytes: int
    created: float


@dataclass(frozen=True)
class SnapshotScan:
    """What one look through the snapshot directories found."""

    #: steps with an intact snapshot that fits the expected identity, ascending
    readable: list[int]
    #: intact snapshots of another job or model (not at a readable step), newest first, with the reason
    foreign: list[tuple[SnapshotInfo, str]]


class SnapshotListing:
    """The directories of one run (``<root>/<run_id>``) as seen by ``rank``, and the committed
    snapshot files in them; each untrusted entry is reported once."""

    def __init__(self, root: str, run_id: str, rank: int) -> None:
        self.run_id = run_id
        self.rank = rank
        self.run_dir = os.path.join(root, run_id)
        self.rank_dir = self.rank_dir_of(rank)
        self._reported: set[tuple[str, str]] = set()

    def rank_dir_of(self, rank: int) -> str:
        return os.path.join(self.run_dir, f"rank{rank}")

    def final_path(self, step: int, rank: int | None = None) -> str:
        """Where the committed snapshot of ``step`` of ``rank`` (default: this one) lives."""
        return os.path.join(self.rank_dir_of(self.rank if rank is None else rank), f"step-{step:012d}.snap")

    def warn_once(self, path: str, reason: str) -> None:
        # listing runs at every save; a planted entry is reported once, not every time
        if (path, reason) not in self._reported:
            self._reported.add((path, reason))
            log.warning("ignoring %s: %s", path, reason)

    def _dir_trusted(self, path: str) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        problem = private_dir_problem(st.st_mode, st.st_uid, os.getuid(), SNAPSHOT_DIRS)
        if problem is not None:
            self.warn_once(path, f"it {problem[0]}; snapshots there are not read ({problem[1]})")
            return False
        return True

    def ranks(self) -> list[int]:
        """Ranks that have a directory in this run."""
        names = listdir(self.run_dir)
        return sorted(int(m.group(1)) for m in map(_RANK_DIR.match, names) if m)

    def list(self, rank: int | None = None) -> list[SnapshotInfo]:
        """Committed snapshots of ``rank`` (default: this one), newest step first. Not verified."""
        rank = self.rank if rank is None else rank
        directory = self.rank_dir_of(rank)
        if not (self._dir_trusted(self.run_dir) and self._dir_trusted(directory)):
            return []
        return self.files(directory, rank)

    def files(self, directory: str, rank: int) -> builtins.list[SnapshotInfo]:  # list: our method here
        """The committed snapshot files in ``directory`` (``rank``'s), newest first; the caller
        has checked the directories (a save, which just made them)."""
        infos = []
        for name in listdir(directory):
            m = _COMMITTED.match(name)
            if not m:
                continue
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            problem = snapshot_file_problem(st, os.getuid(), for_write=False)
            if problem is not None:
                self.warn_once(path, f"named like a snapshot but {problem}")
                continue
            infos.append(SnapshotInfo(int(m.group(1)), rank, self.run_id, path, st.st_size, st.st_mtime))
        return sorted(infos, key=lambda i: i.step, reverse=True)

    def ranks_to_read(self, include_peers: bool) -> builtins.list[int]:
        """This rank, then (``include_peers``) every other rank with a directory in this run."""
        return [self.rank] + ([r for r in self.ranks() if r != self.rank] if include_peers else [])
