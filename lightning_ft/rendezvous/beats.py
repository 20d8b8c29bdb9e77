"""The two signals of a round that are not decisions: a participant's heartbeat, and the
coordinator's ticks that wake its waiters (see :mod:`.barrier`)."""

from __future__ import annotations

import datetime
import itertools
import logging

from torch.distributed import DistStoreError

from lightning_ft._clock import monotonic
from lightning_ft.deadlines import BackgroundThread, DeadlineExceeded, StoreClient
from lightning_ft.rendezvous.coordinator import newest_tick
from lightning_ft.schema.run import RunKeys, encode_number
from lightning_ft.schema.signing import SealedStore

log = logging.getLogger(__name__)


class TickWaiter:
    """A waiter's side of the coordinator's ticks: waits on the store for the next one.

    The store answers a ``wait`` when the key appears, so a waiter makes a request per tick
    instead of one per poll. Returns when woken or after ``timeout`` (the coordinator is silent:
    the caller then judges its lease). A waiter that fell behind skips to the newest tick.
    """

    def __init__(self, store: StoreClient, keys: RunKeys, round_id: int) -> None:
        self.store, self.keys, self.round_id = store, keys, round_id
        self._next: int | None = None

    def arm(self) -> None:
        """Note the newest tick; call it *before* checking what the tick announces. The coordinator
        writes a decision first and ticks after it, so a decision this check missed comes with a
        tick newer than the one noted here, and :meth:`wait` returns for it at once. (Noted after
        the check, that tick could already be the newest: the wait would sleep through it.)"""
        if self._next is None:
            self._next = newest_tick(self.store, self.keys, self.round_id) + 1

    def wait(self, timeout: float) -> bool:
        """True when a tick newer than the one :meth:`arm` noted came within ``timeout`` seconds."""
        self.arm()
        assert self._next is not None
        started = monotonic()
        try:
            self.store.wait([self.keys.tick(self.round_id, self._next)], datetime.timedelta(seconds=timeout))
        except DistStoreError:  # the wait timed out (a lost store raises a network error instead)
            self._next = None
            return False
        self._next += 1
        if monotonic() - started < 0.001:  # that tick was there already: skip to the newest
            self._next = max(self._next, newest_tick(self.store, self.keys, self.round_id) + 1)
        return True


class Heartbeat(BackgroundThread):
    """Raises this participant's sealed heartbeat number every ``interval`` on a connection of its
    own (one that does not rise for ``dead_after`` counts as dead); beats on after a beat that
    timed out, stops quietly when the store is gone. A sealed number, not a counter: a store
    client can neither bump it nor replay an older one to keep a dead participant alive."""

    def __init__(self, values: SealedStore, key: str, interval: float) -> None:
        super().__init__("lightning_ft-heartbeat", join_timeout=interval)
        self.values, self.key, self.interval = values, key, interval
        self._beats = itertools.count(1)

    def beat(self) -> None:
        self.values.put(self.key, encode_number(next(self._beats)))

    def start(self) -> None:
        self.beat()  # the first beat before returning: the round may judge at once
        super().start()

    def run(self) -> None:
        late = False
        while not self.stopping.is_set():
            try:
                self.beat()
                late = False
            except (DeadlineExceeded, DistStoreError) as exc:
                # a beat that timed out (a loaded store): the next may land; a heartbeat that
                # stopped here for good would count this live participant dead
                if not late:
                    log.debug("a heartbeat timed out, beating on: %s", exc)
                late = True
            except Exception as exc:  # noqa: BLE001 - store gone: stop beating quietly
                log.debug("heartbeat stopped: %s", exc)
                return
            self.stopping.wait(self.interval)
