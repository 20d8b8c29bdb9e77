"""Copies of each rank's sharded snapshot on ranks in other failure domains.

With sharded state a rank's shards exist only where that rank ran: a lost host takes them
along, and no step could be resumed. :class:`ShardReplicator` copies each rank's newest
snapshot, right after it is committed, to its holders
(:func:`~lightning_ft.checkpoint.policy.plan_shard_replicas`: ``replication_factor`` ranks,
each in another domain) over the round's process group -- not through the rendezvous store --
and the holder keeps it in that rank's directory of the run on its own host. After a loss, the
shard exchange of the next round (:func:`~.transfer.exchange_shards`) finds it there like any
snapshot on the host and sends it to whoever takes the lost rank's place.

Memory: each holder keeps ``keep_last`` copies of each rank it holds for, so a rank's host
holds ``(1 + factor) x keep_last`` shard-sized files in all (its own and the copies it holds).
What travels and what the copy costs is recorded per copy (event ``shard_replica``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.exchange.agreement import gather_steps
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import plan_shard_replicas
from lightning_ft.events import names as ev

log = logging.getLogger(__name__)

#: size sent instead of a snapshot: nothing new to copy (or it could not be read)
_NOTHING = -1


def domain_code(domain_id: str) -> int:
    """A failure domain as a non-negative int64 (domains travel through ``gather_steps``)."""
    return int.from_bytes(hashlib.sha256(domain_id.encode()).digest()[:7], "big")


class ShardReplicator:
    """This rank's part of the shard copies of one round: whom it sends its snapshots to, whose it keeps.

    Build it where every rank of the round builds it (a collective: one all_gather of the
    domains); :meth:`copy` is a collective too, called by every rank at the same step.
    """

    def __init__(self, open_store_for: Callable[[int], SnapshotStore], rank: int, world_size: int, domain_id: str,
                 factor: int, emit: Callable[..., None]) -> None:
        codes = [values[0] for values in gather_steps([domain_code(domain_id)])]
        if len(codes) != world_size:
            raise RuntimeError(f"fsdp_ft: shard replicas expected {world_size} ranks, the default group has "
                               f"{len(codes)}")
        self._open_store_for = open_store_for
        self.rank = rank
        self.holders = plan_shard_replicas([str(code) for code in codes], factor)
        #: the ranks whose snapshots this rank keeps copies of
        self.sources = tuple(source for source, held_by in enumerate(self.holders) if rank in held_by)
        self._emit = emit
        self._sent_step: int | None = None
        self.domains = len(set(codes))

    @property
    def copies(self) -> bool:
        """Whether any rank's snapshot has a holder (False: every rank is in one domain, or factor 0)."""
        return any(self.holders)

    def copy(self, own: SnapshotInfo | None, store: SnapshotStore | None) -> bool:
        """Send this rank's snapshot ``own`` (read from ``store``) to its holders unless it was sent
        already, and keep what the ranks this rank holds for send (collective). A copy that fails
        the checks on arrival is dropped with a logged reason; training goes on. Returns whether
        this rank sent a snapshot now."""
        if not self.copies:
            return False
        start = time.perf_counter()
        send_to = self.holders[self.rank]
        with contextlib.ExitStack() as held:
            payload: torch.Tensor | None = None
            if own is not None and store is not None and own.step != self._sent_step and send_to:
                try:
                    payload = held.enter_context(store.bytes_to_send(own))
                except Exception as exc:  # noqa: BLE001 - the holders hear "nothing"; older copies stand
                    log.warning("rank %d: cannot read its snapshot of step %d to copy it: %s", self.rank, own.step, exc)
            size = torch.tensor([payload.numel() if payload is not None else _NOTHING], dtype=torch.int64)
            incoming = {source: torch.zeros(1, dtype=torch.int64) for source in self.sources}
            _wait([*(dist.isend(size, dst=holder) for holder in send_to),
                   *(dist.irecv(buffer, src=source) for source, buffer in incoming.items())])
            received = {source: torch.empty(int(n.item()), dtype=torch.uint8)
                        for source, n in incoming.items() if int(n.item()) >= 0}
            _wait([*(dist.isend(payload, dst=holder) for holder in send_to if payload is not None),
                   *(dist.irecv(buffer, src=source) for source, buffer in received.items())])
            payload = None  # the last reference to the map's view goes before the map is closed
        if own is not None and int(size.item()) >= 0:
            self._sent_step = own.step
        for source, buffer in received.items():
            self._keep(source, buffer)
        seconds = round(time.perf_counter() - start, 4)  # what the copy held training up: sends and writes
        if int(size.item()) < 0:
            return False
        assert own is not None
        self._emit(ev.SHARD_REPLICA, step=own.step, to_ranks=list(send_to), bytes=int(size.item()), seconds=seconds)
        return True

    def _keep(self, source: int, buffer: torch.Tensor) -> None:
        try:
            with self._open_store_for(source) as store:
                info = store.write_bytes(buffer.numpy().data)
        except Exception as exc:  # noqa: BLE001 - a refused copy is dropped; older copies stand
            log.warning("rank %d: copy of rank %d's shards refused: %s", self.rank, source, exc)
            return
        log.debug("rank %d: keeps rank %d's shards of step %d (%d bytes)", self.rank, source, info.step, info.nbytes)


def _wait(requests: Sequence[dist.Work | None]) -> None:
    for request in requests:
        assert request is not None  # isend/irecv return None only to ranks outside the group
        request.wait()
