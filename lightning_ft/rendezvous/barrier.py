"""Barrier rendezvous over a ``torch.distributed.Store``: the part that talks to the store.

Protocol (one run, keys and values in :mod:`lightning_ft.schema.run`):

* ``round`` holds the current round. A participant takes a slot of round N with an atomic
  ``add`` on ``r{N}/arrived``, writes its :class:`Slot` (carrying N) and bumps ``r{N}/written``.
* The first arrival coordinates the round (others take over if its beat stops). It re-reads
  all slots with one ``multi_get`` when the counters say every slot is written, re-checks
  the counters, and asks :func:`decide_completion`. To complete it wins ``r{N}/closed`` with
  ``compare_set``, writes every slot's rank, then sets ``r{N}/ready``.
* Actives of a closed round open round N+1 after a failure (``compare_set`` on ``round``).
  Standby and late participants wait for that, for ``closed_for_good``, or for torch's
  exit-barrier key of round N (the actives finished).
* The first round a participant joins must complete within ``join_timeout``; a round after
  it trained in one (a failure) within ``rejoin_timeout``.

Waits poll in short slices (signals are handled between them) at an interval that scales
with ``max_nodes`` so the total load on the store stays bounded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from lightning_ft.deadlines import BackgroundThread, StoreClient
from lightning_ft.rendezvous.coordinator import Coordinator, CoordinatorWatch
from lightning_ft.rendezvous.decisions import is_extra_participant
from lightning_ft.rendezvous.lifecycle import resolve_incarnation, wait_for_acknowledgements
from lightning_ft.rendezvous.participant import ParticipantInfo, process_start_time
from lightning_ft.rendezvous.settings import RendezvousSettings
from lightning_ft.schema.run import (
    CloseKind,
    CloseReason,
    RunKeys,
    Slot,
    decode_coordinator,
    decode_ready,
    decode_slot_rank,
    encode_coordinator,
    encode_slot,
)
from lightning_ft.schema.signing import SealedStore, Signer, job_signer

log = logging.getLogger(__name__)


class ParticipantExcludedError(RendezvousError):
    """This participant may not take part; the job itself goes on without it."""


class ExtraParticipantError(ParticipantExcludedError):
    """More participants arrived than ``max_nodes``; this one has no place."""


class UnhealthyNodeError(ParticipantExcludedError):
    """This node failed its health check and was excluded."""


@dataclass(frozen=True)
class RoundResult:
    """Where this participant stands after a round completed."""

    round: int
    #: rank among the actives, ``-1`` for standby
    rank: int
    #: number of actives in the round
    world_size: int
    slot_index: int
    #: prefix (on the rendezvous store) for the job's own keys in this round
    store_prefix: str

    @property
    def is_active(self) -> bool:
        return self.rank >= 0


class BarrierRendezvous:
    """One participant's side of the barrier rendezvous.

    ``store`` is any ``torch.distributed.Store`` (TCPStore in production). ``is_store_host``
    marks the process whose exit takes the store down: its :meth:`shutdown` waits (bounded)
    for the others to acknowledge so they can read the final state first.
    """

    def __init__(self, store: StoreClient, settings: RendezvousSettings, participant: ParticipantInfo, *,
                 is_store_host: bool = False, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 heartbeat_store_factory: Callable[[], object] | None = None,
                 signer: Signer | None = None, incarnation: int | None = None,
                 started_at: float | None = None) -> None:
        self.store = store
        self.settings = settings
        self.participant = participant
        self.is_store_host = is_store_host
        self.signer = job_signer() if signer is None else signer
        self.values = SealedStore(store, self.signer)
        if incarnation is None:
            incarnation = resolve_incarnation(store, self.signer, settings.run_id,
                                              process_start_time() if started_at is None else started_at)
        self.keys = RunKeys(settings.run_id, incarnation)
        self.clock = clock
        self._sleep = sleep
        self._heartbeat_store_factory = heartbeat_store_factory
        self._heartbeat: Heartbeat | None = None
        self._last_active_round: int | None = None
        self._last_result: RoundResult | None = None
        self._excluded = False
        self._acked = False
        self.decode_cache: dict[tuple[str, bytes], Slot | None] = {}

    # ----------------------------------------------------------------- public API

    @property
    def participant_id(self) -> str:
        return self.participant.participant_id

    @property
    def last_result(self) -> RoundResult | None:
        return self._last_result

    def next_active_round(self) -> RoundResult:
        """Join rounds until this participant is active in one; standby waits in between.

        Raises ``RendezvousGracefulExitError`` when the job finished or the rendezvous was
        closed for good while this participant was not needed.
        """
        while True:
            result = self.join_round()
            if result.is_active:
                return result
            self.wait_while_standby(result.round)

    def join_round(self) -> RoundResult:
        """Take part in the current (or, after being active, the next) round once."""
        self._start_heartbeat()
        while True:
            self._raise_if_closed_for_good()
            round_id = self._current_round()
            last = self._last_result
            if last is not None and not last.is_active and round_id <= last.round:
                self.wait_while_standby(last.round)  # still standby: wait for a newer round
                continue
            if self._last_active_round is not None and round_id <= self._last_active_round:
                round_id = self.open_next_round(self._last_active_round, "a participant re-joined")
            result = self._join(round_id)
            if result is not None:
                self._last_result = result
                if result.is_active:
                    self._last_active_round = result.round
                return result

    def wait_while_standby(self, round_id: int) -> None:
        """Wait while round ``round_id`` trains without us; return when a newer round opens."""
        log.info("standby in round %d: waiting for a failure to open the next round", round_id)
        exit_barrier = self.keys.exit_barrier(round_id)
        # torch's exit-barrier key cannot be sealed; with a job secret, only the (sealed) close counts
        watch_exit_barrier = not self.signer.enabled
        poll = self.settings.poll_interval
        while True:
            reason = self._closed_reason()
            if reason is not None:
                self._graceful_exit(f"rendezvous closed for good while standby: {reason}")
            if watch_exit_barrier and self.store.check([exit_barrier]):
                self._graceful_exit(f"the active nodes of round {round_id} finished")
            if self._current_round() > round_id:
                return
            self._sleep(poll)

    def open_next_round(self, failed_round: int, reason: str) -> int:
        """Open round ``failed_round + 1`` (idempotent; concurrent callers agree). Returns it."""
        current = int(self.store.compare_set(self.keys.round, str(failed_round), str(failed_round + 1)))
        if current == failed_round + 1:
            log.info("round %d opened after round %d: %s", current, failed_round, reason)
        return max(current, failed_round + 1)

    def current_round(self) -> int:
        return self._current_round()

    def num_nodes_waiting(self) -> int:
        """Participants in a round newer than the one this (active) participant trains in.

        Spares waiting for a closed round are not counted, so they never make the actives
        restart.
        """
        if self._last_active_round is None:
            return 0
        round_id = self._current_round()
        if round_id <= self._last_active_round:
            return 0
        arrived = self.store.add(self.keys.arrived(round_id), 0)
        withdrawn = self.store.add(self.keys.withdrawn(round_id), 0)
        return max(1, arrived - withdrawn)

    def is_closed(self) -> bool:
        return self._closed_reason() is not None

    def closed_reason(self) -> CloseReason | None:
        return self._closed_reason()

    def close_for_good(self, reason: CloseReason) -> CloseReason:
        """Permanently close the rendezvous (first reason wins); returns the reason in force."""
        encoded = reason.encode()
        current = self.values.put_if_absent(self.values.unlisted(self.keys.closed_for_good), encoded)
        if current == encoded.encode():
            log.info("rendezvous %s closed for good: %s", self.settings.run_id, reason)
            return reason
        return CloseReason.decode(current) or reason

    def report_unhealthy(self, reasons: str) -> None:
        """Count this node as unhealthy and lost; it will not be placed again."""
        if self.mark_lost(self.participant_id, f"unhealthy: {reasons}"):
            self.store.add(self.keys.unhealthy_count, 1)
        self._excluded = True

    def withdraw(self, reason: str, stopping: bool = False) -> None:
        """Leave the job for good: free our slot in an open round and count us as lost.

        ``stopping``: this participant leaves because it was told to stop (SIGTERM). If the
        run cannot reach ``min_nodes`` without it, the run is closed STOPPED *before* it is
        counted lost -- a preemption, which a requeue repairs -- rather than left for the
        coordinator to close as TOO_FEW_NODES (which means "no spare left; do not requeue").
        """
        result = self._last_result
        if result is not None and not self._is_ready(result.round):
            self._withdraw_slot(result.round, result.slot_index)
        if stopping:
            capacity = self.settings.max_nodes - self.store.add(self.keys.lost_count, 0) - 1
            if capacity < self.settings.min_nodes:
                self.close_for_good(CloseReason(CloseKind.STOPPED, (
                    f"{self.participant_id} was stopped ({reason}); without it {capacity} of max_nodes="
                    f"{self.settings.max_nodes} nodes can take part, fewer than min_nodes={self.settings.min_nodes}")))
        self.mark_lost(self.participant_id, f"withdrew: {reason}")
        self._excluded = True

    def finished_round(self, round_id: int) -> bool:
        """True when the actives of ``round_id`` passed torch's elastic exit barrier."""
        return self.store.check([self.keys.exit_barrier(round_id)])

    def shutdown(self, job_finished: bool, reason: str = "training finished") -> bool:
        """Leave the rendezvous at process end.

        ``job_finished``: close the rendezvous for good *first*, so that spares and late
        readers see the final state; then acknowledge. The store host then waits until
        every participant of the last round acknowledged (at most ``store_grace_timeout``)
        before its process, and with it the store, goes away.
        """
        self.stop_heartbeat()
        try:
            if job_finished and not self._excluded:
                self.close_for_good(CloseReason(CloseKind.FINISHED, reason))
            self._acknowledge()
            if self.is_store_host:
                self._wait_for_acknowledgements()
            return True
        except (RendezvousError, RuntimeError, OSError) as exc:
            # the store (or its host) may already be gone: nothing left to tell anyone
            log.warning("rendezvous shutdown could not reach the store: %s", exc)
            return False

    # ----------------------------------------------------------------- joining

    def _join(self, round_id: int) -> RoundResult | None:
        keys, store = self.keys, self.store
        index = store.add(keys.arrived(round_id), 1) - 1
        withdrawn = store.add(keys.withdrawn(round_id), 0)
        if is_extra_participant(index, withdrawn, self.settings.max_nodes):
            self._write_slot(round_id, index, withdrawn=True)
            store.add(keys.withdrawn(round_id), 1)
            self._excluded = True
            raise ExtraParticipantError(
                f"participant {self.participant_id} is extra: more than max_nodes="
                f"{self.settings.max_nodes} participants arrived in round {round_id} of run "
                f"{self.settings.run_id!r}; check --nnodes=MIN:MAX and how many nodes were "
                "launched. The job goes on without this node.")
        self._write_slot(round_id, index, withdrawn=False)
        log.debug("%s took slot %d of round %d", self.participant_id, index, round_id)
        if index == 0:
            store.compare_set(keys.coordinator(round_id), "", encode_coordinator(self.participant_id))
        try:
            return self._await_round(round_id, index)
        except (RendezvousGracefulExitError, ParticipantExcludedError):
            raise
        except BaseException:
            # signal, timeout or closed: free the slot so the round does not wait for us
            try:
                if not self._is_ready(round_id):
                    self._withdraw_slot(round_id, index)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            raise

    def _write_slot(self, round_id: int, index: int, withdrawn: bool) -> None:
        self.values.put(self.keys.slot(index), encode_slot(round_id, self.participant, withdrawn))
        self.store.add(self.keys.written(round_id), 1)

    def _withdraw_slot(self, round_id: int, index: int) -> None:
        self.values.put(self.keys.slot(index), encode_slot(round_id, self.participant, withdrawn=True))
        self.store.add(self.keys.withdrawn(round_id), 1)
        log.info("%s withdrew from round %d", self.participant_id, round_id)

    def _await_round(self, round_id: int, index: int) -> RoundResult | None:
        keys, store, settings = self.keys, self.store, self.settings
        join_timeout = settings.timeouts.join_timeout_for(was_active=self._last_active_round is not None)
        deadline = self.clock() + join_timeout
        coordinator = Coordinator(self, round_id) if index == 0 else None
        watch = CoordinatorWatch(self.clock())
        poll = settings.poll_interval
        while True:
            if self._is_ready(round_id):
                return self._read_result(round_id, index)
            reason = self._closed_reason()
            if reason is not None:
                raise RendezvousClosedError(
                    f"rendezvous {settings.run_id!r} was closed for good before round {round_id} "
                    f"completed: {reason}")
            if self._current_round() > round_id:
                # a newer round opened before this one completed: leave this one, join that
                self._withdraw_slot(round_id, index)
                return None
            if coordinator is None and self._should_take_over(round_id, watch):
                coordinator = Coordinator(self, round_id, replaces=watch.replaced)
            if coordinator is not None:
                if not coordinator.still_mine():
                    coordinator = None
                else:
                    coordinator.step()
                    if self._is_ready(round_id):
                        continue
            if self.clock() > deadline:
                arrived = store.add(keys.arrived(round_id), 0) - store.add(keys.withdrawn(round_id), 0)
                raise RendezvousTimeoutError(
                    f"round {round_id} of run {settings.run_id!r} did not complete within "
                    f"{'rejoin' if join_timeout != settings.timeouts.join_timeout else 'join'}_timeout="
                    f"{join_timeout:g}s: {arrived} participant(s) arrived, "
                    f"min_nodes={settings.min_nodes}")
            self._sleep(poll)

    def _should_take_over(self, round_id: int, watch: CoordinatorWatch) -> bool:
        # The coordinator bumps a beat each poll. If it stops for ``dead_after`` (it died),
        # one waiter wins a compare_set and coordinates instead.
        now = self.clock()
        if now < watch.next_check:
            return False
        watch.next_check = now + self.settings.timeouts.heartbeat_interval
        beat = self.store.add(self.keys.coordinator_beat(round_id), 0)
        if beat != watch.beat:
            watch.beat, watch.since = beat, now
            return False
        if now - watch.since < self.settings.dead_after:
            return False
        value = self._get_or_empty(self.keys.coordinator(round_id))
        holder, earlier = decode_coordinator(value)
        replaced = tuple(dict.fromkeys(p for p in (holder, *earlier) if p and p != self.participant_id))
        mine = encode_coordinator(self.participant_id, replaced)
        won = self.store.compare_set(self.keys.coordinator(round_id), value, mine)
        if won.decode() == mine:
            log.info("%s took over coordinating round %d from %r (silent for %.1fs)",
                     self.participant_id, round_id, holder, now - watch.since)
            watch.replaced = replaced
            return True
        watch.since = now
        return False

    def _read_result(self, round_id: int, index: int) -> RoundResult:
        raw_ready = self.values.get(self.keys.ready(round_id))
        ready = decode_ready(raw_ready) if raw_ready is not None else None
        raw = self.values.get(self.keys.decided_rank(round_id, ready.decision, index)) if ready else None
        answer = decode_slot_rank(raw) if raw is not None else None
        store_prefix = self.keys.round_store_prefix(round_id)
        if answer is not None and answer.round == round_id:
            rank, world_size = answer.rank, answer.world_size
        else:  # our slot was not part of the decision: we arrived after the round closed
            world_size = self.settings.min_nodes
            rank = -1
            log.info("%s arrived after round %d closed; waiting as standby", self.participant_id, round_id)
        result = RoundResult(round_id, rank, world_size, index, store_prefix)
        log.info("round %d complete: %s is %s", round_id, self.participant_id,
                 f"active rank {rank} of {world_size}" if rank >= 0 else "standby")
        return result

    # ----------------------------------------------------------------- helpers

    def _current_round(self) -> int:
        # compare_set with expected "" creates the key at 0 on first use, else returns it
        return int(self.store.compare_set(self.keys.round, "", "0"))

    def _closed_reason(self) -> CloseReason | None:
        raw = self.values.get(self.values.unlisted(self.keys.closed_for_good))
        return CloseReason.decode(raw) if raw is not None else None

    def _is_ready(self, round_id: int) -> bool:
        return self.values.has(self.keys.ready(round_id))

    def _raise_if_closed_for_good(self) -> None:
        reason = self._closed_reason()
        if reason is not None:
            self._graceful_exit(f"rendezvous {self.settings.run_id!r} is closed for good: {reason}")

    def _graceful_exit(self, message: str) -> None:
        self._acknowledge()
        log.info("%s leaves the rendezvous: %s", self.participant_id, message)
        raise RendezvousGracefulExitError(message)

    def _get_or_empty(self, key: str) -> str:
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def mark_lost(self, participant_id: str, why: str) -> bool:
        marker = self.keys.lost_marker(participant_id)
        if self.store.compare_set(marker, "", why).decode() != why:
            return False  # already counted
        self.store.add(self.keys.lost_count, 1)
        log.warning("participant %s lost for good: %s", participant_id, why)
        return True

    def _acknowledge(self) -> None:
        if self._acked or self._excluded:
            return
        marker = self.keys.ack(self.participant_id)
        if self.store.compare_set(marker, "", "1").decode() == "1":
            self.store.add(self.keys.shutdown_acks, 1)
        self._acked = True

    def _wait_for_acknowledgements(self) -> None:
        wait_for_acknowledgements(self.store, self.keys, self.settings.timeouts.store_grace_timeout,
                                  self.clock, self._sleep)

    def _start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            return
        store = self._heartbeat_store_factory() if self._heartbeat_store_factory else self.store
        self._heartbeat = Heartbeat(store, self.keys.heartbeat(self.participant_id),
                                    self.settings.timeouts.heartbeat_interval)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(join=False)


class Heartbeat(BackgroundThread):
    """Bumps this participant's heartbeat counter every ``interval`` on a connection of its own
    (one silent for ``dead_after`` counts as dead); stops quietly when the store is gone."""

    def __init__(self, store: Any, key: str, interval: float) -> None:
        super().__init__("lightning_ft-heartbeat", join_timeout=interval)
        self.store, self.key, self.interval = store, key, interval

    def start(self) -> None:
        self.store.add(self.key, 1)  # the first beat before returning: the round may judge at once
        super().start()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.store.add(self.key, 1)
            except Exception as exc:  # noqa: BLE001 - store gone: stop beating quietly
                log.debug("heartbeat stopped: %s", exc)
                return
            self.stopping.wait(self.interval)
