"""What one ``ddp_ft`` process keeps while it takes part in a run: the session and its rounds.

* :class:`Session` -- per process, across rounds: the rendezvous store, this participant's
  side of the barrier rendezvous, the run's keys and the event log.
* :class:`RoundRuntime` -- per round this process trains in: the rendezvous result, the
  process group's transport, the watchdog and the step clock.
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch.distributed as dist

from lightning_ft._clock import monotonic
from lightning_ft._logging import StrategyLog
from lightning_ft.checkpoint.memory.holders import claim_run, release_run
from lightning_ft.checkpoint.memory.roots import remove_run_snapshots
from lightning_ft.deadlines import on_service_thread_stop, raw_store
from lightning_ft.events import EventLog, NullEventLog
from lightning_ft.events import names as ev
from lightning_ft.exit_codes import HandOver
from lightning_ft.failover.backend import FailoverBackend
from lightning_ft.launch.factory import Participant, open_participant
from lightning_ft.rendezvous.barrier import BarrierRendezvous, RoundResult
from lightning_ft.rendezvous.participant import local_participant
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.runtime.decisions import Detector
from lightning_ft.runtime.elastic import GrowWatch
from lightning_ft.runtime.settings import HangSettings, StragglerSettings, StrategySettings
from lightning_ft.runtime.stage_state import NO_FIT
from lightning_ft.runtime.transport import GroupTransport, retire_group
from lightning_ft.runtime.watchdog import RoundWatchdog, StepClock
from lightning_ft.schema.round import VERDICT_KEY, EvictionScope, encode_verdict
from lightning_ft.schema.run import CloseKind, CloseReason, RunKeys
from lightning_ft.schema.signing import SealedStore
from lightning_ft.settings import Timeouts
from lightning_ft.stragglers.meter import WorkMeter
from lightning_ft.stragglers.watch import StragglerWatch

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})


#: the open session of each run this process takes part in, by (endpoint, run id): a script's
#: stages (fit, validate, test, predict) share one, whichever Trainer runs them
_SESSIONS: dict[tuple[str, str], Session] = {}


@dataclass
class Session:
    """Per-process rendezvous state, kept across rounds and across the stages of a job.

    A job ends for this process at interpreter exit (or when the process starts taking part in
    another run): :meth:`end` leaves the rendezvous then, the actives of the last stage closing
    it for good first, so that a script's later ``fit()``, ``test()`` and the rest find it open.
    """

    participant: Participant
    events: EventLog | NullEventLog
    #: stages started in this process (the next one's number)
    stages_started: int = 0
    #: ``fit()`` stages started in this process
    fits_started: int = 0
    #: this participant finished the stage it took part in last as an active
    finished_as_active: bool = False
    #: the fit() stage this process's module state is from (the last fit it finished as an active,
    #: or whose state it received; see runtime/stage_state.py)
    trained_through: int = NO_FIT
    ended: bool = False
    #: this process ended the job with an error of its own in a stage (its text): no later stage
    #: can run (see JobEndedError)
    failed_with: str | None = None
    #: the stage this process took part in last completed (as an active, or without it)
    last_stage_completed: bool = False
    #: this process saw the job finish (a spare told the rendezvous closed as finished)
    saw_job_finish: bool = False
    #: this process was active in some round of the job / took part in one (active or standby)
    was_active: bool = False
    saw_round: bool = False
    #: snapshot roots of the job's EmergencyCheckpoints -> keep them when the job finished
    snapshot_roots: dict[str, bool] = field(default_factory=dict)
    #: (durable tier, step, epoch) of the last fit() this process finished as an active: recorded
    #: there when the job finishes (see ``DurableTier.mark_finished``)
    fit_finished: tuple[Any, int, int] | None = None
    #: the rendezvous endpoint the launch names: what tells this job from another of its run id
    job_endpoint: str = ""

    @classmethod
    def open(cls, settings: StrategySettings, events_for: Callable[[str], EventLog | NullEventLog]) -> Session:
        """This process's session of the run: the open one, else reach (or host) the store and build
        this participant. Raises ``RendezvousError`` when the store cannot be reached;
        ``events_for(participant_id)`` opens the event log."""
        launch = settings.launch
        assert launch.endpoint is not None  # a rendezvous launch has one (resolve_launch_config)
        key = (str(launch.endpoint), launch.run_id)
        existing = _SESSIONS.get(key)
        if existing is not None and not existing.ended:
            return existing
        if _SESSIONS:
            for other in list(_SESSIONS.values()):
                other.end()  # a process takes part in one run at a time: the run it left is over for it
            _SESSIONS.clear()
            # the run left behind holds its store connections in reference cycles (callbacks that
            # name their owner): collected now, a process that runs job after job (a test suite,
            # a sweep) keeps a flat count of descriptors instead of one socket more per run until
            # the cyclic collector happens to run
            gc.collect()
        info = local_participant(domain_id=settings.domain_id, infra_rank=settings.infra_rank)
        participant = open_participant(launch.endpoint, settings.is_store_host, info, settings.rendezvous_settings(),
                                       rejoin=settings.rejoin)
        session = cls(participant, events_for(info.participant_id), job_endpoint=str(launch.endpoint))
        _SESSIONS[key] = session
        _end_sessions_at_exit()
        participant.on_switch.append(session._store_moved)
        session.events.emit(ev.JOIN, participant=info.participant_id, domain=settings.domain_id,
                            endpoint=str(launch.endpoint), run_id=launch.run_id, min_nodes=launch.min_nodes,
                            max_nodes=launch.max_nodes, store_host=participant.hosting)
        ft_log.info("participant %s (domain %s) joins run %s at %s (nodes %d:%d)%s",
                 info.participant_id, settings.domain_id, launch.run_id, launch.endpoint, launch.min_nodes,
                 launch.max_nodes, "; hosting the store" if participant.hosting else "")
        return session

    def next_stage(self, fitting: bool) -> tuple[int, int | None]:
        """Number this process's next stage: (its stage number, and for a ``fit()`` its number among
        the fits, else None)."""
        stage, self.stages_started = self.stages_started, self.stages_started + 1
        self.finished_as_active = self.last_stage_completed = False
        if not fitting:
            return stage, None
        fit, self.fits_started = self.fits_started, self.fits_started + 1
        return stage, fit

    def end(self) -> None:
        """The job is over for this process: leave the rendezvous (idempotent). Closes it for good
        first when this participant finished the last stage as an active; a store that is gone is
        logged, not raised."""
        if self.ended:
            return
        self.ended = True
        rendezvous = self.rendezvous
        crashed = crashed_error()
        if not rendezvous.left:  # else it left already (an exit of its own, a withdrawal)
            try:
                if crashed is not None and self.finished_as_active:
                    # the script failed after its stage: the job did not finish -- the others,
                    # maybe waiting in the next stage, must not read "finished" and exit 0
                    self.close(CloseKind.FAILED, f"{self.participant.info.participant_id} ended with {crashed} "
                                                 "after its stage")
                rendezvous.shutdown(job_finished=self.finished_as_active and crashed is None,
                                    reason="the job's last stage completed")
            except (RuntimeError, OSError) as exc:
                ft_log.warning("could not leave the rendezvous at the end of the job: %s", exc)
        self.participant.close()
        if crashed is None and self.finished_as_active and self.fit_finished is not None:
            tier, step, epoch = self.fit_finished
            try:  # a node started later (a replacement, a restart) must not train the run again
                tier.mark_finished(step, epoch)
            except OSError as exc:
                ft_log.warning("could not record in the durable tier that the run finished: %s", exc)
        if crashed is None and (self.last_stage_completed or self.saw_job_finish):
            self._remove_snapshots()
        for root in self.snapshot_roots:
            try:
                release_run(root, self.rendezvous.settings.run_id)
            except OSError as exc:  # a dead holder's line drops out at the next claim anyway
                ft_log.debug("could not release the run's directory under %s: %s", root, exc)

    def note_snapshot_root(self, root: str, keep: bool) -> None:
        """A stage's EmergencyCheckpoint writes under ``root``: the job's end removes the job's
        snapshots there once it finished, unless one of the stages said ``keep``. The first time,
        this process claims the run's directory there (``RunHeldError``: another live job of this
        run id holds it on this host)."""
        if root not in self.snapshot_roots:
            claim_run(root, self.rendezvous.settings.run_id, self.job_endpoint)
        self.snapshot_roots[root] = self.snapshot_roots.get(root, False) or keep

    def _remove_snapshots(self) -> None:
        """The job finished: its snapshots in memory go (unless kept): nothing is left to resume, and
        /dev/shm is the node's RAM."""
        for root, keep in self.snapshot_roots.items():
            if keep:
                continue
            try:
                removed = remove_run_snapshots(root, self.participant.rendezvous.settings.run_id)
            except OSError as exc:
                ft_log.warning("could not remove the finished job's snapshots under %s: %s", root, exc)
                continue
            if removed:
                ft_log.info("the job finished: removed its snapshots from memory (%s)", ", ".join(removed))

    @property
    def store(self) -> Any:
        """The store client every connection of this process is cloned from (follows a fail-over)."""
        return self.participant.store

    @property
    def rendezvous(self) -> BarrierRendezvous:
        return self.participant.rendezvous

    @property
    def keys(self) -> RunKeys:
        return self.participant.rendezvous.keys

    @property
    def participant_id(self) -> str:
        return self.participant.info.participant_id

    def _store_moved(self, hosting: bool) -> None:
        backend = self.participant.backend
        assert isinstance(backend, FailoverBackend)  # only a fail-over moves the store
        switchboard = backend.switchboard
        epoch, seconds, successor = switchboard.failovers[-1] if switchboard.failovers else \
            (switchboard.epoch, 0.0, "")
        self.events.emit(ev.STORE_FAILOVER, epoch=epoch, endpoint=str(switchboard.endpoint), hosting=hosting,
                         seconds=round(seconds, 3), successor=successor)

    def follow_newest_store(self) -> None:
        """Before re-joining: follow the store the others failed over to while this process was
        frozen, if they did (see the backend)."""
        self.participant.backend.follow_newest()

    def round_store(self, result: RoundResult, store: Any = None) -> dist.PrefixStore:
        """The job's store of a round (on ``store``, default the session's connection), for
        torch's own keys (the exit barrier); our values there go through :meth:`round_values`."""
        return dist.PrefixStore(result.store_prefix, raw_store(self.store if store is None else store))

    def round_values(self, result: RoundResult, store: Any = None) -> SealedStore:
        """The sealed values of a round's job (see :mod:`lightning_ft.schema.round`)."""
        return SealedStore(self.store if store is None else store, self.rendezvous.signer, result.store_prefix)

    def open_round(self, failed_round: int, reason: str) -> int:
        """Open the round after ``failed_round`` (idempotent across participants); returns it."""
        new = self.rendezvous.open_next_round(failed_round, reason)
        self.events.emit(ev.ROUND_OPEN, round=new, after=failed_round, reason=reason)
        return new

    def close(self, kind: CloseKind, text: str) -> None:
        """Close the rendezvous for good; a store that is gone is logged, not raised."""
        try:
            self.rendezvous.close_for_good(CloseReason(kind, text))
        except (RuntimeError, OSError) as exc:
            ft_log.warning("could not close the rendezvous: %s", exc)


