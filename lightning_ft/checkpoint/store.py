"""Crash-consistent snapshot files in host shared memory, one directory per run and rank.

Directory layout::

    <root>/<run_id>/rank<R>/step-<12-digit step>.snap        committed snapshots
    <root>/<run_id>/rank<R>/.tmp-step-<step>-<pid>-<rand>.snap   being written (never loaded)
    <root>/<run_id>/rank<R>/.tmp-spare-<pid>.snap                 preallocated file for the next write

A snapshot is written under a temporary name and committed by ``rename`` (atomic within a
directory), so a process killed mid-write leaves only a temp file. Every load re-checks
the header, the size and the checksums, so a torn or corrupt file is skipped with a logged
reason instead of being loaded. Snapshots survive the death of the writing process (they
live in tmpfs, not in the process), not a reboot.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_ft._validation import require_number
from lightning_ft.checkpoint import snapshot_format as fmt
from lightning_ft.checkpoint.files import (
    ReadMap,
    WritableMaps,
    close_map,
    delete_file,
    listdir,
    pid_alive,
    prefault_for_write,
    reserve,
)
from lightning_ft.checkpoint.policy import plan_write, spare_needed
from lightning_ft.checkpoint.snapshot_format import SnapshotError

log = logging.getLogger(__name__)

ENV_SNAPSHOT_DIR = "LIGHTNING_FT_SNAPSHOT_DIR"
RUN_ID_ENV_VARS = ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
DEFAULT_RUN_ID = "default"

_COMMITTED = re.compile(r"^step-(\d+)\.snap$")
_TEMP = re.compile(r"^\.tmp-(step-\d+|spare)-(\d+)(?:-[0-9a-f]+)?\.snap$")
_RANK_DIR = re.compile(r"^rank(\d+)$")


def default_root() -> str:
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) else tempfile.gettempdir()
    return os.path.join(base, "lightning_ft")


def resolve_root(root: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Explicit ``root``, else ``$LIGHTNING_FT_SNAPSHOT_DIR``, else ``/dev/shm/lightning_ft``."""
    env = os.environ if environ is None else environ
    if root is not None:
        return os.fspath(root)
    return env.get(ENV_SNAPSHOT_DIR) or default_root()


