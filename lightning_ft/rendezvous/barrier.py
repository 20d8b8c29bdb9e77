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

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from lightning_ft.rendezvous.decisions import (
    Action,
    Arrival,
    RoundTimer,
    RoundView,
    arrivals_of_round,
    assign_ranks,
    choose_incarnation,
    decide_completion,
    is_extra_participant,
    newly_dead,
)
from lightning_ft.rendezvous.participant import ParticipantInfo, process_start_time
from lightning_ft.rendezvous.settings import RendezvousSettings
from lightning_ft.schema.run import (
    CloseKind,
    CloseReason,
    RunKeys,
    Slot,
    decode_coordinator,
    decode_last_actives,
    decode_ready,
    encode_coordinator,
    decode_slot,
    decode_slot_rank,
    encode_last_actives,
    encode_ready,
    encode_slot,
    encode_slot_rank,
    incarnation_key,
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

    def __init__(self, store, settings: RendezvousSettings, participant: ParticipantInfo, *,
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
        self._clock = clock
        self._sleep = sleep
        self._heartbeat_store_factory = heartbeat_store_factory
        self._heartbeat_thread: threading.Thread | None = None
        self._heartbeat_stop = threading.Event()
        self._last_active_round: int | None = None
        self._last_result: RoundResult | None = None
        self._excluded = False
        self._acked = False
        self._decode_cache: dict[tuple[str, bytes], Slot | None] = {}

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
        if self._mark_lost(self.participant_id, f"unhealthy: {reasons}"):
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
        self._mark_lost(self.participant_id, f"withdrew: {reason}")
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
        self._heartbeat_stop.set()
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
        deadline = self._clock() + join_timeout
        coordinator = _Coordinator(self, round_id) if index == 0 else None
        watch = _CoordinatorWatch(self._clock())
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
                coordinator = _Coordinator(self, round_id, replaces=watch.replaced)
            if coordinator is not None:
                if not coordinator.still_mine():
                    coordinator = None
                else:
                    coordinator.step()
                    if self._is_ready(round_id):
                        continue
            if self._clock() > deadline:
                arrived = store.add(keys.arrived(round_id), 0) - store.add(keys.withdrawn(round_id), 0)
                raise RendezvousTimeoutError(
                    f"round {round_id} of run {settings.run_id!r} did not complete within "
                    f"{'rejoin' if join_timeout != settings.timeouts.join_timeout else 'join'}_timeout="
                    f"{join_timeout:g}s: {arrived} participant(s) arrived, "
                    f"min_nodes={settings.min_nodes}")
            self._sleep(poll)

    def _should_take_over(self, round_id: int, watch: "_CoordinatorWatch") -> bool:
        # The coordinator bumps a beat each poll. If it stops for ``dead_after`` (it died),
        # one waiter wins a compare_set and coordinates instead.
        now = self._clock()
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

    def _mark_lost(self, participant_id: str, why: str) -> bool:
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
                                  self._clock, self._sleep)

    def _start_heartbeat(self) -> None:
        if self._heartbeat_thread is not None:
            return
        store = self._heartbeat_store_factory() if self._heartbeat_store_factory else self.store
        key = self.keys.heartbeat(self.participant_id)
        interval = self.settings.timeouts.heartbeat_interval
        stop = self._heartbeat_stop

        def beat() -> None:
            while not stop.is_set():
                try:
                    store.add(key, 1)
                except Exception as exc:  # noqa: BLE001 - store gone: stop beating quietly
                    log.debug("heartbeat stopped: %s", exc)
                    return
                stop.wait(interval)

        store.add(key, 1)
        self._heartbeat_thread = threading.Thread(target=beat, name="lightning_ft-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def stop_heartbeat(self) -> None:
        self._heartbeat_stop.set()


def resolve_incarnation(store, signer: Signer, run_id: str, started_at: float) -> int:
    """The incarnation of ``run_id`` a participant started at ``started_at`` belongs to (see
    :func:`~lightning_ft.rendezvous.decisions.choose_incarnation`); opens the next one if needed."""
    counter = incarnation_key(run_id)
    values = SealedStore(store, signer)
    current = store.add(counter, 0)
    while True:
        raw = values.get(values.unlisted(RunKeys(run_id, current).closed_for_good))
        closed = CloseReason.decode(raw) if raw is not None else None
        chosen = choose_incarnation(current, closed.closed_at if closed is not None else None, started_at)
        if chosen == current:
            return current
        moved = int(store.compare_set(counter, str(current), str(chosen)))
        if moved == chosen:
            log.info("run %s: incarnation %d was closed for good (%s) before this process started; this is a new "
                     "launch of the run id: incarnation %d", run_id, current, closed, chosen)
            return chosen
        current = moved  # someone else moved it: judge the new one


def expected_acknowledgements(store, keys: RunKeys) -> int:
    """Participants of the newest round (arrived, not withdrawn): who should acknowledge shutdown."""
    round_id = int(store.compare_set(keys.round, "", "0"))
    return store.add(keys.arrived(round_id), 0) - store.add(keys.withdrawn(round_id), 0)


def wait_for_acknowledgements(store, keys: RunKeys, timeout: float,
                              clock: Callable[[], float] = time.monotonic,
                              sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait until every participant acknowledged shutdown, at most ``timeout`` seconds.

    Ends as soon as all acknowledged (no fixed sleep). Returns whether they all did.
    """
    expected = expected_acknowledgements(store, keys)
    start = clock()
    acks = store.add(keys.shutdown_acks, 0)
    while acks < expected and clock() - start < timeout:
        sleep(0.01)
        acks = store.add(keys.shutdown_acks, 0)
    waited = clock() - start
    if acks >= expected:
        log.info("store host: all %d participant(s) acknowledged shutdown after %.3fs", expected, waited)
        return True
    log.warning("store host: %d of %d participant(s) acknowledged within store_grace_timeout=%.1fs; "
                "letting the store go", acks, expected, timeout)
    return False


@dataclass
class _CoordinatorWatch:
    since: float
    beat: int = -1
    next_check: float = 0.0
    #: the coordinators this one took over from: the silent one, and those it had replaced
    replaced: tuple[str, ...] = ()


class _Coordinator:
    """Decides one round: reads the slots, asks the pure decision, writes the result."""

    def __init__(self, rendezvous: BarrierRendezvous, round_id: int, replaces: tuple[str, ...] = ()) -> None:
        self.rdzv = rendezvous
        self.store = rendezvous.store
        self.keys = rendezvous.keys
        self.settings = rendezvous.settings
        self.round_id = round_id
        self.clock = rendezvous._clock
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
            fetched = dict(zip(present, self.store.multi_get(present))) if present else {}
            raw_values = [fetched.get(k, b"") for k in slot_keys]
        # decoded by (key, raw value): a value is authentic only under the key it was sealed for
        cache, signer = self.rdzv._decode_cache, self.rdzv.signer
        slots = []
        for key, raw in zip(slot_keys, raw_values):
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
        for pid, key in zip(missing, hb_keys):
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
            self.rdzv._mark_lost(pid, f"heartbeat silent for {self.settings.dead_after:.2f}s ({why})")
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
