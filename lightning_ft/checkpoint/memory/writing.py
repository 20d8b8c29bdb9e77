"""Writing one rank's snapshot files: a save in two halves, the spare file, pruning, received copies.

A snapshot is written under a temporary name and committed by ``rename`` (atomic within a
directory), so a process killed mid-write leaves only a temp file. A save is begun
(:meth:`SnapshotWriter.begin`: encode, pick the file, copy) and committed
(:meth:`SnapshotWriter.commit`: header, rename, prune); a background save's copy runs between
the two. Snapshots survive the death of the writing process (they live in tmpfs, not in the
process), not a reboot. Which operation may run when (a pending background save is committed
before anything else changes the directory) is the store's rule (:mod:`.store`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ft.checkpoint.memory import copying
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.files import (
    WritableMaps,
    close_map,
    create_snapshot_file,
    delete_file,
    fmt_size,
    open_snapshot_file,
    pid_alive,
    prefault_for_write,
    reserve,
    unlink_quietly,
)
from lightning_ft.checkpoint.memory.format import SnapshotError
from lightning_ft.checkpoint.memory.listing import SnapshotInfo, SnapshotListing
from lightning_ft.checkpoint.memory.roots import SNAPSHOT_DIRS
from lightning_ft.checkpoint.policy import WritePlan, plan_write, spare_needed
from lightning_ft.private_dirs import make_private_dir

log = logging.getLogger(__name__)

_TEMP = re.compile(r"^\.tmp-(step-\d+|spare)-(\d+)(?:-[0-9a-f]+)?\.snap$")


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape)) or "scalar"


@dataclass(frozen=True)
class SaveTiming:
    """Seconds of the last committed save: the caller blocked, and the work of a synchronous save
    (the two differ when tensors were copied in the background)."""

    blocked: float
    work: float


@dataclass
class PendingSave:
    """A snapshot written into its temp file, not yet committed (see ``SnapshotWriter.begin``)."""

    step: int
    reason: str
    created: float
    started: float  # perf_counter at the save call
    enc: fmt.Encoded
    existing: dict[int, SnapshotInfo]
    plan: WritePlan
    tmp: str
    final: str
    source: str
    key: Any
    mm: Any
    sums: torch.Tensor | None  # block sums when every tensor was copied
    copier: copying.BackgroundCopy | None  # else the helper still copying (and summing)
    begin_seconds: float  # what the caller was blocked for before the commit


class SnapshotWriter:
    """The files of one rank's directory (``listing.rank_dir``) that one process writes.

    ``configured_run_id`` is recorded in every snapshot written (None: ``""``) and required of
    received ones; ``keep_last`` committed snapshots are kept. Not thread safe, except
    :meth:`hold`/:meth:`release` (an upload thread reads files while training writes).
    """

    def __init__(self, listing: SnapshotListing, configured_run_id: str | None, keep_last: int) -> None:
        self._listing = listing
        self._configured_run_id = configured_run_id
        self.keep_last = keep_last
        self.rank = listing.rank
        self.rank_dir = listing.rank_dir
        self.maps = WritableMaps()
        #: our preallocated file, if any
        self.spare: str | None = None
        #: timing of the last committed save (None: none yet)
        self.last_timing: SaveTiming | None = None
        # A job's checkpoints have the same structure at every save: the metadata is decoded as a
        # load would decode it at the first save of each store only (see fmt.encode).
        self._loadable_checked = False
        # steps whose file another thread reads (the durable upload): never overwritten in place
        self._held: dict[int, int] = {}
        self._held_lock = threading.Lock()

    # ------------------------------------------------------------------ held files
    def hold(self, step: int) -> None:
        """Keep this rank's file of ``step`` from being recycled for a newer snapshot until
        :meth:`release` (it may still be removed: an open reader keeps its data)."""
        with self._held_lock:
            self._held[step] = self._held.get(step, 0) + 1

    def release(self, step: int) -> None:
        """Undo one :meth:`hold`."""
        with self._held_lock:
            count = self._held.get(step, 0) - 1
            if count > 0:
                self._held[step] = count
            else:
                self._held.pop(step, None)

    def held_steps(self) -> set[int]:
        """Steps currently held by readers of this process."""
        with self._held_lock:
            return set(self._held)

    # ------------------------------------------------------------------ paths
    def make_dirs(self) -> None:
        make_private_dir(self._listing.run_dir, "run directory", SNAPSHOT_DIRS)
        make_private_dir(self.rank_dir, "rank directory", SNAPSHOT_DIRS)

    def spare_path(self) -> str:
        return os.path.join(self.rank_dir, f".tmp-spare-{os.getpid()}.snap")

    def _temp_path(self, step: int) -> str:
        return os.path.join(self.rank_dir, f".tmp-step-{step:012d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.snap")

    # ------------------------------------------------------------------ a save: begin, commit
    def _open_write_target(self, recycle: SnapshotInfo | None, tmp: str, step: int) -> tuple[int, str]:
        """(fd, source) of the file the next snapshot is written into, renamed to ``tmp`` first."""
        if recycle is not None:
            # Leaves the committed set first: if we die mid-write it is only a stale temp file.
            os.rename(recycle.path, tmp)
            source = "recycled"
        elif self.spare is not None and os.path.lexists(self.spare):
            os.rename(self.spare, tmp)
            self.spare = None
            source = "preallocated"
        else:
            return create_snapshot_file(tmp), "new"
        try:
            fd, _ = open_snapshot_file(tmp, for_write=True)
        except SnapshotError as exc:
            # something was swapped in since it was listed: remove that entry (unlink never
            # follows a link) and write a fresh file instead
            log.warning("not reusing the %s file for step %d: %s; writing a fresh file", source, step, exc)
            os.unlink(tmp)
            return create_snapshot_file(tmp), "new"
        return fd, source

    def begin(self, state: Any, step: int, reason: str,
              defer: Callable[[torch.Tensor], bool] | None) -> PendingSave:
        """Encode ``state`` into a temp file: every tensor copied, or (``defer``) those it selects
        copying on a helper thread. Nothing is committed; on an error the temp file is removed."""
        start = time.perf_counter()
        created = time.time()  # the state is this step's from here on, whenever the copy ends
        enc = fmt.encode(state, run_id=self._configured_run_id or "", rank=self.rank,
                         check_loadable=not self._loadable_checked)
        self._loadable_checked = True
        self.make_dirs()  # checks both directories, so the listing below need not
        self.maps.drop_stale(self.rank_dir)
        existing = {info.step: info for info in self._listing.files(self.rank_dir, self.rank)}
        plan = plan_write(existing, step, self.keep_last, held=self.held_steps())
        tmp = self._temp_path(step)
        fd, source = self._open_write_target(existing[plan.recycle] if plan.recycle is not None else None, tmp, step)
        recycled = source != "new"
        mm = None
        try:
            current = os.fstat(fd).st_size
            # Never shrink a recycled file: a reader that still maps it (a peer rank, a
            # transfer) would get SIGBUS past the new end. Slack after file_size is ignored.
            size = max(current, enc.file_size)
            if current < size or not recycled:
                reserve(fd, size)
            # Populating pays off only for pages that already exist (a recycled file);
            # for a fresh file it would zero every page up front and then fault anyway.
            key, mm = self.maps.map(fd, size, populate=recycled)
            data = fmt.frombuffer_u8(mm, enc.data_off, enc.data_len)
            sums = copier = None
            later = [] if defer is None else [(t, off) for t, off in enc.tensors
                                              if defer(t) and copying.has_version_counter(t)]
            if sum(t.numel() * t.element_size() for t, _ in later) < copying.BACKGROUND_MIN_BYTES:
                sums = copying.copy_and_sum(enc, data)  # nothing worth a helper thread
            else:
                deferred = {id(t) for t, _ in later}
                copying.copy_tensors(enc, data, tensors=[(t, off) for t, off in enc.tensors if id(t) not in deferred])
                copier = copying.BackgroundCopy(enc, data, later)
            del data
        except BaseException:
            if mm is not None:
                close_map(mm)
            unlink_quietly(tmp)
            raise
        finally:
            os.close(fd)  # the map stays valid
        return PendingSave(step, reason, created, start, enc, existing, plan, tmp, self._listing.final_path(step),
                           source, key, mm, sums, copier, time.perf_counter() - start)

    def commit(self, p: PendingSave) -> SnapshotInfo:
        """Finish the header of ``p`` and rename it into place; then prune (see ``plan_write``)."""
        commit_start = time.perf_counter()
        waited = 0.0
        try:
            sums = p.sums
            if p.copier is not None:
                wait_start = time.perf_counter()
                sums = p.copier.wait()
                waited = time.perf_counter() - wait_start
                changed = p.copier.modified()
                if changed:
                    shapes = ", ".join(_shape(t) for t in changed[:3]) + (" ..." if len(changed) > 3 else "")
                    raise SnapshotError(
                        f"background snapshot of step {p.step} abandoned: {len(changed)} of the tensors it was "
                        f"still copying (shapes {shapes}) changed in place before the copy finished, so it would "
                        f"mix two steps. Something other than the optimizer step changes parameters or optimizer "
                        f"state between a batch's end and the next optimizer step")
            assert sums is not None  # a PendingSave has its sums or a copier that makes them
            head = fmt.finish(p.enc, p.step, p.created, sums)
            p.mm[: len(head)] = head
            self.maps.forget(p.final)
            os.replace(p.tmp, p.final)
        except BaseException:
            close_map(p.mm)
            unlink_quietly(p.tmp)
            raise
        self.maps.keep(p.key, p.mm)
        self._prune(p)
        now = time.perf_counter()
        blocked = p.begin_seconds + now - commit_start
        copied = 0.0 if p.copier is None else p.copier.seconds or 0.0
        # a synchronous save's work: what blocked, less the wait, plus the copy the helper did
        # (never the time between the start and the commit, when training went on)
        self.last_timing = SaveTiming(blocked, blocked - waited + copied)
        background = "" if p.copier is None else f", {copied:.3f} s of it copied in the background"
        log.debug("saved snapshot step=%d rank=%d run=%s%s: %s in %.3f s (training blocked %.3f s%s; %s file) -> %s",
                  p.step, self.rank, self._listing.run_id, f" ({p.reason})" if p.reason else "",
                  fmt_size(p.enc.file_size), now - p.started, blocked, background, p.source, p.final)
        return SnapshotInfo(p.step, self.rank, self._listing.run_id, p.final, p.enc.file_size, time.time())

    def _prune(self, p: PendingSave) -> None:
        """Remove what ``p``'s plan drops after its commit; with ``keep_last=1`` the replaced
        snapshot becomes the next write's target (the spare) instead."""
        held = self.held_steps()
        committed = len((set(p.existing) - {p.plan.recycle}) | {p.step})
        for old in p.plan.delete_after_commit:
            committed -= 1
            if self.spare is None and old not in held and spare_needed(committed, self.keep_last):
                self.spare = self.spare_path()
                os.rename(p.existing[old].path, self.spare)
            else:
                self.delete_path(p.existing[old].path)

    # ------------------------------------------------------------------ the spare file
    def spare_needed(self) -> bool:
        """True if the next save would write a fresh file (nothing to recycle, no spare)."""
        if self.spare is not None and os.path.lexists(self.spare):
            return False
        return spare_needed(len(self._listing.list()), self.keep_last)

    def _create_new(self, path: str) -> int:
        """A fresh 0600 file at ``path``; an entry we did not make there (planted, or left by an
        earlier process with our pid) is removed first, never opened."""
        try:
            return create_snapshot_file(path)
        except FileExistsError:
            log.warning("removing %s before creating it: an entry this process did not make was there", path)
            os.unlink(path)
            return create_snapshot_file(path)

    def preallocate(self, nbytes: int) -> float:
        """Create (or resize) a spare file of ``nbytes`` with all pages allocated and mapped (see
        ``SnapshotStore.preallocate``). Returns seconds."""
        start = time.perf_counter()
        self.make_dirs()
        if self.spare is not None and os.path.lexists(self.spare):
            path = self.spare
            try:
                fd, _ = open_snapshot_file(path, for_write=True)
            except SnapshotError as exc:
                log.warning("not reusing the spare file: %s", exc)
                os.unlink(path)
                fd = create_snapshot_file(path)
        else:
            path = self.spare_path()
            fd = self._create_new(path)
        try:
            nbytes = max(nbytes, os.fstat(fd).st_size)  # never shrink (see begin)
            reserve(fd, nbytes)
            key, mm = self.maps.map(fd, nbytes, populate=False)
            prefault_for_write(mm)
        except BaseException:
            os.close(fd)
            self.spare = None
            unlink_quietly(path)
            raise
        os.close(fd)
        self.maps.keep(key, mm)
        self.spare = path
        seconds = time.perf_counter() - start
        log.debug("preallocated a %s spare snapshot file for rank %d in %.3f s", fmt_size(nbytes), self.rank,
                  seconds)
        return seconds

    def discard_spare(self) -> None:
        """Remove the preallocated spare file (frees its shared memory)."""
        if self.spare is not None:
            self.delete_path(self.spare)
            self.spare = None

    # ------------------------------------------------------------------ removal
    def delete_path(self, path: str) -> None:
        delete_file(self.maps, path)

    def delete(self, info: SnapshotInfo) -> None:
        """Remove one snapshot file."""
        self.delete_path(info.path)
        log.debug("removed snapshot step=%d rank=%d: %s", info.step, info.rank, info.path)

    def discard_newer_than(self, step: int) -> list[int]:
        """Remove this rank's snapshots newer than ``step`` (an abandoned timeline after a
        resume from an older state); returns the removed steps."""
        removed = []
        for info in self._listing.list():
            if info.step > step:
                self.delete_path(info.path)
                removed.append(info.step)
                log.info("removed snapshot step=%d rank=%d: newer than the resumed step %d (abandoned timeline)",
                         info.step, info.rank, step)
        return removed

    def remove_stale_temp_files(self) -> list[str]:
        """Delete temp files left in this rank's directory by writers that no longer exist."""
        removed: list[str] = []
        try:
            names = os.listdir(self.rank_dir)
        except FileNotFoundError:
            return removed
        for name in names:
            m = _TEMP.match(name)
            if not m or int(m.group(2)) == os.getpid() or pid_alive(int(m.group(2))):
                continue
            path = os.path.join(self.rank_dir, name)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(path)
            log.warning("removed leftover %s (%s): its writer (pid %s) is gone%s", path, m.group(1), m.group(2),
                        "" if m.group(1) == "spare" else " and never committed it (torn)")
        return removed

    # ------------------------------------------------------------------ received copies
    def check_received(self, blob: bytes | bytearray | memoryview) -> tuple[fmt.Header, int]:
        """(header, the rank that took it) of a blob from ``read_bytes`` (possibly another
        rank/host); SnapshotError if it is damaged, belongs to another run than this writer's,
        or its metadata would be refused when loaded."""
        header = fmt.verify(blob, len(memoryview(blob)))
        found = fmt.read_identity(blob, header)
        if self._configured_run_id is not None and found.run_id != self._configured_run_id:
            raise SnapshotError(f"received snapshot of step {header.step} belongs to run {found.run_id!r}, not to "
                                f"{self._configured_run_id!r}; not stored")
        try:
            fmt.check_metadata(blob, header)
        except SnapshotError as exc:
            raise SnapshotError(f"received snapshot of step {header.step}: {exc}; not stored") from None
        return header, found.rank

    def commit_received(self, blob: bytes | bytearray | memoryview, header: fmt.Header, taken_by: int) -> SnapshotInfo:
        """Commit a blob :meth:`check_received` accepted as this rank's snapshot of its step."""
        blob = memoryview(blob)[: header.file_size]  # drop any slack of a recycled source file
        self.make_dirs()
        existing = {info.step: info for info in self._listing.list()}
        plan = plan_write(existing, header.step, self.keep_last)
        tmp = self._temp_path(header.step)
        final = self._listing.final_path(header.step)
        try:
            with os.fdopen(create_snapshot_file(tmp), "wb") as f:
                f.write(blob)
            self.maps.forget(final)
            os.replace(tmp, final)
        except BaseException:
            unlink_quietly(tmp)
            raise
        # nothing was recycled, so the would-be-recycled file is pruned like any other
        for old in [*plan.delete_after_commit, *([plan.recycle] if plan.recycle not in (None, header.step) else [])]:
            self.delete_path(existing[old].path)
        log.info("committed received snapshot step=%d rank=%d run=%s (taken by rank %d): %s -> %s",
                 header.step, self.rank, self._listing.run_id, taken_by, fmt_size(header.file_size), final)
        return SnapshotInfo(header.step, self.rank, self._listing.run_id, final, header.file_size, time.time())
