"""The durable tier: committed snapshot files copied verbatim to a directory or object store.

Layout under the target (``persist_to``)::

    <run_id>/steps/step-<12 digits>/<timeline>/rank<R>.snap        one rank's shard (the snapshot file)
    <run_id>/steps/step-<12 digits>/<timeline>/rank<R>.done.json   its done marker (written after verify)
    <run_id>/manifests/step-<12 digits>.json                       the step is complete (written last)

A timeline is one stretch of training between two resumes (:mod:`lightning_ft.checkpoint.tiers`);
markers and manifests name it in their field ``segment``. Markers and manifests name their run
and model and are sealed with the job secret when there is one; what they say is checked before
it names a path (:mod:`.records`). One of another run or model, or whose seal fails, is skipped
with a warning that says which and why.

Protocol (decisions in :mod:`lightning_ft.checkpoint.tiers`): each rank uploads its shard
(temp name + rename, or one put), checks its size (an object store's is read back and checked
against the snapshot's own checksums), then writes its done marker (rank, step, timeline, world
size, bytes, the CRC-32 of the shard's snapshot header). Whoever then sees every rank's marker
of one timeline writes the step's manifest; readers read only manifests, so a partial step is
never seen. Retention (:func:`lightning_ft.checkpoint.tiers.plan_durable_retention`) keeps the
newest ``keep_last`` complete steps and never removes what the newest manifest names.

Shards are downloaded into the local snapshot root (``SnapshotStore.write_bytes``: format and
run id checked) and then loaded by the ordinary verified loader (restricted unpickler).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lightning_ft._clock import monotonic
from lightning_ft.checkpoint.durable import records
from lightning_ft.checkpoint.durable.settings import DEFAULT_PERSIST_KEEP_LAST, DurableSettings
from lightning_ft.checkpoint.durable.targets import DurableTarget, FileRanges, open_target, path_parts
from lightning_ft.checkpoint.identity import ExpectedIdentity
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.files import close_map, open_snapshot_file
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.pacing import bucket_delay
from lightning_ft.checkpoint.tiers import (
    Completion,
    ShardMarker,
    abandoned_manifests,
    complete_steps,
    plan_durable_retention,
    shard_rank_to_fetch,
)
from lightning_ft.schema.signing import Signer, read_secret

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20

_STEP_DIR = re.compile(r"^step-(\d+)$")
_MANIFEST = re.compile(r"^step-(\d+)\.json$")
_MARKER = re.compile(r"^rank(\d+)\.done\.json$")


class UploadCancelled(Exception):
    """An upload passed its deadline (the SIGTERM grace budget) and was abandoned (not durable)."""


def _step_name(step: int) -> str:
    return f"step-{step:012d}"


def shard_checksum(header: fmt.Header) -> str:
    """A shard's checksum in markers and manifests: ``snapshot-crc32:<8 hex digits>``, the CRC-32
    of its snapshot header's fields (stored in the header, :meth:`lightning_ft.checkpoint.memory.format.Header.crc`).

    A shard is a snapshot file, which checks itself: the header's CRC covers the body's CRC
    (identity, block-sum table, metadata), and the block sums cover the data. So the header's
    CRC names one exact snapshot (step, creation time, sizes, content), and a shard is checked
    against its manifest by comparing it and then verifying the whole file
    (:func:`lightning_ft.checkpoint.memory.format.verify`, block sums at memory speed). An upload never reads the
    data on the CPU: a CRC over the shard's bytes had been most of a direct upload's CPU and
    memory traffic competing with training (benchmarks/RESULTS.md). Not a cryptographic digest
    either way: it catches accidental damage only (a torn, truncated, stale or misplaced upload,
    a flipped bit). A job secret seals the markers and manifests that name it (:mod:`.records`),
    not the shard's bytes: whoever can write the storage could still forge a shard with the same
    checksums; what is loaded is read only by the restricted unpickler.
    """
    return f"{records.CHECKSUM_KIND}{header.crc():08x}"


def range_bytes(max_bytes_per_second: float | None) -> int:
    """Bytes per upload range: 1/8 s at the bandwidth bound, at most CHUNK_BYTES, and a multiple
    of 64 KiB so that a target can write every range but the last with direct I/O."""
    if not max_bytes_per_second:
        return CHUNK_BYTES
    return max(1, min(CHUNK_BYTES, int(max_bytes_per_second / 8)) >> 16) << 16


class _ShardSource(FileRanges):
    """A committed snapshot file as the source of one upload: paced ranges of a read-only map.

    Ranges are at most 1/8 s of the bandwidth bound in size (:func:`range_bytes`), paced by a
    token bucket (a burst of one range). The bound is read before every range (``rate()``), so
    a SIGTERM flush can lift it for an upload already running. The target copies the ranges (a
    directory: direct writes from the map or ``sendfile``; fsspec: the mapped bytes); nothing
    here reads the data.
    """

    def __init__(self, fd: int, nbytes: int, rate: Callable[[], float | None], deadline: float | None) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.rate = rate
        self.deadline = deadline
        #: seconds spent waiting for the token bucket (the upload's time minus this: what it
        #: takes unbounded, which the SIGTERM flush runs at)
        self.paced_seconds = 0.0
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._view = memoryview(self._map)

    def view(self, offset: int, length: int) -> memoryview:
        return self._view[offset:offset + length]

    def ranges(self) -> Iterator[tuple[int, int]]:
        offset = 0
        chunk_bytes = range_bytes(self.rate())
        tokens, last = float(chunk_bytes), monotonic()
        while offset < self.nbytes:
            n = min(chunk_bytes, self.nbytes - offset)
            rate = self.rate()
            if rate:
                now = monotonic()
                wait, tokens = bucket_delay(tokens, now - last, rate, float(chunk_bytes), n)
                last = now + wait
                if wait:
                    time.sleep(wait)
                    self.paced_seconds += wait
            if self.deadline is not None and monotonic() > self.deadline:
                raise UploadCancelled(f"deadline passed after {offset} of {self.nbytes} bytes")
            yield offset, n
            offset += n

    def close(self) -> None:
        try:
            self._view.release()
        except BufferError:
            pass  # a slice is still referenced somewhere; the map goes with the last reference
        close_map(self._map)


@dataclass(frozen=True)
class UploadResult:
    """One shard made durable: its marker exists; ``complete`` if this rank then saw every marker."""

    step: int
    nbytes: int
    seconds: float
    complete: bool
    #: of ``seconds``, the time the bandwidth bound made the upload wait
    paced_seconds: float = 0.0

    @property
    def unbounded_bytes_per_second(self) -> float:
        """The rate this upload would have had without the bandwidth bound."""
        return self.nbytes / max(self.seconds - self.paced_seconds, 1e-6)


class DurableTier:
    """The durable copies of one run: upload a shard, publish complete steps, list, fetch, prune.

    Thread safe for one uploader plus readers (every method works on the target only).
    """

    def __init__(self, target: DurableTarget, run_id: str, keep_last: int = DEFAULT_PERSIST_KEEP_LAST,
                 max_bytes_per_second: float | None = None, signer: Signer | None = None) -> None:
        """``signer``: seals and opens markers and manifests (default: none, unsealed)."""
        self.target = target
        if len(path_parts(run_id)) != 1:
            raise ValueError(f"run id {run_id!r} is not usable as a directory name")
        self.run_id = run_id
        self.signer = signer if signer is not None else Signer(None)
        self.keep_last = keep_last
        self.max_bytes_per_second = max_bytes_per_second
        #: (step, monotonic()) of the last manifest this process wrote: when a step became durable
        self.last_published: tuple[int, float] | None = None
        self._reported: set[tuple[str, str]] = set()  # (path, why) of the records skipped so far

    @classmethod
    def from_settings(cls, settings: DurableSettings, run_id: str) -> DurableTier:
        """The tier ``settings`` describe, its records sealed with the job secret when there is one
        (SecretError, a ValueError, when one is configured but unusable)."""
        return cls(open_target(settings.url, settings.storage_options), run_id, settings.keep_last,
                   settings.max_bytes_per_second, Signer(*read_secret()))

    # ------------------------------------------------------------------ paths
    def _timeline_dir(self, step: int, timeline: str) -> str:
        return f"{self.run_id}/steps/{_step_name(step)}/{records.plain_name(timeline, 'timeline')}"

    def shard_path(self, step: int, timeline: str, rank: int) -> str:
        return f"{self._timeline_dir(step, timeline)}/rank{rank}.snap"

    def marker_path(self, step: int, timeline: str, rank: int) -> str:
        return f"{self._timeline_dir(step, timeline)}/rank{rank}.done.json"

    def manifest_path(self, step: int) -> str:
        return f"{self.run_id}/manifests/{_step_name(step)}.json"

    def finished_path(self) -> str:
        return f"{self.run_id}/finished.json"

    # ------------------------------------------------------------------ the run's end
    def mark_finished(self, step: int, epoch: int) -> None:
        """Record that this run's training finished at ``step`` (in ``epoch``): a node started after
        the job ended finds it here, not the last durable step to train on from (OSError: not written)."""
        path = self.finished_path()
        self.target.write(path, [records.encode(self.signer, path, records.finished_record(self.run_id, step, epoch))])

    def finished(self) -> tuple[int, int] | None:
        """(step, epoch) at which this run's training finished, when a job of it recorded that; None
        when none did, the record is not this run's or not authentic (logged), or it cannot be read."""
        path = self.finished_path()
        try:
            raw = self.target.read(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("durable storage %s: cannot read whether the run finished: %s", self.target.url, exc)
            return None
        try:
            run_id, step, epoch = records.parse_finished(records.decode(self.signer, path, raw))
        except (ValueError, KeyError, TypeError) as exc:
            self._skip("finished record", path, str(exc))
            return None
        return (step, epoch) if run_id == self.run_id else None

    # ------------------------------------------------------------------ writing
    def upload(self, info: SnapshotInfo, timeline: str, world_size: int, deadline: float | None = None,
               fd: int | None = None, rate: Callable[[], float | None] | None = None) -> UploadResult:
        """Copy the committed snapshot file ``info`` verbatim as this rank's shard, verify, mark done,
        and publish the step's manifest when every rank's marker is there.

        The caller keeps the file from being overwritten meanwhile (``SnapshotStore.hold``); ``fd``:
        the file opened beforehand (then it may be pruned meanwhile; closed here); ``rate``: the
        bandwidth bound in bytes/s, asked before every range (None from it: unbounded; default:
        this tier's ``max_bytes_per_second``). Raises UploadCancelled past ``deadline``
        (monotonic()), OSError/SnapshotError otherwise; then no marker is written and the
        step is not durable.
        """
        start = monotonic()
        if fd is None:
            fd, st = open_snapshot_file(info.path, for_write=False)
        else:
            st = os.fstat(fd)
        try:
            header = fmt.Header.unpack(os.pread(fd, fmt.HEADER_SIZE, 0))
            if header.step != info.step:
                raise fmt.SnapshotError(f"{info.path} holds step {header.step}, not {info.step} (recycled)")
            nbytes = header.file_size
            if st.st_size < nbytes:
                raise fmt.SnapshotError(f"{info.path} is shorter than its header says")
            checksum = shard_checksum(header)
            model = fmt.read_identity(os.pread(fd, fmt.HEADER_SIZE + header.ident_len, 0), header).model
            source = _ShardSource(fd, nbytes, rate or (lambda: self.max_bytes_per_second), deadline)
            shard = self.shard_path(info.step, timeline, info.rank)
            try:
                self.target.write(shard, source)
            finally:
                source.close()
            paced = source.paced_seconds
        finally:
            os.close(fd)
        self._verify(shard, nbytes, checksum, read_back=self.target.read_back_verifies)
        marker = ShardMarker(info.step, timeline, info.rank, world_size, nbytes, checksum, model)
        path = self.marker_path(info.step, timeline, info.rank)
        self.target.write(path, [records.encode(self.signer, path, records.marker_record(marker, self.run_id))])
        seconds = monotonic() - start
        complete = self.publish_if_complete(info.step, timeline)
        return UploadResult(info.step, nbytes, seconds, complete, paced)

    def _verify(self, path: str, nbytes: int, checksum: str, read_back: bool) -> None:
        size = self.target.size(path)
        if size != nbytes:
            raise OSError(f"{self.target.describe(path)} has {size} bytes after the upload, expected {nbytes}")
        if not read_back:
            return
        try:
            header = fmt.verify_chunks(self.target.read_chunks(path, CHUNK_BYTES), nbytes)
        except fmt.SnapshotError as exc:
            raise OSError(f"{self.target.describe(path)}: damaged when read back after the upload: {exc}") from None
        if shard_checksum(header) != checksum:
            raise OSError(f"{self.target.describe(path)}: read back as another snapshot than was uploaded")

    def _records(self, directory: str, pattern: re.Pattern, what: str,
                 parse: Callable[[Any], tuple[str, Any]]) -> Iterator[tuple[re.Match, str, str, Any]]:
        """(name match, path, run id, record) of every marker or manifest in ``directory`` whose
        name matches ``pattern`` and that is authentic and well formed (:mod:`.records`); any other
        is skipped with a warning, never trusted. OSError if ``directory`` cannot be listed."""
        for name in self.target.list(directory):
            m = pattern.match(name)
            if not m:
                continue
            path = f"{directory}/{name}"
            try:
                run_id, record = parse(records.decode(self.signer, path, self.target.read(path)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self._skip(what, path, str(exc))
                continue
            yield m, path, run_id, record

    def _skip(self, what: str, path: str, why: str) -> None:
        # listing runs after every upload: a record is reported once, not every time
        if (path, why) not in self._reported:
            self._reported.add((path, why))
            log.warning("skipped the durable %s %s: %s", what, self.target.describe(path), why)

    def markers(self, step: int, timeline: str) -> list[ShardMarker]:
        """The valid done markers of one (step, timeline) of this run; others are skipped with a warning."""
        found = []
        for m, path, run_id, marker in self._records(self._timeline_dir(step, timeline), _MARKER, "marker",
                                                     records.parse_marker):
            why = records.record_mismatch(run_id, marker.model, marker.step, ExpectedIdentity(self.run_id))
            if why is not None:
                self._skip("marker", path, why)
            elif (marker.step, marker.timeline, marker.rank) == (step, timeline, int(m.group(1))):
                found.append(marker)
        return found

    def publish_if_complete(self, step: int, timeline: str) -> bool:
        """Write the manifest of ``step`` if every rank of ``timeline`` has its marker; then apply retention."""
        completion = complete_steps(self.markers(step, timeline)).get(step)
        if completion is None:
            return False
        path = self.manifest_path(step)
        # every rank that sees completion writes the same bytes: a race between them is harmless
        self.target.write(path, [records.encode(self.signer, path, records.manifest_record(completion, self.run_id))])
        self.last_published = (step, monotonic())
        log.debug("durable: step %d complete (%d shards of segment %s) -> %s", step, completion.world_size, timeline,
                  self.target.describe(path))
        self.apply_retention()
        return True

    # ------------------------------------------------------------------ reading
    def complete(self, expect: ExpectedIdentity | None = None) -> dict[int, Completion]:
        """Complete durable steps by step, read from the manifests only: those of this run and,
        when ``expect`` names one, of its model. Any other manifest (another run's or model's, a
        seal that fails, a field that is not what it must be) is skipped with a warning that says
        which and why."""
        expected = ExpectedIdentity(self.run_id, expect.model if expect is not None else None)
        result: dict[int, Completion] = {}
        for m, path, run_id, completion in self._records(f"{self.run_id}/manifests", _MANIFEST, "manifest",
                                                         records.parse_manifest):
            ranks = [shard[0] for shard in completion.shards]
            why: str | None
            if completion.step != int(m.group(1)) or ranks != list(range(completion.world_size)):
                why = f"it names step {completion.step} with ranks {ranks} of {completion.world_size}"
            else:
                why = records.record_mismatch(run_id, completion.model, completion.step, expected)
            if why is not None:
                self._skip("manifest", path, why)
                continue
            result[completion.step] = completion
        return result

    def complete_steps(self, attempts: int = 3, expect: ExpectedIdentity | None = None) -> list[int] | None:
        """Complete durable steps (of ``expect``'s model when given), ascending; None when the target
        cannot be listed (after ``attempts`` tries half a second apart; logged): unknown is not
        "nothing there"."""
        listed = self._complete_or_unknown(attempts, expect)
        return None if listed is None else sorted(listed)

    def _complete_or_unknown(self, attempts: int, expect: ExpectedIdentity | None = None
                             ) -> dict[int, Completion] | None:
        """:meth:`complete`, tried ``attempts`` times half a second apart; None (logged) when it cannot be listed."""
        for attempt in range(attempts):
            try:
                return self.complete(expect)
            except OSError as exc:
                log.warning("durable storage %s cannot be listed (attempt %d of %d): %s", self.target.url,
                            attempt + 1, attempts, exc)
                if attempt + 1 < attempts:
                    time.sleep(0.5)
        return None

    def fetch_into(self, step: int, rank: int, store: SnapshotStore,
                   expect: ExpectedIdentity | None = None) -> SnapshotInfo:
        """Download the shard of ``step`` this rank needs (its manifest of this run and of
        ``expect``'s model when given), check size and checksum against the manifest, and commit
        it into ``store`` (which checks the format and run id)."""
        completion = self.complete(expect).get(step)
        if completion is None:
            raise FileNotFoundError(f"no complete durable step {step} under {self.target.describe(self.run_id)}")
        source = shard_rank_to_fetch(rank, completion.world_size)
        _, nbytes, checksum = completion.shards[source]
        path = self.shard_path(step, completion.timeline, source)
        start = monotonic()
        blob = self.target.read(path)
        try:
            if len(blob) != nbytes or shard_checksum(fmt.Header.unpack(blob)) != checksum:
                raise fmt.SnapshotError("size or header checksum")
            info = store.write_bytes(blob)  # verifies the whole file (block sums) and the run id
        except fmt.SnapshotError as exc:
            raise fmt.SnapshotError(f"{self.target.describe(path)} does not match its manifest: {exc}") from None
        log.info("rank %d: downloaded durable step %d (rank %d's shard, %.1f MiB) in %.2f s from %s", rank, step,
                 source, nbytes / 2**20, monotonic() - start, self.target.describe(path))
        return info

    # ------------------------------------------------------------------ pruning
    def apply_retention(self) -> None:
        """Remove what :func:`lightning_ft.checkpoint.tiers.plan_durable_retention` says (manifests first,
        then shards)."""
        try:
            completions = self.complete()
            manifests = {step: c.timeline for step, c in completions.items()}
            step_dirs = [int(m.group(1)) for m in map(_STEP_DIR.match, self.target.list(f"{self.run_id}/steps")) if m]
            kept = sorted(manifests)[-self.keep_last:]
            timelines = {s: self.target.list(f"{self.run_id}/steps/{_step_name(s)}") for s in kept}
            plan = plan_durable_retention(manifests, step_dirs, timelines, self.keep_last)
            for step in plan.manifests:
                self.target.delete(self.manifest_path(step))
            for step in plan.step_dirs:
                self.target.delete(f"{self.run_id}/steps/{_step_name(step)}")
            for step, timeline in plan.timeline_dirs:
                self.target.delete(self._timeline_dir(step, timeline))
        except OSError as exc:
            log.warning("durable retention under %s failed (retried after the next upload): %s", self.target.url, exc)

    def drop_abandoned(self, resumed_step: int, timeline: str, attempts: int = 3) -> list[int]:
        """Training (re)starts at ``resumed_step`` in ``timeline``: remove the manifests of the
        steps :func:`lightning_ft.checkpoint.tiers.abandoned_manifests` names (newer, written by
        another timeline); returns them. Nothing when the storage cannot be listed (see
        :meth:`complete_steps`)."""
        listed = self._complete_or_unknown(attempts)
        if listed is None:
            return []
        steps = abandoned_manifests({step: c.timeline for step, c in listed.items()}, resumed_step, timeline)
        self.drop_manifests(steps)
        return steps

    def drop_manifests(self, steps: list[int]) -> None:
        """Remove manifests (steps of an abandoned timeline); their shards go with retention."""
        for step in steps:
            self.target.delete(self.manifest_path(step))
            log.info("durable: removed manifest of step %d (a timeline this job left)", step)
