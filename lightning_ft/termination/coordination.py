"""Agreeing on a common stop step through a ``torch.distributed`` Store, without collectives.

Any rank that sees a termination signal proposes ``stop = its step + margin`` with
``compare_set`` (first writer wins); every rank checks the key at each optimizer-step
boundary with ``check`` (a few microseconds on a TCPStore). A node that exits as
unhealthy publishes that first, so its peers know why their next collective fails.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_ft.schema.termination import (
    STOP_KEY,
    UNHEALTHY_COUNT_KEY,
    StopRequest,
    decode_unhealthy,
    encode_unhealthy,
    unhealthy_key,
)

from lightning_ft.schema.signing import SealedStore, Signer, job_signer

log = logging.getLogger(__name__)

__all__ = ["LocalStopCoordinator", "StopRequest", "StoreStopCoordinator"]


class StoreStopCoordinator:
    """Stop-step agreement and unhealthy-peer notices over a Store, in the key space ``prefix``.

    The stop request and the notices are sealed with the job secret (see
    :mod:`lightning_ft.schema.signing`): a forged stop key or notice is ignored.
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "",
                 signer: Signer | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.values = SealedStore(store, job_signer() if signer is None else signer, prefix)

    def clone(self) -> "StoreStopCoordinator":
        """A coordinator on its own connection, for use from another thread."""
        clone = getattr(self.store, "clone", None)
        store = self.store
        if callable(clone):
            try:
                store = clone()
            except Exception:  # not every Store type can clone; the TCPStore client is locked anyway
                log.debug("store clone failed; sharing the connection", exc_info=True)
        return StoreStopCoordinator(store, self.rank, self.world_size, self.prefix, self.values.signer)

    def propose(self, step: int, signum: int, reason: str) -> StopRequest:
        """Propose stopping after ``step``; returns the agreed request (possibly an earlier one)."""
        mine = StopRequest(step, self.rank, signum, reason)
        return StopRequest.decode(self.values.put_if_absent(STOP_KEY, mine.encode()))

    def poll(self) -> StopRequest | None:
        raw = self.values.get(STOP_KEY)
        return StopRequest.decode(raw) if raw is not None else None

    def announce_unhealthy(self, step: int, signum: int, reasons: list[str]) -> StopRequest:
        """Tell peers this rank is leaving as unhealthy (and ask them to stop).

        Ends with a request/response operation (``add``), so everything before it has
        reached the store when this returns, even if the process exits right after.
        """
        agreed = self.propose(step, signum, f"rank {self.rank} unhealthy")
        self.values.put(unhealthy_key(self.rank), encode_unhealthy(step, reasons))
        self.store.add(self.values.key(UNHEALTHY_COUNT_KEY), 1)
        return agreed

    def any_peer_unhealthy(self) -> bool:
        # the counter is a hint (counters cannot be sealed); the sealed notices decide
        return bool(self.store.check([self.values.key(UNHEALTHY_COUNT_KEY)])) and bool(self.unhealthy_peers())

    def unhealthy_peers(self) -> dict[int, list[str]]:
        """rank -> reasons, for every rank that announced itself unhealthy."""
        if not self.store.check([self.values.key(UNHEALTHY_COUNT_KEY)]):
            return {}
        peers: dict[int, list[str]] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            raw = self.values.get(unhealthy_key(rank))
            if raw is not None:
                peers[rank] = decode_unhealthy(raw)
        return peers


class LocalStopCoordinator:
    """The single-process stand-in: no peers, the proposer always wins."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self._stop: StopRequest | None = None

    def clone(self) -> "LocalStopCoordinator":
        return self

    def propose(self, step: int, signum: int, reason: str) -> StopRequest:
        if self._stop is None:
            self._stop = StopRequest(step, 0, signum, reason)
        return self._stop

    def poll(self) -> StopRequest | None:
        return self._stop

    def announce_unhealthy(self, step: int, signum: int, reasons: list[str]) -> StopRequest:
        return self.propose(step, signum, "rank 0 unhealthy")

    def any_peer_unhealthy(self) -> bool:
        return False

    def unhealthy_peers(self) -> dict[int, list[str]]:
        return {}
