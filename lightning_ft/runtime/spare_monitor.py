"""The hot spare's monitor: a background thread while a spare waits in the rendezvous.

It keeps a copy of the newest snapshot when the actives publish one for replication
(:class:`~lightning_ft.checkpoint.exchange.replication.ReplicaPuller`), and opens the next round when
every active of the current round is silent -- survivors detect the loss of some of them
themselves, but nobody would open the next round if all of them were gone. It uses a store
connection of its own (``TCPStore.clone()``).

Its window is ``all_silent_after`` (:mod:`lightning_ft.rendezvous.liveness`), at least 3 s, longer
than the rendezvous's ``dead_after``: the
actives do the same work at the same moment (setting up, a snapshot of the same step), and on a
loaded machine work that holds the GIL kept all of their heartbeat threads from running for
about a second at the start of training -- long enough for a spare to open a round against a
healthy job, whose coordinator (that spare) then judged the actives dead: exit 83 for all.
When every active's process is proven gone (its presence port refuses: the store fail-over's
``proves_gone``), nothing is waited out: the round opens after ``dead_after`` of silence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from lightning_ft._clock import monotonic
from lightning_ft.checkpoint.exchange.replication import ReplicaPuller
from lightning_ft.deadlines import BackgroundThread, StoreClient
from lightning_ft.rendezvous.liveness import HeartbeatTracker
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.schema.round import decode_member, member_key
from lightning_ft.schema.run import RunKeys
from lightning_ft.schema.signing import SealedStore, Signer

log = logging.getLogger(__name__)


class SpareMonitor(BackgroundThread):
    """Runs on a hot spare while it waits (see the module docstring).

    ``open_round(failed_round, reason)`` opens the next round; ``replicas`` (optional)
    keeps copies of published snapshots.
    """

    def __init__(self, *, rdzv_store: StoreClient, keys: RunKeys, signer: Signer, dead_after: float,
                 open_round: Callable[[int, str], object], replicas: ReplicaPuller | None = None,
                 proves_gone: Callable[[Sequence[str]], set[str]] | None = None, gone_after: float = float("inf"),
                 poll_interval: float = 0.25, join_timeout: float = 2.0) -> None:
        super().__init__("lightning_ft-spare-monitor", join_timeout)
        self.store = rdzv_store
        self.signer = signer
        self.keys = keys
        self.records = RunRecords(rdzv_store, signer, keys)
        self.dead_after = dead_after
        #: which participants are proven gone (their processes ended), asked of actives silent for
        #: ``gone_after``: every active gone is judged at once, not after ``dead_after``
        self.proves_gone, self.gone_after = proves_gone, gone_after
        self.open_round = open_round
        self.replicas = replicas
        self.poll_interval = poll_interval
        self._watched_round = -1
        self._members: dict[int, str] = {}
        self._beats = HeartbeatTracker()

    def run(self) -> None:
        while not self.stopping.wait(self.poll_interval):
            try:
                self._poll()
            except Exception as exc:  # noqa: BLE001 - best effort: the main thread owns the real errors
                log.debug("spare monitor: %s", exc)

    def _poll(self) -> None:
        round_id = self.records.current_round()
        if not self.records.values.has(self.keys.ready(round_id)):
            return  # the round is still forming: nothing trains yet
        values = SealedStore(self.store, self.signer, self.keys.round_store_prefix(round_id))
        if self.replicas is not None:
            self.replicas.poll(values)
        self._watch_actives(round_id, values)

    def _watch_actives(self, round_id: int, values: SealedStore) -> None:
        if round_id != self._watched_round:
            self._watched_round = round_id
            self._members.clear()
            self._beats.clear()
        now = monotonic()
        rank = len(self._members)
        while (raw := values.get(member_key(rank))) is not None:
            self._members[rank] = decode_member(raw).participant_id
            rank += 1
        if (not self._members or self.store.check([self.keys.exit_barrier(round_id)])
                or self.records.round_finished(round_id)):  # the actives finished: their silence is no fault
            return
        # Only when *every* active is silent (see the module docstring).
        members = list(self._members.values())
        still = {p: self._beats.observe(p, self.records.heartbeat(p), now) for p in members}
        silent = [p for p in members if still[p] >= self.dead_after]
        if len(silent) < len(members) and self.proves_gone is not None and \
                all(t >= self.gone_after for t in still.values()) and set(members) <= self.proves_gone(members):
            silent = members  # every active's process ended: nothing to wait out
        if len(silent) == len(members):
            if self._closed_for_good():
                return  # the actives stopped (SIGTERM) or finished: their silence is the end, not a fault
            self.open_round(round_id, f"every active of round {round_id} is silent ({', '.join(silent)})")
            self._beats.clear()

    def _closed_for_good(self) -> bool:
        return self.records.closed_for_good() is not None
