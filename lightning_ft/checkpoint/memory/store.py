"""Crash-consistent snapshot files in host shared memory, one directory per run and rank.

:class:`SnapshotStore` is the one object callers use; it lists (:mod:`.listing`), checks and
loads (:mod:`.reading`) and writes (:mod:`.writing`) through collaborators, and keeps the one
rule that spans them: a background save still pending is committed before anything else
changes the directory. The directory layout is :mod:`.roots`'s; the file format
:mod:`.format`'s.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from lightning_ft._validation import require_number
from lightning_ft.checkpoint.identity import ExpectedIdentity, SnapshotIdentity
from lightning_ft.checkpoint.memory.format import SnapshotError
from lightning_ft.checkpoint.memory.listing import SnapshotInfo, SnapshotListing, SnapshotScan
from lightning_ft.checkpoint.memory.reading import SnapshotReader
from lightning_ft.checkpoint.memory.roots import (
    DEFAULT_RUN_ID,
    SNAPSHOT_DIRS,
    configured_run_id,
    current_rank,
    ensure_writable_root,
    resolve_root,
)
from lightning_ft.checkpoint.memory.writing import PendingSave, SaveTiming, SnapshotWriter
from lightning_ft.private_dirs import require_private_dir

log = logging.getLogger(__name__)


class SnapshotStore:
    """Snapshots of one rank of one run under ``<root>/<run_id>/rank<rank>``.

    Args:
        root: base directory (default ``$LIGHTNING_FT_SNAPSHOT_DIR`` or ``/dev/shm/lightning_ft-<uid>``).
        run_id: scope (default from LIGHTNING_FT_RUN_ID / TORCHELASTIC_RUN_ID / SLURM_JOB_ID; with none
            of them the directory is ``default`` and snapshots record no run id: they are never resumed).
        rank: the rank whose directory this store writes (default: ``current_rank()``).
        keep_last: committed snapshots kept in this rank's directory (>= 1).

    Raises ValueError if the root, run or rank directory exists but is not a private directory
    of this user (a symlink, another owner, writable by group or others).

    Not thread safe; one writer per rank directory.
    """

    def __init__(self, root: str | os.PathLike | None = None, run_id: str | None = None,
                 rank: int | None = None, keep_last: int = 2) -> None:
        require_number("keep_last", keep_last, integer=True, minimum=1, inclusive=True)
        rank = current_rank() if rank is None else rank
        require_number("rank", rank, integer=True, inclusive=True)
        self.root = resolve_root(root)
        ensure_writable_root(self.root)
        #: the run id written into snapshots and expected from them; None when none is configured
        self.configured_run_id = configured_run_id(run_id)
        self.run_id = self.configured_run_id or DEFAULT_RUN_ID
        self.rank = rank
        self.keep_last = keep_last
        self._listing = SnapshotListing(self.root, self.run_id, rank)
        self.run_dir = self._listing.run_dir
        self.rank_dir = self._listing.rank_dir
        for directory, what in ((self.run_dir, "run directory"), (self.rank_dir, "rank directory")):
            if os.path.lexists(directory):
                require_private_dir(directory, what, SNAPSHOT_DIRS)
        self._reader = SnapshotReader(self._listing)
        self._writer = SnapshotWriter(self._listing, self.configured_run_id, keep_last)
        self._saving = False
        self._pending: PendingSave | None = None  # a background save not yet committed
        self._writer.remove_stale_temp_files()

    @property
    def last_timing(self) -> SaveTiming | None:
        """Timing of the last committed save (None: none yet)."""
        return self._writer.last_timing

    def hold(self, step: int) -> None:
        """Keep this rank's file of ``step`` from being recycled for a newer snapshot until
        :meth:`release` (it may still be removed: an open reader keeps its data)."""
        self._writer.hold(step)

    def release(self, step: int) -> None:
        """Undo one :meth:`hold`."""
        self._writer.release(step)

    def held_steps(self) -> set[int]:
        """Steps currently held by readers of this process."""
        return self._writer.held_steps()

    def expected_identity(self, model: str | None = None, rank: int | None = None) -> ExpectedIdentity:
        """What a resume through this store accepts: its run id (none: nothing), ``model`` and ``rank`` if given."""
        return ExpectedIdentity(self.configured_run_id or "", model, rank)

    # ------------------------------------------------------------------ listing
    def ranks(self) -> list[int]:
        """Ranks that have a directory in this run."""
        return self._listing.ranks()

    def readable_in_every_rank_dir(self, expect: ExpectedIdentity | None = None) -> list[SnapshotInfo]:
        """Intact snapshots fitting ``expect`` in every rank directory of this run on this host,
        each with the rank of its directory (sharded state: whose shards it holds)."""
        return self._reader.readable_in_every_rank_dir(expect)

    def list(self, rank: int | None = None) -> list[SnapshotInfo]:
        """Committed snapshots of ``rank`` (default: this store's), newest step first. Not verified.

        Only regular files of this user in private directories count; anything else named like a
        snapshot (a symlink, another user's file) is skipped with a logged reason, never followed.
        """
        return self._listing.list(rank)

    # ------------------------------------------------------------------ checking
    def verify(self, info: SnapshotInfo, expect: ExpectedIdentity | None = None) -> str | None:
        """None if the snapshot is intact (and fits ``expect`` when given), else the reason it must not be loaded."""
        return self._reader.verify(info, expect)

    def latest(self, rank: int | None = None, expect: ExpectedIdentity | None = None) -> SnapshotInfo | None:
        """Newest intact snapshot of ``rank`` (default: own) that fits ``expect``; others are logged and skipped."""
        return self._reader.latest(rank, expect)

    def scan(self, include_peers: bool = False, expect: ExpectedIdentity | None = None) -> SnapshotScan:
        """Intact snapshots in this rank's directory or (``include_peers``) any rank directory of
        this run on this host. Torn or corrupt ones are logged; those of another job or model
        (``expect``) are returned in ``foreign`` for the caller to explain."""
        return self._reader.scan(include_peers, expect)

    def readable_steps(self, include_peers: bool = False,
                       expect: ExpectedIdentity | None = None) -> builtins.list[int]:  # list: our method here
        """Steps with an intact snapshot (fitting ``expect`` when given) in this rank's directory,
        or (``include_peers``) in any rank directory of this run on this host. Ascending."""
        return self._reader.readable_steps(include_peers, expect)

    def find(self, step: int, include_peers: bool = False,
             expect: ExpectedIdentity | None = None) -> SnapshotInfo | None:
        """An intact snapshot at ``step`` fitting ``expect``: this rank's own if possible, else
        (``include_peers``) a peer's."""
        return self._reader.find(step, include_peers, expect)

    def created(self, info: SnapshotInfo) -> float:
        """When the snapshot was taken (wall clock, from its header: copies keep it)."""
        return self._reader.created(info)

    def identity(self, info: SnapshotInfo) -> SnapshotIdentity:
        """Run id, rank, step and model fingerprint recorded in a snapshot (checked against its checksum)."""
        return self._reader.identity(info)

    # ------------------------------------------------------------------ load
    def load(self, info: SnapshotInfo | None = None, expect: ExpectedIdentity | None = None) -> Any:
        """Verify and load a snapshot (default: ``latest(expect=expect)``); tensors are fresh CPU copies.

        Raises FileNotFoundError if there is no snapshot, SnapshotError if it is corrupt, was
        renamed, does not fit ``expect``, or its metadata names a global the restricted loader
        does not allow. No code from the file runs: the metadata is decoded by an allow-list
        unpickler (torch's weights_only list, see ``restricted_pickle``), tensors are copied out
        of the checked data region.
        """
        return self._reader.load(info, expect)

    # ------------------------------------------------------------------ save
    def save(self, state: Any, step: int, reason: str = "") -> SnapshotInfo:
        """Write ``state`` (any picklable structure of tensors) as the snapshot of ``step``.

        Synchronous and local: no collectives, safe to call from a SIGTERM path. Tensors are
        copied (the caller may keep training right after). A background save still pending is
        committed first (or abandoned, with a warning). Older snapshots beyond ``keep_last`` are
        removed after the commit. The file records this store's run id and rank and the
        fingerprint of ``state["state_dict"]``. Raises SnapshotError for state the restricted
        loader could not read back: a tensor that is not plain and dense (any save), a global
        outside the allow-list (checked at the first save of this store; a job's checkpoints
        keep their structure), so what is saved can be resumed.
        """
        self._check_save(step)
        self._settle("a new snapshot")
        self._saving = True
        try:
            return self._writer.commit(self._writer.begin(state, step, reason, None))
        finally:
            self._saving = False

    def save_in_background(self, state: Any, step: int, defer: Callable[[torch.Tensor], bool],
                           reason: str = "") -> None:
        """Start a snapshot of ``step`` whose large tensors are copied while training goes on.

        Like :meth:`save`, except that the tensors for which ``defer(tensor)`` is true are
        copied on a helper thread (when they hold ``copying.BACKGROUND_MIN_BYTES`` or more;
        smaller ones are copied at once): the caller promises not to change them until
        :meth:`commit_pending` (e.g. parameters and optimizer state until the next optimizer
        step). Every other tensor and the metadata are copied before this returns. Nothing is
        visible to readers until :meth:`commit_pending`, which checks the promise; any other
        change to this store (:meth:`save`, :meth:`close`, ...) commits the pending snapshot first.
        """
        self._check_save(step)
        self._settle("a new snapshot")
        self._saving = True
        try:
            self._pending = self._writer.begin(state, step, reason, defer)
        finally:
            self._saving = False

    @property
    def pending_step(self) -> int | None:
        """The step of the background snapshot not yet committed (None: none)."""
        return None if self._pending is None else self._pending.step

    def pending_copy_done(self) -> bool:
        """Whether the pending background copy finished (committing it will not wait); True when none is pending."""
        return self._pending is None or self._pending.copier is None or self._pending.copier.done()

    def commit_pending(self) -> SnapshotInfo | None:
        """Wait for the pending background copy and commit its snapshot (None: nothing pending).

        Raises SnapshotError, and removes the unfinished file, if a deferred tensor was changed in
        place before its copy finished (the snapshot would mix two steps), or the copy's own
        error; the committed snapshots are untouched either way."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        self._saving = True
        try:
            return self._writer.commit(pending)
        finally:
            self._saving = False

    def _settle(self, before: str) -> None:
        """Commit a pending background snapshot before ``before`` changes this store; a
        snapshot that cannot be committed is abandoned with a warning (the caller goes on)."""
        if self._pending is None:
            return
        step = self._pending.step
        try:
            self.commit_pending()
        except Exception as exc:  # noqa: BLE001 - older snapshots stand; the reason is logged
            log.warning("rank %d: background snapshot of step %d abandoned before %s: %s", self.rank, step, before,
                        exc)

    def _check_save(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if self._saving:
            # e.g. save() called from a signal handler that interrupted a periodic save
            raise RuntimeError("SnapshotStore.save() re-entered while a save is in progress")

    # ------------------------------------------------------------------ the spare file
    def spare_needed(self) -> bool:
        """True if the next ``save`` would write a fresh file (nothing to recycle, no spare)."""
        return self._writer.spare_needed()

    def preallocate(self, nbytes: int) -> float:
        """Create (or resize) a spare file of ``nbytes`` with all pages allocated and mapped.

        The next ``save`` that cannot recycle a committed file writes into it, so an emergency
        snapshot never pays for tmpfs page allocation (the dominant cost of a fresh file,
        ~5-10x the copy). Costs one state-size of shared memory until used. Returns seconds.
        """
        self._settle("preallocating a spare file")
        return self._writer.preallocate(nbytes)

    def discard_spare(self) -> None:
        """Remove the preallocated spare file (frees its shared memory)."""
        self._settle("discarding the spare file")
        self._writer.discard_spare()

    # ------------------------------------------------------------------ removal
    def delete(self, info: SnapshotInfo) -> None:
        """Remove one snapshot file."""
        self._settle("a removal")
        self._writer.delete(info)

    def discard_newer_than(self, step: int) -> builtins.list[int]:
        """Remove this rank's snapshots newer than ``step`` (an abandoned timeline after a
        resume from an older state); returns the removed steps."""
        self._settle("removing newer snapshots")
        return self._writer.discard_newer_than(step)

    def discard_newer_in_other_rank_dirs(self, step: int) -> builtins.list[tuple[int, int]]:
        """Remove the snapshots newer than ``step`` in the other ranks' directories of this run on
        this host (sharded state: copies of an abandoned timeline, which a later resume must not
        mix with the new one's); returns the removed ``(rank, step)`` pairs."""
        removed = []
        for rank in self._listing.ranks():
            if rank == self.rank:
                continue  # this rank's own: discard_newer_than, once it resumed
            for info in self._listing.list(rank):
                if info.step > step:
                    self._writer.delete(info)
                    removed.append((rank, info.step))
        return removed

    def remove_stale_temp_files(self) -> builtins.list[str]:
        """Delete temp files left in this rank's directory by writers that no longer exist."""
        return self._writer.remove_stale_temp_files()

    # ------------------------------------------------------------------ raw bytes (peer transfer)
    def read_bytes(self, info: SnapshotInfo) -> bytes:
        """The whole snapshot file as one verified blob, for sending to another host."""
        return self._reader.read_bytes(info)

    def bytes_to_send(self, info: SnapshotInfo) -> contextlib.AbstractContextManager[torch.Tensor]:
        """``read_bytes`` without the copies: the verified file as a uint8 tensor over a private
        map, valid inside the ``with`` block (see :meth:`SnapshotReader.bytes_to_send`)."""
        return self._reader.bytes_to_send(info)

    def write_bytes(self, blob: bytes | bytearray | memoryview, taken_by: int | None = None) -> SnapshotInfo:
        """Verify a blob from ``read_bytes`` (possibly another rank/host) and commit it as this
        rank's snapshot of the step recorded inside it. The copy keeps the identity it was taken
        with (run id, the taking rank, step, model). Raises SnapshotError if it is damaged,
        belongs to another run than this store's, or its metadata would be refused when loaded
        (so a refused snapshot is never kept, offered to peers or chosen to resume from).
        ``taken_by``: the rank that must have taken it (sharded state: whose shards it holds)."""
        header, took = self._writer.check_received(blob)
        if taken_by is not None and took != taken_by:
            raise SnapshotError(f"received snapshot of step {header.step} holds rank {took}'s state, not rank "
                                f"{taken_by}'s; not stored")
        self._settle("storing a received snapshot")
        return self._writer.commit_received(blob, header, took)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Commit a pending background snapshot, then release cached memory maps (files stay)."""
        self._settle("closing the store")
        self._writer.maps.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
