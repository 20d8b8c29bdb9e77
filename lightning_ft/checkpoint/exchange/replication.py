"""Copies of the newest snapshot on hot spares, through the rendezvous store.

Every DDP rank snapshots the same state, so each active already holds a copy. While fewer
than ``replication_factor + 1`` participants (or failure domains) train, losing one node
could lose the newest state; then rank 0 publishes its newest snapshot under the round's
prefix (:class:`ReplicaPublisher`) and spares keep a copy (:class:`ReplicaPuller`), which
the snapshot exchange of the next round (:mod:`.transfer`) finds like any other.

Only with a job secret (:func:`replica_cipher`): without one nothing in the store can be shown
to come from the job, and a replica is model state a store client could choose. A publication
is a sealed meta (:class:`~lightning_ft.schema.round.ReplicaMeta`: step, run id, model, size)
and the snapshot's bytes in chunks encrypted with a key derived from the secret
(:mod:`lightning_ft.schema.encryption`), so the store and its traffic never hold the weights in
the clear. A spare checks the meta before it reads a byte of the copy, the first chunk's header
before it sets memory aside for the rest, and the whole copy before it keeps it.

Both do their store I/O on a connection of their own, off the training thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from lightning_ft.checkpoint.identity import ExpectedIdentity
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.files import read_snapshot_bytes
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import (
    replica_header_mismatch,
    replica_needed,
    replica_refusal,
    should_pull_replica,
)
from lightning_ft.events import names as ev
from lightning_ft.schema.encryption import SEAL_OVERHEAD, ReplicaCipher, chunk_spans
from lightning_ft.schema.round import (
    REPLICA_CHUNK_BYTES,
    REPLICA_META_KEY,
    ReplicaMeta,
    decode_member,
    decode_replica_meta,
    encode_replica_meta,
    member_key,
    replica_chunk_key,
    replica_pullers_key,
)
from lightning_ft.schema.signing import ENV_SECRET, ENV_SECRET_FILE, SealedStore, Signer, get_if_present

log = logging.getLogger(__name__)

#: publications of one round kept in the store: the newest, and the one before for a spare still reading it
_KEPT_PUBLICATIONS = 2


def read_snapshot_file(path: str) -> bytes:
    """The verified bytes of a committed snapshot file of ours (a symlink is not followed; one
    recycled while we read fails here)."""
    blob = read_snapshot_bytes(path)
    fmt.verify(blob, len(blob))
    return blob


def replica_cipher(signer: Signer, replication_factor: int) -> ReplicaCipher | None:
    """What replicas are published and taken with; None when there are none: ``replication_factor``
    0, or no job secret (then one warning per process says why and how to turn them on)."""
    if replication_factor <= 0:
        return None
    cipher = ReplicaCipher.for_job(signer)
    if cipher is None:
        _warn_replicas_off()
    return cipher


@functools.cache
def _warn_replicas_off() -> None:
    log.warning("snapshot replicas for hot spares are off: this job has no secret (%s or %s), so nothing in the "
                "store can be shown to come from it; a hot spare starts from the survivors' snapshots (or from "
                "none when no active survives). Give every participant and the store the same secret to turn "
                "them on (docs/trust.md).", ENV_SECRET_FILE, ENV_SECRET)


def put_replica(values: SealedStore, cipher: ReplicaCipher, meta: ReplicaMeta, blob: bytes | memoryview) -> list[str]:
    """Store ``blob`` as the replica ``meta`` announces, under ``values``' prefix: its chunks
    encrypted, then the sealed meta (last: a spare reads only complete copies). Returns the
    chunk keys."""
    keys = [values.key(replica_chunk_key(meta.step, index)) for index in range(meta.chunks)]
    for key, sealed in cipher.seal_chunks(keys, blob, meta.chunk_bytes):
        values.store.set(key, sealed)
    values.put(REPLICA_META_KEY, encode_replica_meta(meta))
    return keys


class ReplicaRefused(Exception):
    """A published replica this spare must not keep: ``stage`` says how far it was read
    (``header``: its first chunk; ``contents``: all of it), the message why."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage


def fetch_replica(values: SealedStore, cipher: ReplicaCipher, meta: ReplicaMeta) -> bytearray | None:
    """The snapshot ``meta`` announces under ``values``' prefix, opened chunk by chunk; None when
    the publisher removed it meanwhile (a newer one is out). The first chunk's header and
    identity are checked against the meta before memory is set aside for the rest; ReplicaRefused
    when anything is not what the meta announces or does not open with the job's key. For a
    meta :func:`~lightning_ft.checkpoint.policy.replica_refusal` accepted: it sets aside
    ``meta.nbytes``."""
    spans = chunk_spans(meta.nbytes, meta.chunk_bytes)
    first = _open_chunk(values, cipher, meta, 0, spans[0][1])
    if first is None:
        return None
    _check_header(meta, first)
    blob = bytearray(meta.nbytes)
    blob[: len(first)] = first
    for index, (offset, length) in enumerate(spans[1:], start=1):
        chunk = _open_chunk(values, cipher, meta, index, length)
        if chunk is None:
            return None
        blob[offset: offset + length] = chunk
    return blob


