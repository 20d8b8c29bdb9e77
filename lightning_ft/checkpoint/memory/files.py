"""The file layer of the snapshot store: safe file operations and the memory maps they use.

:class:`~lightning_ft.checkpoint.memory.store.SnapshotStore` decides what to write where; this module
knows how a snapshot file is allocated (never a SIGBUS on a full tmpfs), mapped, recycled
without re-faulting its pages, and mapped again for reading, and which files may be trusted at
all (which directories: :mod:`lightning_ft.private_dirs`, with the words of
:data:`lightning_ft.checkpoint.memory.roots.SNAPSHOT_DIRS`):

* files are created with ``O_EXCL|O_NOFOLLOW`` and mode 0600 from the start; an existing file
  is opened with ``O_NOFOLLOW`` and used only if it is a regular file of ours (one link, for
  writing), so a planted symlink is never followed and never written through.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
from typing import Any

from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.format import SnapshotError

log = logging.getLogger(__name__)

MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux value; Python < 3.13 lacks the name

FileKey = tuple[int, int]  # (st_dev, st_ino)


_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


# ---------------------------------------------------------------------------------------------- trust


def snapshot_file_problem(st: os.stat_result, my_uid: int, for_write: bool) -> str | None:
    """Why a file (``lstat``/``fstat`` result) must not be read or written as a snapshot; None if fine."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (not followed)"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != my_uid:
        return f"is owned by uid {st.st_uid}, not by this user ({my_uid})"
    if for_write and st.st_nlink != 1:
        # writing would change the file under its other names too
        return f"has {st.st_nlink} hard links"
    return None


def open_snapshot_file(path: str, for_write: bool) -> tuple[int, os.stat_result]:
    """Open an existing snapshot file without following a symlink and check it (SnapshotError if unsafe)."""
    try:
        fd = os.open(path, (os.O_RDWR if for_write else os.O_RDONLY) | _NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SnapshotError(f"{path} is a symbolic link (not followed)") from None
        raise
    try:
        st = os.fstat(fd)
        problem = snapshot_file_problem(st, os.getuid(), for_write)
        if problem is not None:
            raise SnapshotError(f"{path} {problem}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def create_snapshot_file(path: str) -> int:
    """Create ``path`` read-write with mode 0600; fails if anything (a symlink too) is already there."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)


def read_snapshot_bytes(path: str) -> bytes:
    """The whole content of a snapshot file of ours (symlinks and other users' files refused)."""
    fd, st = open_snapshot_file(path, for_write=False)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def listdir(directory: str) -> list[str]:
    # Unreadable peer directories must not crash one rank while the others wait in a collective.
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot list %s: %s", directory, exc)
        return []


def reserve(fd: int, size: int) -> None:
    """Give the file ``size`` bytes of allocated space (never shrinks it).

    On tmpfs a write through a mapping into a hole that cannot get a page raises SIGBUS and
    kills the process, so space is allocated up front, where a full /dev/shm is a clean
    ENOSPC instead. Measured on tmpfs: fallocate + copy costs the same as faulting the pages
    in during the copy.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)


def prefault_for_write(mm: mmap.mmap) -> None:
    """Allocate every page of a shared file mapping and make it writable in our page tables.

    MAP_POPULATE is not enough for fresh tmpfs pages: it maps them read-only, and the first
    write to each page then takes a fault (measured: a 1 GiB copy 0.16 s instead of 0.08 s).
    MADV_POPULATE_WRITE (Linux 5.14+) pre-faults for writing in one call; older kernels get
    one written byte per page, which is slower but has the same effect.
    """
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        fmt.frombuffer_u8(mm, 0, len(mm))[:: mmap.PAGESIZE].fill_(0)


def close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a tensor view still exports it; it is freed with the last reference


class WritableMaps:
    """Writable maps of the snapshot files this store wrote, by (dev, inode).

    Reusing the map of a file that is recycled for the next snapshot skips re-faulting
    ~250k pages per GiB. A map keeps an unlinked tmpfs file's memory alive, so maps are
    dropped before their file goes (:meth:`forget`) and when another writer replaced or
    pruned the file (:meth:`drop_stale`).
    """

    def __init__(self) -> None:
        self._maps: dict[FileKey, mmap.mmap] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def map(self, fd: int, size: int, populate: bool) -> tuple[FileKey, mmap.mmap]:
        """A read-write shared map of ``size`` bytes of ``fd``: the cached one when it fits."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        mm = self._maps.pop(key, None)
        if mm is not None and len(mm) != size:
            close_map(mm)
            mm = None
        if mm is None:
            flags = mmap.MAP_SHARED | (MAP_POPULATE if populate else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return key, mm

    def keep(self, key: FileKey, mm: mmap.mmap) -> None:
        self._maps[key] = mm

    def forget(self, path: str) -> None:
        """Drop the map of ``path`` (before the file is replaced or removed)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        mm = self._maps.pop((st.st_dev, st.st_ino), None)
        if mm is not None:
            close_map(mm)

    def drop_stale(self, directory: str) -> None:
        """Drop maps of files that are no longer in ``directory``."""
        if not self._maps:
            return
        try:
            live = {entry.inode() for entry in os.scandir(directory)}
        except OSError:
            live = set()
        for key in [k for k in self._maps if k[1] not in live]:
            close_map(self._maps.pop(key))

    def close(self) -> None:
        for mm in self._maps.values():
            close_map(mm)
        self._maps.clear()


def unlink_quietly(path: str) -> None:
    """Remove ``path``; a file already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fmt_size(nbytes: int) -> str:
    """``nbytes`` in MiB, for log lines."""
    return f"{nbytes / 2**20:.1f} MiB"


def delete_file(maps: WritableMaps, path: str) -> None:
    """Remove ``path`` (and its map); a file already gone is fine."""
    maps.forget(path)
    unlink_quietly(path)


class ReadMap:
    """Read-only, pre-faulted map of a snapshot file owned by this user (a symlink is not followed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.mm: mmap.mmap | None = None

    def __enter__(self) -> tuple[mmap.mmap, int]:
        self.fd, st = open_snapshot_file(self.path, for_write=False)
        try:
            if st.st_size < fmt.HEADER_SIZE:
                raise SnapshotError(f"file too short ({st.st_size} bytes; torn/truncated)")
            self.mm = mmap.mmap(self.fd, st.st_size, flags=mmap.MAP_SHARED | MAP_POPULATE, prot=mmap.PROT_READ)
        except BaseException:
            os.close(self.fd)
            raise
        return self.mm, st.st_size

    def __exit__(self, *exc: Any) -> None:
        if self.mm is not None:
            close_map(self.mm)
        os.close(self.fd)
