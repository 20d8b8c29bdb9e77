"""Crash-consistent snapshot files in host shared memory, one directory per run and rank.

Directory layout::

    <root>/<run_id>/rank<R>/step-<12-digit step>.snap        committed snapshots
    <root>/<run_id>/rank<R>/.tmp-step-<step>-<pid>-<rand>.snap   being written (never loaded)
    <root>/<run_id>/rank<R>/.tmp-spare-<pid>.snap                 preallocated file for the next write

``<root>`` defaults to ``/dev/shm/lightning_ft-<uid>``; without a configured run id ``<run_id>``
is ``default`` and what is written there is never resumed. Every directory on that path must be
a private directory of this user (see ``files.private_dir_problem``).

A snapshot is written under a temporary name and committed by ``rename`` (atomic within a
directory), so a process killed mid-write leaves only a temp file. Every load re-checks
the header, the size, the checksums and that the file name's step is the header's, so a torn,
corrupt or renamed file is skipped with a logged reason instead of being loaded; given an
expected identity, snapshots of another run or model are skipped too. Snapshots survive the
death of the writing process (they live in tmpfs, not in the process), not a reboot.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft._validation import require, require_number
from lightning_ft.checkpoint import snapshot_format as fmt
from lightning_ft.checkpoint.files import (
    ReadMap,
    WritableMaps,
    close_map,
    create_snapshot_file,
    delete_file,
    listdir,
    make_private_dir,
    open_snapshot_file,
    pid_alive,
    prefault_for_write,
    private_dir_problem,
    read_snapshot_bytes,
    require_private_dir,
    reserve,
    snapshot_file_problem,
)
from lightning_ft.checkpoint.identity import ExpectedIdentity, SnapshotIdentity, identity_mismatch
from lightning_ft.checkpoint.policy import WritePlan, plan_write, spare_needed
from lightning_ft.checkpoint.snapshot_format import SnapshotError

log = logging.getLogger(__name__)

ENV_SNAPSHOT_DIR = "LIGHTNING_FT_SNAPSHOT_DIR"
RUN_ID_ENV_VARS = ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
#: directory of snapshots written without a configured run id (never resumed)
DEFAULT_RUN_ID = "default"
# what torchrun puts in TORCHELASTIC_RUN_ID when --rdzv-id is not given: not a job's name
_TORCHRUN_PLACEHOLDER_RUN_ID = "none"

_COMMITTED = re.compile(r"^step-(\d+)\.snap$")
_TEMP = re.compile(r"^\.tmp-(step-\d+|spare)-(\d+)(?:-[0-9a-f]+)?\.snap$")
_RANK_DIR = re.compile(r"^rank(\d+)$")


def default_root() -> str:
    """``/dev/shm/lightning_ft-<uid>`` (the temp dir when there is no /dev/shm): one root per user."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) else tempfile.gettempdir()
    return os.path.join(base, f"lightning_ft-{os.getuid()}")