_exit_hook_installed = False


def _end_sessions_at_exit() -> None:
    """At interpreter exit, end every open session (registered once; atexit runs it before the
    exit gate of store calls, which registered when the first store client was made) -- and
    when outside code stops one of our threads (see ``ServiceThread``)."""
    global _exit_hook_installed
    if not _exit_hook_installed:
        _exit_hook_installed = True
        atexit.register(_end_every_session)
        on_service_thread_stop(_end_every_session)


def _tick_all(ticks: list[Callable[[], None]]) -> None:
    for tick in ticks:
        tick()


def _end_every_session() -> None:
    for session in list(_SESSIONS.values()):
        session.end()


@dataclass
class RoundRuntime:
    """One round this process trains in.

    ``failure_at`` is the ``monotonic()`` of the failure that led to this round (None
    for the first); the first completed step after it is reported as the recovery's end.
    """

    result: RoundResult | None
    round_id: int | None
    failure_at: float | None = None
    #: this round replaces a failed one -- the same answer on every participant of the round,
    #: spares included (unlike ``failure_at``, which only processes that saw the failure have)
    after_failure: bool = False
    #: with ``after_failure``: the round replaces one that did not fail but re-formed on purpose
    #: (``hand_over``, ``grow``; see ``RunRecords.mark_planned``) -- the run's figures count no
    #: recovery for it (known on rank 0 only, which alone adds to them)
    planned: str | None = None
    clock: StepClock = field(default_factory=StepClock)
    transport: GroupTransport | None = None
    watchdog: RoundWatchdog | None = None
    #: this rank's own work per step (None: stragglers are not watched in this round)
    work: WorkMeter | None = None
    #: the straggler watch the watchdog drives (None without ``work``)
    stragglers: StragglerWatch | None = None
    #: a training step completed in this round
    progressed: bool = False
    #: a hand-over verdict of the SIGTERM path, acted on at the next step boundary
    hand_over: HandOver | None = None
    #: an elastic job's look-out for newcomers (None: the world size is fixed, or at its maximum)
    grow: GrowWatch | None = None
    awaiting_first_step: bool = False

    def __post_init__(self) -> None:
        self.awaiting_first_step = self.failure_at is not None

    @property
    def follows_a_failure(self) -> bool:
        """This round replaces a failed one (see ``after_failure``)."""
        return self.after_failure

    def step_started(self) -> None:
        self.clock.started(monotonic())

    def step_finished(self) -> float | None:
        """Record a completed optimizer step; returns seconds since the failure when it is the
        first step after a recovery, else None."""
        now = monotonic()
        self.clock.finished(now)
        self.progressed = True
        if not self.awaiting_first_step:
            return None
        self.awaiting_first_step = False
        return now - self.failure_at if self.failure_at is not None else None

    def start_watchdog(self, session: Session, hang: HangSettings, timeouts: Timeouts,
                       global_step: Callable[[], int | None], stragglers: StragglerSettings | None = None,
                       grow: tuple[int, float] | None = None) -> None:
        """Watch this round from a thread with its own store connection (see :class:`RoundWatchdog`)."""
        result, events, keys = self.result, session.events, session.keys
        assert result is not None  # only a round of the barrier rendezvous is watched
        # a connection of its own whose every call is bounded more tightly than the session's
        clone = session.store.clone(timeouts.watchdog_store_timeout)
        round_values = session.round_values(result, clone)
        records = RunRecords(clone, session.rendezvous.signer, keys)

        def on_trigger(detector: Detector, reason: str, stalled: tuple[int, ...]) -> None:
            if detector.judges_a_stall:
                # the trainer's step, not the clock's (it restarts with every round); and how long
                # the step had been stuck, which the report counts as lost time
                began = self.clock.in_flight_since
                events.emit(ev.FAILURE_DETECTED, round=result.round, step=global_step(), error=reason,
                            detector=detector.value, stalled=list(stalled), step_seconds=self.clock.median_seconds(),
                            stuck_seconds=None if began is None else round(monotonic() - began, 3))
            if detector.judges_a_stall:
                round_values.put_if_absent(VERDICT_KEY, encode_verdict(detector.value, reason))
            opened = records.open_round(result.round + 1)
            if detector.judges_a_stall and opened == result.round + 1:
                events.emit(ev.ROUND_OPEN, round=result.round + 1, after=result.round, reason=reason)

        if stragglers is not None and stragglers.straggler_factor is not None and result.world_size > 1:
            self.work = WorkMeter(stragglers.straggler_window)
            rendezvous = session.rendezvous  # an eviction is bound to this run, incarnation, round and launch
            scope = EvictionScope(rendezvous.settings.run_id, keys.incarnation, result.round,
                                  rendezvous.records.launch_id)
            self.stragglers = StragglerWatch(
                self.work, rank=result.rank, world_size=result.world_size, scope=scope,
                factor=stragglers.straggler_factor, window=stragglers.straggler_window, round_values=round_values,
                records=records, emit=events.emit)
        if grow is not None and result.world_size < grow[0]:  # (max_nodes, elastic_grow_interval)
            self.grow = GrowWatch(rank=result.rank, world_size=result.world_size, max_world_size=grow[0],
                                  round_id=result.round, round_values=round_values, records=records,
                                  grow_interval=grow[1], global_step=global_step,
                                  step_seconds=self.clock.median_seconds)
        ticks = [watch.tick for watch in (self.stragglers, self.grow) if watch is not None]
        transport = self.transport
        self.clock.touch()  # building the group was progress; the watchdog measures from here
        self.watchdog = RoundWatchdog(
            round_values=round_values, records=records, round_id=result.round, rank=result.rank,
            world_size=result.world_size,
            clock=self.clock, hang_detection=hang.hang_detection, hang_floor=hang.hang_timeout_floor,
            hang_factor=hang.hang_safety_factor,
            liveness=session.rendezvous.settings.liveness, on_trigger=on_trigger,
            break_group=transport.abort if transport is not None else (lambda: 0),
            poll_interval=hang.watchdog_interval, join_timeout=timeouts.thread_stop_timeout,
            on_poll=partial(_tick_all, ticks) if ticks else None)
        self.watchdog.start()

    def stop_watchdog(self) -> RoundWatchdog | None:
        """Stop the watchdog (if any) and return it, so its verdict can be read."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop()
        if self.work is not None:
            self.work.close()  # its gradient hooks: the parameters outlive the round
        return watchdog

    def retire_group(self) -> None:
        """Break the round's group (pending collectives fail) and retire it; see
        :func:`~lightning_ft.runtime.transport.retire_group`."""
        transport, self.transport = self.transport, None
        retire_group(transport)


def crashed_error() -> str | None:
    """At interpreter exit: the exception that ended the script (Python keeps it as
    ``sys.last_value`` once it printed the traceback), as ``Type: message``; None on a clean end."""
    error = getattr(sys, "last_value", None)
    if error is None:
        return None
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}".rstrip(": ")
