"""The fail-over candidates, as a participant learns them: who may host the store next.

After each round it completes, a participant takes the round's participants that announced a
presence (and the endpoint each would serve the store on), in arrivals-log order, as its
:class:`~lightning_ft.failover.switchboard.StoreSwitchboard`'s candidates (the first of them
that is alive serves the store if it is lost). Apart from the module of the switchboard, which
moves the store; this one only feeds it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_ft._clock import monotonic
from lightning_ft.deadlines import BackgroundThread, first_line
from lightning_ft.failover.partition import follow_newest
from lightning_ft.failover.presence import ask_each, refuses
from lightning_ft.failover.switchboard import Candidate, StoreSwitchboard
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.schema.failover import decode_presence, encode_presence, epoch_key, presence_key
from lightning_ft.schema.run import ROSTER_HEAD, decode_last_actives, decode_number, decode_roster_head
from lightning_ft.schema.signing import SealedStore

if TYPE_CHECKING:
    from lightning_ft.rendezvous.barrier import BarrierRendezvous, RoundResult

log = logging.getLogger(__name__)

#: how long asking whether a participant is gone waits for its host (a refusal comes at once)
GONE_CONNECT_TIMEOUT = 0.2


def read_candidates(switchboard: StoreSwitchboard, records: RunRecords, round_id: int) -> bool:
    """Set the switchboard's candidates to the participants of ``round_id`` that announced a
    presence, in log order. A participant among the first :data:`ROSTER_HEAD` (the ones that may
    host the store next) reads them all: it needs them for a quorum. The others read only those
    first ones from the roster head, so a round costs the store O(N), not O(N^2) (every
    participant reading the whole log). Returns True when this participant read them all."""
    head = decode_roster_head(records.values.get(records.keys.roster_head(round_id)))
    whole = head is None or head[0] <= ROSTER_HEAD or switchboard.participant_id in head[1]
    ids = [a.participant_id for a in records.arrivals(round_id)] if whole or head is None else list(head[1])
    names = [presence_key(records.keys.prefix, pid) for pid in ids]
    keys = [records.values.key(n) for n in names]
    if keys and records.store.check(keys):  # all there (the usual case): one request for all
        found = records.values.multi_get(names)
    else:
        found = [records.values.get(n) for n in names]
    announced = [(pid, decode_presence(raw) if raw is not None else None) for pid, raw in zip(ids, found, strict=True)]
    switchboard.candidates = [Candidate(pid, a.presence, a.successor) for pid, a in announced if a is not None]
    return whole


class FailoverParticipant:
    """Ties a :class:`StoreSwitchboard` to this process's rendezvous participant: announces its
    presence, takes the candidates from every round it completes (and, about once a second,
    the spares that arrive later), and takes nothing over once the participant left."""

    def __init__(self, switchboard: StoreSwitchboard, rendezvous: BarrierRendezvous) -> None:
        self.switchboard, self.rendezvous = switchboard, rendezvous
        self.tracked_round: int | None = None
        #: this participant knows every candidate (it is among the first: it may host the store)
        self.whole = False
        self._refresher: CandidateRefresher | None = None
        switchboard.participating = lambda: not rendezvous.left
        # presence answers and fail-over keys name this launch (run id, incarnation and the
        # launch's random id, read from the store now: see read_launch_id) and, with a job secret,
        # prove it
        switchboard.bind_launch(rendezvous.settings.run_id, rendezvous.keys.incarnation,
                                rendezvous.records.launch_id)
        # one that joins a store a fail-over opened counts its epochs from there (its sealed number
        # under this launch's keys; none: the launch's first store), as the others do
        assert switchboard.scope is not None  # bound just now
        served = decode_number(SealedStore(rendezvous.store, switchboard.signer).get(epoch_key(switchboard.scope)))
        if served is not None and served > switchboard.epoch:
            switchboard.epoch = served
        switchboard.presence.start()
        rendezvous.values.put(presence_key(rendezvous.keys.prefix, rendezvous.participant_id),
                              encode_presence(switchboard.presence.endpoint, switchboard.successor))
        rendezvous.proves_gone = self.proven_gone
        rendezvous.on_round_complete.append(self.track_round)
        rendezvous.on_leave.append(lambda: switchboard.presence.stop(join=False))

    def track_round(self, result: RoundResult) -> None:
        self.switchboard.active = result.is_active
        raw = self.rendezvous.values.get(self.rendezvous.keys.last_actives)
        last = decode_last_actives(raw) if raw is not None else None
        self.switchboard.actives = frozenset(last[1]) if last is not None and last[0] == result.round else frozenset()
        self.tracked_round = result.round
        self.whole = read_candidates(self.switchboard, self.rendezvous.records, result.round)
        if self._refresher is None and self.whole:
            clone = self.rendezvous.store.clone(4 * self.switchboard.timeouts.probe_timeout)
            self._refresher = CandidateRefresher(self, RunRecords(clone, self.rendezvous.signer, self.rendezvous.keys))
            self._refresher.start()

    def proven_gone(self, participant_ids: Sequence[str]) -> set[str]:
        """Which of ``participant_ids`` are proven gone: the presence port each announced refuses
        connections (its process ended, or it left). Asked in parallel, each within
        :data:`GONE_CONNECT_TIMEOUT`; one whose presence is unknown here is not proven gone."""
        endpoints = {c.participant_id: c.presence for c in self.switchboard.candidates}
        asked = [(pid, endpoints[pid]) for pid in participant_ids if pid in endpoints]
        refused = ask_each(asked, lambda a: refuses(a[1], GONE_CONNECT_TIMEOUT), "gone")
        return {pid for (pid, _), gone in zip(asked, refused, strict=True) if gone}

    def follow_newest(self) -> None:
        """Before re-joining after a failure (see :func:`~lightning_ft.failover.partition.follow_newest`)."""
        follow_newest(self.switchboard)

    def close(self) -> None:
        """The participant left for good: stop the refresher (joined)."""
        if self._refresher is not None:
            self._refresher.stop()


class CandidateRefresher(BackgroundThread):
    """Re-reads the tracked round's arrivals when their hint changes (about once a second, one
    request), so the fail-over order includes hot spares that arrived after the round completed;
    on a connection of its own. Ends when the participant left.

    It also notices a freeze of its own process (:meth:`frozen_for`): a store host frozen for
    less than the others take to judge it comes back on the store it serves itself -- its own
    clients still reach it, so nothing else tells it that the others failed over meanwhile; it
    would train on with them and, at the next fault, recover there alone (found by the chaos
    test: it ended 81 while they went on). After such a gap it asks the others which store they
    follow (:func:`~lightning_ft.failover.partition.follow_newest`) once a pass, for up to
    :attr:`THAW_WINDOW` -- their fail-over may still be under way as it thaws."""

    INTERVAL = 1.0
    #: a pass this much later than its interval means this process did not run (SIGSTOP, a hung
    #: or starved host); asking the others then costs a few probes, and moves only to a store a
    #: majority of them follow
    FROZEN_GAP = 1.5
    THAW_WINDOW = 10.0

    def __init__(self, owner: FailoverParticipant, records: RunRecords) -> None:
        super().__init__("lightning_ft-candidates", join_timeout=owner.switchboard.timeouts.thread_stop_timeout)
        self.owner, self.records = owner, records
        self._hint: tuple[int, bytes] | None = None

    def run(self) -> None:
        passed_at, follow_until = monotonic(), None
        while not self.stopping.wait(self.INTERVAL):
            if self.owner.rendezvous.left:
                return
            now = monotonic()
            if self.frozen_for(now - passed_at) and self.owner.switchboard.hosting:
                follow_until = now + self.THAW_WINDOW
            if follow_until is not None:
                follow_until = None if self._followed_the_others() or now >= follow_until else follow_until
            passed_at = monotonic()
            round_id = self.owner.tracked_round
            if round_id is None or not self.owner.whole:
                continue  # spares arriving later join the end of the order: only the first need them
            try:
                hint = (round_id, self.records.appended_hint(round_id))
                if hint != self._hint:
                    self.owner.whole = read_candidates(self.owner.switchboard, self.records, round_id)
                    self._hint = hint
            except Exception as exc:  # noqa: BLE001 - the next try, or the fail-over, tells
                log.debug("refreshing the fail-over candidates: %s", first_line(exc))

    def frozen_for(self, since_last_pass: float) -> bool:
        """Whether ``since_last_pass`` seconds between two passes mean this process was frozen."""
        return since_last_pass > self.INTERVAL + self.FROZEN_GAP

    def _followed_the_others(self) -> bool:
        try:
            return follow_newest(self.owner.switchboard)
        except Exception as exc:  # noqa: BLE001 - asked again next pass; a store call fails over if it must
            log.debug("after a freeze: asking which store the others follow: %s", first_line(exc))
            return False
