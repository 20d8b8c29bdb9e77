"""Pure decisions of the barrier rendezvous: no store, no clock, no I/O.

The coordinator reads the store into a :class:`RoundView`, asks :func:`decide_completion`
what to do, and performs the answer. Everything here is deterministic so it can be
tested with plain values and a fake clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lightning_ft.rendezvous.settings import RendezvousSettings
from lightning_ft.schema.run import ArrivalRecord, RankAnswer


class Arrival(NamedTuple):
    """A participant that arrived in the round under decision (and did not withdraw)."""

    #: where its arrival record is in the round's arrivals log: earlier arrivals come first
    position: int
    participant_id: str
    infra_rank: int = -1
    domain_id: str = "none"


@dataclass(frozen=True)
class RoundView:
    """What the coordinator read from the store for one round."""

    round: int
    arrivals: tuple[Arrival, ...]
    #: participant ids of the previous round's actives, in their old rank order
    previous_actives: tuple[str, ...] = ()
    #: previous actives known to be dead (heartbeat silent)
    dead_previous_actives: frozenset[str] = frozenset()
    #: participants the job lost for good so far (unhealthy, dead, withdrawn)
    lost_count: int = 0
    #: participant ids that waited as standby in the previous round (hot spares, newcomers), not lost
    previous_standby: tuple[str, ...] = ()
    #: how many of the lost places nodes that joined later took (participants known beyond max_nodes)
    replaced: int = 0


def arrivals_of_round(records: Sequence[ArrivalRecord | None]) -> tuple[Arrival, ...]:
    """The live arrivals of a round from its arrivals log (authentic records, in log order).

    Each participant counts by its newest record (highest ``seq``) at the position where that
    record first appears: a participant that withdrew is left out, one that arrived again counts
    at its new place, and a record replayed later in the log (a copy) changes neither.
    """
    newest: dict[str, tuple[int, ArrivalRecord]] = {}
    for position, record in enumerate(records):
        if record is None:
            continue
        seen = newest.get(record.participant_id)
        if seen is None or record.seq > seen[1].seq:
            newest[record.participant_id] = (position, record)
    live = sorted((position, record) for position, record in newest.values() if not record.withdrawn)
    return tuple(Arrival(position, r.participant_id, r.infra_rank, r.domain_id) for position, r in live)


def split_extras(arrivals: Sequence[Arrival], max_nodes: int) -> tuple[tuple[Arrival, ...], tuple[Arrival, ...]]:
    """``(eligible, extra)``: the first ``max_nodes`` live arrivals have a place; later ones do not."""
    return tuple(arrivals[:max_nodes]), tuple(arrivals[max_nodes:])


@dataclass(frozen=True)
class Assignment:
    """Result of a round: actives in rank order, the rest standby."""

    active: tuple[Arrival, ...]
    standby: tuple[Arrival, ...]

    def rank_of(self, participant_id: str) -> int:
        for rank, arrival in enumerate(self.active):
            if arrival.participant_id == participant_id:
                return rank
        return -1


def _priority(arrival: Arrival, previous_rank: dict[str, int]) -> tuple:
    # previous actives first (in their old rank order), then scheduler node index, then arrival
    old = previous_rank.get(arrival.participant_id)
    if old is not None:
        return (0, old, 0, arrival.position)
    infra = arrival.infra_rank if arrival.infra_rank >= 0 else math.inf
    return (1, 0, infra, arrival.position)


def actives_from_answers(round_id: int, answers: Iterable[tuple[str, RankAnswer | None]]) -> tuple[str, ...]:
    """The actives of ``round_id`` in rank order, from the rank answers of its participants that are
    still known (``(participant id, answer)``; None: not known). After a store fail-over the round's
    list of actives may be gone (only its coordinator had written it) while every participant that
    handed its view over kept its own answer: those name the survivors, the ones a round after a
    failure must keep places for; a participant whose answer is gone did not hand its view over."""
    ranked = sorted((answer.rank, pid) for pid, answer in answers
                    if answer is not None and answer.round == round_id and answer.rank >= 0)
    return tuple(pid for _, pid in ranked)


def assign_ranks(arrivals: Iterable[Arrival], previous_actives: Sequence[str], min_nodes: int,
                 segment: int = 1, keep_ranks: bool = False) -> Assignment:
    """Choose the ``min_nodes`` actives deterministically; everyone else is standby.

    With ``segment > 1`` actives come in whole groups of ``segment`` participants sharing
    a ``domain_id``; domains are taken in the order of their best member's priority.
    Fewer than ``min_nodes`` eligible participants gives fewer actives (callers check
    :func:`can_form_active_set` first).

    ``keep_ranks`` (sharded state: a rank's shard exists only where that rank ran): every
    previous active that arrived keeps its old rank, and the places of those missing go to
    the others in priority order -- instead of closing ranks, which would move every shard
    after the hole. Only with ``segment == 1``.
    """
    previous_rank = {pid: rank for rank, pid in enumerate(previous_actives)}
    ordered = sorted(arrivals, key=lambda a: _priority(a, previous_rank))
    if keep_ranks:
        if segment != 1:
            raise ValueError("keep_ranks needs segment == 1")
        return _keep_ranks(ordered, previous_rank, min_nodes)
    if segment == 1:
        return Assignment(tuple(ordered[:min_nodes]), tuple(ordered[min_nodes:]))

    domains: dict[str, list[Arrival]] = {}
    for arrival in ordered:  # keeps each domain's members in priority order
        domains.setdefault(arrival.domain_id, []).append(arrival)
    active: list[Arrival] = []
    for members in domains.values():  # dict order = order of each domain's best member
        room = min_nodes - len(active)
        if room <= 0:
            break
        usable = (len(members) // segment) * segment
        active.extend(members[:min(usable, (room // segment) * segment)])
    chosen = {a.position for a in active}
    return Assignment(tuple(active), tuple(a for a in ordered if a.position not in chosen))


def _keep_ranks(ordered: Sequence[Arrival], previous_rank: dict[str, int], min_nodes: int) -> Assignment:
    # callers complete a round only with min_nodes eligible arrivals (can_form_active_set), so
    # every place is filled and no rank moves; with fewer, the actives would close ranks
    places: list[Arrival | None] = [None] * min_nodes
    others = []
    for arrival in ordered:
        old = previous_rank.get(arrival.participant_id)
        if old is not None and old < min_nodes and places[old] is None:
            places[old] = arrival
        else:
            others.append(arrival)
    waiting = iter(others)
    places = [place if place is not None else next(waiting, None) for place in places]
    active = tuple(place for place in places if place is not None)
    return Assignment(active, tuple(waiting))


def can_form_active_set(arrivals: Sequence[Arrival], min_nodes: int, segment: int = 1) -> bool:
    if segment == 1:
        return len(arrivals) >= min_nodes
    per_domain: dict[str, int] = {}
    for arrival in arrivals:
        per_domain[arrival.domain_id] = per_domain.get(arrival.domain_id, 0) + 1
    return sum((n // segment) * segment for n in per_domain.values()) >= min_nodes


class Action(enum.Enum):
    WAIT = "wait"
    COMPLETE = "complete"
    CLOSE_FOR_GOOD = "close_for_good"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    #: for WAIT: the time (same clock as ``now``) at which waiting alone would change the answer
    wake_at: float | None = None


@dataclass
class RoundTimer:
    """Times the coordinator tracks for one round (same clock as ``now``)."""

    opened_at: float
    min_reached_at: float | None = None
    #: when the round first found too few nodes able to take part (see ``replacement_wait``)
    short_since: float | None = None


def decide_completion(view: RoundView, settings: RendezvousSettings, timer: RoundTimer,
                      now: float) -> Decision:
    """Should the round complete now, keep waiting, or can it never complete?

    Updates ``timer.min_reached_at`` the first time enough participants are present.
    """
    arrived = len(view.arrivals)
    # a lost node's place is taken by a node that joined later (a replacement a scheduler started):
    # the places lost over a long job are not all gone for good
    capacity = settings.max_nodes - view.lost_count + view.replaced
    if arrived >= settings.max_nodes:
        return Decision(Action.COMPLETE, f"all max_nodes={settings.max_nodes} arrived")

    if not can_form_active_set(view.arrivals, settings.min_nodes, settings.segment):
        timer.min_reached_at = None
        if capacity >= settings.min_nodes:
            timer.short_since = None
        else:
            if timer.short_since is None:
                timer.short_since = now
            left = settings.timeouts.replacement_wait - (now - timer.short_since)
            if left > 0:  # a scheduler's restart loop brings a crashed node back within seconds
                return Decision(Action.WAIT, f"{arrived} arrived, need {settings.min_nodes}; too few nodes can "
                                             f"still take part ({view.lost_count} lost for good): waiting up to "
                                             f"{left:.1f}s for a replacement (replacement_wait)")
            return Decision(
                Action.CLOSE_FOR_GOOD,
                f"only {max(capacity, 0)} of max_nodes={settings.max_nodes} nodes can still take "
                f"part ({view.lost_count} lost for good: unhealthy, dead or withdrawn"
                f"{f'; {view.replaced} of their places taken by nodes that joined later' if view.replaced else ''}), "
                f"fewer than "
                f"min_nodes={settings.min_nodes}; {arrived} arrived in round {view.round}")
        need = (f"{settings.min_nodes} in whole segments of {settings.segment}"
                if settings.segment > 1 else str(settings.min_nodes))
        return Decision(Action.WAIT, f"{arrived} arrived, need {need}")

    timer.short_since = None  # enough nodes again: a later shortage waits for a replacement anew
    if timer.min_reached_at is None:
        timer.min_reached_at = now
    last_call_end = timer.min_reached_at + settings.timeouts.last_call_timeout
    if settings.elastic and view.round == 0:  # nodes started together arrive seconds apart: wait for them
        last_call_end = max(last_call_end, timer.opened_at + settings.timeouts.elastic_start_window)
    arrived_ids = {a.participant_id for a in view.arrivals}
    missing = [pid for pid in view.previous_actives
               if pid not in arrived_ids and pid not in view.dead_previous_actives]
    grace_end = timer.opened_at + settings.timeouts.previous_active_grace
    if missing and now < grace_end:
        return Decision(Action.WAIT,
                        f"keeping places for {len(missing)} survivor(s) of the previous round",
                        wake_at=grace_end)
    expected = {*view.previous_actives, *view.previous_standby} - view.dead_previous_actives
    if view.previous_actives and not missing and expected <= arrived_ids:
        # every live participant of the previous round is here: nobody else is known to come (a
        # newcomer waits as standby and is taken in later), so no last call is waited out
        return Decision(Action.COMPLETE, f"every live participant of the previous round arrived ({arrived})")
    if now < last_call_end:
        return Decision(Action.WAIT, f"last call ({arrived} arrived)", wake_at=last_call_end)
    return Decision(Action.COMPLETE, f"{arrived} arrived (min_nodes={settings.min_nodes}) and "
                                     f"the last call ended")


def choose_incarnation(current: int, closed_at: float | None, started_at: float) -> int:
    """Which incarnation of a run a participant belongs to.

    ``current`` is the newest incarnation in the store, ``closed_at`` when it was closed for
    good (None: still open), ``started_at`` when this participant's process started. An open
    incarnation is joined. A closed one is this participant's only if it started before the
    close -- a late starter of that launch, which then leaves as "not needed"; a process
    started after the close is a new launch of the run id (a requeue, a second job on a
    long-lived store) and opens the next incarnation, so it never inherits "closed".
    """
    if closed_at is None or started_at < closed_at:
        return current
    return current + 1
