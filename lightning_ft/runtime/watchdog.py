"""The round watchdog: a background thread on every active rank while its round trains.

:class:`RoundWatchdog` publishes the rank's progress in the round store, notices a newer
round (a peer saw a failure first), and detects a stall: a frozen peer (its heartbeat is
silent), a peer that fell behind, or a deadlock (every rank waits in a collective and none
moves -- they entered different ones). On any of these it breaks the process group so the
blocked collective returns and the recovery path runs. It uses a store connection of its own
(``TCPStore.clone()``), never the training thread's.

What counts as progress (:class:`StepClock`): training steps, validation batches and every
collective the strategy runs (``barrier``, ``broadcast``, ``reduce``, ``all_gather``), so a
stall in setup, validation or a checkpoint save is seen, not only one inside a step.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from types import FrameType

from lightning_ft._clock import monotonic
from lightning_ft.deadlines import BackgroundThread
from lightning_ft.rendezvous.liveness import HeartbeatTracker, LivenessThresholds
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.runtime.decisions import Detector, PeerState, find_stalled_ranks, hang_timeout
from lightning_ft.schema.round import decode_member, decode_progress, encode_progress, member_key, progress_key
from lightning_ft.schema.signing import SealedStore

log = logging.getLogger(__name__)


class StepClock:
    """Progress of this rank, written by the training thread, read by the watchdog.

    ``completed``: optimizer steps done in this round; ``activity``: every unit of progress
    (steps, validation batches, collectives), with the time of the last one.
    """

    def __init__(self, window: int = 20) -> None:
        self.completed = 0
        self.activity = 0
        self.last_activity = monotonic()
        self.in_flight_since: float | None = None
        self._durations: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def touch(self, now: float | None = None) -> None:
        self.activity += 1
        self.last_activity = monotonic() if now is None else now

    def started(self, now: float) -> None:
        self.in_flight_since = now
        self.touch(now)

    def finished(self, now: float) -> float | None:
        began, self.in_flight_since = self.in_flight_since, None
        self.completed += 1
        self.touch(now)
        if began is None:
            return None
        seconds = now - began
        if self.completed > 1:  # the first step of a round is warm-up: not a sample
            with self._lock:
                self._durations.append(seconds)
        return seconds

    def durations(self) -> list[float]:
        with self._lock:
            return list(self._durations)

    def median_seconds(self) -> float | None:
        """Median of the recent step durations of this round (None before the second step):
        the step time the report prices redone steps with."""
        durations = sorted(self.durations())
        return round(durations[len(durations) // 2], 6) if durations else None


# where a thread waits inside a collective: torch.distributed's Python functions, DDP's buffer
# sync, and backward (DDP's gradient all-reduce completes inside it)
_COLLECTIVE_PATHS = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}nn{os.sep}parallel{os.sep}distributed.py")
_BACKWARD = (f"torch{os.sep}autograd{os.sep}", "_engine_run_backward")
# frames skipped when naming the caller: torch and the strategy layers between it and the user
_PLUMBING = (f"{os.sep}torch{os.sep}", f"lightning{os.sep}pytorch{os.sep}strategies{os.sep}",
             f"lightning{os.sep}fabric{os.sep}", f"lightning_ft{os.sep}strategy{os.sep}")


def waiting_in_collective(frame: FrameType | None) -> str | None:
    """Where the thread whose innermost frame is ``frame`` waits in a collective, or None.

    The label names the collective and the first caller outside torch and the strategy
    layers, e.g. ``"broadcast from lightning/pytorch/cli.py:276 (setup)"``.
    """
    if frame is None:
        return None
    code = frame.f_code
    in_collective = any(p in code.co_filename for p in _COLLECTIVE_PATHS)
    in_backward = _BACKWARD[0] in code.co_filename and code.co_name == _BACKWARD[1]
    if not (in_collective or in_backward):
        return None
    caller: FrameType | None = frame
    while caller is not None and any(p in caller.f_code.co_filename for p in _PLUMBING):
        caller = caller.f_back
    where = "" if caller is None else \
        f" from {_short_path(caller.f_code.co_filename)}:{caller.f_lineno} ({caller.f_code.co_name})"
    return f"{'backward (gradient all-reduce)' if in_backward else code.co_name}{where}"


def _short_path(path: str) -> str:
    for marker in (f"site-packages{os.sep}", f"lightning_ft{os.sep}"):
        if marker in path:
            return path.split(marker, 1)[1] if marker != f"lightning_ft{os.sep}" else "lightning_ft/" + \
                path.split(marker, 1)[1]
    return os.path.basename(path)


class RoundWatchdog(BackgroundThread):
    """Watches one round on one active rank (see the module docstring).

    ``round_values``: the round's sealed values (on a store connection of the watchdog's own);
    ``records``: the run's sealed rendezvous state (round, heartbeats) on the same clone.
    ``on_trigger(detector, reason, stalled)`` runs in the watchdog thread before the group is
    broken; ``break_group()`` makes the training thread's collective fail. Build it on the
    training thread: that is the thread whose stack tells where this rank waits.
    """

    def __init__(self, *, round_values: SealedStore, records: RunRecords, round_id: int, rank: int,
                 world_size: int, clock: StepClock,
                 hang_detection: bool, hang_floor: float, hang_factor: float, liveness: LivenessThresholds,
                 on_trigger: Callable[[Detector, str, tuple[int, ...]], None], break_group: Callable[[], int],
                 poll_interval: float = 0.2, progress_interval: float = 1.0, join_timeout: float = 2.0,
                 on_poll: Callable[[], None] | None = None) -> None:
        super().__init__("lightning_ft-round-watchdog", join_timeout)
        self.round_values = round_values
        self.records = records
        self.round_id = round_id
        self.rank = rank
        self.world_size = world_size
        self.clock = clock
        self.hang_detection = hang_detection
        self.hang_floor = hang_floor
        self.hang_factor = hang_factor
        self.dead_after = liveness.dead_after
        self.on_trigger = on_trigger
        self.break_group = break_group
        self.poll_interval = poll_interval
        #: more work for each poll on this thread and connection (the straggler watch)
        self.on_poll = on_poll
        # Peers read a rank's progress only once their own progress is overdue (>= hang_floor),
        # so publishing it every poll is wasted store traffic, which competes with training for
        # the CPU when the store shares the machine; fresh within progress_interval suffices.
        self.progress_interval = min(progress_interval, hang_floor / 4)
        # a deadlock is declared only after every peer's published position stood still this long
        self.confirm_seconds = 2 * self.progress_interval + poll_interval
        # A peer whose heartbeat is silent while this rank cannot progress is frozen (SIGSTOP, a
        # hung host): a failure at once, not after the hang timeout -- which has no step times to
        # go by in the first steps of a round and falls back to its floor. Looked at only after
        # this long without progress, so that steady training reads no heartbeats.
        self.silence_after = liveness.frozen_peer_after
        # heartbeats are watched from this much idleness on (a step this long is rare) so that a
        # peer frozen since the step began is judged at about silence_after, not twice that: its
        # silence counts from the first read
        self.watch_after = min(liveness.dead_after, self.silence_after)
        self.triggered: tuple[Detector, str, tuple[int, ...]] | None = None
        self._training_thread = threading.get_ident()
        self._published: tuple[int, int, str | None] | None = None
        self._published_at = float("-inf")
        self._members: dict[int, str] = {}
        self._heartbeats = HeartbeatTracker()
        self._positions: dict[int, tuple[bytes, float]] = {}
        self._polled_at = monotonic()
        self._warned_at = -1

    def run(self) -> None:
        # Every poll talks to the store, and a frozen store (its host SIGSTOPped, a dead
        # machine whose TCP connection is still open) answers nothing. The stores given here
        # bound each call (a ``BoundedStore``: StoreUnresponsiveError after its bound, and at
        # once while an earlier call is stuck), so a poll fails instead of blocking; once this
        # rank is overdue the group is broken without the store's help.
        while not self.stopping.wait(self.poll_interval):
            try:
                if self._poll():
                    return
            except Exception as exc:  # noqa: BLE001 - judged here: the store failed or froze
                if self.triggered is not None:
                    return  # it fired; only telling the store failed (_trigger broke the group)
                # Without the store nobody can be blamed; but a rank that cannot progress must
                # not wait for the process-group timeout either: once it is overdue, break the
                # group (the recovery path then finds out whether the store is gone for good).
                # Until then keep watching -- the store may come back.
                if self._overdue_without_store(f"the rendezvous store does not answer ({type(exc).__name__}: "
                                               f"{(str(exc).splitlines() or [''])[0][:200]})"):
                    return
                log.debug("round watchdog: store call failed (%s); still watching", exc)

    def _overdue_without_store(self, why: str) -> bool:
        if self.triggered is not None or self.stopping.is_set() or not self.hang_detection:
            return self.triggered is not None
        idle = monotonic() - self.clock.last_activity
        timeout = hang_timeout(self.clock.durations(), self.hang_floor, self.hang_factor)
        if idle < timeout:
            return False
        reason = (f"no progress for {idle:.1f}s, longer than the hang timeout {timeout:.1f}s, and {why}; "
                  "nobody can be blamed")
        try:  # reported like any verdict of this watchdog (the event log is a file); the store may not take it
            self._trigger(Detector.HANG, reason, ())
        except Exception as exc:  # noqa: BLE001 - the group is broken (in _trigger's finally): that is what counts
            log.debug("round watchdog: the store did not take the verdict: %s", exc)
        return True

    def _poll(self) -> bool:
        clock = self.clock
        now = monotonic()
        if now - self._polled_at > max(1.0, 5 * self.poll_interval):
            # this process was frozen (SIGSTOP) or starved: what it measured spans its own stop,
            # not its peers' silence -- a peer that moved on meanwhile is judged afresh, and the
            # broken group's errors reach this rank's collective by themselves
            self._heartbeats.clear()
            self._positions.clear()
        self._polled_at = now
        timeout = hang_timeout(clock.durations(), self.hang_floor, self.hang_factor)
        idle = now - clock.last_activity
        overdue = self.hang_detection and idle >= timeout
        waiting = waiting_in_collective(sys._current_frames().get(self._training_thread)) if overdue else None
        self._publish((clock.completed, clock.activity, waiting), now, urgent=overdue)
        if self.on_poll is not None and not overdue:
            self.on_poll()
        current = self.records.current_round()
        if current > self.round_id:
            return self._trigger(Detector.RENDEZVOUS, f"round {current} opened while this rank trains in round "
                                               f"{self.round_id} (a peer saw a failure)", ())
        if not overdue:
            if self.hang_detection and idle >= self.watch_after:
                return self._check_silent_peers(idle, now)
            self._heartbeats.clear()
            self._positions.clear()
            return False
        completed = clock.completed
        verdict = find_stalled_ranks(self.rank, completed, self._peer_states(now), self.dead_after,
                                     own_waiting=waiting, confirm_seconds=self.confirm_seconds)
        what = (f"in its step {completed + 1} of this round" if clock.in_flight_since is not None
                else f"after {completed} step(s) of this round")
        if verdict.stalled or verdict.deadlock:
            return self._trigger(Detector.DEADLOCK if verdict.deadlock else Detector.HANG,
                                 f"no progress for {idle:.1f}s ({what}), longer than the hang timeout "
                                 f"{timeout:.1f}s: {verdict.reason}", verdict.stalled)
        if self._warned_at != clock.activity and idle >= timeout + self.dead_after:
            self._warned_at = clock.activity
            log.warning("rank %d: no progress for %.1fs (%s; hang timeout %.1fs) but nobody can be blamed (%s); "
                        "waiting (the process-group timeout bounds the wait)", self.rank, idle, what, timeout,
                        verdict.reason)
        return False

    def _check_silent_peers(self, idle: float, now: float) -> bool:
        silent = tuple(p.rank for p in self._peer_states(now) if p.silent_seconds >= self.silence_after)
        if not silent:
            return False
        # recorded lost with the beat it stands at, as the round's coordinator would record it:
        # the coordinator takes the record instead of judging the same silence again (2 s more);
        # a peer whose heartbeat rises later was frozen, not dead, and comes back as a spare
        try:
            for rank in silent:
                self.records.mark_lost(self._members[rank], f"heartbeat silent for {self.silence_after:.2f}s while "
                                       f"rank {self.rank} could not progress (frozen or hung)",
                                       silent_at=self._heartbeats.last_beat(rank))
        except Exception as exc:  # noqa: BLE001 - the coordinator judges it then; the trigger must not wait
            log.debug("round watchdog: recording rank(s) %s lost failed: %s", list(silent), exc)
        return self._trigger(Detector.HANG, f"no progress for {idle:.1f}s and the heartbeat of rank(s) {list(silent)} "
                                     f"silent for >= {self.silence_after:.1f}s (frozen or hung host)", silent)

    def _publish(self, position: tuple[int, int, str | None], now: float, urgent: bool) -> None:
        if position == self._published:
            return
        if not urgent and now - self._published_at < self.progress_interval:
            return
        self.round_values.put(progress_key(self.rank), encode_progress(*position))
        self._published, self._published_at = position, now

    def _peer_states(self, now: float) -> list[PeerState]:
        states = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            if rank not in self._members:
                raw = self.round_values.get(member_key(rank))
                if raw is not None:
                    self._members[rank] = decode_member(raw).participant_id
            participant = self._members.get(rank)
            silent = 0.0 if participant is None else \
                self._heartbeats.observe(rank, self.records.heartbeat(participant), now)
            raw = self.round_values.get(progress_key(rank)) or b""
            position = self._positions.get(rank)
            if position is None or position[0] != raw:
                self._positions[rank] = position = (raw, now)
            progress = decode_progress(raw)
            states.append(PeerState(rank, progress.completed, silent, progress.waiting, now - position[1]))
        return states

    def _trigger(self, detector: Detector, reason: str, stalled: tuple[int, ...]) -> bool:
        self.triggered = (detector, reason, stalled)
        try:
            self.on_trigger(detector, reason, stalled)
        finally:
            broken = self.break_group()
            log.warning("rank %d: %s; broke the process group (%d connection(s)) so blocked collectives return",
                        self.rank, reason, broken)
        return True
