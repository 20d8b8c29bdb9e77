"""The stop watcher: learns about a peer's stop request or unhealthy exit off the training thread.

Before, every rank asked the store at every optimizer-step boundary whether a stop had been
requested -- two store round trips per step on the training thread, a few percent of a
short step, and a step that blocked for the store's op timeout (minutes) when the store host
froze. Now one thread per rank blocks in a store ``wait`` on its wake key, on a connection of
its own: no traffic and no wake-ups while nothing happens. Whoever writes a stop request or
an unhealthy notice sets every rank's wake key after it; the woken watcher reads the sealed
request, publishes it in plain attributes (``stop``, ``unhealthy``) that the training thread
reads at its step boundary, and confirms it in the store. The confirmation is what keeps the
agreement exact: see ``GracefulTermination._hold_until_confirmed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lightning_ft.deadlines import BackgroundThread, call_with_timeout
from lightning_ft.termination.coordination import StopRequest, StoreStopCoordinator

log = logging.getLogger(__name__)

# a wait in the store server costs nothing while it lasts; the slice only bounds how long a
# watcher that nobody woke (its store gone mid-close) outlives its fit
_WAIT_SLICE_S = 3600.0
# after a failed store call (store gone or restarting): try again this much later
_RETRY_AFTER_S = 1.0
# a wake-up that brought nothing new (a stray or forged wake key): rest this long before the next
_SPURIOUS_WAKE_PAUSE_S = 0.01
# a store that cannot give the watcher a connection of its own: poll it at this interval instead
# (a blocking wait would hold the connection the training thread uses)
_POLL_INTERVAL_S = 0.1


class StopWatcher(BackgroundThread):
    """One rank's watcher thread (see the module docstring); ``on_stop(request)`` runs in it once.

    The thread opens a connection of its own from ``source`` (:meth:`StoreStopCoordinator.clone`,
    in the thread: a new TCPStore connection can take seconds) and blocks in it.
    """

    def __init__(self, source: StoreStopCoordinator, on_stop: Callable[[StopRequest], None],
                 close_timeout: float = 0.5) -> None:
        super().__init__("lightning-ft-stop-watcher", close_timeout)
        self._source = source
        self._coordinator = source
        self._on_stop = on_stop
        #: the agreed stop request, once this rank's watcher has read it (read by the training thread)
        self.request: StopRequest | None = None
        #: rank -> reasons, for peers that announced an unhealthy exit
        self.unhealthy: dict[int, list[str]] = {}
        self._failure_logged = False

    @property
    def peer_unhealthy(self) -> bool:
        return bool(self.unhealthy)

    def close(self, waker: StoreStopCoordinator) -> None:
        """End the thread: wake it through ``waker`` (another connection) and wait at most its close
        timeout. A watcher stuck in a store that does not answer is left behind (a daemon thread);
        nothing waits for it."""
        self.stopping.set()
        if not self.alive:
            return
        call_with_timeout(waker.wake_self, self.join_timeout, "waking the stop watcher")
        self.stop(join=True)

    def run(self) -> None:
        self._coordinator = self._source.clone()
        blocking = self._coordinator.store is not self._source.store
        if not blocking:
            log.info("rank %d: the store cannot open another connection; the stop watcher polls it every %.1f s",
                     self._source.rank, _POLL_INTERVAL_S)
        while not self.stopping.is_set():
            try:
                if not blocking:
                    if self.stopping.wait(_POLL_INTERVAL_S):
                        return
                    self._read()
                    continue
                woken = self._coordinator.wait_for_wake(_WAIT_SLICE_S)
                if self.stopping.is_set():
                    return
                if woken and not self._read() and self.stopping.wait(_SPURIOUS_WAKE_PAUSE_S):
                    return
            except Exception as exc:  # noqa: BLE001 - the store is gone or failing: the training thread's
                # own bounded calls report it when it matters; keep trying quietly
                if not self._failure_logged:
                    self._failure_logged = True
                    log.warning("rank %d: stop watcher cannot reach the store (%s: %s); retrying every %.0f s",
                                self._coordinator.rank, type(exc).__name__, str(exc).splitlines()[0][:200]
                                if str(exc) else "", _RETRY_AFTER_S)
                if self.stopping.wait(_RETRY_AFTER_S):
                    return

    def _read(self) -> bool:
        """Read what the wake-up is about; True if something new was learned."""
        learned = False
        if self.request is None:
            stop = self._coordinator.poll()
            if stop is not None:
                self.request = stop  # published before confirming: a rank that confirmed knows
                self._coordinator.confirm()
                learned = True
                try:
                    self._on_stop(stop)
                except Exception:  # the watcher must survive a failing callback
                    log.exception("rank %d: handling the stop request failed", self._coordinator.rank)
        peers = self._coordinator.unhealthy_peers()
        if peers != self.unhealthy and peers:
            self.unhealthy = peers
            learned = True
        return learned