def _open_chunk(values: SealedStore, cipher: ReplicaCipher, meta: ReplicaMeta, index: int,
                length: int) -> bytes | None:
    stage = "header" if index == 0 else "contents"
    key = values.key(replica_chunk_key(meta.step, index))
    sealed = get_if_present(values.store, key)  # never waits: the publisher may have removed the chunk
    if sealed is None:
        log.debug("replica of step %d: chunk %d is gone (superseded)", meta.step, index)
        return None
    if len(sealed) != length + SEAL_OVERHEAD:
        raise ReplicaRefused(stage, f"chunk {index} holds {len(sealed)} bytes, not the {length + SEAL_OVERHEAD} "
                                    "its meta announces")
    plain = cipher.open(key, index, meta.chunks, meta.nbytes, sealed)
    if plain is None:
        raise ReplicaRefused(stage, f"chunk {index} does not open with the job's replica key (altered, moved, "
                                    "or sealed with another secret)")
    return plain


def _check_header(meta: ReplicaMeta, first: bytes) -> None:
    try:
        header = fmt.Header.unpack(first)
        if fmt.HEADER_SIZE + header.ident_len > len(first):
            raise fmt.SnapshotError("its identity record does not fit in the first chunk")
        found = fmt.read_identity(first, header)
    except fmt.SnapshotError as exc:
        raise ReplicaRefused("header", f"the first chunk is not a snapshot header: {exc}") from None
    mismatch = replica_header_mismatch(meta, header.step, header.file_size, found)
    if mismatch is not None:
        raise ReplicaRefused("header", mismatch)


class ReplicaPublisher:
    """Rank 0's side: publish each new snapshot for the spares when copies are short.

    ``connect()`` returns a store connection of the publisher's own (``TCPStore.clone``);
    ``emit(event, **fields)`` writes the event log. :meth:`offer` is called on the training
    thread and only queues; a daemon thread reads the file and writes the store.
    """

    def __init__(self, connect: Callable[[], Any], signer: Signer, cipher: ReplicaCipher, replication_factor: int,
                 max_bytes: int, emit: Callable[..., None]) -> None:
        self._connect = connect
        self._signer = signer
        self._cipher = cipher
        self.replication_factor = replication_factor
        self.max_bytes = max_bytes
        self._emit = emit
        self._lock = threading.Lock()
        self._pending: tuple[SnapshotInfo, int, str, int] | None = None
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self._published_step: int | None = None
        self._publications: list[tuple[str, list[str]]] = []  # (round prefix, chunk keys), oldest first
        self._domains: tuple[int, list[str]] | None = None  # (round, active domains in rank order)

    def offer(self, info: SnapshotInfo | None, round_id: int, store_prefix: str, world_size: int) -> None:
        """Publish ``info`` (the newest local snapshot) unless it already was."""
        if info is None or info.step == self._published_step:
            return
        self._published_step = info.step
        with self._lock:
            self._pending = (info, round_id, store_prefix, world_size)
            if self._thread is None:  # the thread clears it under this lock when it leaves
                self._thread = threading.Thread(target=self._run, daemon=True, name="lightning_ft-replica")
                self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout)

    def _run(self) -> None:
        if self._store is None:  # one connection for all publications: new ones can be slow
            try:
                self._store = self._connect()
            except (RuntimeError, OSError) as exc:
                log.warning("cannot connect to publish a replica: %s", exc)
                with self._lock:
                    self._thread = None
                return
        while True:
            with self._lock:
                pending, self._pending = self._pending, None
                if pending is None:
                    self._thread = None
                    return
            try:
                self._publish(*pending)
            except (RuntimeError, OSError) as exc:  # the store went away: the main thread will see it too
                log.warning("replica of step %d not published: %s", pending[0].step, exc)

    def _active_domains(self, round_id: int, store_prefix: str, world_size: int) -> list[str]:
        if self._domains is None or self._domains[0] != round_id:
            values = SealedStore(self._store, self._signer, store_prefix)
            members = values.multi_get([member_key(rank) for rank in range(world_size)])
            self._domains = (round_id, [decode_member(raw).domain_id if raw is not None else "?" for raw in members])
        return self._domains[1]

    def _publish(self, info: SnapshotInfo, round_id: int, store_prefix: str, world_size: int) -> None:
        domains = self._active_domains(round_id, store_prefix, world_size)
        if not replica_needed(domains, self.replication_factor):
            return
        if info.nbytes > self.max_bytes:
            log.warning("snapshot of step %d (%d bytes) exceeds replica_max_bytes=%d; not replicated",
                        info.step, info.nbytes, self.max_bytes)
            return
        try:
            blob = read_snapshot_file(info.path)
        except Exception as exc:  # noqa: BLE001 - recycled by a newer snapshot while we read: skip it
            log.debug("replica of step %d skipped: %s", info.step, exc)
            return
        identity = fmt.read_identity(blob, fmt.Header.unpack(blob))
        meta = ReplicaMeta(info.step, tuple(domains), identity.run_id, identity.model, len(blob), REPLICA_CHUNK_BYTES)
        keys = put_replica(SealedStore(self._store, self._signer, store_prefix), self._cipher, meta, blob)
        self._forget_old_publications(store_prefix, keys)
        self._emit(ev.REPLICA_PUBLISHED, round=round_id, step=info.step, bytes=len(blob))

    def _forget_old_publications(self, store_prefix: str, keys: list[str]) -> None:
        """Remove what no spare needs any more: other rounds' copies (their spares have theirs by
        now), and this round's but the newest two (a spare may still be reading the one before)."""
        self._publications.append((store_prefix, keys))
        kept = [p for p in self._publications if p[0] == store_prefix][-_KEPT_PUBLICATIONS:]
        for publication in self._publications:
            if publication not in kept:
                for key in publication[1]:
                    try:
                        self._store.delete_key(key)
                    except (RuntimeError, OSError):
                        pass
        self._publications = kept


