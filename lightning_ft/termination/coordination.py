"""Agreeing on a common stop step through a ``torch.distributed`` Store, without collectives.

Any rank that sees a termination signal proposes ``stop = its step + margin`` with
``compare_set`` (first writer wins) and wakes every rank's stop watcher
(:mod:`lightning_ft.termination.watcher`), a thread blocked in a store ``wait`` that reads
the request off the training thread and confirms it. A rank that knows the stop holds back
before the stop step until every rank has confirmed (see ``GracefulTermination``), so no rank
can complete the stop step without knowing it -- and no training step ever waits on the
store. A node that exits as unhealthy publishes that first, so its peers know why their next
collective fails.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from typing import Any

import torch.distributed as dist

from lightning_ft._clock import monotonic
from lightning_ft._torch import default_group_store
from lightning_ft.schema.signing import SealedStore, Signer, job_signer
from lightning_ft.schema.termination import (
    HAND_OVER_KEY,
    SIGNALLED_LOG,
    STOP_KEY,
    UNHEALTHY_COUNT_KEY,
    HandOverVerdict,
    StopRequest,
    confirmed_key,
    decode_signalled,
    decode_unhealthy,
    encode_signalled,
    encode_unhealthy,
    namespace_prefix,
    unhealthy_key,
    wake_key,
)

log = logging.getLogger(__name__)

__all__ = ["LocalStopCoordinator", "StopRequest", "StoreStopCoordinator", "coordinator_for"]

# polling for the confirmations: start fast (they usually arrive within a few store round
# trips), back off so a long wait costs the store little
_CONFIRM_POLL_FIRST_S = 0.001
_CONFIRM_POLL_MAX_S = 0.02


class StoreStopCoordinator:
    """Stop-step agreement and unhealthy-peer notices over a Store, in the key space ``prefix``.

    The stop request and the notices are sealed with the job secret (see
    :mod:`lightning_ft.schema.signing`): a forged stop key or notice is ignored. Every method
    is a few store round trips and blocks while the store does not answer: callers on the
    training thread run them under a bound.
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "",
                 signer: Signer | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.values = SealedStore(store, job_signer() if signer is None else signer, prefix)

    def clone(self) -> StoreStopCoordinator:
        """A coordinator on its own connection, for use from another thread."""
        clone = getattr(self.store, "clone", None)
        store = self.store
        if callable(clone):
            try:
                store = clone()
            except Exception:  # not every Store type can clone; the TCPStore client is locked anyway
                log.debug("store clone failed; sharing the connection", exc_info=True)
        return StoreStopCoordinator(store, self.rank, self.world_size, self.prefix, self.values.signer)

    def propose(self, step: int, signum: int, reason: str, signalled: bool = False) -> StopRequest:
        """Propose stopping after ``step``; returns the agreed request (possibly an earlier one).

        This rank then knows the stop: it confirms, and wakes every rank's watcher. ``signalled``:
        this rank received the signal itself (recorded first, for the hand-over verdict).
        """
        if signalled:
            self.mark_signalled()
        mine = StopRequest(step, self.rank, signum, reason)
        agreed = StopRequest.decode(self.values.put_if_absent(STOP_KEY, mine.encode()))
        self.confirm()
        self.wake_all()
        return agreed

    def poll(self) -> StopRequest | None:
        raw = self.values.get(STOP_KEY)
        return StopRequest.decode(raw) if raw is not None else None

    def mark_signalled(self) -> None:
        """Record that this rank received the termination signal itself (a leaver if it hands over)."""
        self.values.append(SIGNALLED_LOG, encode_signalled(self.rank))

    def signalled_ranks(self) -> set[int]:
        ranks = (decode_signalled(raw) for raw in self.values.records(SIGNALLED_LOG))
        return {r for r in ranks if r is not None and r < self.world_size}

    def hand_over_verdict(self) -> HandOverVerdict | None:
        """The verdict some rank published for this termination, None before any."""
        raw = self.values.get(HAND_OVER_KEY)
        return HandOverVerdict.decode(raw) if raw is not None else None

    def publish_hand_over(self, verdict: HandOverVerdict) -> HandOverVerdict:
        """Publish ``verdict`` unless one is there; returns the one every rank acts on."""
        winner = HandOverVerdict.decode(self.values.put_if_absent(HAND_OVER_KEY, verdict.encode()))
        return winner if winner is not None else HandOverVerdict((), "a damaged hand-over verdict: the job stops")

    def confirm(self) -> None:
        """Tell the proposer(s) this rank knows the stop request."""
        self.store.set(self.values.key(confirmed_key(self.rank)), "1")

    def all_confirmed(self) -> bool:
        return bool(self.store.check([self.values.key(confirmed_key(r)) for r in range(self.world_size)]))

    def wait_until_all_confirmed(self, timeout_s: float) -> bool:
        """Poll until every rank confirmed the stop (True) or ``timeout_s`` passed (False)."""
        deadline = monotonic() + timeout_s
        interval = _CONFIRM_POLL_FIRST_S
        while not self.all_confirmed():
            left = deadline - monotonic()
            if left <= 0:
                return False
            time.sleep(min(interval, left))
            interval = min(2 * interval, _CONFIRM_POLL_MAX_S)
        return True

    def wake_all(self) -> None:
        """Wake every rank's stop watcher (after writing what it should read)."""
        keys = [self.values.key(wake_key(r)) for r in range(self.world_size)]
        self.store.multi_set(keys, ["1"] * len(keys))

    def wake_self(self) -> None:
        """Wake this rank's own stop watcher (so that it can end)."""
        self.store.set(self.values.key(wake_key(self.rank)), "1")

    def wait_for_wake(self, timeout_s: float) -> bool:
        """Block until this rank's wake key is set (True, and consume it) or ``timeout_s`` passed (False).

        The wait happens in the store server: no traffic and no wake-ups while nothing happens.
        """
        from torch.distributed import DistStoreError  # torch raises it for a wait that timed out

        key = self.values.key(wake_key(self.rank))
        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
        except DistStoreError:  # a timeout is an answer; a lost connection (DistNetworkError) is not
            return False
        self.store.delete_key(key)
        return True

    def announce_unhealthy(self, step: int, signum: int, reasons: list[str]) -> StopRequest:
        """Tell peers this rank is leaving as unhealthy (and ask them to stop).

        The notice is written before the stop request and the wake-ups, so a woken watcher
        finds it; the rank also confirms, so nobody waits for its confirmation.
        """
        self.values.put(unhealthy_key(self.rank), encode_unhealthy(step, reasons))
        # a marker, not a counter: only its existence is a hint (``add`` on a value a store client
        # garbled would make the server drop this connection)
        self.store.set(self.values.key(UNHEALTHY_COUNT_KEY), "1")
        return self.propose(step, signum, f"rank {self.rank} unhealthy")

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

    def clone(self) -> LocalStopCoordinator:
        return self

    def propose(self, step: int, signum: int, reason: str, signalled: bool = False) -> StopRequest:
        if self._stop is None:
            self._stop = StopRequest(step, 0, signum, reason)
        return self._stop

    def poll(self) -> StopRequest | None:
        return self._stop

    def confirm(self) -> None:
        pass

    def all_confirmed(self) -> bool:
        return True

    def wait_until_all_confirmed(self, timeout_s: float) -> bool:
        return True

    def announce_unhealthy(self, step: int, signum: int, reasons: list[str]) -> StopRequest:
        return self.propose(step, signum, "rank 0 unhealthy")

    def any_peer_unhealthy(self) -> bool:
        return False

    def unhealthy_peers(self) -> dict[int, list[str]]:
        return {}


