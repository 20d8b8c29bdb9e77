"""The durable tier: committed snapshot files copied verbatim to a directory or object store.

Layout under the target (``persist_to``)::

    <run_id>/steps/step-<12 digits>/<segment>/rank<R>.snap        one rank's shard (the snapshot file)
    <run_id>/steps/step-<12 digits>/<segment>/rank<R>.done.json   its done marker (written after verify)
    <run_id>/manifests/step-<12 digits>.json                      the step is complete (written last)

Protocol (decisions in :mod:`.tiers`): each rank uploads its shard (temp name + rename, or one
put), checks its size (an object store's is read back and checked against the snapshot's own
checksums), then writes its done marker (rank, step, segment, world size, bytes, the CRC-32 of
the shard's snapshot header). Whoever then sees every rank's
marker of one segment writes the step's manifest; readers read only manifests, so a partial
step is never seen. Retention (:func:`.tiers.plan_durable_retention`) keeps the newest
``keep_last`` complete steps and never removes what the newest manifest names.

Shards are downloaded into the local snapshot root (``SnapshotStore.write_bytes``: format and
run id checked) and then loaded by the ordinary verified loader (restricted unpickler).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_ft._validation import require_number
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.durable_target import DurableTarget, FileRanges, open_target, storage_options_from_env
from lightning_ft.checkpoint.memory.files import close_map, open_snapshot_file
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.tiers import (
    DEFAULT_MTBF_SECONDS,
    DEFAULT_PERSIST_OVERHEAD,
    Completion,
    ShardMarker,
    UploadPacer,
    bucket_delay,
    complete_steps,
    daly_interval_seconds,
    plan_durable_retention,
    shard_rank_to_fetch,
    upload_decision,
)
from lightning_ft.events import names as ev

log = logging.getLogger(__name__)

ENV_PERSIST_TO = "LIGHTNING_FT_PERSIST_TO"
ENV_PERSIST_EVERY_SECONDS = "LIGHTNING_FT_PERSIST_EVERY_SECONDS"
ENV_PERSIST_MAX_MIB_PER_SECOND = "LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND"
ENV_PERSIST_KEEP_LAST = "LIGHTNING_FT_PERSIST_KEEP_LAST"
ENV_MTBF_SECONDS = "LIGHTNING_FT_MTBF_SECONDS"
ENV_PERSIST_MAX_OVERHEAD = "LIGHTNING_FT_PERSIST_MAX_OVERHEAD"

DEFAULT_MAX_MIB_PER_SECOND = 512.0
DEFAULT_PERSIST_KEEP_LAST = 2
CHUNK_BYTES = 4 << 20

_STEP_DIR = re.compile(r"^step-(\d+)$")
_MANIFEST = re.compile(r"^step-(\d+)\.json$")
_MARKER = re.compile(r"^rank(\d+)\.done\.json$")
_CHECKSUM_KIND = "snapshot-crc32:"


class UploadCancelled(Exception):
    """An upload passed its deadline (the SIGTERM grace budget) and was abandoned (not durable)."""


@dataclass(frozen=True)
class DurableSettings:
    """Where and how often snapshots are copied durably (see :func:`resolve_durable_settings`)."""

    url: str
    #: seconds between durable copies; None: Daly's interval from the measured copy time and ``mtbf_seconds``
    every_n_seconds: float | None = None
    max_bytes_per_second: float | None = DEFAULT_MAX_MIB_PER_SECOND * 2**20
    keep_last: int = DEFAULT_PERSIST_KEEP_LAST
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    mtbf_seconds: float = DEFAULT_MTBF_SECONDS
    #: share of step time that steps overlapping an upload may lose (the bound is paced to keep
    #: it, ``max_bytes_per_second`` the most it may reach); 0: a fixed bound
    max_overhead: float = DEFAULT_PERSIST_OVERHEAD

    def pacer(self) -> UploadPacer | None:
        """The upload pacer these settings ask for (None: a fixed bound, or unbounded)."""
        if not self.max_overhead or not self.max_bytes_per_second:
            return None
        return UploadPacer(self.max_bytes_per_second, self.max_overhead)

    def interval_seconds(self, copy_seconds: float) -> float:
        """Seconds between durable copies: the setting, else Daly's interval for a checkpoint cost
        of one durable copy (``copy_seconds``). The copy runs in the background, so counting all
        of it as cost makes the interval longer than a strict optimum (less contention, a few
        more steps at risk when a whole job is lost at once)."""
        if self.every_n_seconds is not None:
            return self.every_n_seconds
        return daly_interval_seconds(copy_seconds, self.mtbf_seconds)


def _env_float(env: Mapping[str, str], key: str) -> float | None:
    raw = env.get(key)
    if raw in (None, ""):
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {raw!r}") from None


def resolve_durable_settings(persist_to: str | os.PathLike | None = None, every_n_seconds: float | None = None,
                             max_mib_per_second: float | None = None, keep_last: int | None = None,
                             storage_options: Mapping[str, Any] | None = None,
                             environ: Mapping[str, str] | None = None,
                             mtbf_seconds: float | None = None,
                             max_overhead: float | None = None) -> DurableSettings | None:
    """Arguments win, else ``LIGHTNING_FT_PERSIST_*``; None when no ``persist_to`` is set anywhere.

    ``max_mib_per_second <= 0`` means unbounded; ``max_overhead`` 0: the bound is not paced.
    """
    env = os.environ if environ is None else environ
    url = os.fspath(persist_to) if persist_to is not None else env.get(ENV_PERSIST_TO) or None
    if url is None:
        return None
    every = every_n_seconds if every_n_seconds is not None else _env_float(env, ENV_PERSIST_EVERY_SECONDS)
    require_number("persist_every_n_seconds", every, minimum=0, inclusive=True, allow_none=True)
    mtbf = mtbf_seconds if mtbf_seconds is not None else _env_float(env, ENV_MTBF_SECONDS)
    mtbf = DEFAULT_MTBF_SECONDS if mtbf is None else mtbf
    require_number("persist_mtbf_seconds", mtbf, minimum=0)
    rate = max_mib_per_second if max_mib_per_second is not None else _env_float(env, ENV_PERSIST_MAX_MIB_PER_SECOND)
    rate = DEFAULT_MAX_MIB_PER_SECOND if rate is None else rate
    require_number("persist_max_mib_per_second", rate, minimum=float("-inf"))
    keep = keep_last if keep_last is not None else _env_float(env, ENV_PERSIST_KEEP_LAST)
    keep = DEFAULT_PERSIST_KEEP_LAST if keep is None else keep
    if isinstance(keep, float) and keep.is_integer():
        keep = int(keep)
    require_number("persist_keep_last", keep, integer=True, minimum=1, inclusive=True)
    overhead = max_overhead if max_overhead is not None else _env_float(env, ENV_PERSIST_MAX_OVERHEAD)
    overhead = DEFAULT_PERSIST_OVERHEAD if overhead is None else overhead
    require_number("persist_max_overhead", overhead, minimum=0, inclusive=True)
    if overhead >= 1:
        raise ValueError(f"persist_max_overhead is a share of step time below 1 (0.02: 2 %), got {overhead!r}")
    options = dict(storage_options) if storage_options is not None else storage_options_from_env(env)
    return DurableSettings(url, None if every is None else float(every), rate * 2**20 if rate > 0 else None, keep,
                           options, float(mtbf), float(overhead))


def _step_name(step: int) -> str:
    return f"step-{step:012d}"


def shard_checksum(header: fmt.Header) -> str:
    """A shard's checksum in markers and manifests: ``snapshot-crc32:<8 hex digits>``, the CRC-32
    of its snapshot header's fields (stored in the header, :meth:`.snapshot_format.Header.crc`).

    A shard is a snapshot file, which checks itself: the header's CRC covers the body's CRC
    (identity, block-sum table, metadata), and the block sums cover the data. So the header's
    CRC names one exact snapshot (step, creation time, sizes, content), and a shard is checked
    against its manifest by comparing it and then verifying the whole file
    (:func:`.snapshot_format.verify`, block sums at memory speed). An upload never reads the
    data on the CPU: a CRC over the shard's bytes had been most of a direct upload's CPU and
    memory traffic competing with training (benchmarks/RESULTS.md). Not a cryptographic digest
    either way: markers and manifests are not signed, so it catches accidental damage only (a
    torn, truncated, stale or misplaced upload, a flipped bit); what is loaded is read only by
    the restricted unpickler.
    """
    return f"{_CHECKSUM_KIND}{header.crc():08x}"


def _checked_checksum(raw: Any) -> str:
    """A checksum read from a marker or manifest; another kind (an earlier build's) is unreadable."""
    if not (isinstance(raw, str) and raw.startswith(_CHECKSUM_KIND)):
        raise ValueError(f"checksum {raw!r} is not a {_CHECKSUM_KIND}... value")
    return raw


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
        tokens, last = float(chunk_bytes), time.monotonic()
        while offset < self.nbytes:
            n = min(chunk_bytes, self.nbytes - offset)
            rate = self.rate()
            if rate:
                now = time.monotonic()
                wait, tokens = bucket_delay(tokens, now - last, rate, float(chunk_bytes), n)
                last = now + wait
                if wait:
                    time.sleep(wait)
                    self.paced_seconds += wait
            if self.deadline is not None and time.monotonic() > self.deadline:
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
                 max_bytes_per_second: float | None = None) -> None:
        self.target = target
        self.run_id = run_id
        self.keep_last = keep_last
        self.max_bytes_per_second = max_bytes_per_second
        #: (step, time.monotonic()) of the last manifest this process wrote: when a step became durable
        self.last_published: tuple[int, float] | None = None

    @classmethod
    def from_settings(cls, settings: DurableSettings, run_id: str) -> DurableTier:
        return cls(open_target(settings.url, settings.storage_options), run_id, settings.keep_last,
                   settings.max_bytes_per_second)

    # ------------------------------------------------------------------ paths
    def _segment_dir(self, step: int, segment: str) -> str:
        return f"{self.run_id}/steps/{_step_name(step)}/{segment}"

    def shard_path(self, step: int, segment: str, rank: int) -> str:
        return f"{self._segment_dir(step, segment)}/rank{rank}.snap"

    def marker_path(self, step: int, segment: str, rank: int) -> str:
        return f"{self._segment_dir(step, segment)}/rank{rank}.done.json"

    def manifest_path(self, step: int) -> str:
        return f"{self.run_id}/manifests/{_step_name(step)}.json"

    # ------------------------------------------------------------------ writing
    def upload(self, info: SnapshotInfo, segment: str, world_size: int, deadline: float | None = None,
               fd: int | None = None, rate: Callable[[], float | None] | None = None) -> UploadResult:
        """Copy the committed snapshot file ``info`` verbatim as this rank's shard, verify, mark done,
        and publish the step's manifest when every rank's marker is there.

        The caller keeps the file from being overwritten meanwhile (``SnapshotStore.hold``); ``fd``:
        the file opened beforehand (then it may be pruned meanwhile; closed here); ``rate``: the
        bandwidth bound in bytes/s, asked before every range (None from it: unbounded; default:
        this tier's ``max_bytes_per_second``). Raises UploadCancelled past ``deadline``
        (time.monotonic()), OSError/SnapshotError otherwise; then no marker is written and the
        step is not durable.
        """
        start = time.monotonic()
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
            source = _ShardSource(fd, nbytes, rate or (lambda: self.max_bytes_per_second), deadline)
            shard = self.shard_path(info.step, segment, info.rank)
            try:
                self.target.write(shard, source)
            finally:
                source.close()
            paced = source.paced_seconds
        finally:
            os.close(fd)
        self._verify(shard, nbytes, checksum, read_back=self.target.read_back_verifies)
        marker = ShardMarker(info.step, segment, info.rank, world_size, nbytes, checksum)
        self.target.write(self.marker_path(info.step, segment, info.rank), [json.dumps(marker.__dict__).encode()])
        seconds = time.monotonic() - start
        complete = self.publish_if_complete(info.step, segment)
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

    def _json_records(self, directory: str, pattern: re.Pattern, what: str,
                      parse: Callable[[dict], Any]) -> Iterator[tuple[re.Match, Any]]:
        """(name match, parsed record) of every JSON file in ``directory`` whose name matches
        ``pattern``; one that cannot be read or parsed is logged and skipped (never trusted)."""
        for name in self.target.list(directory):
            m = pattern.match(name)
            if not m:
                continue
            path = f"{directory}/{name}"
            try:
                yield m, parse(json.loads(self.target.read(path)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring durable %s %s: %s", what, self.target.describe(path), exc)

    def markers(self, step: int, segment: str) -> list[ShardMarker]:
        """The valid done markers of one (step, segment); unreadable ones are ignored."""
        def parse(raw: dict) -> ShardMarker:
            return ShardMarker(int(raw["step"]), str(raw["segment"]), int(raw["rank"]), int(raw["world_size"]),
                               int(raw["nbytes"]), _checked_checksum(raw["checksum"]))

        return [marker for m, marker in self._json_records(self._segment_dir(step, segment), _MARKER, "marker", parse)
                if (marker.step, marker.segment, marker.rank) == (step, segment, int(m.group(1)))]

    def publish_if_complete(self, step: int, segment: str) -> bool:
        """Write the manifest of ``step`` if every rank of ``segment`` has its marker; then apply retention."""
        completion = complete_steps(self.markers(step, segment)).get(step)
        if completion is None:
            return False
        body = {"step": step, "segment": segment, "world_size": completion.world_size, "run_id": self.run_id,
                "shards": [{"rank": r, "nbytes": n, "checksum": c} for r, n, c in completion.shards]}
        # every rank that sees completion writes the same bytes: a race between them is harmless
        self.target.write(self.manifest_path(step), [json.dumps(body, sort_keys=True).encode()])
        self.last_published = (step, time.monotonic())
        log.debug("durable: step %d complete (%d shards of segment %s) -> %s", step, completion.world_size, segment,
                 self.target.describe(self.manifest_path(step)))
        self.apply_retention()
        return True

    # ------------------------------------------------------------------ reading
    def complete(self) -> dict[int, Completion]:
        """Complete durable steps by step, read from the manifests only (unreadable ones ignored)."""
        def parse(raw: dict) -> Completion:
            shards = tuple((int(s["rank"]), int(s["nbytes"]), _checked_checksum(s["checksum"])) for s in raw["shards"])
            return Completion(int(raw["step"]), str(raw["segment"]), int(raw["world_size"]), shards)

        result = {}
        for m, completion in self._json_records(f"{self.run_id}/manifests", _MANIFEST, "manifest", parse):
            ranks = [shard[0] for shard in completion.shards]
            if completion.step == int(m.group(1)) and ranks == list(range(completion.world_size)):
                result[completion.step] = completion
        return result

    def complete_steps(self, attempts: int = 3) -> list[int] | None:
        """Complete durable steps, ascending; None when the target cannot be listed (after
        ``attempts`` tries half a second apart; logged): unknown is not "nothing there"."""
        for attempt in range(attempts):
            try:
                return sorted(self.complete())
            except OSError as exc:
                log.warning("durable storage %s cannot be listed (attempt %d of %d): %s", self.target.url,
                            attempt + 1, attempts, exc)
                if attempt + 1 < attempts:
                    time.sleep(0.5)
        return None

    def fetch_into(self, step: int, rank: int, store: SnapshotStore) -> SnapshotInfo:
        """Download the shard of ``step`` this rank needs, check size and checksum against the manifest,
        and commit it into ``store`` (which checks the format and run id)."""
        completion = self.complete().get(step)
        if completion is None:
            raise FileNotFoundError(f"no complete durable step {step} under {self.target.describe(self.run_id)}")
        source = shard_rank_to_fetch(rank, completion.world_size)
        _, nbytes, checksum = completion.shards[source]
        path = self.shard_path(step, completion.segment, source)
        start = time.monotonic()
        blob = self.target.read(path)
        try:
            if len(blob) != nbytes or shard_checksum(fmt.Header.unpack(blob)) != checksum:
                raise fmt.SnapshotError("size or header checksum")
            info = store.write_bytes(blob)  # verifies the whole file (block sums) and the run id
        except fmt.SnapshotError as exc:
            raise fmt.SnapshotError(f"{self.target.describe(path)} does not match its manifest: {exc}") from None
        log.info("rank %d: downloaded durable step %d (rank %d's shard, %.1f MiB) in %.2f s from %s", rank, step,
                 source, nbytes / 2**20, time.monotonic() - start, self.target.describe(path))
        return info

    # ------------------------------------------------------------------ pruning
    def apply_retention(self) -> None:
        """Remove what :func:`.tiers.plan_durable_retention` says (manifests first, then shards)."""
        try:
            completions = self.complete()
            manifests = {step: c.segment for step, c in completions.items()}
            step_dirs = [int(m.group(1)) for m in map(_STEP_DIR.match, self.target.list(f"{self.run_id}/steps")) if m]
            kept = sorted(manifests)[-self.keep_last:]
            segments = {s: self.target.list(f"{self.run_id}/steps/{_step_name(s)}") for s in kept}
            plan = plan_durable_retention(manifests, step_dirs, segments, self.keep_last)
            for step in plan.manifests:
                self.target.delete(self.manifest_path(step))
            for step in plan.step_dirs:
                self.target.delete(f"{self.run_id}/steps/{_step_name(step)}")
            for step, segment in plan.segment_dirs:
                self.target.delete(self._segment_dir(step, segment))
        except OSError as exc:
            log.warning("durable retention under %s failed (retried after the next upload): %s", self.target.url, exc)

    def drop_manifests(self, steps: list[int]) -> None:
        """Remove manifests (steps of an abandoned timeline); their shards go with retention."""
        for step in steps:
            self.target.delete(self.manifest_path(step))
            log.info("durable: removed manifest of step %d (a timeline this job left)", step)


class DurablePersister:
    """One rank's background uploader: the newest committed snapshot supersedes older offers.

    :meth:`offer` runs on the training thread and only records the snapshot (holding its file
    against recycling); a daemon thread uploads. While an upload runs, newer offers replace one
    another and only the newest is uploaded next, so a new snapshot never queues behind old
    ones. A thread, not a sidecar process: the snapshot file lives in this rank's shared-memory
    root, held and released by this process's store; see the README for the trade-off.
    """

    def __init__(self, tier: DurableTier, snapshot_store: Callable[[], SnapshotStore], rank: int,
                 emit: Callable[..., None] | None = None, pacer: UploadPacer | None = None) -> None:
        """``pacer``: adjusts ``tier.max_bytes_per_second`` from the step times the trainer reports
        (:meth:`observe_step`); it sets the bound now (its starting rate)."""
        self.tier = tier
        self.pacer = pacer
        if pacer is not None:
            tier.max_bytes_per_second = pacer.rate
        self._uploads_started = 0
        # time between the last two offers and the last offer's size: the pacer never slows a
        # copy so far that it would not finish well before the next one is offered
        self._last_offer_time: float | None = None
        self._offer_interval: float | None = None
        self._last_offer_bytes: int | None = None
        # the store that writes this rank's snapshots now (it changes when a recovery changes the
        # rank); a hold is released on the store it was taken on
        self._snapshot_store = snapshot_store
        self.rank = rank
        self._emit = emit or (lambda *a, **k: None)
        self._cv = threading.Condition()
        self._pending: tuple[SnapshotInfo, str, int, int, SnapshotStore] | None = None  # + open fd, holder
        self._busy: int | None = None
        self._thread: threading.Thread | None = None
        self.last_durable_step: int | None = None
        self.last_uploaded_step: int | None = None
        #: bytes/s of the last finished upload (upload + verify), None before the first
        self.measured_bytes_per_second: float | None = None
        #: the same without the time the bandwidth bound made it wait: what a flush, which runs
        #: unbounded, can expect
        self.measured_unbounded_bytes_per_second: float | None = None
        # set while a flush runs: the upload in flight and the flush's own go unbounded (the
        # training is stopped; only the grace period counts now)
        self._unbounded = False
        self.failures = 0
        self.skipped = 0

    def offer(self, info: SnapshotInfo, segment: str, world_size: int) -> str:
        """Queue ``info`` for upload; returns the :func:`.tiers.upload_decision` taken."""
        with self._cv:
            decision = upload_decision(self._busy, info.step, self.last_uploaded_step)
            if decision == "skip" or (self._pending is not None and self._pending[0].step == info.step):
                return "skip"
            try:
                # opened now, on the training thread: the file may be pruned before the upload
                # starts, but the open file keeps its bytes
                fd, _ = open_snapshot_file(info.path, for_write=False)
            except (OSError, fmt.SnapshotError) as exc:
                log.warning("rank %d: snapshot of step %d not copied durably: %s", self.rank, info.step, exc)
                return "skip"
            holder = self._snapshot_store()
            holder.hold(info.step)
            now = time.monotonic()  # an accepted offer: the interval between copies the pacer keeps up with
            if self._last_offer_time is not None:
                self._offer_interval = now - self._last_offer_time
            self._last_offer_time, self._last_offer_bytes = now, info.nbytes
            if self._pending is not None:
                log.debug("rank %d: durable copy of step %d superseded by step %d", self.rank,
                          self._pending[0].step, info.step)
                self._drop_pending()
                self.skipped += 1
            self._pending = (info, segment, world_size, fd, holder)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="lightning_ft-persist")
                self._thread.start()
            self._cv.notify_all()
            return decision

    def _drop_pending(self) -> None:
        """Forget the waiting offer (caller holds the lock)."""
        info, _, _, fd, holder = self._pending
        self._pending = None
        os.close(fd)
        holder.release(info.step)

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._pending is None:
                    self._thread = None
                    self._cv.notify_all()
                    return
                pending, self._pending = self._pending, None
                self._busy = pending[0].step
                self._uploads_started += 1
            try:
                info, segment, world_size, fd, holder = pending
                self._upload(info, segment, world_size, deadline=None, fd=fd)
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()
                holder.release(info.step)

    def _upload(self, info: SnapshotInfo, segment: str, world_size: int, deadline: float | None,
                fd: int | None = None) -> UploadResult | None:
        try:
            result = self.tier.upload(info, segment, world_size, deadline=deadline, fd=fd, rate=self._rate)
        except Exception as exc:  # noqa: BLE001 - a failed copy never stops training; the next one may work
            self.failures += 1
            log.warning("rank %d: durable copy of step %d failed (not durable): %s: %s", self.rank, info.step,
                        type(exc).__name__, exc)
            self._emit(ev.DURABLE_FAILED, step=info.step, error=f"{type(exc).__name__}: {exc}")
            return None
        self.last_uploaded_step = info.step
        self.measured_bytes_per_second = result.nbytes / max(result.seconds, 1e-6)
        self.measured_unbounded_bytes_per_second = result.unbounded_bytes_per_second
        if result.complete:
            self.last_durable_step = info.step
        self._emit(ev.DURABLE_UPLOAD, step=info.step, bytes=result.nbytes, seconds=round(result.seconds, 4),
                   complete=result.complete)
        log.debug("rank %d: shard of step %d durable in %.3f s (%.1f MiB/s)%s", self.rank, info.step,
                  result.seconds, self.measured_bytes_per_second / 2**20, "; step complete" if result.complete else "")
        return result

    def activity(self) -> tuple[bool, int]:
        """(an upload is running, uploads started so far): mark a step's start with it, then pass
        it to :meth:`observe_step` at the step's end."""
        with self._cv:
            return self._busy is not None, self._uploads_started

    def observe_step(self, seconds: float, since: tuple[bool, int]) -> None:
        """One training step took ``seconds``; ``since``: :meth:`activity` at its start. A step
        one upload ran through, or one no upload touched, feeds the pacer; one an upload
        started or ended in says nothing and is left out."""
        if self.pacer is None:
            return
        running, started = self.activity()
        if started != since[1] or running != since[0]:
            return
        verdict = self.pacer.observe(seconds, busy=running, keep_up=self._keep_up_bytes_per_second())
        if verdict is None:
            return
        self.tier.max_bytes_per_second = verdict.rate_after
        slowdown = None if verdict.slowdown is None else round(verdict.slowdown, 4)
        fields = dict(slowdown=slowdown, busy_steps=verdict.busy_steps, idle_steps=verdict.idle_steps,
                      mib_per_second=round(verdict.rate_after / 2**20, 1),
                      mib_per_second_before=round(verdict.rate_before / 2**20, 1))
        self._emit(ev.DURABLE_PACING, **fields)
        why = ("to keep up with the copies" if verdict.slowdown is None else
               f"steps during durable copies were {100 * verdict.slowdown:+.1f} % slower (budget "
               f"{100 * self.pacer.budget:.1f} %)")
        log.debug("rank %d: %s: upload bound %.0f -> %.0f MiB/s", self.rank, why, verdict.rate_before / 2**20,
                  verdict.rate_after / 2**20)

    def _keep_up_bytes_per_second(self) -> float:
        """The rate at which the last offered snapshot is copied in half the time between the
        last two offers (0 before there are two)."""
        if self._offer_interval is None or self._last_offer_bytes is None:
            return 0.0
        return self._last_offer_bytes / max(0.5 * self._offer_interval, 1e-3)

    def _rate(self) -> float | None:
        return None if self._unbounded else self.tier.max_bytes_per_second

    def idle(self) -> bool:
        with self._cv:
            return self._thread is None and self._pending is None

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running (True) or ``timeout`` passed (False)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._thread is not None or self._pending is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def flush(self, info: SnapshotInfo, segment: str, world_size: int, deadline: float) -> UploadResult | None:
        """Make ``info`` durable on the calling thread before ``deadline`` (SIGTERM path).

        Runs without the bandwidth bound (the training is stopped), and lifts it for a running
        upload, which it waits for first (an upload of the same step counts); queued older offers
        are dropped. Returns None if it did not become durable in time.
        """
        with self._cv:
            self._unbounded = True
            uploading = False
            try:
                if self._pending is not None:
                    self._drop_pending()
                while self._busy is not None and time.monotonic() < deadline:
                    self._cv.wait(max(0.0, deadline - time.monotonic()))
                if self._busy is not None:
                    return None
                if self.last_uploaded_step == info.step:
                    return UploadResult(info.step, info.nbytes, 0.0, self.last_durable_step == info.step)
                holder = self._snapshot_store()
                holder.hold(info.step)
                self._busy = info.step  # only once held: a failed hold must not leave the persister busy
                self._uploads_started += 1
                uploading = True
            finally:
                if not uploading:
                    self._unbounded = False
        try:
            return self._upload(info, segment, world_size, deadline)
        finally:
            with self._cv:
                self._busy = None
                self._unbounded = False
                self._cv.notify_all()
            holder.release(info.step)
