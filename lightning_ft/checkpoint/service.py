"""The snapshot service: what the code around training (the strategy, a hot spare waiting in the
rendezvous) does with a run's snapshots, so that it never builds a ``SnapshotStore`` itself.

Obtained from the ``EmergencyCheckpoint`` of the Trainer (``checkpoint.snapshots``); imports no
Lightning.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_ft.checkpoint.exchange.replication import ReplicaPuller
from lightning_ft.checkpoint.exchange.transfer import exchange_shards, exchange_snapshots
from lightning_ft.checkpoint.identity import ExpectedIdentity
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import ShardTransferPlan, TransferPlan
from lightning_ft.schema.encryption import ReplicaCipher


class SnapshotService:
    """The snapshots of one run on this host (``<root>/<run_id>``, ``keep_last`` per rank).

    ``run_id`` is what ``EmergencyCheckpoint.run_id`` holds: the configured run id, or
    ``"default"`` without one. The stores built here then take ``"default"`` as their run id,
    so the snapshots of a run without a run id (which record none) are neither exchanged nor
    kept as replicas, as they are never resumed either.

    A store is built only when one is needed (building one checks the directories and removes
    the temp files of writers that are gone).
    """

    def __init__(self, root: str, run_id: str, keep_last: int) -> None:
        self.root = root
        self.run_id = run_id
        self.keep_last = keep_last

    def open_store_for(self, rank: int) -> SnapshotStore:
        """A store of ``rank``'s directory of this run (the caller closes it; a context manager)."""
        return SnapshotStore(self.root, self.run_id, rank, self.keep_last)

    def expected_identity(self, model: str | None = None) -> ExpectedIdentity:
        """What a copy received for this run must have: its run id (``"default"``, which no
        snapshot records, without one) and ``model`` when given."""
        return ExpectedIdentity(self.run_id, model)

    def exchange(self, rank: int, world_size: int, emit: Callable[..., None],
                 model: str | None = None) -> TransferPlan | None:
        """After a round formed: make the newest snapshot any rank holds available on every rank
        (collective over the default group; see
        :func:`~lightning_ft.checkpoint.exchange.transfer.exchange_snapshots`). ``emit(event,
        **fields)`` records the plan, sends and receipts. ``model``: the fingerprint of this
        rank's model when it is known already (snapshots of another model are then not
        offered). Returns the plan (None: no rank holds a snapshot); its step is where training
        resumes."""
        with self.open_store_for(rank) as store:
            return exchange_snapshots(store, rank, world_size, emit, model)

    def exchange_shards(self, rank: int, world_size: int, emit: Callable[..., None],
                        model: str | None = None) -> ShardTransferPlan | None:
        """:meth:`exchange` for sharded state: every rank ends up holding its own shards of the
        newest step whose shards all exist (see
        :func:`~lightning_ft.checkpoint.exchange.transfer.exchange_shards`); its step is where
        training resumes (None: no complete step)."""
        with self.open_store_for(rank) as store:
            return exchange_shards(store, rank, world_size, emit, model)


def replica_puller(service: SnapshotService | None, domain_id: str, replication_factor: int,
                   emit: Callable[..., None], *, cipher: ReplicaCipher | None, model: str | None,
                   max_bytes: int) -> ReplicaPuller | None:
    """A hot spare's :class:`~lightning_ft.checkpoint.exchange.replication.ReplicaPuller`: the
    copies it keeps go into rank 0's directory of ``service``'s run (a spare has no rank yet; the
    next round's exchange finds a copy in any rank directory of the host), if they are of this
    run and of ``model`` (a fingerprint; None: not known before setup, the run id only) and at
    most ``max_bytes``. None -- the spare keeps no copies -- without ``service`` (no
    ``EmergencyCheckpoint``) or without ``cipher`` (no replicas: see
    :func:`~lightning_ft.checkpoint.exchange.replication.replica_cipher`)."""
    if service is None or cipher is None:
        return None
    return ReplicaPuller(domain_id, replication_factor, lambda: service.open_store_for(0), emit,
                         cipher=cipher, expected=service.expected_identity(model), max_bytes=max_bytes)