def resolve_run_id(run_id: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Explicit ``run_id``, else the first set of LIGHTNING_FT_RUN_ID, TORCHELASTIC_RUN_ID,
    SLURM_JOB_ID, else ``"default"``; made safe as a single directory name."""
    env = os.environ if environ is None else environ
    if run_id is None:
        run_id = next((env[k] for k in RUN_ID_ENV_VARS if env.get(k)), DEFAULT_RUN_ID)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(run_id))
    if safe in ("", ".", ".."):
        raise ValueError(f"run_id={run_id!r} is not usable as a directory name")
    return safe


def current_rank(environ: Mapping[str, str] | None = None) -> int:
    """Global rank: the initialized process group's, else $RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ if environ is None else environ
    return int(env.get("RANK", "0") or 0)


def ensure_writable_root(root: str) -> None:
    """Create ``root`` if needed and prove it writable; raise ValueError naming ``root`` if not."""
    created = not os.path.isdir(root)
    try:
        os.makedirs(root, exist_ok=True)
        if created and os.path.abspath(root) == os.path.abspath(default_root()):
            # the default root is shared by all users of the host, like /tmp; run dirs are 0700
            os.chmod(root, 0o1777)
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


class SnapshotStore:
    """Snapshots of one rank of one run under ``<root>/<run_id>/rank<rank>``.

    Args:
        root: base directory (default ``$LIGHTNING_FT_SNAPSHOT_DIR`` or ``/dev/shm/lightning_ft``).
        run_id: scope (default from LIGHTNING_FT_RUN_ID / TORCHELASTIC_RUN_ID / SLURM_JOB_ID, else "default").
        rank: the rank whose directory this store writes (default: ``current_rank()``).
        keep_last: committed snapshots kept in this rank's directory (>= 1).

    Not thread safe; one writer per rank directory.
    """

    def __init__(self, root: str | os.PathLike | None = None, run_id: str | None = None,
                 rank: int | None = None, keep_last: int = 2) -> None:
        require_number("keep_last", keep_last, integer=True, minimum=1, inclusive=True)
        rank = current_rank() if rank is None else rank
        require_number("rank", rank, integer=True, inclusive=True)
        self.root = resolve_root(root)
        ensure_writable_root(self.root)
        self.run_id = resolve_run_id(run_id)
        self.rank = rank
        self.keep_last = keep_last
        self.run_dir = os.path.join(self.root, self.run_id)
        self.rank_dir = self._rank_dir(rank)
        self._maps = WritableMaps()
        self._spare: str | None = None  # our preallocated file, if any
        self._saving = False
        self.remove_stale_temp_files()

    # ------------------------------------------------------------------ listing
    def _rank_dir(self, rank: int) -> str:
        return os.path.join(self.run_dir, f"rank{rank}")

    def _final_path(self, step: int, rank: int | None = None) -> str:
        return os.path.join(self._rank_dir(self.rank if rank is None else rank), f"step-{step:012d}.snap")

    def ranks(self) -> list[int]:
        """Ranks that have a directory in this run."""
        names = listdir(self.run_dir)
        return sorted(int(m.group(1)) for m in map(_RANK_DIR.match, names) if m)

    def list(self, rank: int | None = None) -> list[SnapshotInfo]:
        """Committed snapshots of ``rank`` (default: this store's), newest step first. Not verified."""
        rank = self.rank if rank is None else rank
        directory = self._rank_dir(rank)
        names = listdir(directory)
        infos = []
        for name in names:
            m = _COMMITTED.match(name)
            if not m:
                continue
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            infos.append(SnapshotInfo(int(m.group(1)), rank, self.run_id, path, st.st_size, st.st_mtime))
        return sorted(infos, key=lambda i: i.step, reverse=True)

    # ------------------------------------------------------------------ checking
    def verify(self, info: SnapshotInfo) -> str | None:
        """None if the snapshot is intact, else the reason it must not be loaded."""
        try:
            with ReadMap(info.path) as (mm, size):
                fmt.verify(mm, size)
        except (SnapshotError, OSError, ValueError) as exc:
            return str(exc)
        return None

    def latest(self, rank: int | None = None) -> SnapshotInfo | None:
        """Newest intact snapshot of ``rank`` (default: own); torn/corrupt ones are logged and skipped."""
        for info in self.list(rank):
            reason = self.verify(info)
            if reason is None:
                return info
            log.warning("skipping snapshot %s (step %d): %s", info.path, info.step, reason)
        return None

    def readable_steps(self, include_peers: bool = False) -> list[int]:
        """Steps with an intact snapshot in this rank's directory, or (``include_peers``) in any
        rank directory of this run on this host. Ascending."""
        ranks = [self.rank] + ([r for r in self.ranks() if r != self.rank] if include_peers else [])
        found: set[int] = set()
        for rank in ranks:
            for info in self.list(rank):
                if info.step in found:
                    continue
                reason = self.verify(info)
                if reason is None:
                    found.add(info.step)
                else:
                    log.warning("skipping snapshot %s (step %d): %s", info.path, info.step, reason)
        return sorted(found)

    def find(self, step: int, include_peers: bool = False) -> SnapshotInfo | None:
        """An intact snapshot at ``step``: this rank's own if possible, else (``include_peers``) a peer's."""
        ranks = [self.rank] + ([r for r in self.ranks() if r != self.rank] if include_peers else [])
        for rank in ranks:
            for info in self.list(rank):
                if info.step != step:
                    continue
                reason = self.verify(info)
                if reason is None:
                    return info
                log.warning("skipping snapshot %s (step %d): %s", info.path, info.step, reason)
        return None

    def created(self, info: SnapshotInfo) -> float:
        """When the snapshot was taken (wall clock, from its header: copies keep it)."""
        with open(info.path, "rb") as f:
            return fmt.Header.unpack(f.read(fmt.HEADER_SIZE)).created

    # ------------------------------------------------------------------ load
    def load(self, info: SnapshotInfo | None = None) -> Any:
        """Verify and load a snapshot (default: ``latest()``); tensors are fresh CPU copies.

        Raises FileNotFoundError if there is no snapshot, SnapshotError if it is corrupt.
        The metadata is unpickled: only load snapshots this user wrote (the store checks
        file ownership), as with ``torch.load(weights_only=False)``.
        """
        if info is None:
            info = self.latest()
            if info is None:
                raise FileNotFoundError(f"no intact snapshot in {self.rank_dir}")
        start = time.perf_counter()
        with ReadMap(info.path) as (mm, size):
            header = fmt.verify(mm, size)
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
        copied (the caller may keep training right after). Older snapshots beyond
        ``keep_last`` are removed after the commit.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if self._saving:
            # e.g. save() called from a signal handler that interrupted a periodic save
            raise RuntimeError("SnapshotStore.save() re-entered while a save is in progress")
        self._saving = True
        try:
            return self._save(state, step, reason)
        finally:
            self._saving = False

    def _save(self, state: Any, step: int, reason: str) -> SnapshotInfo:
        start = time.perf_counter()
        enc = fmt.encode(state)
        self._make_dirs()
        self._maps.drop_stale(self.rank_dir)
        existing = {info.step: info for info in self.list()}
        plan = plan_write(existing, step, self.keep_last)
        tmp = self._temp_path(step)
        final = self._final_path(step)
        if plan.recycle is not None:
            # Leaves the committed set first: if we die mid-write it is only a stale temp file.
            os.rename(existing[plan.recycle].path, tmp)
            source = "recycled"
        elif self._spare is not None and os.path.exists(self._spare):
            os.rename(self._spare, tmp)
            self._spare = None
            source = "preallocated"
        else:
            source = "new"
        recycled = source != "new"
        fd = os.open(tmp, os.O_RDWR) if recycled else os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
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
            fmt.copy_tensors(enc, data)
            sums = fmt.block_sums(data)
            del data
            head = fmt.finish(enc, step, time.time(), sums)
            mm[: len(head)] = head
            self._maps.forget(final)
            os.replace(tmp, final)
        except BaseException:
            if mm is not None:
                close_map(mm)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(fd)
        self._maps.keep(key, mm)
        committed = len((set(existing) - {plan.recycle}) | {step})
        for old in plan.delete_after_commit:
            committed -= 1
            if self._spare is None and spare_needed(committed, self.keep_last):
                # keep_last=1: the replaced snapshot becomes the next write's target
                self._spare = self._spare_path()
                os.rename(existing[old].path, self._spare)
            else:
                self._delete_path(existing[old].path)
        seconds = time.perf_counter() - start
        size = enc.file_size
        log.debug("saved snapshot step=%d rank=%d run=%s%s: %s in %.3f s (%.2f GB/s, %s file) -> %s",
                 step, self.rank, self.run_id, f" ({reason})" if reason else "", _fmt_size(size), seconds,
                 size / max(seconds, 1e-9) / 1e9, source, final)
        return SnapshotInfo(step, self.rank, self.run_id, final, size, time.time())

    def _make_dirs(self) -> None:
        for directory in (self.run_dir, self.rank_dir):
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass

    def _spare_path(self) -> str:
        return os.path.join(self.rank_dir, f".tmp-spare-{os.getpid()}.snap")

    def spare_needed(self) -> bool:
        """True if the next ``save`` would write a fresh file (nothing to recycle, no spare)."""
        if self._spare is not None and os.path.exists(self._spare):
            return False
        return spare_needed(len(self.list()), self.keep_last)

    def preallocate(self, nbytes: int) -> float:
        """Create (or resize) a spare file of ``nbytes`` with all pages allocated and mapped.

        The next ``save`` that cannot recycle a committed file writes into it, so an emergency
        snapshot never pays for tmpfs page allocation (the dominant cost of a fresh file,
        ~5-10x the copy). Costs one state-size of shared memory until used. Returns seconds.
        """
        start = time.perf_counter()
        self._make_dirs()
        path = self._spare if self._spare is not None and os.path.exists(self._spare) else self._spare_path()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            nbytes = max(nbytes, os.fstat(fd).st_size)  # never shrink (see _save)
            reserve(fd, nbytes)
            key, mm = self._maps.map(fd, nbytes, populate=False)
            prefault_for_write(mm)
        except BaseException:
            os.close(fd)
            self._spare = None
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
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
        self._delete_path(info.path)
        log.debug("removed snapshot step=%d rank=%d: %s", info.step, info.rank, info.path)

    def discard_newer_than(self, step: int) -> list[int]:
        """Remove this rank's snapshots newer than ``step`` (an abandoned timeline after a
        resume from an older state); returns the removed steps."""
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
        with open(info.path, "rb") as f:
            blob = f.read()
        header = fmt.verify(blob, len(blob))
        return blob[: header.file_size] if len(blob) > header.file_size else blob

    def write_bytes(self, blob: bytes | bytearray | memoryview) -> SnapshotInfo:
        """Verify a blob from ``read_bytes`` (possibly another rank/host) and commit it as this
        rank's snapshot of the step recorded inside it. Raises SnapshotError if it is damaged."""
        header = fmt.verify(blob, len(memoryview(blob)))
        blob = memoryview(blob)[: header.file_size]  # drop any slack of a recycled source file
        self._make_dirs()
        existing = {info.step: info for info in self.list()}
        plan = plan_write(existing, header.step, self.keep_last)
        tmp = self._temp_path(header.step)
        final = self._final_path(header.step)
        try:
            with open(tmp, "xb") as f:
                f.write(blob)
            os.chmod(tmp, 0o600)
            self._maps.forget(final)
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        # nothing was recycled, so the would-be-recycled file is pruned like any other
        for old in [*plan.delete_after_commit, *([plan.recycle] if plan.recycle not in (None, header.step) else [])]:
            self._delete_path(existing[old].path)
        log.info("committed received snapshot step=%d rank=%d run=%s: %s -> %s",
                 header.step, self.rank, self.run_id, _fmt_size(header.file_size), final)
        return SnapshotInfo(header.step, self.rank, self.run_id, final, header.file_size, time.time())

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release cached memory maps (files stay)."""
        self._maps.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
