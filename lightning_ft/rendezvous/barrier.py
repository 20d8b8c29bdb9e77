"""Barrier rendezvous over a ``torch.distributed.Store``: the part that talks to the store.

Protocol (one run incarnation; keys and values in :mod:`lightning_ft.schema.run`, the sealed
state in :mod:`lightning_ft.rendezvous.records`):

* ``round`` holds the current round, a sealed number. A participant arrives in round N by
  appending a sealed arrival record to ``r{N}/arrivals`` (torch's atomic ``append``) and then
  claims ``r{N}/coordinator``; the first claim wins.
* The coordinator re-reads the arrivals log when its hint moves (at most every
  ``reread_interval``, and every heartbeat regardless), asks :func:`decide_completion`, and
  completes the round by writing an answer per participant under a decision of its own and
  then ``r{N}/ready`` naming that decision (first writer wins). Arrivals past ``max_nodes``
  are answered "extra".
* Waiters do not poll: each waits on the store (server-side) for the coordinator's next *tick*
  (``r{N}/tick/<k>``). The coordinator ticks right after ``ready`` -- every waiter returns about
  one round trip after the round completed -- and every ``tick_interval`` otherwise, when the
  waiters check for a close, a newer round and the coordinator's lease. A round's store work is
  therefore linear in the number of participants.
* Actives of a closed round open round N+1 after a failure (``compare_set`` on the sealed
  round). Standby and late participants wait for that, for ``closed_for_good``, or for torch's
  exit-barrier key of round N (the actives finished).
* The coordinator renews a sealed lease with every tick; if it stops rising for
  ``takeover_after`` (the ticks stop too: a waiter's wait times out), a waiter replaces the claim
  (``compare_set`` on the bytes it read) and coordinates instead.
* The first round a participant joins must complete within ``join_timeout``; a round after
  it trained in one (a failure) within ``rejoin_timeout``.

No counter decides anything (a store client can ``add`` to any key): who arrived, who is
lost for good, whose heartbeat rises, who coordinates and who acknowledged are sealed values
and records. Every wait is bounded (a tick's wait by ``tick_interval + takeover_after``); the
calling thread waits in short slices, so signals are handled in between.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from lightning_ft._clock import monotonic
from lightning_ft.deadlines import StoreClient
from lightning_ft.rendezvous.beats import Heartbeat, TickWaiter
from lightning_ft.rendezvous.coordinator import Coordinator, CoordinatorWatch
from lightning_ft.rendezvous.lifecycle import wait_for_acknowledgements
from lightning_ft.rendezvous.participant import ParticipantInfo, process_start_time
from lightning_ft.rendezvous.records import RunRecords, resolve_incarnation
from lightning_ft.rendezvous.settings import RendezvousSettings
from lightning_ft.rendezvous.stages import Stages
from lightning_ft.schema.run import (
    EXTRA_RANK,
    CloseKind,
    CloseReason,
    RunKeys,
    decode_rank_answer,
    decode_ready,
)
from lightning_ft.schema.signing import SealedStore, Signer, job_signer

log = logging.getLogger(__name__)


class ParticipantExcludedError(RendezvousError):
    """This participant may not take part; the job itself goes on without it."""


class ExtraParticipantError(ParticipantExcludedError):
    """More participants arrived than ``max_nodes``; this one has no place. ``job_full``: the job
    had formed before (a replacement that found it full), not too many nodes at launch."""

    job_full = False


class UnhealthyNodeError(ParticipantExcludedError):
    """This node failed its health check and was excluded."""


class ActivesFinishedError(RendezvousGracefulExitError):
    """A standby participant saw the actives of its round pass torch's exit barrier (watched
    without a job secret only): the job finished, although the run's close may not be written yet."""


@dataclass(frozen=True)
class RoundResult:
    """Where this participant stands after a round completed."""

    round: int
    #: rank among the actives, ``-1`` for standby
    rank: int
    #: number of actives in the round
    world_size: int
    #: prefix (on the rendezvous store) for the job's own keys in this round
    store_prefix: str

    @property
    def is_active(self) -> bool:
        return self.rank >= 0



