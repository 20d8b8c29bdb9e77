"""The coordinator of one round of the barrier rendezvous: reads the arrivals, asks the pure
decision (:func:`~lightning_ft.rendezvous.decisions.decide_completion`), writes the result.

The first participant to claim a round coordinates it; a waiter takes over when its lease stops rising
(:class:`CoordinatorWatch` in :class:`~lightning_ft.rendezvous.barrier.BarrierRendezvous`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning_ft._text import printable
from lightning_ft.rendezvous.decisions import (
    Action,
    Arrival,
    RoundTimer,
    RoundView,
    actives_from_answers,
    assign_ranks,
    decide_completion,
    split_extras,
)
from lightning_ft.rendezvous.liveness import HeartbeatTracker, came_back
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.rendezvous.settings import RendezvousSettings
from lightning_ft.schema.run import (
    EXTRA_RANK,
    ROSTER_HEAD,
    Beat,
    CloseKind,
    CloseReason,
    LostRecord,
    RunKeys,
    decode_last_actives,
    decode_rank_answer,
    decode_ready,
    encode_last_actives,
    encode_rank_answer,
    encode_ready,
    encode_roster_head,
)
from lightning_ft.schema.signing import SealedStore, Signer, get_if_present

log = logging.getLogger(__name__)


class RendezvousMember(Protocol):
    """What a coordinator uses of the participant that runs it (a ``BarrierRendezvous``)."""

    store: Any
    keys: RunKeys
    settings: RendezvousSettings
    values: SealedStore
    records: RunRecords
    signer: Signer
    clock: Callable[[], float]
    #: which of the given participants are proven gone (None: nothing can prove it here)
    proves_gone: Callable[[Sequence[str]], set[str]] | None

    @property
    def participant_id(self) -> str: ...

    def mark_lost(self, participant_id: str, why: str, silent_at: int | None = None) -> bool: ...

    def close_for_good(self, reason: CloseReason) -> CloseReason: ...


@dataclass
class CoordinatorWatch:
    """A waiter's watch on the coordinator's lease."""

    since: float
    next_check: float = 0.0
    #: the highest lease renewal seen per holder: only a higher one shows the holder alive
    renewals: dict[str, int] = field(default_factory=dict)
    #: the coordinators this one took over from: the silent one, and those it had replaced
    replaced: tuple[str, ...] = ()
    #: whose silence ``since`` measures: a new holder of the claim gets a full ``takeover_after``
    #: (one that just took over has not renewed its lease yet)
    holder: str | None = None

    def lease_rose(self, lease: Beat | None, now: float) -> bool:
        """Record ``lease`` (read at ``now``); True when it rose (a replayed older one does not)."""
        if lease is None or lease.seq <= self.renewals.get(lease.holder, -1):
            return False
        self.renewals[lease.holder] = lease.seq
        self.since = now
        return True


    def should_take_over(self, records: RunRecords, round_id: int, participant_id: str,
                         settings: RendezvousSettings, now: float) -> bool:
        """Whether this waiter takes the round over, and has (its claim replaced the silent one's).

        The coordinator renews a sealed lease each tick. If it does not rise for ``takeover_after``
        (the coordinator died), one waiter replaces the claim and coordinates instead."""
        if now < self.next_check:
            return False
        self.next_check = now + settings.heartbeat_every
        if self.lease_rose(records.lease(round_id), now):
            return False
        if now - self.since < settings.takeover_after:
            return False
        seen, claim = records.coordinator(round_id)
        holder, earlier = claim if claim is not None else ("", ())
        if holder != (self.holder or ""):  # a new holder: its silence is timed from now
            self.holder, self.since = holder, now
            return False
        replaced = tuple(dict.fromkeys(p for p in (holder, *earlier) if p and p != participant_id))
        if records.take_over_coordinator(round_id, seen, participant_id, replaced):
            log.info("%s took over coordinating round %d from %r (silent for %.1fs)",
                     participant_id, round_id, holder, now - self.since)
            self.replaced = replaced
            return True
        self.since = now
        return False


def newest_tick(store: Any, keys: RunKeys, round_id: int) -> int:
    """The number of the newest tick of ``round_id`` (-1: none yet, or not a number: it is a hint)."""
    raw = get_if_present(store, keys.last_tick(round_id))
    try:
        return int(raw) if raw is not None else -1
    except ValueError:
        return -1


class Coordinator:
    """Decides one round: reads the arrivals, asks the pure decision, writes the result."""

    def __init__(self, rendezvous: RendezvousMember, round_id: int, replaces: tuple[str, ...] = ()) -> None:
        self.rdzv = rendezvous
        self.records = rendezvous.records
        self.keys = rendezvous.keys
        self.settings = rendezvous.settings
        self.round_id = round_id
        self.clock = rendezvous.clock
        self.timer = RoundTimer(opened_at=self.clock())
        #: the previous round's participants (actives and standby, lost or not)
        self._previous_ids: frozenset[str] = frozenset()
        self.previous_actives, self.previous_standby = self._read_previous_round()
        self._heartbeats = HeartbeatTracker()
        self._dead: set[str] = set()
        #: the dead judged by a silent heartbeat alone (a watchdog's verdict or this coordinator's),
        #: with the beat each stood at: one that arrives with its heartbeat risen past it was frozen
        #: or starved, not dead, and takes part in this round after all
        self._silenced: dict[str, LostRecord] = {}
        self._silenced_read_at = -float("inf")
        #: arrivals found without a heartbeat (logged once each)
        self._phantoms: set[str] = set()
        #: when each silent participant was last asked whether it is gone (once per heartbeat)
        self._asked_gone: dict[str, float] = {}
        # a coordinator this one took over from fell silent; if its heartbeat is silent too it
        # is dead, and must not get a place in the round it failed to decide. The same for the
        # ones it had replaced: a takeover from a slow coordinator still judges the dead one.
        self._suspects: set[str] = set(replaces)
        self._renewals = itertools.count(1)
        self._arrivals: tuple[Arrival, ...] | None = None
        self._hint: bytes | None = None
        self._read_at = -float("inf")
        self._last_reason = ""
        #: the next tick's number (continuing after a coordinator this one took over from)
        self._tick = newest_tick(rendezvous.store, self.keys, round_id) + 1
        self._ticked_at = -float("inf")
        log.debug("%s coordinates round %d (previous actives: %d)", rendezvous.participant_id,
                  round_id, len(self.previous_actives))

    def tick(self) -> None:
        """Wake every waiter of the round now (they wait on the store for this key) and renew the
        lease: the ticks are how waiters see this coordinator alive."""
        self.records.renew_lease(self.round_id, self.rdzv.participant_id, next(self._renewals))
        store = self.rdzv.store
        number, self._tick = self._tick, self._tick + 1
        store.set(self.keys.last_tick(self.round_id), str(number))
        store.set(self.keys.tick(self.round_id, number), "")
        self._ticked_at = self.clock()

    def still_mine(self) -> bool:
        _, claim = self.records.coordinator(self.round_id)
        # a claim that fails its check is tampering, not a successor: keep coordinating
        return claim is None or claim[0] in ("", self.rdzv.participant_id)

    def _read_previous_round(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The previous round's actives (in rank order) and its standby participants not lost."""
        raw = self.rdzv.values.get(self.keys.last_actives)
        last = decode_last_actives(raw) if raw is not None else None
        if self.round_id > 0 and (last is None or last[0] < self.round_id - 1):
            recovered = self._actives_from_answers(self.round_id - 1)
            if recovered:
                log.info("round %d: the actives of round %d were not in the store (rebuilt by a fail-over); %d "
                         "recovered from their rank answers", self.round_id, self.round_id - 1, len(recovered))
                last = (self.round_id - 1, recovered)
        if last is None or last[0] >= self.round_id:
            return (), ()
        lost = self.records.lost()
        arrived = self.records.arrivals(last[0])
        self._previous_ids = frozenset(a.participant_id for a in arrived) | frozenset(last[1])
        standby = tuple(a.participant_id for a in arrived
                        if a.participant_id not in last[1] and a.participant_id not in lost)
        return last[1], standby

    def _actives_from_answers(self, round_id: int) -> tuple[str, ...]:
        """The actives of ``round_id`` named by the rank answers still in the store (see
        :func:`~lightning_ft.rendezvous.decisions.actives_from_answers`); () when it never completed."""
        raw = self.rdzv.values.get(self.keys.ready(round_id))
        ready = decode_ready(raw) if raw is not None else None
        if ready is None:
            return ()
        ids = [a.participant_id for a in self.records.arrivals(round_id)]
        answers = [self.rdzv.values.get(self.keys.decided_rank(round_id, ready.decision, pid)) for pid in ids]
        return actives_from_answers(round_id, [(pid, decode_rank_answer(raw) if raw is not None else None)
                                               for pid, raw in zip(ids, answers, strict=True)])

    def _read_arrivals(self, now: float) -> tuple[Arrival, ...]:
        # the hint is read before the log: an arrival it counts is in the log read after it. Read
        # again every heartbeat interval regardless: a hint is only a hint.
        hint = self.records.appended_hint(self.round_id)
        since = now - self._read_at
        if (self._arrivals is None or (hint != self._hint and since >= self.settings.reread_interval)
                or since >= self.settings.heartbeat_every):
            self._arrivals = self.records.arrivals(self.round_id)
            self._hint, self._read_at = hint, now
        return self._arrivals

    def read_view(self) -> RoundView:
        """The round as the store says now (arrivals in log order, lost participants)."""
        arrivals = self._read_arrivals(self.clock())
        lost, replaced = self._lost_count(arrivals)
        return RoundView(self.round_id, arrivals, self.previous_actives, frozenset(self._dead), lost,
                         self.previous_standby, replaced)

    def _lost_count(self, arrivals: tuple[Arrival, ...]) -> tuple[int, int]:
        """Participants lost for good that cannot come back, and how many of their places nodes that
        joined later took. One judged dead while it was only frozen beats again once thawed, waits
        as a spare and counts as able to take part; its heartbeat is read only while the count
        matters (fewer than min_nodes arrived). The places taken: participants known to this round
        (the previous round's, this round's, the lost) beyond max_nodes -- without them every
        replaced loss of a long job would count against it, and after max_nodes - min_nodes + 1
        losses a survivor arriving before the spares closed the job for good."""
        lost = self.records.lost_records()
        known = len(self._previous_ids | {a.participant_id for a in arrivals} | set(lost))
        replaced = max(0, known - self.settings.max_nodes)
        if len(arrivals) < self.settings.min_nodes:
            return self.records.not_back(lost), replaced
        return len(lost), replaced

    def _update_dead(self, view: RoundView) -> bool:
        """Mark silent previous actives dead; True when someone newly died."""
        arrived_ids = {a.participant_id for a in view.arrivals}
        self._suspects &= arrived_ids | self._dead  # one that withdrew has no place to lose
        missing = [p for p in self.previous_actives if p not in arrived_ids and p not in self._dead]
        missing += [p for p in self._suspects if p in arrived_ids and p not in self._dead and p not in missing]
        if not missing:
            return False
        # a previous active that withdrew or left unhealthy (a hand-over, an eviction) is lost for
        # good already: nothing to wait out, no heartbeat to judge. So is one a peer's watchdog
        # judged frozen, while its heartbeat stands where that judgement found it.
        lost = self.records.lost_records()
        gone = {pid for pid, record in lost.items() if record.silent_at is None}
        judged = [pid for pid in missing if pid in lost and pid not in gone]
        if judged:
            beats = self.records.heartbeats(judged)
            stayed = [pid for pid in judged if not came_back(lost[pid], beats[pid])]
            gone.update(stayed)
            self._silenced.update((pid, lost[pid]) for pid in stayed if pid not in self._suspects)
        left = [pid for pid in missing if pid in gone]
        self._dead.update(left)
        missing = [pid for pid in missing if pid not in gone]
        now, liveness = self.clock(), self.settings.liveness
        dead: dict[str, str] = {}
        unproven = []
        for pid, beat in self.records.heartbeats(missing).items():
            known = self._heartbeats.knows(pid)
            still = self._heartbeats.observe(pid, beat, now)
            if still >= liveness.unproven_dead_after:
                dead[pid] = f"heartbeat silent for {liveness.unproven_dead_after:.2f}s"
            elif still >= liveness.dead_after:
                unproven.append(pid)
            elif known and still == 0.0 and pid in self._suspects:
                self._suspects.discard(pid)  # its heartbeat rises: slow, not dead; it keeps its place
        for pid in self._proven_gone(unproven, now):
            dead[pid] = f"heartbeat silent for {liveness.dead_after:.2f}s, its process gone"
        for pid in sorted(dead):
            self._dead.add(pid)
            why = ("coordinator of this round that went silent" if pid in self._suspects
                   else f"previous active, missing from round {self.round_id}")
            record = LostRecord(pid, f"{dead[pid]} ({why})", self._heartbeats.last_beat(pid))
            self.rdzv.mark_lost(pid, record.why, silent_at=record.silent_at)
            if pid not in self._suspects and pid not in unproven:
                self._silenced[pid] = record
        return bool(dead or left)

    def _without_heartbeat(self, arrivals: tuple[Arrival, ...]) -> tuple[Arrival, ...] | None:
        """``arrivals`` less those without a heartbeat of their own (absent, or not authentic), or
        None when every one has one (one read, as the round is about to complete). A participant
        beats before it arrives, so only an arrival record nobody's process stands behind lacks
        one: a store client's forgery without a secret, a replayed record of a dead participant
        with one. Placed, such a phantom held every step for the group's init timeout (60 s)."""
        beats = self.records.heartbeats([a.participant_id for a in arrivals])
        phantoms = {pid for pid, beat in beats.items() if beat is None}
        if not phantoms:
            return None
        for pid in sorted(phantoms - self._phantoms):
            log.warning("round %d: arrival of %s has no heartbeat of its own (no process stands behind it): no "
                        "place for it", self.round_id, printable(pid[:200]))
        self._phantoms |= phantoms
        return tuple(a for a in arrivals if a.participant_id not in phantoms)

    def _revive_silenced(self, arrivals: tuple[Arrival, ...]) -> None:
        """Give back their place to the :attr:`_silenced` that arrived and beat again (read once per
        heartbeat). A live process starved for seconds on an overloaded machine was once judged
        frozen by a peer's watchdog; without this the round counted it lost though it had
        arrived, and with too few nodes left the whole job ended 81."""
        now = self.clock()
        arrived = [a.participant_id for a in arrivals if a.participant_id in self._silenced]
        if not arrived or now - self._silenced_read_at < self.settings.heartbeat_every:
            return
        self._silenced_read_at = now
        beats = self.records.heartbeats(arrived)
        for pid in arrived:
            if came_back(self._silenced[pid], beats[pid]):
                del self._silenced[pid]
                self._dead.discard(pid)
                log.info("round %d: %s, judged dead by its silent heartbeat, arrived and beats again "
                         "(it was starved or frozen, not dead): it takes part", self.round_id, pid)

    def _proven_gone(self, silent: list[str], now: float) -> set[str]:
        """Which of ``silent`` are proven gone, each asked at most once per heartbeat: a silent
        heartbeat alone may be a loaded machine (see :mod:`.liveness`), judged only later."""
        ask = [pid for pid in silent if now - self._asked_gone.get(pid, -float("inf")) >= self.settings.heartbeat_every]
        if not ask or self.rdzv.proves_gone is None:
            return set()
        self._asked_gone.update(dict.fromkeys(ask, now))
        return self.rdzv.proves_gone(ask) & set(ask)

    def step(self) -> None:
        if self.clock() - self._ticked_at >= min(self.settings.tick_interval, self.settings.heartbeat_every):
            self.tick()
        view = self.read_view()
        if self._update_dead(view):  # deaths just recorded as lost change what the view says
            lost, replaced = self._lost_count(view.arrivals)
            view = dataclasses.replace(view, dead_previous_actives=frozenset(self._dead), lost_count=lost,
                                       replaced=replaced)
        if self._suspects:
            if self._suspects - self._dead:
                return  # not judged yet: deciding now could give a dead coordinator a place
        self._revive_silenced(view.arrivals)
        if self._dead:
            view = dataclasses.replace(view, arrivals=tuple(a for a in view.arrivals
                                                            if a.participant_id not in self._dead))
        arrived = view.arrivals
        eligible, extras = split_extras(arrived, self.settings.max_nodes)
        view = dataclasses.replace(view, arrivals=eligible)
        now = self.clock()
        decision = decide_completion(view, self.settings, self.timer, now)
        if decision.action is Action.COMPLETE:
            beating = self._without_heartbeat(arrived)
            if beating is not None:  # a place only for arrivals seen beating
                eligible, extras = split_extras(beating, self.settings.max_nodes)
                view = dataclasses.replace(view, arrivals=eligible)
                decision = decide_completion(view, self.settings, self.timer, now)
        if decision.reason != self._last_reason:
            log.debug("round %d: %s -> %s", self.round_id, decision.reason, decision.action.value)
            self._last_reason = decision.reason
        if decision.action is Action.COMPLETE:
            self._complete(eligible, extras, view.arrivals)
            self.tick()
        elif decision.action is Action.CLOSE_FOR_GOOD:
            self.rdzv.close_for_good(CloseReason(CloseKind.TOO_FEW_NODES, decision.reason))
            self.tick()

    def _complete(self, arrivals: tuple[Arrival, ...], extras: tuple[Arrival, ...],
                  in_log_order: tuple[Arrival, ...]) -> None:
        # Each decision writes its answers under a name of its own; ``ready`` -- first writer
        # wins -- names the one in force. A coordinator that dies (or stalls) anywhere in here
        # therefore never blocks the round: whoever takes over decides again and publishes its
        # own answers; a stalled one that wakes up loses the race for ``ready`` and leaves its
        # answers unread.
        decision = f"{self.rdzv.participant_id}#{uuid.uuid4().hex[:8]}"
        assignment = assign_ranks(arrivals, self.previous_actives, self.settings.active_count,
                                  self.settings.segment, keep_ranks=self.settings.keep_ranks)
        world = len(assignment.active)
        answers = [(a, rank) for rank, a in enumerate(assignment.active)]
        answers += [(a, -1) for a in assignment.standby] + [(a, EXTRA_RANK) for a in extras]
        values = self.rdzv.values
        values.multi_put([self.keys.decided_rank(self.round_id, decision, a.participant_id) for a, _ in answers],
                         [encode_rank_answer(self.round_id, rank, world) for _, rank in answers])
        mine = encode_ready(world, len(assignment.standby), self.clock() - self.timer.opened_at, decision)
        if values.put_if_absent(self.keys.ready(self.round_id), mine) != mine.encode():
            return  # another coordinator's decision is in force
        values.put(self.keys.last_actives,
                   encode_last_actives(self.round_id, [a.participant_id for a in assignment.active]))
        values.put(self.keys.roster_head(self.round_id),
                   encode_roster_head(len(in_log_order), [a.participant_id for a in in_log_order[:ROSTER_HEAD]]))
        log.debug("round %d closed: %d active, %d standby, %d extra (decided in %.3fs)", self.round_id, world,
                  len(assignment.standby), len(extras), self.clock() - self.timer.opened_at)