class ReplicaPuller:
    """A hot spare's side: keep a copy of the published snapshot when this spare is needed for one.

    ``open_snapshot_store()`` returns the :class:`SnapshotStore` to commit copies into
    (``None``: this process keeps no snapshots); called from the spare monitor's thread.
    ``expected``: the run id (and model fingerprint, when known) a copy must have;
    ``max_bytes``: the largest copy this spare takes.
    """

    def __init__(self, domain_id: str, replication_factor: int,
                 open_snapshot_store: Callable[[], SnapshotStore | None], emit: Callable[..., None], *,
                 cipher: ReplicaCipher, expected: ExpectedIdentity, max_bytes: int) -> None:
        self.domain_id = domain_id
        self.replication_factor = replication_factor
        self._open_snapshot_store = open_snapshot_store
        self._emit = emit
        self._cipher = cipher
        self.expected = expected
        self.max_bytes = max_bytes
        self._seen_meta = b""
        #: this puller's name in a step's pullers log (unique per process and puller)
        self.puller_id = uuid.uuid4().hex

    def poll(self, values: SealedStore) -> None:
        """Look for a newly published replica in a round's sealed values; pull it if wanted."""
        raw = values.get(REPLICA_META_KEY)
        if raw is None or raw == self._seen_meta:
            return
        self._seen_meta = raw
        meta = decode_replica_meta(raw)
        if meta is None:
            log.debug("ignored a replica meta that does not decode (another lightning_ft version?)")
            return
        refusal = replica_refusal(meta, self.expected, self.max_bytes)
        if refusal is not None:  # nothing of the copy read, nothing set aside for it
            self._refuse(meta, "meta", refusal)
            return
        # our place among the step's pullers: a log of sealed records, not a counter, so a store
        # client cannot push every spare out of the first replication_factor places
        pullers_log = replica_pullers_key(meta.step)
        values.append(pullers_log, self.puller_id)
        pullers = list(dict.fromkeys(r.decode(errors="replace") for r in values.records(pullers_log)))
        index = pullers.index(self.puller_id) if self.puller_id in pullers else len(pullers)
        if not should_pull_replica(self.domain_id, meta.active_domains, self.replication_factor, index):
            return
        try:
            blob = fetch_replica(values, self._cipher, meta)
        except ReplicaRefused as exc:
            self._refuse(meta, exc.stage, str(exc))
            return
        if blob is not None:
            self._keep(meta, blob)

    def _keep(self, meta: ReplicaMeta, blob: bytearray) -> None:
        snapshots = self._open_snapshot_store()
        if snapshots is None:
            return
        with snapshots:
            try:
                info = snapshots.write_bytes(blob)
            except fmt.SnapshotError as exc:
                self._refuse(meta, "contents", str(exc))
                return
        self._emit(ev.REPLICA_RECEIVED, step=info.step, bytes=len(blob))

    def _refuse(self, meta: ReplicaMeta, stage: str, reason: str) -> None:
        # a refused copy is dropped (never kept, so never offered or chosen); the spare takes the next
        log.warning("replica of step %d refused (%s): %s", meta.step, stage, reason)
        self._emit(ev.REPLICA_REFUSED, step=meta.step, bytes=meta.nbytes, stage=stage, error=reason[:200])
