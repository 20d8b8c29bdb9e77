"""The round watchdog: a background thread on every active rank while its round trains.

:class:`RoundWatchdog` publishes the rank's progress in the round store, notices a newer
round (a peer saw a failure first), and detects a hung step; on either it breaks the process
group so the blocked collective returns and the recovery path runs. It uses a store
connection of its own (``TCPStore.clone()``), never the training thread's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from lightning_ft.schema.round import decode_member, decode_progress, encode_progress, member_key, progress_key
from lightning_ft.strategy.decisions import PeerState, find_stalled_ranks, hang_timeout

log = logging.getLogger(__name__)


class StepClock:
    """Training-step timing of this rank, written by the main thread, read by the watchdog."""

    def __init__(self, window: int = 20) -> None:
        self.completed = 0
        self.in_flight_since: float | None = None
        self._durations: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def started(self, now: float) -> None:
        self.in_flight_since = now

    def finished(self, now: float) -> float | None:
        began, self.in_flight_since = self.in_flight_since, None
        self.completed += 1
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


class RoundWatchdog:
    """Watches one round on one active rank (see the module docstring).

    ``round_store``: a store scoped to the round (``PrefixStore(round prefix, clone)``);
    ``rdzv_store`` + ``round_key``/``heartbeat_key``: the rendezvous keys on the same clone.
    ``on_trigger(detector, reason, stalled)`` runs in the watchdog thread before the group is
    broken; ``break_group()`` makes the main thread's collective fail.
    """

    def __init__(self, *, round_store, rdzv_store, round_key: str, heartbeat_key: Callable[[str], str],
                 round_id: int, rank: int, world_size: int, clock: StepClock, hang_detection: bool,
                 hang_floor: float, hang_factor: float, dead_after: float,
                 on_trigger: Callable[[str, str, tuple[int, ...]], None], break_group: Callable[[], int],
                 poll_interval: float = 0.2, progress_interval: float = 1.0) -> None:
        self.round_store = round_store
        self.rdzv_store = rdzv_store
        self.round_key = round_key
        self.heartbeat_key = heartbeat_key
        self.round_id = round_id
        self.rank = rank
        self.world_size = world_size
        self.clock = clock
        self.hang_detection = hang_detection
        self.hang_floor = hang_floor
        self.hang_factor = hang_factor
        self.dead_after = dead_after
        self.on_trigger = on_trigger
        self.break_group = break_group
        self.poll_interval = poll_interval
        # Peers read a rank's progress only once their own step is overdue (>= hang_floor), so
        # publishing it every poll is wasted store traffic, which competes with training for
        # the CPU when the store shares the machine; fresh within progress_interval suffices.
        self.progress_interval = min(progress_interval, hang_floor / 4)
        self._published_at = float("-inf")
        self.triggered: tuple[str, str, tuple[int, ...]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._published = -1
        self._members: dict[int, str] = {}
        self._heartbeats: dict[int, tuple[int, float]] = {}
        self._warned_step = -1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lightning_ft-round-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                if self._poll():
                    return
            except Exception as exc:  # noqa: BLE001 - the store went away: the main thread will see it too
                log.debug("round watchdog stopped: %s", exc)
                return

    def _poll(self) -> bool:
        completed = self.clock.completed
        now = time.monotonic()
        if completed != self._published and now - self._published_at >= self.progress_interval:
            self.round_store.set(progress_key(self.rank), encode_progress(completed))
            self._published, self._published_at = completed, now
        current = int(self.rdzv_store.compare_set(self.round_key, "", "0"))
        if current > self.round_id:
            return self._trigger("rendezvous", f"round {current} opened while this rank trains in round "
                                               f"{self.round_id} (a peer saw a failure)", ())
        if not self.hang_detection:
            return False
        began = self.clock.in_flight_since
        timeout = hang_timeout(self.clock.durations(), self.hang_floor, self.hang_factor)
        if began is None or timeout is None:
            self._heartbeats.clear()
            return False
        overdue = time.monotonic() - began
        if overdue < timeout:
            self._heartbeats.clear()
            return False
        verdict = find_stalled_ranks(self.rank, completed, self._peer_states(), self.dead_after)
        if verdict.stalled:
            return self._trigger("hang", f"step {completed + 1} ran {overdue:.1f}s, longer than the hang timeout "
                                         f"{timeout:.1f}s: {verdict.reason}", verdict.stalled)
        if self._warned_step != completed and overdue >= timeout + self.dead_after:
            self._warned_step = completed
            log.warning("rank %d: step %d has run %.1fs (hang timeout %.1fs) but nobody can be blamed (%s); "
                        "waiting (the process-group timeout bounds the wait)", self.rank, completed + 1, overdue,
                        timeout, verdict.reason)
        return False

    def _peer_states(self) -> list[PeerState]:
        now = time.monotonic()
        states = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            if rank not in self._members and self.round_store.check([member_key(rank)]):
                self._members[rank] = decode_member(self.round_store.get(member_key(rank))).participant_id
            participant = self._members.get(rank)
            silent = 0.0
            if participant is not None:
                beat = self.rdzv_store.add(self.heartbeat_key(participant), 0)
                seen = self._heartbeats.get(rank)
                if seen is None or seen[0] != beat:
                    self._heartbeats[rank] = (beat, now)
                else:
                    silent = now - seen[1]
            key = progress_key(rank)
            completed = decode_progress(self.round_store.get(key)) if self.round_store.check([key]) else 0
            states.append(PeerState(rank, completed, silent))
        return states

    def _trigger(self, detector: str, reason: str, stalled: tuple[int, ...]) -> bool:
        self.triggered = (detector, reason, stalled)
        try:
            self.on_trigger(detector, reason, stalled)
        finally:
            broken = self.break_group()
            log.warning("rank %d: %s; broke the process group (%d connection(s)) so blocked collectives return",
                        self.rank, reason, broken)
        return True
