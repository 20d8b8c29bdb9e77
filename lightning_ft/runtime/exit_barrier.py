"""The end of a stage on an active rank: torch's elastic exit barrier, waited for in short slices.

Torch's keys and semantics (``_exit_barrier``: a counter, and a marker the last to arrive sets), so
a torchrun-minded reader finds what they expect in the store. What this wait adds:

- **a newer round** opened meanwhile (a peer saw a failure before it finished its part) ends the
  wait: the stage runs again with the peer's replacement;
- **a lost peer** (its heartbeat silent for ``silent_after``) ends the wait the same way -- where
  asked for: an evaluation's ranks need not meet in any collective (``predict`` has none), so a peer
  that died in its part of the data is seen only here; a fit's ranks finish in lockstep (the last
  step's gradients were reduced together), so a fit's survivor knows the training is complete;
- otherwise the wait is bounded: a peer lost at the very end, or a frozen store, is no reason to
  fail a stage that completed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist

from lightning_ft._clock import monotonic
from lightning_ft._torch import exit_barrier_counter, exit_barrier_names
from lightning_ft.rendezvous.liveness import HeartbeatTracker
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.schema.round import decode_member, member_key
from lightning_ft.schema.signing import SealedStore

#: how often the barrier's marker and the run's round are read
POLL_SECONDS = 0.02
#: how often the peers' heartbeats are read (when they are watched)
HEARTBEAT_POLL_SECONDS = 0.25


@dataclass(frozen=True)
class BarrierOutcome:
    """Why the wait ended without every active: ``newer_round`` opened, or ``silent`` ranks."""

    newer_round: int | None = None
    silent: tuple[int, ...] = ()

    @property
    def passed(self) -> bool:
        return self.newer_round is None and not self.silent


class PeerSilence:
    """Which ranks of a round have a heartbeat that stood still for ``after`` seconds."""

    def __init__(self, round_values: SealedStore, records: RunRecords, rank: int, world_size: int,
                 after: float) -> None:
        self._round_values, self._records = round_values, records
        self._peers = [r for r in range(world_size) if r != rank]
        self._after = after
        self._members: dict[int, str] = {}
        self._heartbeats = HeartbeatTracker()

    def silent(self, now: float) -> tuple[int, ...]:
        found = []
        for rank in self._peers:
            if rank not in self._members:
                raw = self._round_values.get(member_key(rank))
                if raw is None:
                    continue
                self._members[rank] = decode_member(raw).participant_id
            beat = self._records.heartbeat(self._members[rank])
            if self._heartbeats.observe(rank, beat, now) >= self._after:
                found.append(rank)
        return tuple(found)


def wait_at_exit_barrier(store: dist.Store, records: RunRecords, round_id: int, world_size: int, timeout: float,
                         peers: PeerSilence | None = None) -> BarrierOutcome:
    """Arrive at the round's exit barrier and wait until every active arrived (``passed``), a newer
    round opened, or a watched peer fell silent; raises ``TimeoutError`` after ``timeout``."""
    _, last_member = exit_barrier_names()
    if store.add(exit_barrier_counter(), 1) == world_size:
        store.set(last_member, "<val_ignored>")
    start = monotonic()
    next_heartbeats = start
    while not store.check([last_member]):
        newest = records.current_round()
        if newest > round_id:
            # finished: the others passed (a bounded wait ran out on one of them) and the job went
            # on to its next stage; else a peer was lost before the stage completed
            return BarrierOutcome() if records.round_finished(round_id) else BarrierOutcome(newer_round=newest)
        now = monotonic()
        if peers is not None and now >= next_heartbeats:
            next_heartbeats = now + HEARTBEAT_POLL_SECONDS
            silent = peers.silent(now)
            if silent:
                return BarrierOutcome(silent=silent)
        if now - start > timeout:
            raise TimeoutError(f"not every active arrived within {timeout:g}s")
        time.sleep(POLL_SECONDS)
    return BarrierOutcome()
