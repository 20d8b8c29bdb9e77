"""Where durable copies go: a local/shared directory or an fsspec URL (``s3://bucket/prefix``).

:class:`DurableTarget` is the whole I/O surface the durable tier needs (write a whole object
atomically, read, size, list, delete); decisions live in :mod:`lightning_ft.checkpoint.tiers`.
Paths given to a target are relative, ``/``-separated, and checked component by component
(:func:`path_parts`): none can lead outside the target, whatever a manifest said.

* :class:`LocalDirTarget`: a private directory of this user (:mod:`lightning_ft.private_dirs`);
  write to a temporary name in the same directory, ``fsync``, then ``rename`` (atomic within a
  directory) and ``fsync`` the directory, so a reader sees the whole object or nothing.
* :class:`FsspecTarget`: one ``put`` of the whole object (``open("wb")`` streams a multipart
  upload on S3; the object exists only once the upload completed, and an interrupted write
  aborts it), so no reader sees a part.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from lightning_ft.private_dirs import DirPurpose, make_private_dir

log = logging.getLogger(__name__)

#: a durable directory and the directories in it, in the words of their errors
DURABLE_DIRS = DirPurpose("durable snapshots", "another persist_to (or LIGHTNING_FT_PERSIST_TO)")


def path_parts(path: str) -> list[str]:
    """The components of a relative ``/``-separated target path (none for ``""``: the target
    itself). ValueError for a path that could name something outside the target: absolute, an
    empty, ``.`` or ``..`` component, a backslash or a NUL."""
    parts = path.split("/") if path else []
    for part in parts:
        if part in ("", ".", "..") or "\\" in part or "\0" in part:
            raise ValueError(f"durable path {path!r}: component {part!r} is not a plain name")
    return parts


class FileRanges:
    """Part of a local file to store, as ``(offset, length)`` ranges (``ranges()`` may pace,
    hash or cancel as it goes); a target may copy them kernel-side from ``fd`` or write the
    mapped bytes ``view(offset, length)``."""

    fd: int

    def ranges(self) -> Iterator[tuple[int, int]]:
        raise NotImplementedError

    def view(self, offset: int, length: int) -> memoryview:
        raise NotImplementedError

    def __iter__(self) -> Iterator[memoryview]:
        for offset, length in self.ranges():
            yield self.view(offset, length)


#: file offsets, lengths and buffer addresses of direct writes are multiples of this (the
#: largest logical block size in use; FileRanges hands out ranges at multiples of 64 KiB of a
#: page-aligned map)
DIRECT_ALIGN = 4096


#: how a filesystem says it cannot do direct I/O (at fcntl or at the first write)
_DIRECT_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False if the filesystem refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as exc:
        if exc.errno not in _DIRECT_REFUSED:
            raise
        return False
    return True


#: filesystems on a local block device, where direct I/O was measured to cut an upload's CPU
#: (benchmarks/RESULTS.md) and streams at the disk's rate. Elsewhere (NFS, Lustre, FUSE, tmpfs,
#: overlay, unknown) each direct write may wait for a server round trip or is cached anyway, so
#: uploads go through the page cache as before.
DIRECT_IO_FILESYSTEMS = frozenset({"ext4", "ext3", "xfs", "btrfs", "f2fs"})


def filesystem_type(path: str, mountinfo: str) -> str | None:
    """The type of the filesystem mounted at the longest mount point containing ``path``
    (absolute, symlinks resolved), from ``/proc/self/mountinfo`` text; None if none matches."""
    best, fstype = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        # the kernel writes a space, tab, newline or backslash in a mount point as \ooo
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        after = line.split(" - ", 1)[1].split()
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= best and after:
            best, fstype = len(mount_point), after[0]
    return fstype


def direct_io_default(directory: str) -> bool:
    """Whether uploads into ``directory`` use direct I/O: only on a local block filesystem."""
    try:
        with open("/proc/self/mountinfo") as f:
            fstype = filesystem_type(os.path.realpath(directory), f.read())
    except OSError:
        return False
    return fstype in DIRECT_IO_FILESYSTEMS


def _copy_ranges(fd: int, source: FileRanges, name: str, direct_io: bool = True) -> int:
    """Copy ``source``'s ranges to ``fd`` at the same offsets; returns the bytes copied.

    With ``direct_io``, block-aligned ranges are written with O_DIRECT straight from the
    source's map: the bytes bypass the page cache, so a multi-GiB shard neither evicts the
    training job's cached data nor costs a kernel copy plus write-back on a core the training
    shares (measured in benchmarks/RESULTS.md). A tail shorter than a block, a filesystem that
    refuses O_DIRECT (EINVAL/EOPNOTSUPP at fcntl or at the first write), or ``direct_io=False``
    goes through ``sendfile``, kernel to kernel. The caller fsyncs either way.
    """
    direct = direct_io and _set_direct(fd, True)
    written = direct_bytes = 0
    for offset, length in source.ranges():
        done = 0
        if direct:
            aligned = length - length % DIRECT_ALIGN
            try:
                while done < aligned:
                    wrote = os.pwrite(fd, source.view(offset + done, aligned - done), offset + done)
                    if wrote == 0:
                        raise OSError(f"no progress writing {name} at byte {offset + done}")
                    done += wrote
            except OSError as exc:
                if exc.errno not in _DIRECT_REFUSED:
                    raise
                log.debug("direct writes to %s refused (%s); copying through the page cache", name, exc)
            direct_bytes += done
            if done < length:
                # a tail shorter than a block, or direct writes refused: buffered from here on
                _set_direct(fd, False)
                direct = False
        if done < length:
            os.lseek(fd, offset + done, os.SEEK_SET)  # sendfile writes at the file position; pwrite did not move it
        while done < length:
            sent = os.sendfile(fd, source.fd, offset + done, length - done)
            if sent == 0:
                raise OSError(f"source file ended after {offset + done} bytes")
            done += sent
        written += length
    log.debug("copied %d bytes to %s (%d with direct I/O)", written, name, direct_bytes)
    return written


class DurableTarget:
    """Durable storage for snapshot shards, markers and manifests (relative ``/``-separated paths)."""

    url: str
    #: whether an upload is read back and verified as a snapshot before its marker is written. A
    #: local directory's read-back right after fsync checks the same kernel's view of the file
    #: and proves little more than the size check; an object store's read-back checks what the server
    #: stored. Every download is checked against the manifest and verified whole either way.
    read_back_verifies: bool = True

    def write(self, path: str, chunks: Iterable[bytes | memoryview] | FileRanges) -> int:
        """Store ``chunks`` as the object ``path``, all or nothing; returns the bytes written."""
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        """The whole object (FileNotFoundError if it is not there)."""
        raise NotImplementedError

    def read_chunks(self, path: str, chunk_bytes: int) -> Iterable[bytes]:
        """The object in chunks (to verify it without holding it whole)."""
        raise NotImplementedError

    def size(self, path: str) -> int | None:
        """Size in bytes, None if the object does not exist."""
        raise NotImplementedError

    def list(self, path: str) -> list[str]:
        """Names directly inside the directory/prefix ``path`` (empty if there is none)."""
        raise NotImplementedError

    def delete(self, path: str) -> None:
        """Remove an object or a whole directory/prefix; one already gone is fine."""
        raise NotImplementedError

    def describe(self, path: str) -> str:
        """``path`` as a user would write it (for messages)."""
        return f"{self.url.rstrip('/')}/{path}"


class LocalDirTarget(DurableTarget):
    """A directory (local disk or a shared filesystem) of this user that nobody else can write
    (ValueError naming it, its owner and mode otherwise), created with mode 0700."""

    read_back_verifies = False

    def __init__(self, directory: str, direct_io: bool | None = None) -> None:
        """``direct_io``: write shards with O_DIRECT; None: when the directory is on a local
        block filesystem (:data:`DIRECT_IO_FILESYSTEMS`), decided once here."""
        self.directory = os.path.abspath(directory)
        self.url = self.directory
        # another user's directory could hold shards of its making under this run's name
        make_private_dir(self.directory, "durable directory", DURABLE_DIRS, parents=True)
        self.direct_io = direct_io_default(self.directory) if direct_io is None else bool(direct_io)
        log.debug("durable directory %s: shards written %s", self.directory,
                  "with direct I/O" if self.direct_io else "through the page cache")

    def _full(self, path: str) -> str:
        return os.path.join(self.directory, *path_parts(path))

    def _make_parents(self, full: str) -> None:
        parent = os.path.dirname(full)
        missing = []
        while not os.path.isdir(parent) and parent != self.directory:
            missing.append(parent)
            parent = os.path.dirname(parent)
        for directory in reversed(missing):
            make_private_dir(directory, "durable directory", DURABLE_DIRS)

    def write(self, path: str, chunks: Iterable[bytes | memoryview] | FileRanges) -> int:
        full = self._full(path)
        self._make_parents(full)
        # the temp name never matches what readers list (see DurableTier): a torn write is ignored
        tmp = os.path.join(os.path.dirname(full), f".tmp-{os.path.basename(full)}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        written = 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if isinstance(chunks, FileRanges):
                written = _copy_ranges(fd, chunks, tmp, self.direct_io)
            else:
                with os.fdopen(os.dup(fd), "wb") as f:
                    for chunk in chunks:
                        f.write(chunk)
                        written += len(chunk)
            os.fsync(fd)
            # the fd is released even when close reports an error (NFS: EIO at close), so it
            # must not be closed again below (the number may already belong to another thread)
            closing, fd = fd, -1
            os.close(closing)
            os.replace(tmp, full)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dfd = os.open(os.path.dirname(full), os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename itself survives a power loss
        finally:
            os.close(dfd)
        return written

    def read(self, path: str) -> bytes:
        with open(self._full(path), "rb") as f:
            return f.read()

    def read_chunks(self, path: str, chunk_bytes: int) -> Iterable[bytes]:
        with open(self._full(path), "rb") as f:
            while chunk := f.read(chunk_bytes):
                yield chunk

    def size(self, path: str) -> int | None:
        try:
            return os.stat(self._full(path)).st_size
        except FileNotFoundError:
            return None

    def list(self, path: str) -> list[str]:
        try:
            return os.listdir(self._full(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, path: str) -> None:
        import shutil

        full = self._full(path)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.unlink(full)
            except FileNotFoundError:
                pass


class FsspecTarget(DurableTarget):
    """Any fsspec filesystem (``s3://bucket/prefix`` through s3fs); credentials and endpoint come
    from the usual places (environment, ``~/.aws``, ``storage_options``)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise ValueError(f"persist_to={url!r} needs fsspec: pip install 'lightning-ft[s3]' "
                             "(or pip install fsspec s3fs)") from exc
        protocol = url.split("://", 1)[0]
        try:
            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:
            hint = " pip install s3fs" if protocol in ("s3", "s3a") else ""
            raise ValueError(f"persist_to={url!r}: fsspec cannot open the {protocol!r} scheme ({exc}).{hint}") from exc
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")

    def _full(self, path: str) -> str:
        return "/".join([self.root, *path_parts(path)])

    def write(self, path: str, chunks: Iterable[bytes | memoryview] | FileRanges) -> int:
        written = 0
        f = self.fs.open(self._full(path), "wb")
        try:
            for chunk in chunks:
                f.write(chunk)
                written += len(chunk)
        except BaseException:
            # not `with`: closing a buffered fsspec file commits what was written so far (a
            # partial object); discard aborts the multipart upload and nothing appears
            try:
                f.discard()
            finally:
                f.closed = True  # keeps close() and __del__ from committing the part
            raise
        f.close()
        self.fs.invalidate_cache(self._full(path).rsplit("/", 1)[0])
        return written

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(self._full(path))

    def read_chunks(self, path: str, chunk_bytes: int) -> Iterable[bytes]:
        with self.fs.open(self._full(path), "rb", block_size=chunk_bytes) as f:
            while chunk := f.read(chunk_bytes):
                yield chunk

    def size(self, path: str) -> int | None:
        try:
            return int(self.fs.info(self._full(path))["size"])
        except FileNotFoundError:
            return None

    def list(self, path: str) -> list[str]:
        full = self._full(path)
        self.fs.invalidate_cache(full)  # other ranks write here; a cached listing would be stale
        try:
            entries = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != full})

    def delete(self, path: str) -> None:
        full = self._full(path)
        try:
            self.fs.rm(full, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(full.rsplit("/", 1)[0])


def open_target(url: str, storage_options: Mapping[str, Any] | None = None) -> DurableTarget:
    """A directory path (or ``file://``) -> :class:`LocalDirTarget`; ``<scheme>://`` -> :class:`FsspecTarget`."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"persist_to must be a directory or an fsspec URL, got {url!r}")
    if url.startswith("file://"):
        return LocalDirTarget(url[len("file://"):])
    if "://" not in url:
        return LocalDirTarget(url)
    return FsspecTarget(url, storage_options)
