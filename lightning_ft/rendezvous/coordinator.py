"""The coordinator of one round of the barrier rendezvous: reads the slots, asks the pure
decision (:func:`~lightning_ft.rendezvous.decisions.decide_completion`), writes the result.

The first arrival coordinates; a waiter takes over when its beat stops
(:class:`CoordinatorWatch` in :class:`~lightning_ft.rendezvous.barrier.BarrierRendezvous`).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_ft.rendezvous.decisions import (
    Action,
    Arrival,
    RoundTimer,
    RoundView,
    arrivals_of_round,
    assign_ranks,
    decide_completion,
    newly_dead,
)
from lightning_ft.rendezvous.settings import RendezvousSettings
from lightning_ft.schema.run import (
    CloseKind,
    CloseReason,
    RunKeys,
    Slot,
    decode_coordinator,
    decode_last_actives,
    decode_slot,
    encode_last_actives,
    encode_ready,
    encode_slot_rank,
)
from lightning_ft.schema.signing import SealedStore, Signer

log = logging.getLogger(__name__)


class RendezvousMember(Protocol):
    """What a coordinator uses of the participant that runs it (a ``BarrierRendezvous``)."""

    store: Any
    keys: RunKeys
    settings: RendezvousSettings
    values: SealedStore
    signer: Signer
    clock: Callable[[], float]
    #: sealed slot values decoded so far, by (key, raw value)
    decode_cache: dict[tuple[str, bytes], Slot | None]

    @property
    def participant_id(self) -> str: ...

    def mark_lost(self, participant_id: str, why: str) -> bool: ...

    def close_for_good(self, reason: CloseReason) -> CloseReason: ...


@dataclass
class CoordinatorWatch:
    since: float
    beat: int = -1
    next_check: float = 0.0
    #: the coordinators this one took over from: the silent one, and those it had replaced
    replaced: tuple[str, ...] = ()


class Coordinator:
    """Decides one round: reads the slots, asks the pure decision, writes the result."""

    def __init__(self, rendezvous: RendezvousMember, round_id: int, replaces: tuple[str, ...] = ()) -> None:
        self.rdzv = rendezvous
        self.store = rendezvous.store
        self.keys = rendezvous.keys
        self.settings = rendezvous.settings
        self.round_id = round_id
        self.clock = rendezvous.clock
        self.timer = RoundTimer(opened_at=self.clock())
        self.previous_actives = self._read_previous_actives()
        self._heartbeats_seen: dict[str, tuple[int | None, float]] = {}
        self._dead: set[str] = set()
        # a coordinator this one took over from fell silent; if its heartbeat is silent too it
        # is dead, and must not get a place in the round it failed to decide. The same for the
        # ones it had replaced: a takeover from a slow coordinator still judges the dead one.
        self._suspects: set[str] = set(replaces)
        self._unwritten_since: float | None = None
        self._last_reason = ""
        log.debug("%s coordinates round %d (previous actives: %d)", rendezvous.participant_id,
                 round_id, len(self.previous_actives))

    def still_mine(self) -> bool:
        value = self.store.get(self.keys.coordinator(self.round_id)).decode() \
            if self.store.check([self.keys.coordinator(self.round_id)]) else ""
        return decode_coordinator(value)[0] in ("", self.rdzv.participant_id)

    def _read_previous_actives(self) -> tuple[str, ...]:
        raw = self.rdzv.values.get(self.keys.last_actives)
        if raw is None:
            return ()
        last = decode_last_actives(raw)
        return last[1] if last is not None and last[0] < self.round_id else ()

    def _read_counts(self) -> tuple[int, int, int]:
        store, keys, c = self.store, self.keys, self.round_id
        return (store.add(keys.arrived(c), 0), store.add(keys.written(c), 0), store.add(keys.withdrawn(c), 0))

    def _read_slots(self, arrived: int, all_written: bool) -> list[Slot | None]:
        slot_keys = self.keys.slot_keys(arrived)
        if all_written:
            raw_values = self.store.multi_get(slot_keys)
        else:
            # Someone took a slot and never wrote it (died in between): read the slots that
            # exist one check at a time; missing ones, and stale ones from earlier rounds, count
            # as absent.
            present = [k for k in slot_keys if self.store.check([k])]
            fetched = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
            raw_values = [fetched.get(k, b"") for k in slot_keys]
        # decoded by (key, raw value): a value is authentic only under the key it was sealed for
        cache, signer = self.rdzv.decode_cache, self.rdzv.signer
        slots = []
        for key, raw in zip(slot_keys, raw_values, strict=True):
            slot = cache.get((key, raw))
            if slot is None and (key, raw) not in cache:
                opened = signer.open(key, raw) if raw else None
                slot = decode_slot(opened) if opened is not None else None
                if len(cache) < 100_000:
                    cache[(key, raw)] = slot
            slots.append(slot)
        return slots

    def read_view(self) -> RoundView | None:
        """Full re-read of the round; ``None`` when it must be retried (counts moved)."""
        now = self.clock()
        arrived, written, withdrawn = self._read_counts()
        if written < arrived:
            if self._unwritten_since is None:
                self._unwritten_since = now
            if now - self._unwritten_since < self.settings.timeouts.unwritten_slot_timeout:
                return None
        else:
            self._unwritten_since = None
        slots = self._read_slots(arrived, all_written=written >= arrived)
        if self._read_counts()[0::2] != (arrived, withdrawn):
            return None  # someone arrived or withdrew while we read: read again
        arrivals = arrivals_of_round(self.round_id, slots)
        lost = self.store.add(self.keys.lost_count, 0)
        return RoundView(self.round_id, arrivals, self.previous_actives, frozenset(self._dead), lost)

    def _update_dead(self, view: RoundView) -> bool:
        """Mark silent previous actives dead; True when someone newly died."""
        arrived_ids = {a.participant_id for a in view.arrivals}
        self._suspects &= arrived_ids | self._dead  # one that withdrew has no place to lose
        missing = [p for p in self.previous_actives if p not in arrived_ids and p not in self._dead]
        missing += [p for p in self._suspects if p in arrived_ids and p not in self._dead and p not in missing]
        if not missing:
            return False
        hb_keys = [self.keys.heartbeat(p) for p in missing]
        values = {}
        for pid, key in zip(missing, hb_keys, strict=True):
            values[pid] = self.store.add(key, 0) if self.store.check([key]) else None
        before = {p: self._heartbeats_seen.get(p) for p in self._suspects}
        dead = newly_dead(values, self._heartbeats_seen, self.clock(), self.settings.dead_after)
        for pid, seen in before.items():
            if seen is not None and values.get(pid, seen[0]) != seen[0]:
                self._suspects.discard(pid)  # its heartbeat moves: slow, not dead; it keeps its place
        for pid in dead:
            self._dead.add(pid)
            why = ("coordinator of this round that went silent" if pid in self._suspects
                   else f"previous active, missing from round {self.round_id}")
            self.rdzv.mark_lost(pid, f"heartbeat silent for {self.settings.dead_after:.2f}s ({why})")
        return bool(dead)

    def step(self) -> None:
        self.store.add(self.keys.coordinator_beat(self.round_id), 1)
        view = self.read_view()
        if view is None:
            return
        if self._update_dead(view):  # deaths just counted as lost change what the view says
            view = dataclasses.replace(view, dead_previous_actives=frozenset(self._dead),
                                       lost_count=self.store.add(self.keys.lost_count, 0))
        if self._suspects:
            if self._suspects - self._dead:
                return  # not judged yet: deciding now could give a dead coordinator a place
            view = dataclasses.replace(view, arrivals=tuple(a for a in view.arrivals
                                                            if a.participant_id not in self._dead))
        now = self.clock()
        decision = decide_completion(view, self.settings, self.timer, now)
        if decision.reason != self._last_reason:
            log.debug("round %d: %s -> %s", self.round_id, decision.reason, decision.action.value)
            self._last_reason = decision.reason
        if decision.action is Action.COMPLETE:
            self._complete(view.arrivals)
        elif decision.action is Action.CLOSE_FOR_GOOD:
            self.rdzv.close_for_good(CloseReason(CloseKind.TOO_FEW_NODES, decision.reason))

    def _complete(self, arrivals: tuple[Arrival, ...]) -> None:
        # Each decision writes its answers under a name of its own; ``ready`` -- first writer
        # wins -- names the one in force. A coordinator that dies (or stalls) anywhere in here
        # therefore never blocks the round: whoever takes over decides again and publishes its
        # own answers; a stalled one that wakes up loses the race for ``ready`` and leaves its
        # answers unread.
        decision = f"{self.rdzv.participant_id}#{uuid.uuid4().hex[:8]}"
        assignment = assign_ranks(arrivals, self.previous_actives, self.settings.min_nodes,
                                  self.settings.segment)
        world = len(assignment.active)
        rank_keys, rank_values = [], []
        for rank, arrival in enumerate(assignment.active):
            rank_keys.append(self.keys.decided_rank(self.round_id, decision, arrival.slot_index))
            rank_values.append(encode_slot_rank(self.round_id, rank, world))
        for arrival in assignment.standby:
            rank_keys.append(self.keys.decided_rank(self.round_id, decision, arrival.slot_index))
            rank_values.append(encode_slot_rank(self.round_id, -1, world))
        values = self.rdzv.values
        values.multi_put(rank_keys, rank_values)
        mine = encode_ready(world, len(assignment.standby), self.clock() - self.timer.opened_at, decision)
        if values.put_if_absent(self.keys.ready(self.round_id), mine) != mine.encode():
            return  # another coordinator's decision is in force
        values.put(self.keys.last_actives,
                   encode_last_actives(self.round_id, [a.participant_id for a in assignment.active]))
        log.debug("round %d closed: %d active, %d standby (decided in %.3fs)", self.round_id, world,
                 len(assignment.standby), self.clock() - self.timer.opened_at)
