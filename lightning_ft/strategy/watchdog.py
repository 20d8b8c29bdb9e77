"""Background threads of the ``ddp_ft`` strategy.

* :class:`RoundWatchdog` runs on every active rank while its round trains: it publishes the
  rank's progress in the round store, notices a newer round (a peer saw a failure first),
  and detects a hung step; on either it breaks the process group so the blocked collective
  returns and the recovery path runs.
* :class:`SpareMonitor` runs on a hot spare while it waits: it keeps a copy of the newest
  snapshot when the actives publish one for replication, and opens the next round when an
  active of the current round is silent (so a job whose actives all died still recovers).

Both use a store connection of their own (``TCPStore.clone()``), never the main thread's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from lightning_ft.strategy.decisions import PeerState, find_stalled_ranks, hang_timeout, should_pull_replica

log = logging.getLogger(__name__)

_SEP = "\x1f"


def member_key(rank: int) -> str:
    return f"member/{rank}"


def progress_key(rank: int) -> str:
    return f"progress/{rank}"


def failed_key(rank: int) -> str:
    return f"failed/{rank}"


REPLICA_META_KEY = "replica/meta"
REPLICA_BLOB_KEY = "replica/blob"


def encode_member(participant_id: str, domain_id: str) -> str:
    return f"{participant_id}{_SEP}{domain_id}"


def decode_member(raw: bytes) -> tuple[str, str]:
    participant_id, _, domain = raw.decode().partition(_SEP)
    return participant_id, domain


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
    ``rdzv_store`` + ``cycle_key``/``heartbeat_key``: the rendezvous keys on the same clone.
    ``on_trigger(detector, reason, stalled)`` runs in the watchdog thread before the group is
    broken; ``break_group()`` makes the main thread's collective fail.
    """

    def __init__(self, *, round_store, rdzv_store, cycle_key: str, heartbeat_key: Callable[[str], str],
                 cycle: int, rank: int, world_size: int, clock: StepClock, hang_detection: bool,
                 hang_floor: float, hang_factor: float, dead_after: float,
                 on_trigger: Callable[[str, str, tuple[int, ...]], None], break_group: Callable[[], int],
                 poll_interval: float = 0.2, progress_interval: float = 1.0) -> None:
        self.round_store = round_store
        self.rdzv_store = rdzv_store
        self.cycle_key = cycle_key
        self.heartbeat_key = heartbeat_key
        self.cycle = cycle
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
            self.round_store.set(progress_key(self.rank), str(completed))
            self._published, self._published_at = completed, now
        current = int(self.rdzv_store.compare_set(self.cycle_key, "", "0"))
        if current > self.cycle:
            return self._trigger("rendezvous", f"round {current} opened while this rank trains in round "
                                               f"{self.cycle} (a peer saw a failure)", ())
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
                self._members[rank] = decode_member(self.round_store.get(member_key(rank)))[0]
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
            completed = int(self.round_store.get(key)) if self.round_store.check([key]) else 0
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


class SpareMonitor:
    """Runs on a hot spare while it waits (see the module docstring)."""

    def __init__(self, *, rdzv_store, keys, participant_id: str, domain_id: str, replication_factor: int,
                 dead_after: float, save_replica: Callable[[bytes], int | None],
                 on_replica: Callable[[int, int], None], open_round: Callable[[int, str], None],
                 poll_interval: float = 0.25) -> None:
        self.store = rdzv_store
        self.keys = keys
        self.participant_id = participant_id
        self.domain_id = domain_id
        self.replication_factor = replication_factor
        self.dead_after = dead_after
        self.save_replica = save_replica
        self.on_replica = on_replica
        self.open_round = open_round
        self.poll_interval = poll_interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._replica_version = ""
        self._watched_cycle = -1
        self._members: dict[int, str] = {}
        self._beats: dict[str, tuple[int, float]] = {}

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="lightning_ft-spare-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self._poll()
            except Exception as exc:  # noqa: BLE001 - best effort: the main thread owns the real errors
                log.debug("spare monitor: %s", exc)

    def _poll(self) -> None:
        cycle = int(self.store.compare_set(self.keys.cycle, "", "0"))
        if not self.store.check([self.keys.ready(cycle)]):
            return  # the round is still forming: nothing trains yet
        prefix = self.keys.round_store_prefix(cycle)
        self._pull_replica(prefix)
        self._watch_actives(cycle, prefix)

    def _pull_replica(self, prefix: str) -> None:
        meta_key = f"{prefix}/{REPLICA_META_KEY}"
        if not self.store.check([meta_key]):
            return
        meta = self.store.get(meta_key).decode()
        if meta == self._replica_version:
            return
        self._replica_version = meta
        step_text, _, domains_text = meta.partition(_SEP)
        active_domains = domains_text.split(",") if domains_text else []
        index = self.store.add(f"{prefix}/replica/pullers/{step_text}", 1) - 1
        if not should_pull_replica(self.domain_id, active_domains, self.replication_factor, index):
            return
        blob = self.store.get(f"{prefix}/{REPLICA_BLOB_KEY}")
        step = self.save_replica(blob)
        if step is not None:
            self.on_replica(step, len(blob))

    def _watch_actives(self, cycle: int, prefix: str) -> None:
        if cycle != self._watched_cycle:
            self._watched_cycle = cycle
            self._members.clear()
            self._beats.clear()
        now = time.monotonic()
        rank = len(self._members)
        while self.store.check([f"{prefix}/{member_key(rank)}"]):
            self._members[rank] = decode_member(self.store.get(f"{prefix}/{member_key(rank)}"))[0]
            rank += 1
        if not self._members or self.store.check([self.keys.exit_barrier(cycle)]):
            return
        # Only when *every* active is silent: survivors detect the loss of some of them
        # themselves (a failed collective, the hang detector); nobody would open the next
        # round if all of them were gone.
        silent = []
        for participant in self._members.values():
            beat = self.store.add(self.keys.heartbeat(participant), 0)
            seen = self._beats.get(participant)
            if seen is None or seen[0] != beat:
                self._beats[participant] = (beat, now)
            elif now - seen[1] >= self.dead_after:
                silent.append(participant)
        if len(silent) == len(self._members):
            self.open_round(cycle, f"every active of round {cycle} is silent ({', '.join(silent)})")
            self._beats.clear()