def extra_participant(participant_id: str, run_id: str, max_nodes: int, round_id: int) -> ExtraParticipantError:
    """The error of a participant with no place: one of too many nodes at launch (round 0), or, once
    the job has formed, a node started later that found every place taken (``job_full``)."""
    if round_id == 0:
        return ExtraParticipantError(
            f"participant {participant_id} is extra: more than max_nodes={max_nodes} participants arrived in "
            f"round 0 of run {run_id!r}; check --nnodes=MIN:MAX and how many nodes were launched. The job goes "
            "on without this node.")
    full = ExtraParticipantError(f"participant {participant_id} is not needed: run {run_id!r} has "
                                 f"max_nodes={max_nodes} participants (round {round_id}); the job goes on without "
                                 "this node")
    full.job_full = True
    return full


#: a participant waiting for a round to complete says why after this long, then this often
WAITING_NOTE_AFTER = 5.0
WAITING_NOTE_EVERY = 15.0


class BarrierRendezvous:
    """One participant's side of the barrier rendezvous.

    ``store`` is any ``torch.distributed.Store`` (TCPStore in production). ``is_store_host``
    marks the process whose exit takes the store down: its :meth:`shutdown` waits (bounded)
    for the others to acknowledge so they can read the final state first.
    """

    def __init__(self, store: StoreClient, settings: RendezvousSettings, participant: ParticipantInfo, *,
                 is_store_host: bool = False, clock: Callable[[], float] = monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 heartbeat_store_factory: Callable[[], Any] | None = None,
                 signer: Signer | None = None, incarnation: int | None = None,
                 started_at: float | None = None, rejoin: bool = False) -> None:
        self.store = store
        self.settings = settings
        self.participant = participant
        self.is_store_host = is_store_host
        self.signer = job_signer() if signer is None else signer
        self.values = SealedStore(store, self.signer)
        if incarnation is None:
            incarnation = resolve_incarnation(store, self.signer, settings.run_id,
                                              process_start_time() if started_at is None else started_at,
                                              rejoin=rejoin)
        self.keys = RunKeys(settings.run_id, incarnation)
        self.records = RunRecords(store, self.signer, self.keys)
        self.clock, self._sleep = clock, sleep
        self._heartbeat_store_factory = heartbeat_store_factory
        self._heartbeat: Heartbeat | None = None
        #: which of the given participants are proven gone (set by the store fail-over's presence)
        self.proves_gone: Callable[[Sequence[str]], set[str]] | None = None
        #: the job's stages as this participant sees them (see :mod:`.stages`)
        self.stages = Stages(self.records, self.open_next_round, self._raise_if_closed_for_good,
                             settings.standby_poll_interval, self.clock, self._sleep)
        self._heartbeat_store: Any = None
        self._tick_store: StoreClient | None = None
        #: the authentic ``ready`` of a round, as :meth:`_is_ready` read it (its result reads it from here)
        self._ready_seen: tuple[int, bytes | None] = (-1, None)
        self._last_active_round: int | None = None
        self._last_result: RoundResult | None = None
        self._excluded = self._acked = False
        #: numbers this participant's arrival records (a reader keeps each writer's newest)
        self._record_seq = itertools.count(1)
        #: called with every round this participant completes (active or standby)
        self.on_round_complete: list[Callable[[RoundResult], None]] = []
        #: called once, when this participant leaves (acknowledged the end, or excluded)
        self.on_leave: list[Callable[[], None]] = []

    # ----------------------------------------------------------------- public API

    @property
    def participant_id(self) -> str:
        return self.participant.participant_id

    @property
    def last_result(self) -> RoundResult | None:
        return self._last_result

    @property
    def left(self) -> bool:
        """This participant acknowledged the end or was excluded: it takes no part any more."""
        return self._acked or self._excluded

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
            round_id = self.records.current_round()
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
                for callback in self.on_round_complete:
                    callback(result)
                return result

    def wait_while_standby(self, round_id: int) -> None:
        """Wait while round ``round_id`` trains without us; return when a newer round opens.

        Raises ``ActivesFinishedError`` once the round's actives finished their work (this
        participant stays in the rendezvous: a later stage may need it), and
        ``RendezvousGracefulExitError`` when the rendezvous is closed for good."""
        log.info("standby in round %d: waiting for a failure to open the next round", round_id)
        exit_barrier = self.keys.exit_barrier(round_id)
        # torch's exit-barrier key cannot be sealed: with a job secret, only the sealed marker counts
        watch_exit_barrier = not self.signer.enabled
        poll = self.settings.standby_poll_interval
        while True:
            reason = self._closed_reason()
            if reason is not None:
                self._graceful_exit(f"rendezvous closed for good while standby: {reason}")
            if self.records.round_finished(round_id) or (watch_exit_barrier and self.store.check([exit_barrier])):
                raise ActivesFinishedError(f"the active nodes of round {round_id} finished")
            if self.records.current_round() > round_id:
                return
            self._sleep(poll)

    def open_next_round(self, failed_round: int, reason: str) -> int:
        """Open round ``failed_round + 1`` (idempotent; concurrent callers agree). Returns it."""
        current = self.records.open_round(failed_round + 1)
        if current == failed_round + 1:
            log.info("round %d opened after round %d: %s", current, failed_round, reason)
        return current

    def current_round(self) -> int:
        return self.records.current_round()

    def num_nodes_waiting(self) -> int:
        """Participants in a round newer than the one this (active) participant trains in.

        Spares waiting for a closed round are not counted, so they never make the actives
        restart.
        """
        if self._last_active_round is None:
            return 0
        round_id = self.records.current_round()
        if round_id <= self._last_active_round:
            return 0
        return max(1, len(self.records.arrivals(round_id)))

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
        """Record this node as unhealthy and lost; it will not be placed again."""
        self.mark_lost(self.participant_id, f"unhealthy: {reasons}")
        self._leave(excluded=True)

    def withdraw(self, reason: str, stopping: bool = False) -> None:
        """Leave the job for good: withdraw from an open round and record us as lost.

        ``stopping``: this participant leaves because it was told to stop (SIGTERM). If the
        run cannot reach ``min_nodes`` without it, the run is closed STOPPED *before* it is
        recorded lost -- a preemption, which a requeue repairs -- rather than left for the
        coordinator to close as TOO_FEW_NODES (which means "no spare left; do not requeue").
        """
        result = self._last_result
        if result is not None and not self._is_ready(result.round):
            self._withdraw_arrival(result.round)
        if stopping:
            capacity = self.settings.max_nodes - len(self.records.lost()) - 1
            if capacity < self.settings.min_nodes:
                self.close_for_good(CloseReason(CloseKind.STOPPED, (
                    f"{self.participant_id} was stopped ({reason}); without it {capacity} of max_nodes="
                    f"{self.settings.max_nodes} nodes can take part, fewer than min_nodes={self.settings.min_nodes}")))
        self.mark_lost(self.participant_id, f"withdrew: {reason}")
        self._leave(excluded=True)

    def finished_round(self, round_id: int) -> bool:
        """True when the actives of ``round_id`` passed torch's elastic exit barrier."""
        return bool(self.store.check([self.keys.exit_barrier(round_id)]))

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
        self.records.append_arrival(round_id, next(self._record_seq), self.participant)
        holder = self.records.claim_coordinator(round_id, self.participant_id)
        if holder == self.participant_id:
            log.debug("%s coordinates round %d", self.participant_id, round_id)
        try:
            return self._await_round(round_id, holder)
        except (RendezvousGracefulExitError, ParticipantExcludedError):
            raise
        except BaseException:
            # signal, timeout or closed: withdraw so the round does not wait for us
            try:
                if not self._is_ready(round_id):
                    self._withdraw_arrival(round_id)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            raise

    def _withdraw_arrival(self, round_id: int) -> None:
        self.records.append_arrival(round_id, next(self._record_seq), self.participant, withdrawn=True)
        log.info("%s withdrew from round %d", self.participant_id, round_id)

    def _await_round(self, round_id: int, holder: str | None) -> RoundResult | None:
        settings = self.settings
        join_timeout = settings.timeouts.join_timeout_for(was_active=self._last_active_round is not None)
        start = self.clock()
        deadline = start + join_timeout
        coordinator = Coordinator(self, round_id) if holder == self.participant_id else None
        watch = CoordinatorWatch(start, next_check=start + settings.heartbeat_every, holder=holder)
        ticks = TickWaiter(self._tick_connection(), self.keys, round_id)
        checked_at, note_at = start, start + WAITING_NOTE_AFTER  # join_round just checked the close, the round
        while True:
            if coordinator is None:
                ticks.arm()
            if self._is_ready(round_id):
                return self._read_result(round_id)
            now = self.clock()
            if now >= note_at:  # a wait that prints nothing looks like a hang: say why
                note_at = now + note_waiting(self.records, settings, round_id, now - start, deadline - now)
            # a waiter checks each time a tick woke it; the coordinator once per tick it gives
            if coordinator is None or now - checked_at >= settings.tick_interval:
                checked_at = now
                reason = self._closed_reason()
                if reason is not None:
                    raise RendezvousClosedError(
                        f"rendezvous {settings.run_id!r} was closed for good before round {round_id} "
                        f"completed: {reason}")
                if self.records.current_round() > round_id:
                    # a newer round opened before this one completed: leave this one, join that
                    if coordinator is not None:
                        coordinator.tick()  # its waiters learn it now, not a tick interval later
                    self._withdraw_arrival(round_id)
                    return None
                if coordinator is None and watch.should_take_over(self.records, round_id, self.participant_id,
                                                                          self.settings, self.clock()):
                    coordinator = Coordinator(self, round_id, replaces=watch.replaced)
                if coordinator is not None and not coordinator.still_mine():
                    coordinator = None
            if coordinator is not None:
                coordinator.step()
                if self._is_ready(round_id):
                    continue
            if self.clock() > deadline:
                arrived = len(self.records.arrivals(round_id))
                raise RendezvousTimeoutError(
                    f"round {round_id} of run {settings.run_id!r} did not complete within "
                    f"{'rejoin' if join_timeout != settings.timeouts.join_timeout else 'join'}_timeout="
                    f"{join_timeout:g}s: {arrived} participant(s) arrived, "
                    f"min_nodes={settings.min_nodes}{self.signer.invalid_values_note()}")
            if coordinator is not None:
                self._sleep(settings.poll_interval)
            else:
                remaining = max(0.0, deadline - self.clock())
                ticks.wait(min(remaining, settings.tick_interval + settings.takeover_after) + settings.poll_interval)

    def _read_result(self, round_id: int) -> RoundResult:
        raw_ready = self._ready_seen[1] if self._ready_seen[0] == round_id else None  # _is_ready read it
        ready = decode_ready(raw_ready) if raw_ready is not None else None
        # a decision's answers are all written before its ``ready``: ours is there if we are in it
        raw = (self.values.get(self.keys.decided_rank(round_id, ready.decision, self.participant_id))
               if ready else None)
        answer = decode_rank_answer(raw) if raw is not None else None
        store_prefix = self.keys.round_store_prefix(round_id)
        if answer is not None and answer.round == round_id:
            if answer.rank == EXTRA_RANK:
                self._leave_as_extra(round_id)
            rank, world_size = answer.rank, answer.world_size
        elif self._is_extra_late_arrival(round_id):
            self._leave_as_extra(round_id)
        else:  # we were not part of the decision: we arrived after the round closed
            world_size = self.settings.min_nodes
            rank = -1
            log.info("%s arrived after round %d closed; waiting as standby", self.participant_id, round_id)
        result = RoundResult(round_id, rank, world_size, store_prefix)
        log.info("round %d complete: %s is %s", round_id, self.participant_id,
                 f"active rank {rank} of {world_size}" if rank >= 0 else "standby")
        return result

    def _is_extra_late_arrival(self, round_id: int) -> bool:
        return self.records.no_place_for(round_id, self.participant_id, self.settings.max_nodes,
                                         self.settings.liveness.unproven_dead_after, self._sleep)

    def _leave_as_extra(self, round_id: int) -> NoReturn:
        self._withdraw_arrival(round_id)
        self._leave(excluded=True)
        raise extra_participant(self.participant_id, self.settings.run_id, self.settings.max_nodes, round_id)

    # ----------------------------------------------------------------- helpers

    def _closed_reason(self) -> CloseReason | None:
        raw = self.records.closed_for_good()
        return CloseReason.decode(raw) if raw is not None else None

    def _is_ready(self, round_id: int) -> bool:
        raw = self.values.get(self.keys.ready(round_id))  # one request
        if raw is not None:
            self._ready_seen = (round_id, raw)
        return raw is not None

    def _raise_if_closed_for_good(self) -> None:
        reason = self._closed_reason()
        if reason is not None:
            self._graceful_exit(f"rendezvous {self.settings.run_id!r} is closed for good: {reason}")

    def _graceful_exit(self, message: str,
                       error: type[RendezvousGracefulExitError] = RendezvousGracefulExitError) -> NoReturn:
        self._acknowledge()
        log.info("%s leaves the rendezvous: %s", self.participant_id, message)
        raise error(message)

    def mark_lost(self, participant_id: str, why: str, silent_at: int | None = None) -> bool:
        """Record ``participant_id`` as lost for good (``silent_at``: see ``LostRecord``); False when
        it already was."""
        if not self.records.mark_lost(participant_id, why, silent_at):
            return False
        log.warning("participant %s lost for good: %s", participant_id, why)
        return True

    def _leave(self, excluded: bool) -> None:
        was_left = self.left
        if excluded:
            self._excluded = True
        else:
            self._acked = True
        if not was_left:
            for callback in self.on_leave:
                callback()

    def _acknowledge(self) -> None:
        if self._acked or self._excluded:
            return
        self.records.acknowledge(self.participant_id)
        self._leave(excluded=False)

    def _wait_for_acknowledgements(self) -> None:
        wait_for_acknowledgements(self.records, self.settings.timeouts.store_grace_timeout, self.settings.max_nodes,
                                  self.clock, self._sleep)

    def _tick_connection(self) -> StoreClient:
        # ticks are awaited on a connection of their own: a wait holds its connection until the
        # tick comes, and a signal meanwhile must still find this one free (to withdraw)
        if self._tick_store is None:
            clone = getattr(self.store, "clone", None)
            self._tick_store = clone() if clone is not None else self.store
        return self._tick_store

    def open_connections(self) -> None:
        """Open the store connections a round needs besides the main one (the heartbeat's and the
        ticks'). Called when the participant is created, so that its first round starts with them;
        otherwise the first round opens them itself."""
        self._tick_connection()
        if self._heartbeat_store is None and self._heartbeat_store_factory is not None:
            self._heartbeat_store = self._heartbeat_store_factory()

    def _start_heartbeat(self) -> None:
        if self._heartbeat is not None:
            return
        store = self._heartbeat_store
        if store is None:
            store = self._heartbeat_store_factory() if self._heartbeat_store_factory else self.store
        self._heartbeat = Heartbeat(SealedStore(store, self.signer), self.keys.heartbeat(self.participant_id),
                                    self.settings.heartbeat_every)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        """Stop beating; waits (at most one heartbeat interval) for a beat in flight to land."""
        if self._heartbeat is not None:
            # joined: a process that leaves right after must not end with a beat on its way
            # (a thread back from a store call while the interpreter finalizes aborts it)
            self._heartbeat.stop()


def note_waiting(records: RunRecords, settings: RendezvousSettings, round_id: int, waited: float,
                 left: float) -> float:
    """Say why a participant still waits for ``round_id`` (too few arrived); returns how long until
    it says it again."""
    arrived = len(records.arrivals(round_id))
    missing = settings.min_nodes - arrived
    if missing > 0:
        log.info("round %d of run %r: waiting for %d more participant(s) (%d of min_nodes=%d arrived, %.0fs so "
                 "far, %.0fs left of the join timeout)", round_id, settings.run_id, missing, arrived,
                 settings.min_nodes, waited, left)
    return WAITING_NOTE_EVERY