def coordinator_for(strategy: Any, rank: int, world_size: int,
                    store: Any | None = None) -> StoreStopCoordinator | LocalStopCoordinator:
    """The coordinator of one ``fit()``: over ``store``, else the store the strategy offers
    (``stop_store``), else the process group's; a fresh key space chosen by rank 0 (a collective:
    every rank calls this at the same point of ``fit()``, never from a signal handler)."""
    if world_size <= 1:
        return LocalStopCoordinator()
    # a strategy that keeps its own store connection (ddp_ft: one that follows the store when
    # it fails over) offers it; else the process group's
    store = store if store is not None else getattr(strategy, "stop_store", None)
    if store is None:
        if not (dist.is_available() and dist.is_initialized()):
            log.warning("rank %d: world size %d but no process group; ranks cannot agree on a stop step",
                        rank, world_size)
            return LocalStopCoordinator()
        store = default_group_store()
    # Stores outlive worker groups: torchrun's agent keeps one TCPStore across worker restarts
    # and membership changes, so a stop key left by an earlier group would stop the restarted
    # one at once.
    namespace = strategy.broadcast(secrets.token_hex(8) if rank == 0 else None, src=0)
    assert namespace is not None  # rank 0's, on every rank
    return StoreStopCoordinator(store, rank, world_size, prefix=namespace_prefix(namespace))