def resolve_root(root: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Explicit ``root``, else ``$LIGHTNING_FT_SNAPSHOT_DIR``, else ``/dev/shm/lightning_ft-<uid>``."""
    env = os.environ if environ is None else environ
    if root is not None:
        return os.fspath(root)
    return env.get(ENV_SNAPSHOT_DIR) or default_root()


def _safe_run_id(run_id: object) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(run_id))
    require(safe not in ("", ".", ".."), "run_id", "usable as a directory name", run_id)
    return safe


def configured_run_id(run_id: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """Explicit ``run_id``, else the first set of LIGHTNING_FT_RUN_ID, TORCHELASTIC_RUN_ID (not
    torchrun's placeholder ``none``), SLURM_JOB_ID; made safe as a directory name. None when no
    run id is configured anywhere: then no snapshot can be shown to belong to this job."""
    if run_id is not None:
        return _safe_run_id(run_id)
    env = os.environ if environ is None else environ
    for key in RUN_ID_ENV_VARS:
        value = env.get(key)
        if value and not (key == "TORCHELASTIC_RUN_ID" and value == _TORCHRUN_PLACEHOLDER_RUN_ID):
            return _safe_run_id(value)
    return None


def resolve_run_id(run_id: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The run's directory name: :func:`configured_run_id`, else ``"default"`` (written, never resumed)."""
    return configured_run_id(run_id, environ) or DEFAULT_RUN_ID


def current_rank(environ: Mapping[str, str] | None = None) -> int:
    """Global rank: the initialized process group's, else $RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ if environ is None else environ
    return int(env.get("RANK", "0") or 0)


def ensure_writable_root(root: str) -> None:
    """Create ``root`` (mode 0700) if needed, check it is a private directory of this user and
    prove it writable; raise ValueError naming ``root``, its owner and mode, and the fix, if not."""
    try:
        if not os.path.lexists(root):
            parent = os.path.dirname(os.path.abspath(root))
            os.makedirs(parent, exist_ok=True)
            try:
                os.mkdir(root, 0o700)
            except FileExistsError:
                pass
        require_private_dir(root, "snapshot root")
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"root={root!r} is not a writable directory: {exc}") from exc


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


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


def _renamed(info: SnapshotInfo, header: fmt.Header) -> str | None:
    if header.step == info.step:
        return None
    return f"its file name says step {info.step} but its header says step {header.step} (renamed or planted file)"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape)) or "scalar"


@dataclass(frozen=True)
class SaveTiming:
    """Seconds of the last committed save: the caller blocked, and the work of a synchronous save
    (the two differ when tensors were copied in the background)."""

    blocked: float
    work: float


@dataclass
class _PendingSave:
    """A snapshot written into its temp file, not yet committed (see ``SnapshotStore._begin``)."""

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
    copier: fmt.BackgroundCopy | None  # else the helper still copying (and summing)
    begin_seconds: float  # what the caller was blocked for before the commit


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
        self.run_dir = os.path.join(self.root, self.run_id)
        self.rank_dir = self._rank_dir(rank)
        for directory, what in ((self.run_dir, "run directory"), (self.rank_dir, "rank directory")):
            if os.path.lexists(directory):
                require_private_dir(directory, what)
        self._maps = WritableMaps()
        self._spare: str | None = None  # our preallocated file, if any
        self._saving = False
        self._pending: _PendingSave | None = None  # a background save not yet committed
        #: timing of the last committed save (None: none yet)
        self.last_timing: SaveTiming | None = None
        # A job's checkpoints have the same structure at every save: the metadata is decoded as a
        # load would decode it at the first save of each store only (see fmt.encode).
        self._loadable_checked = False
        self._reported: set[tuple[str, str]] = set()
        # steps whose file another thread reads (the durable upload): never overwritten in place
        self._held: dict[int, int] = {}
        self._held_lock = threading.Lock()
        self.remove_stale_temp_files()

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

    def expected_identity(self, model: str | None = None, rank: int | None = None) -> ExpectedIdentity:
        """What a resume through this store accepts: its run id (none: nothing), ``model`` and ``rank`` if given."""
        return ExpectedIdentity(self.configured_run_id or "", model, rank)

    # ------------------------------------------------------------------ listing
    def _rank_dir(self, rank: int) -> str:
        return os.path.join(self.run_dir, f"rank{rank}")

    def _final_path(self, step: int, rank: int | None = None) -> str:
        return os.path.join(self._rank_dir(self.rank if rank is None else rank), f"step-{step:012d}.snap")

    def _warn_once(self, path: str, reason: str) -> None:
        # listing runs at every save; a planted entry is reported once, not every time
        if (path, reason) not in self._reported:
            self._reported.add((path, reason))
            log.warning("ignoring %s: %s", path, reason)

    def _dir_trusted(self, path: str) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        problem = private_dir_problem(st.st_mode, st.st_uid, os.getuid())
        if problem is not None:
            self._warn_once(path, f"it {problem[0]}; snapshots there are not read ({problem[1]})")
            return False
        return True

    def ranks(self) -> list[int]:
        """Ranks that have a directory in this run."""
        names = listdir(self.run_dir)
        return sorted(int(m.group(1)) for m in map(_RANK_DIR.match, names) if m)

    def list(self, rank: int | None = None) -> list[SnapshotInfo]:
        """Committed snapshots of ``rank`` (default: this store's), newest step first. Not verified.

        Only regular files of this user in private directories count; anything else named like a
        snapshot (a symlink, another user's file) is skipped with a logged reason, never followed.
        """
        rank = self.rank if rank is None else rank
        directory = self._rank_dir(rank)
        if not (self._dir_trusted(self.run_dir) and self._dir_trusted(directory)):
            return []
        return self._list_files(directory, rank)

    def _list_files(self, directory: str, rank: int) -> list[SnapshotInfo]:
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
                self._warn_once(path, f"named like a snapshot but {problem}")
                continue
            infos.append(SnapshotInfo(int(m.group(1)), rank, self.run_id, path, st.st_size, st.st_mtime))
        return sorted(infos, key=lambda i: i.step, reverse=True)

    def _ranks_to_read(self, include_peers: bool) -> list[int]:
        return [self.rank] + ([r for r in self.ranks() if r != self.rank] if include_peers else [])

    # ------------------------------------------------------------------ checking
    def _head(self, info: SnapshotInfo) -> tuple[fmt.Header, SnapshotIdentity]:
        """Header and identity of a snapshot, checked against the body crc; reads only the bytes
        before the data region (no mapping of the whole file)."""
        fd, st = open_snapshot_file(info.path, for_write=False)
        try:
            header = fmt.Header.unpack(os.pread(fd, fmt.HEADER_SIZE, 0))
            prefix = os.pread(fd, header.meta_off + header.meta_len, 0)
        finally:
            os.close(fd)
        header = fmt.check_body(prefix, st.st_size)
        return header, fmt.read_identity(prefix, header)

    def _check(self, info: SnapshotInfo, expect: ExpectedIdentity | None) -> tuple[str | None, bool]:
        """(why it must not be loaded, whether that is because it is another job's), (None, False) if fine.

        Name, identity and body crc are checked before the data is mapped and summed, so another
        job's file costs a few small reads.
        """
        try:
            header, found = self._head(info)
            renamed = _renamed(info, header)
            if renamed is not None:
                return renamed, False
            if expect is not None:
                mismatch = identity_mismatch(found, expect)
                if mismatch is not None:
                    return mismatch, True
            with ReadMap(info.path) as (mm, size):
                if fmt.check_body(mm, size) != header:
                    return "it changed while it was being checked", False
                fmt.check_data(mm, header)
        except (SnapshotError, OSError, ValueError) as exc:
            return str(exc), False
        return None, False

    def _log_skip(self, info: SnapshotInfo, reason: str) -> None:
        log.warning("skipping snapshot %s (step %d): %s", info.path, info.step, reason)

    def verify(self, info: SnapshotInfo, expect: ExpectedIdentity | None = None) -> str | None:
        """None if the snapshot is intact (and fits ``expect`` when given), else the reason it must not be loaded."""
        return self._check(info, expect)[0]

    def latest(self, rank: int | None = None, expect: ExpectedIdentity | None = None) -> SnapshotInfo | None:
        """Newest intact snapshot of ``rank`` (default: own) that fits ``expect``; others are logged and skipped."""
        for info in self.list(rank):
            reason = self.verify(info, expect)
            if reason is None:
                return info
            self._log_skip(info, reason)
        return None

    def scan(self, include_peers: bool = False, expect: ExpectedIdentity | None = None) -> SnapshotScan:
        """Intact snapshots in this rank's directory or (``include_peers``) any rank directory of
        this run on this host. Torn or corrupt ones are logged; those of another job or model
        (``expect``) are returned in ``foreign`` for the caller to explain."""
        found: set[int] = set()
        foreign: list[tuple[SnapshotInfo, str]] = []
        for rank in self._ranks_to_read(include_peers):
            for info in self.list(rank):
                if info.step in found:
                    continue
                reason, is_foreign = self._check(info, expect)
                if reason is None:
                    found.add(info.step)
                elif is_foreign:
                    foreign.append((info, reason))
                else:
                    self._log_skip(info, reason)
        foreign = sorted((f for f in foreign if f[0].step not in found), key=lambda f: f[0].step, reverse=True)
        return SnapshotScan(sorted(found), foreign)

    def readable_steps(self, include_peers: bool = False, expect: ExpectedIdentity | None = None) -> list[int]:
        """Steps with an intact snapshot (fitting ``expect`` when given) in this rank's directory,
        or (``include_peers``) in any rank directory of this run on this host. Ascending."""
        result = self.scan(include_peers, expect)
        for info, reason in result.foreign:
            self._log_skip(info, reason)
        return result.readable

    def find(self, step: int, include_peers: bool = False,
             expect: ExpectedIdentity | None = None) -> SnapshotInfo | None:
        """An intact snapshot at ``step`` fitting ``expect``: this rank's own if possible, else
        (``include_peers``) a peer's."""
        for rank in self._ranks_to_read(include_peers):
            for info in self.list(rank):
                if info.step != step:
                    continue
                reason = self.verify(info, expect)
                if reason is None:
                    return info
                self._log_skip(info, reason)
        return None

    def _read_head(self, info: SnapshotInfo) -> fmt.Header:
        fd, _ = open_snapshot_file(info.path, for_write=False)
        try:
            return fmt.Header.unpack(os.pread(fd, fmt.HEADER_SIZE, 0))
        finally:
            os.close(fd)

    def created(self, info: SnapshotInfo) -> float:
        """When the snapshot was taken (wall clock, from its header: copies keep it)."""
        return self._read_head(info).created

    def identity(self, info: SnapshotInfo) -> SnapshotIdentity:
        """Run id, rank, step and model fingerprint recorded in a snapshot (checked against its checksum)."""
        return self._head(info)[1]

    # ------------------------------------------------------------------ load
    def load(self, info: SnapshotInfo | None = None, expect: ExpectedIdentity | None = None) -> Any:
        """Verify and load a snapshot (default: ``latest(expect=expect)``); tensors are fresh CPU copies.

        Raises FileNotFoundError if there is no snapshot, SnapshotError if it is corrupt, was
        renamed, does not fit ``expect``, or its metadata names a global the restricted loader
        does not allow. No code from the file runs: the metadata is decoded by an allow-list
        unpickler (torch's weights_only list, see ``restricted_pickle``), tensors are copied out
        of the checked data region.
        """
        if info is None:
            info = self.latest(expect=expect)
            if info is None:
                raise FileNotFoundError(f"no intact snapshot in {self.rank_dir}")
        start = time.perf_counter()
        with ReadMap(info.path) as (mm, size):
            header = fmt.verify(mm, size)
            refusal = _renamed(info, header)
            if refusal is None and expect is not None:
                refusal = identity_mismatch(fmt.read_identity(mm, header), expect)
            if refusal is not None:
                raise SnapshotError(f"{info.path} (step {info.step}): {refusal}")
            state = fmt.decode(mm, header)
            # The writer may recycle a committed file for a newer snapshot (another process, or a
            # peer rank's dir); a second check catches a file that changed while we copied it.
            if fmt.verify(mm, size) != header:
                raise SnapshotError(f"{info.path} was overwritten while it was being loaded")
        seconds = time.perf_counter() - start
        log.info("loaded snapshot step=%d rank=%d run=%s: %s in %.3f s from %s",
                 info.step, info.rank, info.run_id, _fmt_size(size), seconds, info.path)
        return state

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
            return self._commit(self._begin(state, step, reason, None))
        finally:
            self._saving = False

    def save_in_background(self, state: Any, step: int, defer: Callable[[torch.Tensor], bool],
                           reason: str = "") -> None:
        """Start a snapshot of ``step`` whose large tensors are copied while training goes on.

        Like :meth:`save`, except that the tensors for which ``defer(tensor)`` is true are
        copied on a helper thread (when they hold ``snapshot_format.BACKGROUND_MIN_BYTES`` or
        more; smaller ones are copied at once): the caller promises not to change them until
        :meth:`commit_pending` (e.g. parameters and optimizer state until the next optimizer
        step). Every other tensor and the metadata are copied before this returns. Nothing is
        visible to readers until :meth:`commit_pending`, which checks the promise; any other
        change to this store (:meth:`save`, :meth:`close`, ...) commits the pending snapshot first.
        """
        self._check_save(step)
        self._settle("a new snapshot")
        self._saving = True
        try:
            self._pending = self._begin(state, step, reason, defer)
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
            return self._commit(pending)
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

    def _open_write_target(self, recycle: SnapshotInfo | None, tmp: str, step: int) -> tuple[int, str]:
        """(fd, source) of the file the next snapshot is written into, renamed to ``tmp`` first."""
        if recycle is not None:
            # Leaves the committed set first: if we die mid-write it is only a stale temp file.
            os.rename(recycle.path, tmp)
            source = "recycled"
        elif self._spare is not None and os.path.lexists(self._spare):
            os.rename(self._spare, tmp)
            self._spare = None
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

    def _begin(self, state: Any, step: int, reason: str,
               defer: Callable[[torch.Tensor], bool] | None) -> _PendingSave:
        """Encode ``state`` into a temp file: every tensor copied, or (``defer``) those it selects
        copying on a helper thread. Nothing is committed; on an error the temp file is removed."""
        start = time.perf_counter()
        created = time.time()  # the state is this step's from here on, whenever the copy ends
        enc = fmt.encode(state, run_id=self.configured_run_id or "", rank=self.rank,
                         check_loadable=not self._loadable_checked)
        self._loadable_checked = True
        self._make_dirs()  # checks both directories, so the listing below need not
        self._maps.drop_stale(self.rank_dir)
        existing = {info.step: info for info in self._list_files(self.rank_dir, self.rank)}
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
            key, mm = self._maps.map(fd, size, populate=recycled)
            data = fmt.frombuffer_u8(mm, enc.data_off, enc.data_len)
            sums = copier = None
            later = [] if defer is None else [(t, off) for t, off in enc.tensors
                                              if defer(t) and fmt.has_version_counter(t)]
            if sum(t.numel() * t.element_size() for t, _ in later) < fmt.BACKGROUND_MIN_BYTES:
                sums = fmt.copy_and_sum(enc, data)  # nothing worth a helper thread
            else:
                deferred = {id(t) for t, _ in later}
                fmt.copy_tensors(enc, data, tensors=[(t, off) for t, off in enc.tensors if id(t) not in deferred])
                copier = fmt.BackgroundCopy(enc, data, later)
            del data
        except BaseException:
            if mm is not None:
                close_map(mm)
            _unlink_quietly(tmp)
            raise
        finally:
            os.close(fd)  # the map stays valid
        return _PendingSave(step, reason, created, start, enc, existing, plan, tmp, self._final_path(step), source,
                            key, mm, sums, copier, time.perf_counter() - start)

    def _commit(self, p: _PendingSave) -> SnapshotInfo:
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
            head = fmt.finish(p.enc, p.step, p.created, sums)
            p.mm[: len(head)] = head
            self._maps.forget(p.final)
            os.replace(p.tmp, p.final)
        except BaseException:
            close_map(p.mm)
            _unlink_quietly(p.tmp)
            raise
        self._maps.keep(p.key, p.mm)
        held = self.held_steps()
        committed = len((set(p.existing) - {p.plan.recycle}) | {p.step})
        for old in p.plan.delete_after_commit:
            committed -= 1
            if self._spare is None and old not in held and spare_needed(committed, self.keep_last):
                # keep_last=1: the replaced snapshot becomes the next write's target
                self._spare = self._spare_path()
                os.rename(p.existing[old].path, self._spare)
            else:
                self._delete_path(p.existing[old].path)
        now = time.perf_counter()
        blocked = p.begin_seconds + now - commit_start
        copied = 0.0 if p.copier is None else p.copier.seconds or 0.0
        # a synchronous save's work: what blocked, less the wait, plus the copy the helper did
        # (never the time between the start and the commit, when training went on)
        self.last_timing = SaveTiming(blocked, blocked - waited + copied)
        background = "" if p.copier is None else f", {copied:.3f} s of it copied in the background"
        log.debug("saved snapshot step=%d rank=%d run=%s%s: %s in %.3f s (training blocked %.3f s%s; %s file) -> %s",
                  p.step, self.rank, self.run_id, f" ({p.reason})" if p.reason else "", _fmt_size(p.enc.file_size),
                  now - p.started, blocked, background, p.source, p.final)
        return SnapshotInfo(p.step, self.rank, self.run_id, p.final, p.enc.file_size, time.time())

    def _make_dirs(self) -> None:
        make_private_dir(self.run_dir, "run directory")
        make_private_dir(self.rank_dir, "rank directory")

    def _spare_path(self) -> str:
        return os.path.join(self.rank_dir, f".tmp-spare-{os.getpid()}.snap")

    def spare_needed(self) -> bool:
        """True if the next ``save`` would write a fresh file (nothing to recycle, no spare)."""
        if self._spare is not None and os.path.lexists(self._spare):
            return False
        return spare_needed(len(self.list()), self.keep_last)

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
        """Create (or resize) a spare file of ``nbytes`` with all pages allocated and mapped.

        The next ``save`` that cannot recycle a committed file writes into it, so an emergency
        snapshot never pays for tmpfs page allocation (the dominant cost of a fresh file,
        ~5-10x the copy). Costs one state-size of shared memory until used. Returns seconds.
        """
        self._settle("preallocating a spare file")
        start = time.perf_counter()
        self._make_dirs()
        if self._spare is not None and os.path.lexists(self._spare):
            path = self._spare
            try:
                fd, _ = open_snapshot_file(path, for_write=True)
            except SnapshotError as exc:
                log.warning("not reusing the spare file: %s", exc)
                os.unlink(path)
                fd = create_snapshot_file(path)
        else:
            path = self._spare_path()
            fd = self._create_new(path)
        try:
            nbytes = max(nbytes, os.fstat(fd).st_size)  # never shrink (see _save)
            reserve(fd, nbytes)
            key, mm = self._maps.map(fd, nbytes, populate=False)
            prefault_for_write(mm)
        except BaseException:
            os.close(fd)
            self._spare = None
            _unlink_quietly(path)
            raise
        os.close(fd)
        self._maps.keep(key, mm)
        self._spare = path
        seconds = time.perf_counter() - start
        log.debug("preallocated a %s spare snapshot file for rank %d in %.3f s", _fmt_size(nbytes), self.rank,
                  seconds)
        return seconds

    def discard_spare(self) -> None:
        """Remove the preallocated spare file (frees its shared memory)."""
        self._settle("discarding the spare file")
        if self._spare is not None:
            self._delete_path(self._spare)
            self._spare = None

    def _temp_path(self, step: int) -> str:
        return os.path.join(self.rank_dir, f".tmp-step-{step:012d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.snap")

    # ------------------------------------------------------------------ removal
    def _delete_path(self, path: str) -> None:
        delete_file(self._maps, path)

    def delete(self, info: SnapshotInfo) -> None:
        """Remove one snapshot file."""
        self._settle("a removal")
        self._delete_path(info.path)
        log.debug("removed snapshot step=%d rank=%d: %s", info.step, info.rank, info.path)

    def discard_newer_than(self, step: int) -> list[int]:
        """Remove this rank's snapshots newer than ``step`` (an abandoned timeline after a
        resume from an older state); returns the removed steps."""
        self._settle("removing newer snapshots")
        removed = []
        for info in self.list():
            if info.step > step:
                self._delete_path(info.path)
                removed.append(info.step)
                log.info("removed snapshot step=%d rank=%d: newer than the resumed step %d (abandoned timeline)",
                         info.step, info.rank, step)
        return removed

    def remove_stale_temp_files(self) -> list[str]:
        """Delete temp files left in this rank's directory by writers that no longer exist."""
        removed = []
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

    # ------------------------------------------------------------------ raw bytes (peer transfer)
    def read_bytes(self, info: SnapshotInfo) -> bytes:
        """The whole snapshot file as one verified blob, for sending to another host."""
        blob = read_snapshot_bytes(info.path)
        header = fmt.verify(blob, len(blob))
        refusal = _renamed(info, header)
        if refusal is not None:
            raise SnapshotError(f"{info.path}: {refusal}")
        return blob[: header.file_size] if len(blob) > header.file_size else blob

    def write_bytes(self, blob: bytes | bytearray | memoryview) -> SnapshotInfo:
        """Verify a blob from ``read_bytes`` (possibly another rank/host) and commit it as this
        rank's snapshot of the step recorded inside it. The copy keeps the identity it was taken
        with (run id, the taking rank, step, model). Raises SnapshotError if it is damaged,
        belongs to another run than this store's, or its metadata would be refused when loaded
        (so a refused snapshot is never kept, offered to peers or chosen to resume from)."""
        header = fmt.verify(blob, len(memoryview(blob)))
        found = fmt.read_identity(blob, header)
        if self.configured_run_id is not None and found.run_id != self.configured_run_id:
            raise SnapshotError(f"received snapshot of step {header.step} belongs to run {found.run_id!r}, not to "
                                f"{self.configured_run_id!r}; not stored")
        try:
            fmt.check_metadata(blob, header)
        except SnapshotError as exc:
            raise SnapshotError(f"received snapshot of step {header.step}: {exc}; not stored") from None
        self._settle("storing a received snapshot")
        blob = memoryview(blob)[: header.file_size]  # drop any slack of a recycled source file
        self._make_dirs()
        existing = {info.step: info for info in self.list()}
        plan = plan_write(existing, header.step, self.keep_last)
        tmp = self._temp_path(header.step)
        final = self._final_path(header.step)
        try:
            with os.fdopen(create_snapshot_file(tmp), "wb") as f:
                f.write(blob)
            self._maps.forget(final)
            os.replace(tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        # nothing was recycled, so the would-be-recycled file is pruned like any other
        for old in [*plan.delete_after_commit, *([plan.recycle] if plan.recycle not in (None, header.step) else [])]:
            self._delete_path(existing[old].path)
        log.info("committed received snapshot step=%d rank=%d run=%s (taken by rank %d): %s -> %s",
                 header.step, self.rank, self.run_id, found.rank, _fmt_size(header.file_size), final)
        return SnapshotInfo(header.step, self.rank, self.run_id, final, header.file_size, time.time())

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Commit a pending background snapshot, then release cached memory maps (files stay)."""
        self._settle("closing the store")
        self._maps.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
