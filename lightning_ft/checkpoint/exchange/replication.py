"""Copies of the newest snapshot on hot spares, through the rendezvous store.

Every DDP rank snapshots the same state, so each active already holds a copy. While fewer
than ``replication_factor + 1`` participants (or failure domains) train, losing one node
could lose the newest state; then rank 0 publishes its newest snapshot under the round's
prefix (:class:`ReplicaPublisher`) and spares keep a copy (:class:`ReplicaPuller`), which
the snapshot exchange of the next round (:mod:`.transfer`) finds like any other.

Both do their store I/O on a connection of their own, off the training thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.files import read_snapshot_bytes
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import replica_needed, should_pull_replica
from lightning_ft.events import names as ev
from lightning_ft.schema.round import (
    REPLICA_BLOB_KEY,
    REPLICA_META_KEY,
    decode_member,
    decode_replica_meta,
    encode_replica_meta,
    member_key,
    replica_pullers_key,
)
from lightning_ft.schema.signing import SealedStore, Signer

log = logging.getLogger(__name__)


def read_snapshot_file(path: str) -> bytes:
    """The verified bytes of a committed snapshot file of ours (a symlink is not followed; one
    recycled while we read fails here)."""
    blob = read_snapshot_bytes(path)
    fmt.verify(blob, len(blob))
    return blob


class ReplicaPublisher:
    """Rank 0's side: publish each new snapshot for the spares when copies are short.

    ``connect()`` returns a store connection of the publisher's own (``TCPStore.clone``);
    ``emit(event, **fields)`` writes the event log. :meth:`offer` is called on the training
    thread and only queues; a daemon thread reads the file and writes the store.
    """

    def __init__(self, connect: Callable[[], Any], signer: Signer, replication_factor: int, max_bytes: int,
                 emit: Callable[..., None]) -> None:
        self._connect = connect
        self._signer = signer
        self.replication_factor = replication_factor
        self.max_bytes = max_bytes
        self._emit = emit
        self._lock = threading.Lock()
        self._pending: tuple[SnapshotInfo, int, str, int] | None = None
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self._published_step: int | None = None
        self._published_prefix: str | None = None
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
        store = self._store
        if self._published_prefix is not None and self._published_prefix != store_prefix:
            try:  # the previous round's copy: the spares have theirs by now
                store.delete_key(f"{self._published_prefix}/{REPLICA_BLOB_KEY}")
            except (RuntimeError, OSError):
                pass
        self._published_prefix = store_prefix
        values = SealedStore(store, self._signer, store_prefix)
        values.put(REPLICA_BLOB_KEY, blob)  # sealed: a spare keeps only what this job published
        values.put(REPLICA_META_KEY, encode_replica_meta(info.step, domains))
        self._emit(ev.REPLICA_PUBLISHED, round=round_id, step=info.step, bytes=len(blob))


class ReplicaPuller:
    """A hot spare's side: keep a copy of the published snapshot when this spare is needed for one.

    ``open_snapshot_store()`` returns the :class:`SnapshotStore` to commit copies into
    (``None``: this process keeps no snapshots); called from the spare monitor's thread.
    """

    def __init__(self, domain_id: str, replication_factor: int,
                 open_snapshot_store: Callable[[], SnapshotStore | None],
                 emit: Callable[..., None]) -> None:
        self.domain_id = domain_id
        self.replication_factor = replication_factor
        self._open_snapshot_store = open_snapshot_store
        self._emit = emit
        self._seen_meta = b""

    def poll(self, values: SealedStore) -> None:
        """Look for a newly published replica in a round's sealed values; pull it if wanted."""
        raw = values.get(REPLICA_META_KEY)
        if raw is None or raw == self._seen_meta:
            return
        self._seen_meta = raw
        meta = decode_replica_meta(raw)
        if meta is None:
            return
        index = values.store.add(values.key(replica_pullers_key(meta.step)), 1) - 1
        if not should_pull_replica(self.domain_id, meta.active_domains, self.replication_factor, index):
            return
        blob = values.get(REPLICA_BLOB_KEY)
        if blob is None:
            return
        snapshots = self._open_snapshot_store()
        if snapshots is None:
            return
        with snapshots:
            try:
                info = snapshots.write_bytes(blob)
            except fmt.SnapshotError as exc:
                # without a job secret anyone who reaches the store can put a replica there
                # (docs/trust.md): a refused one is dropped and the spare pulls the next
                log.warning("replica of step %d refused: %s", meta.step, exc)
                self._emit(ev.REPLICA_REFUSED, step=meta.step, bytes=len(blob), error=str(exc)[:200])
                return
        self._emit(ev.REPLICA_RECEIVED, step=info.step, bytes=len(blob))
