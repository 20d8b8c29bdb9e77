"""Checking and loading committed snapshots: nothing is loaded that is not intact and this job's.

Every load re-checks the header, the size, the checksums and that the file name's step is the
header's, so a torn, corrupt or renamed file is skipped with a logged reason instead of being
loaded; given an expected identity, snapshots of another run or model are skipped too. No code
from a file runs: the metadata is decoded by an allow-list unpickler (see ``restricted_pickle``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from lightning_ft.checkpoint.identity import ExpectedIdentity, SnapshotIdentity, identity_mismatch
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.files import (
    ReadMap,
    close_map,
    fmt_size,
    open_snapshot_file,
    read_snapshot_bytes,
)
from lightning_ft.checkpoint.memory.format import SnapshotError
from lightning_ft.checkpoint.memory.listing import SnapshotInfo, SnapshotListing, SnapshotScan

log = logging.getLogger(__name__)


def renamed(info: SnapshotInfo, header: fmt.Header) -> str | None:
    """Why a file whose name says another step than its header must not be loaded (None: it does not)."""
    if header.step == info.step:
        return None
    return f"its file name says step {info.step} but its header says step {header.step} (renamed or planted file)"


def _log_skip(info: SnapshotInfo, reason: str) -> None:
    log.warning("skipping snapshot %s (step %d): %s", info.path, info.step, reason)


#: what identifies one content of a file: any write or rename moves its ctime (a recycled file
#: also gets another name), so a key seen before names bytes already checked
FileKey = tuple[str, int, int, int, int, int]
_VERIFIED_KEYS = 64


def file_key(path: str, st: os.stat_result) -> FileKey:
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class SnapshotReader:
    """Verifies, finds and loads the snapshots ``listing`` lists (this rank's and its peers')."""

    def __init__(self, listing: SnapshotListing) -> None:
        self._listing = listing
        # Files whose data region passed its block sums, so that a recovery that scans, finds
        # and sends one snapshot sums its gigabytes once, not three times. Loading (decode)
        # always verifies again: that is what a resume trusts.
        self._verified: dict[FileKey, None] = {}

    def _remember_verified(self, key: FileKey) -> None:
        self._verified[key] = None
        while len(self._verified) > _VERIFIED_KEYS:
            del self._verified[next(iter(self._verified))]

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
            refusal = renamed(info, header)
            if refusal is not None:
                return refusal, False
            if expect is not None:
                mismatch = identity_mismatch(found, expect)
                if mismatch is not None:
                    return mismatch, True
            key = file_key(info.path, os.stat(info.path, follow_symlinks=False))
            if key in self._verified:
                return None, False
            with ReadMap(info.path) as (mm, size):
                if fmt.check_body(mm, size) != header:
                    return "it changed while it was being checked", False
                fmt.check_data(mm, header)
            self._remember_verified(key)
        except (SnapshotError, OSError, ValueError) as exc:
            return str(exc), False
        return None, False

    def verify(self, info: SnapshotInfo, expect: ExpectedIdentity | None = None) -> str | None:
        """None if the snapshot is intact (and fits ``expect`` when given), else the reason it must not be loaded."""
        return self._check(info, expect)[0]

    def latest(self, rank: int | None = None, expect: ExpectedIdentity | None = None) -> SnapshotInfo | None:
        """Newest intact snapshot of ``rank`` (default: own) that fits ``expect``; others are logged and skipped."""
        for info in self._listing.list(rank):
            reason = self.verify(info, expect)
            if reason is None:
                return info
            _log_skip(info, reason)
        return None

    def scan(self, include_peers: bool = False, expect: ExpectedIdentity | None = None) -> SnapshotScan:
        """Intact snapshots in this rank's directory or (``include_peers``) any rank directory of
        this run on this host. Torn or corrupt ones are logged; those of another job or model
        (``expect``) are returned in ``foreign`` for the caller to explain."""
        found: set[int] = set()
        foreign: list[tuple[SnapshotInfo, str]] = []
        for rank in self._listing.ranks_to_read(include_peers):
            for info in self._listing.list(rank):
                if info.step in found:
                    continue
                reason, is_foreign = self._check(info, expect)
                if reason is None:
                    found.add(info.step)
                elif is_foreign:
                    foreign.append((info, reason))
                else:
                    _log_skip(info, reason)
        foreign = sorted((f for f in foreign if f[0].step not in found), key=lambda f: f[0].step, reverse=True)
        return SnapshotScan(sorted(found), foreign)

    def readable_steps(self, include_peers: bool = False, expect: ExpectedIdentity | None = None) -> list[int]:
        """Steps with an intact snapshot (fitting ``expect`` when given) in this rank's directory,
        or (``include_peers``) in any rank directory of this run on this host. Ascending."""
        result = self.scan(include_peers, expect)
        for info, reason in result.foreign:
            _log_skip(info, reason)
        return result.readable

    def readable_in_every_rank_dir(self, expect: ExpectedIdentity | None = None) -> list[SnapshotInfo]:
        """Every intact snapshot fitting ``expect`` in any rank directory of this run on this host,
        each rank's own (sharded state: the directory's rank is whose shards it holds)."""
        found = []
        for rank in self._listing.ranks_to_read(True):
            for info in self._listing.list(rank):
                reason = self.verify(info, expect)
                if reason is None:
                    found.append(info)
                else:
                    _log_skip(info, reason)
        return found

    def find(self, step: int, include_peers: bool = False,
             expect: ExpectedIdentity | None = None) -> SnapshotInfo | None:
        """An intact snapshot at ``step`` fitting ``expect``: this rank's own if possible, else
        (``include_peers``) a peer's."""
        for rank in self._listing.ranks_to_read(include_peers):
            for info in self._listing.list(rank):
                if info.step != step:
                    continue
                reason = self.verify(info, expect)
                if reason is None:
                    return info
                _log_skip(info, reason)
        return None

    def created(self, info: SnapshotInfo) -> float:
        """When the snapshot was taken (wall clock, from its header: copies keep it)."""
        fd, _ = open_snapshot_file(info.path, for_write=False)
        try:
            return fmt.Header.unpack(os.pread(fd, fmt.HEADER_SIZE, 0)).created
        finally:
            os.close(fd)

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
                raise FileNotFoundError(f"no intact snapshot in {self._listing.rank_dir}")
        start = time.perf_counter()
        with ReadMap(info.path) as (mm, size):
            header = fmt.verify(mm, size)
            refusal = renamed(info, header)
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
                 info.step, info.rank, info.run_id, fmt_size(size), seconds, info.path)
        return state

    def read_bytes(self, info: SnapshotInfo) -> bytes:
        """The whole snapshot file as one verified blob, for sending to another host."""
        blob = read_snapshot_bytes(info.path)
        header = fmt.verify(blob, len(blob))
        refusal = renamed(info, header)
        if refusal is not None:
            raise SnapshotError(f"{info.path}: {refusal}")
        return blob[: header.file_size] if len(blob) > header.file_size else blob

    @contextlib.contextmanager
    def bytes_to_send(self, info: SnapshotInfo) -> Iterator[torch.Tensor]:
        """The whole snapshot file, verified, as a uint8 tensor over a private map of it: what
        :meth:`read_bytes` gives, without copying the file into memory twice (reading 1 GiB
        into a fresh ``bytes`` and copying that into a writable buffer cost ~5 s on this
        machine; the send reads the mapped pages of ``/dev/shm`` directly). The map is private
        and writable only so that torch gets a writable buffer: nothing writes to it. Valid
        inside the ``with`` block; a receiver verifies what arrives in any case."""
        fd, st = open_snapshot_file(info.path, for_write=False)
        verified = file_key(info.path, st) in self._verified
        try:
            if st.st_size < fmt.HEADER_SIZE:
                raise SnapshotError(f"{info.path}: file too short ({st.st_size} bytes; torn/truncated)")
            # no MAP_POPULATE: on a private writable map it pre-faults every page for writing,
            # i.e. copies the whole file (1.2 s/GiB, and 1 s more to free the copies)
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the map holds the file
        try:
            header = fmt.check_body(mm, st.st_size) if verified else fmt.verify(mm, st.st_size)
            refusal = renamed(info, header)
            if refusal is not None:
                raise SnapshotError(f"{info.path}: {refusal}")
            view = torch.frombuffer(mm, dtype=torch.uint8, count=header.file_size)
            try:
                yield view
            finally:
                del view
        finally:
            close_map(mm)
