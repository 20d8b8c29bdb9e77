"""An in-process cluster: the participants of one run as threads of this process, over one real TCPStore.

The fast tier of the fault matrix (tests/FAULTS.md): the decision paths of the real-process tests
in seconds. The harness hosts one TCPStore; every participant is built by the real factory
(:func:`lightning_ft.launch.factory.open_participant`) and runs, in a thread of its own, the part
of the strategy's fit loop that decides (``RendezvousFitLoop._join_round`` and
``_rendezvous_ended``, ``RecoveryExecutor.handle``, ``_pass_exit_barrier``), with every decision
taken by the package: the barrier rendezvous and its coordinator, the round watchdog
(``RoundRuntime.start_watchdog``), the hot spare's ``SpareMonitor``, ``read_failure_facts`` and
the pure decisions of :mod:`lightning_ft.runtime.decisions`. Modelled instead of run:

* Training. A step is a short sleep and then an in-process stand-in for the gradient all-reduce
  (:class:`RoundGroup`): it completes once every rank of the round entered it, so a peer that
  stops stops the others, as a real collective does. The first collective of a round hands every
  rank the newest step, as the snapshot exchange does; the collective that follows
  :meth:`InProcessCluster.finish` tells every rank to end ``fit()`` at the same step.
* A process. A participant owns every store connection (``BoundedStore``) built on its thread,
  and asks it before each call (:class:`_StoreGate`). Faults act on those connections, which is
  what a signal does to a process as far as the others can tell:

  - kill (SIGKILL): from then on every call of its connections fails at once, so nothing more of
    it reaches the store and it never shuts down cleanly; its heartbeat stops and its thread
    ends. Its side of the round's collective goes away: with ``reset_connections`` the peers'
    pending collective fails with gloo's "Connection closed by peer" (the kernel closes a killed
    process's sockets), without it the peers just wait (a host gone silent);
  - freeze (SIGSTOP): every call of its connections blocks until it thaws, and so does its
    training loop: its heartbeat stops rising; thawed, it carries on where it stopped;
  - SIGTERM: raised on its main thread at its next store call (where Python would run the handler
    the fit loop installs while it waits in the rendezvous), then handled as the fit loop does
    (``withdraw(stopping=True)``). A SIGTERM to an active that trains takes the graceful
    termination path (stop-step agreement, snapshot), which is not modelled here;
  - a lost store: :meth:`InProcessCluster.lose_store` drops the TCPStore the harness hosts; its
    server stops and every connection fails as with a killed store process. Store fail-over is
    off (``store_failover=False``): the tier models one TCPStore for the life of the job.

Faults at an exact point of the package's code (:meth:`InProcessCluster.inject`) wrap one method
while the cluster lives and strike on the named participant's main thread only, as
``ft_train.py --fault KIND:MODULE:QUALNAME:N`` does in a process of its own.

Every wait here is bounded; :meth:`InProcessCluster.close` kills whoever is left, joins every
participant's thread, waits for the package's threads to end (all but the idle worker of each
``BoundedStore``, which ends only once its connection is dropped: the cluster still holds them) and
restores what it wrapped.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils import store as store_util

from lightning_ft._torch import exit_barrier_names
from lightning_ft.deadlines import BoundedStore, call_with_timeout, first_line
from lightning_ft.events import names as ev
from lightning_ft.exit_codes import ExitCode
from lightning_ft.launch.factory import Participant, open_participant
from lightning_ft.rendezvous.barrier import (
    ActivesFinishedError,
    BarrierRendezvous,
    ParticipantExcludedError,
    RoundResult,
)
from lightning_ft.rendezvous.participant import local_participant
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.rendezvous.settings import RendezvousSettings
from lightning_ft.runtime.decisions import (
    Detector,
    EndAction,
    EndCause,
    FailureAction,
    FailureFacts,
    FailureKind,
    FailureOutcome,
    Role,
    classify_failure,
    decide_after_interruption,
    decide_on_failure,
    decide_on_rendezvous_end,
)
from lightning_ft.runtime.recovery import read_failure_facts
from lightning_ft.runtime.run import RunState
from lightning_ft.runtime.session import RoundRuntime, Session
from lightning_ft.runtime.settings import HangSettings
from lightning_ft.runtime.spare_monitor import SpareMonitor
from lightning_ft.schema.round import encode_member, failed_key, member_key
from lightning_ft.schema.run import CloseKind, CloseReason, RunKeys
from lightning_ft.schema.signing import job_signer
from lightning_ft.store.tcp import host_store, parse_endpoint

#: the worker thread every ``BoundedStore`` starts: nothing stops it once its store is dropped (the xfail
#: test_a_dropped_store_connection_leaves_no_thread_behind), so :meth:`InProcessCluster.close` leaves it idle
STORE_WORKER_THREAD = "lightning_ft-store-client"

#: the participant whose main thread is running (a thread-local), for :class:`_StoreGate`
_RUNNING = threading.local()
#: where a ``BoundedStore`` keeps the participant that built it
_OWNER_ATTRIBUTE = "_inprocess_owner"


class ParticipantKilled(RuntimeError):
    """What a killed participant's own code meets at its next store call (its connections are gone).

    A RuntimeError, as torch's lost-connection errors are, so the package's threads of that
    participant (heartbeat, monitors) stop as quietly as they do when a store goes away."""


class SigtermInterrupt(BaseException):
    """SIGTERM, raised on a participant's main thread (the fit loop's ``_SpareTerminated``)."""


class Ending(enum.Enum):
    """How a participant's ``fit()`` ended."""

    #: trained until the job finished, passed the exit barrier and shut down
    FINISHED = "finished"
    #: left the rendezvous (``decide_on_rendezvous_end`` said how: ``ParticipantEnd.action``)
    LEFT_RENDEZVOUS = "left_rendezvous"
    #: had no place in the run (an extra participant): exit 0, the job goes on without it
    EXCLUDED = "excluded"
    #: gave up after a failed round or a failed rendezvous: NO_RESTART
    GAVE_UP = "gave_up"
    #: re-raised its own error, or a deliberate stop
    RAISED = "raised"
    #: killed by the test
    KILLED = "killed"
    #: the harness or the package raised something unexpected (a test failure; ``text`` has the traceback)
    CRASHED = "crashed"


#: the exit status a real process would end with, per ending (LEFT_RENDEZVOUS: per action)
_EXIT_CODES = {Ending.FINISHED: int(ExitCode.SUCCESS), Ending.EXCLUDED: int(ExitCode.SUCCESS),
               Ending.GAVE_UP: int(ExitCode.NO_RESTART), Ending.RAISED: 1, Ending.KILLED: -9, Ending.CRASHED: 1}
_ACTION_EXIT_CODES = {EndAction.RETURN: int(ExitCode.SUCCESS), EndAction.STOPPED: int(ExitCode.STOPPED),
                      EndAction.NO_RESTART: int(ExitCode.NO_RESTART)}


@dataclass(frozen=True)
class ParticipantEnd:
    """How a participant's ``fit()`` ended, and the exit status its process would have."""

    ending: Ending
    text: str
    #: for LEFT_RENDEZVOUS: what it had been, why the rendezvous ended, and the decision
    role: Role | None = None
    cause: EndCause | None = None
    action: EndAction | None = None
    #: the run's close as this participant read it when it left (None: open, or unreadable)
    closed: CloseReason | None = None

    @property
    def exit_code(self) -> int:
        if self.ending is Ending.LEFT_RENDEZVOUS:
            assert self.action is not None
            return _ACTION_EXIT_CODES[self.action]
        return _EXIT_CODES[self.ending]


@dataclass(frozen=True)
class RecoveryDecision:
    """A participant's decisions about one failed round (the pure decisions' answers)."""

    round: int
    facts: FailureFacts
    kind: FailureKind
    #: who noticed the failure (None when the first decision left at once)
    detector: Detector | None
    #: ``decide_on_failure``
    first: FailureOutcome
    #: ``decide_after_interruption`` (None when the first decision left at once)
    outcome: FailureOutcome | None


class RecordingEventLog:
    """The session's event log: keeps every event, for the tests to read (``of``)."""

    enabled = True
    path = None

    def __init__(self, who: str, changed: threading.Condition) -> None:
        self.who = who
        self.records: list[tuple[str, dict[str, Any]]] = []
        self._changed = changed

    def emit(self, event: str, **fields: Any) -> None:
        with self._changed:
            self.records.append((event, dict(fields)))
            self._changed.notify_all()

    def of(self, event: str) -> list[dict[str, Any]]:
        """The fields of every ``event`` emitted so far, in order."""
        with self._changed:
            return [fields for name, fields in self.records if name == event]


class RoundGroup:
    """The process group of one round, in-process: its collectives complete once every rank entered.

    Each collective combines one number per rank (the largest wins: the first collective of a round
    hands every rank the newest step, as the snapshot exchange does) and says whether the job asked
    to finish, so every rank ends at the same step. A rank that is gone never enters again: with a
    reset its peers' collective fails at once, as gloo's does when a peer's connections close;
    without, they wait, as on a frozen peer, until the round watchdog breaks the group (``abort``).
    Every wait is bounded by ``timeout`` (the process group's timeout)."""

    def __init__(self, round_id: int, world_size: int, timeout: float, finish_requested: threading.Event) -> None:
        self.round_id = round_id
        self.world_size = world_size
        self.timeout = timeout
        self._finish_requested = finish_requested
        self._changed = threading.Condition()
        self._entered: dict[int, int] = {}
        self._completed = 0
        self._last: tuple[int, bool] = (0, False)
        self._broken: str | None = None
        self._gone: set[int] = set()

    def collective(self, rank: int, value: int) -> tuple[int, bool]:
        """Enter the next collective with ``value``; returns (the largest value, finish) once every rank did."""
        with self._changed:
            self._raise_if_broken(rank)
            number = self._completed
            self._entered[rank] = value
            if len(self._entered) == self.world_size:
                self._last = (max(self._entered.values()), self._finish_requested.is_set())
                self._entered = {}
                self._completed += 1
                self._changed.notify_all()
                return self._last
            deadline = time.monotonic() + self.timeout
            # the next collective cannot complete without this rank: _last is this one's result
            while self._completed == number:
                self._raise_if_broken(rank)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(f"[in-process group of round {self.round_id}] timed out waiting for the "
                                       f"collective after {self.timeout:g}s")
                self._changed.wait(remaining)
            return self._last

    def depart(self, rank: int, reset: bool) -> None:
        """``rank`` is gone for good (killed); ``reset``: its connections closed (the peers' collective fails)."""
        with self._changed:
            self._gone.add(rank)
            self._entered.pop(rank, None)
            if reset and self._broken is None:
                self._broken = f"Connection closed by peer (rank {rank} of round {self.round_id} is gone)"
            self._changed.notify_all()

    def abort(self, by_rank: int) -> None:
        """Shut the group's connections down (the round watchdog's ``break_group``): every pending
        and later collective fails, as a gloo collective does once its sockets are shut down."""
        with self._changed:
            if self._broken is None:
                self._broken = (f"Connection closed by peer (rank {by_rank} shut down the connections of round "
                                f"{self.round_id})")
            self._changed.notify_all()

    def _raise_if_broken(self, rank: int) -> None:
        if rank in self._gone:
            raise ParticipantKilled(f"rank {rank} of round {self.round_id} is gone")
        if self._broken is not None:
            raise RuntimeError(f"[in-process group of round {self.round_id}] {self._broken}")


class GroupConnections:
    """One rank's connections to its round's group: the part of ``GroupTransport`` the package uses
    (``RoundRuntime.transport``: the watchdog's ``break_group`` and ``read_failure_facts``)."""

    def __init__(self, group: RoundGroup, rank: int, owner: InProcessParticipant) -> None:
        self.group, self.rank, self.owner = group, rank, owner
        self.aborted = False

    def abort(self) -> int:
        if self.owner.killed:
            return 0  # a dead process shuts nothing down
        self.aborted = True
        self.group.abort(self.rank)
        return self.group.world_size - 1


class _StoreGate:
    """Every ``BoundedStore`` remembers the participant whose thread built it, and asks that participant
    before each of its calls (:meth:`InProcessParticipant._before_store_call`): how a kill, a freeze
    or a SIGTERM reaches every thread of a participant at once, without touching the package."""

    def __init__(self) -> None:
        self._init = BoundedStore.__init__
        self._call = BoundedStore._call

    def install(self) -> None:
        original_init, original_call = self._init, self._call

        def __init__(store: BoundedStore, *args: Any, **kwargs: Any) -> None:
            original_init(store, *args, **kwargs)
            vars(store)[_OWNER_ATTRIBUTE] = getattr(_RUNNING, "participant", None)

        def _call(store: BoundedStore, name: str, *args: Any, **kwargs: Any) -> Any:
            owner = vars(store).get(_OWNER_ATTRIBUTE)
            if owner is not None:
                owner._before_store_call()
            return original_call(store, name, *args, **kwargs)

        BoundedStore.__init__ = __init__
        BoundedStore._call = _call

    def uninstall(self) -> None:
        BoundedStore.__init__ = self._init
        BoundedStore._call = self._call


class InProcessParticipant:
    """One participant of an :class:`InProcessCluster`: a thread that takes part in the run as the
    strategy's fit loop does (see the module docstring), and what it did so far.

    Its state is written by its own thread under the cluster's condition (``cluster.changed``); the
    tests read it after :meth:`InProcessCluster.wait_until`."""

    def __init__(self, cluster: InProcessCluster, name: str, local_id: int, infra_rank: int) -> None:
        self.cluster = cluster
        self.name = name
        self.info = local_participant(local_id=local_id, domain_id=name, infra_rank=infra_rank)
        self.events = RecordingEventLog(name, cluster.changed)
        #: every round this participant completed, active or standby, in order
        self.rounds: list[RoundResult] = []
        #: the step it trains at (the trainer's ``global_step``)
        self.step = 0
        #: per round it trained in: the step the round started from (after the exchange), and steps trained
        self.start_step: dict[int, int] = {}
        self.steps_in: dict[int, int] = {}
        #: its decisions about failed rounds, in order
        self.decisions: list[RecoveryDecision] = []
        #: how its ``fit()`` ended (None while it runs)
        self.end: ParticipantEnd | None = None
        #: the factory's participant and the fit loop's session (None before its thread built them)
        self.participant: Participant | None = None
        self.session: Session | None = None
        self.run = RunState()
        self._saw_round = False
        self._killed = threading.Event()
        self._thawed = threading.Event()
        self._thawed.set()
        self._sigterm = threading.Event()
        self._group: RoundGroup | None = None
        self._rank = -1
        self._runtime: RoundRuntime | None = None
        self.thread = threading.Thread(target=self._main, name=f"inprocess-participant-{name}", daemon=True)

    # ----------------------------------------------------------------- what the tests read

    @property
    def participant_id(self) -> str:
        return self.info.participant_id

    @property
    def rendezvous(self) -> BarrierRendezvous:
        assert self.participant is not None, f"{self.name} has no rendezvous yet"
        return self.participant.rendezvous

    @property
    def killed(self) -> bool:
        return self._killed.is_set()

    def result_of(self, round_id: int) -> RoundResult | None:
        """Where it stood in round ``round_id`` (None: it took no part in that round)."""
        return next((r for r in self.rounds if r.round == round_id), None)

    def active_in(self, round_id: int) -> bool:
        result = self.result_of(round_id)
        return result is not None and result.is_active

    def __repr__(self) -> str:
        rounds = ", ".join(f"r{r.round}:{'rank ' + str(r.rank) + '/' + str(r.world_size) if r.is_active else 'standby'}"
                           for r in self.rounds)
        decisions = ", ".join(f"r{d.round}:{d.kind.value}->{(d.outcome or d.first).action.value}"
                              for d in self.decisions)
        end = "running" if self.end is None else (f"{self.end.ending.value} (exit {self.end.exit_code}"
                                                   f"{', ' + self.end.action.value if self.end.action else ''}): "
                                                   f"{self.end.text[:300]}")
        return (f"<{self.name} {self.participant_id}: rounds [{rounds}], step {self.step}, "
                f"decisions [{decisions}], {end}>")

    # ----------------------------------------------------------------- faults

    def kill(self, reset_connections: bool = True) -> None:
        """SIGKILL: nothing of it reaches the store from now on, its heartbeat stops, its thread ends
        without shutting down. ``reset_connections``: its round's peers see their collective fail
        ("Connection closed by peer"); else they wait, as on a host gone silent."""
        with self.cluster.changed:
            self._killed.set()
            self._thawed.set()  # a frozen participant dies too: its blocked calls wake and fail
            group, rank = self._group, self._rank
            self.cluster.changed.notify_all()
        if group is not None:
            group.depart(rank, reset_connections)
        if self.participant is not None:
            self.rendezvous.stop_heartbeat()

    def freeze(self) -> None:
        """SIGSTOP: every call of its store connections, and its training loop, blocks until :meth:`thaw`."""
        self._thawed.clear()

    def thaw(self) -> None:
        """SIGCONT: it carries on where it stopped (its heartbeat rises again)."""
        self._thawed.set()

    def terminate(self) -> None:
        """SIGTERM: raised on its main thread at its next store call (it waits in the rendezvous)."""
        self._sigterm.set()

    def _strike(self, fault: str) -> None:
        """A fault injected by :meth:`InProcessCluster.inject`, on this participant's main thread."""
        if fault == "kill":
            self.kill()
            raise ParticipantKilled(f"{self.name} was killed")
        if fault == "freeze":
            self.freeze()
            self._checkpoint()  # stopped right here until thawed
            return
        raise ValueError(f"unknown fault {fault!r}: kill or freeze")

    def _before_store_call(self) -> None:
        """Asked before every call of this participant's store connections, on the calling thread."""
        self._checkpoint()
        if self._sigterm.is_set() and threading.current_thread() is self.thread:
            self._sigterm.clear()
            raise SigtermInterrupt()

    def _checkpoint(self) -> None:
        """Raise if killed; block (bounded) while frozen."""
        if not self._thawed.is_set() and not self._thawed.wait(self.cluster.longest_freeze):
            raise RuntimeError(f"{self.name} stayed frozen longer than {self.cluster.longest_freeze:g}s: "
                               "the test never thawed it")
        if self._killed.is_set():
            raise ParticipantKilled(f"{self.name} was killed")

    # ----------------------------------------------------------------- its thread

    def _main(self) -> None:
        _RUNNING.participant = self  # every store connection built on this thread is this participant's
        try:
            self.participant = open_participant(self.cluster.endpoint, False, self.info, self.cluster.settings)
            self.session = Session(self.participant, self.events)
            self.session.events.emit(ev.JOIN, participant=self.participant_id, store_host=self.participant.hosting)
            while True:
                result = self._join_round()
                if result is None or self._train(result):
                    break
        except BaseException:  # noqa: BLE001 - every end is recorded: the test judges it
            self._ended(ParticipantEnd(Ending.CRASHED, traceback.format_exc()))
        finally:
            runtime = self._runtime
            if runtime is not None:
                runtime.stop_watchdog()
            if self.participant is not None:
                self.rendezvous.stop_heartbeat()
            _RUNNING.participant = None

    def _ended(self, end: ParticipantEnd) -> None:
        with self.cluster.changed:
            if self.end is None:
                # a killed participant decides nothing: whatever its thread met on the way out
                self.end = ParticipantEnd(Ending.KILLED, "killed") if self._killed.is_set() else end
            self.cluster.changed.notify_all()

    # ----------------------------------------------------------------- the rendezvous (RendezvousFitLoop)

    def _join_round(self) -> RoundResult | None:
        """Block until active in a round (None: this participant left the run)."""
        session = self.session
        assert session is not None
        rendezvous = session.rendezvous
        monitor = None
        try:
            monitor = self._start_spare_monitor(session)
            while True:
                result = rendezvous.join_round()
                with self.cluster.changed:
                    self._saw_round = True
                    self.rounds.append(result)
                    self.cluster.changed.notify_all()
                session.events.emit(ev.ROUND_COMPLETE, round=result.round, rank=result.rank,
                                    world=result.world_size, standby=not result.is_active)
                if result.is_active:
                    return result
                rendezvous.wait_while_standby(result.round)
        except BaseException as exc:  # noqa: BLE001 - sorted below as the fit loop sorts them
            if self._killed.is_set():
                self._ended(ParticipantEnd(Ending.KILLED, "killed"))
                return None
            self._left_rendezvous(exc)
            return None
        finally:
            if monitor is not None:
                monitor.stop()

    def _start_spare_monitor(self, session: Session) -> SpareMonitor | None:
        if not self.cluster.spare_monitors:
            return None
        settings = session.rendezvous.settings
        monitor = SpareMonitor(rdzv_store=session.store.clone(), keys=session.keys, signer=session.rendezvous.signer,
                               dead_after=settings.liveness.all_silent_after, open_round=session.open_round,
                               poll_interval=self.cluster.spare_monitor_interval,
                               join_timeout=settings.timeouts.thread_stop_timeout)
        monitor.start()
        return monitor

    def _left_rendezvous(self, exc: BaseException) -> None:
        """The rendezvous ended for this participant: as ``RendezvousFitLoop._join_round`` sorts it."""
        if isinstance(exc, SigtermInterrupt):
            self._rendezvous_ended(EndCause.SIGTERM, "SIGTERM while waiting in the rendezvous")
        elif isinstance(exc, ActivesFinishedError):
            self._rendezvous_ended(EndCause.ACTIVES_FINISHED, str(exc))
        elif isinstance(exc, (RendezvousGracefulExitError, RendezvousClosedError)):
            self._rendezvous_ended(EndCause.CLOSED, str(exc))
        elif isinstance(exc, RendezvousTimeoutError):
            self._rendezvous_ended(EndCause.TIMED_OUT, str(exc))
        elif isinstance(exc, (RuntimeError, OSError)):  # the store itself (DistStoreError is a RuntimeError)
            self._rendezvous_ended(EndCause.STORE_LOST, f"lost the rendezvous store at {self.cluster.endpoint}: "
                                                        f"{type(exc).__name__}: {first_line(exc)}")
        elif isinstance(exc, ParticipantExcludedError) and not self.run.trained:
            self.rendezvous.stop_heartbeat()
            assert self.session is not None
            self.session.events.emit(ev.SPARE_EXIT, reason=str(exc))
            self._ended(ParticipantEnd(Ending.EXCLUDED, str(exc)))
        elif isinstance(exc, RendezvousError):  # excluded after training, or another rendezvous failure
            self._give_up(f"rendezvous failed: {exc}")
        else:
            raise exc

    def _role(self) -> Role:
        if self.run.trained:
            return Role.TRAINED
        return Role.STANDBY if self._saw_round else Role.UNASSIGNED

    def _rendezvous_ended(self, cause: EndCause, reason: str) -> None:
        """``RendezvousFitLoop._rendezvous_ended``: leave with what ``decide_on_rendezvous_end`` says."""
        rendezvous = self.rendezvous
        role = self._role()
        if cause is EndCause.SIGTERM:
            _best_effort(rendezvous.withdraw, reason, stopping=True)
        closed = None
        if cause in (EndCause.CLOSED, EndCause.ACTIVES_FINISHED):
            try:
                closed = rendezvous.closed_reason()
            except (RuntimeError, OSError):
                closed = None
        action = decide_on_rendezvous_end(role, cause, closed.kind if closed else None)
        text = str(closed) if closed is not None else reason
        end = ParticipantEnd(Ending.LEFT_RENDEZVOUS, text, role, cause, action, closed)
        if action is EndAction.NO_RESTART:
            too_few = closed is not None and closed.kind is CloseKind.TOO_FEW_NODES
            why = (f"no hot spare left to replace the lost participant(s): {closed}" if too_few
                   else f"the job cannot go on: {text}")
            assert self.session is not None
            self.session.events.emit(ev.NO_RESTART, reason=why)
            self._leave()
            self._ended(dataclasses.replace(end, text=why))
            return
        _best_effort(rendezvous.shutdown, job_finished=False)
        assert self.session is not None
        self.session.events.emit(ev.STOPPED if action is EndAction.STOPPED else ev.SPARE_EXIT, reason=text)
        self._ended(end)

    # ----------------------------------------------------------------- training (RecoveryExecutor, _pass_exit_barrier)

    def _train(self, result: RoundResult) -> bool:
        """Train in round ``result`` until the job finishes or the round fails; True when this
        participant is done (finished or left), False to join the next round."""
        session, cluster = self.session, self.cluster
        assert session is not None
        runtime = RoundRuntime(result, result.round, self.run.failure_at)
        self.run.start_round(runtime)
        self._runtime = runtime
        # what the strategy publishes when its group formed: the watchdog and the spare monitor read it
        session.round_values(result).put(member_key(result.rank), encode_member(self.participant_id,
                                                                                self.info.domain_id))
        group = cluster.group_of(result)
        with cluster.changed:
            self._group, self._rank = group, result.rank
        runtime.transport = GroupConnections(group, result.rank, self)
        runtime.start_watchdog(session, cluster.hang, cluster.settings.timeouts, lambda: self.step)
        try:
            self._checkpoint()  # a kill that came before this rank had a group
            newest, _ = group.collective(result.rank, self.step)  # the snapshot exchange
            with cluster.changed:
                self.step = newest
                self.start_step[result.round] = newest
                self.steps_in[result.round] = 0
                cluster.changed.notify_all()
            while True:
                self._checkpoint()
                runtime.step_started()
                self._killed.wait(cluster.step_seconds)  # the step's own work
                self._checkpoint()
                _, finish = group.collective(result.rank, self.step + 1)  # the gradient all-reduce
                with cluster.changed:
                    self.step += 1
                    self.steps_in[result.round] += 1
                    cluster.changed.notify_all()
                runtime.step_finished()
                if finish:
                    break
        except BaseException as exc:  # classified below, as the recovery executor does
            if self._killed.is_set():
                raise ParticipantKilled(f"{self.name} was killed") from exc
            return self._handle_failure(exc, runtime)
        finally:
            with cluster.changed:
                self._group = None
        self._finish(runtime)
        return True

    def _handle_failure(self, exc: BaseException, runtime: RoundRuntime) -> bool:
        """``RecoveryExecutor.handle``: read the facts, decide, open the next round or leave. True: left."""
        session, cluster = self.session, self.cluster
        assert session is not None and runtime.result is not None
        result = runtime.result
        failed_at = time.monotonic()
        failures_without_progress = self.run.count_failure(self.step)
        watchdog = runtime.stop_watchdog()
        own_detector = watchdog.triggered[0] if watchdog is not None and watchdog.triggered else None
        facts, detector = read_failure_facts(exc, runtime, session, own_detector,
                                             cluster.settings.timeouts.failure_notice_timeout)
        kind = classify_failure(facts)
        first = decide_on_failure(kind)
        error_text = f"{type(exc).__name__}: {first_line(exc)}"
        if first.action is not FailureAction.INTERRUPT:
            self._record(RecoveryDecision(result.round, facts, kind, None, first, None))
            if first.publish_error:  # so its peers do not mistake it for a lost node
                session.round_values(result).put(failed_key(result.rank), error_text)
            if first.action is FailureAction.UNHEALTHY:
                self.rendezvous.report_unhealthy(error_text)
            self._leave(CloseReason(first.close, error_text) if first.close is not None else None)
            self._ended(ParticipantEnd(Ending.RAISED, f"{kind.value}: {error_text}"))
            return True
        detector = detector or Detector.COLLECTIVE
        if runtime.transport is not None:  # retire_group: no peer may go on waiting on this round's group
            runtime.transport.abort()
        if not detector.judges_a_stall:  # the watchdog reported it already, when it fired
            session.events.emit(ev.FAILURE_DETECTED, round=result.round, step=self.step, error=error_text,
                                detector=detector.value, stalled=[])
        outcome = decide_after_interruption(kind, False, failures_without_progress,
                                            cluster.max_failures_without_progress, self.run.recoveries,
                                            cluster.max_recoveries)
        self._record(RecoveryDecision(result.round, facts, kind, detector, first, outcome))
        session.events.emit(ev.DECISION, round=result.round, kind=kind.value, action=outcome.action.value,
                            reason=outcome.reason)
        if outcome.action is FailureAction.RAISE:
            self._leave(CloseReason(CloseKind.STOPPED, outcome.reason))
            self._ended(ParticipantEnd(Ending.RAISED, outcome.reason))
            return True
        if outcome.action is FailureAction.NO_RESTART:
            self._give_up(outcome.reason, close=True)
            return True
        self.run.recoveries += 1
        self.run.failure_at = failed_at
        try:
            session.open_round(result.round, f"{kind.value} in round {result.round}: {error_text}")
        except (RuntimeError, OSError) as store_error:  # torch's DistNetworkError/DistStoreError
            if self._killed.is_set():
                raise
            self._give_up(f"lost the rendezvous store at {cluster.endpoint} ({type(store_error).__name__}: "
                          f"{first_line(store_error)}) while recovering from a {kind.value} in round {result.round}")
            return True
        return False

    def _record(self, decision: RecoveryDecision) -> None:
        with self.cluster.changed:
            self.decisions.append(decision)
            self.cluster.changed.notify_all()

    def _finish(self, runtime: RoundRuntime) -> None:
        """``RendezvousFitLoop._pass_exit_barrier``: torch's exit barrier (bounded), then close and leave."""
        session, cluster = self.session, self.cluster
        assert session is not None and runtime.result is not None
        result = runtime.result
        runtime.stop_watchdog()
        timeout = cluster.exit_barrier_timeout
        call_with_timeout(lambda: store_util.barrier(session.round_store(result), result.world_size,
                                                     key_prefix=exit_barrier_names()[0], barrier_timeout=timeout),
                          timeout + 1.0, f"exit barrier of round {result.round}", unanswered="going on without it",
                          log_problem=True, store_call=True)
        session.events.emit(ev.FINISHED, round=result.round, rank=result.rank, step=self.step)
        session.rendezvous.shutdown(job_finished=True, reason=f"round {result.round} completed fit()")
        self._ended(ParticipantEnd(Ending.FINISHED, f"finished in round {result.round} at step {self.step}"))

    def _leave(self, close: CloseReason | None = None) -> None:
        """``RecoveryExecutor.leave``: tell the others (the close, best effort), stop this round's threads,
        shut the rendezvous down."""
        session = self.session
        assert session is not None
        if close is not None:
            session.close(close.kind, close.text)
        if self._runtime is not None:
            self._runtime.stop_watchdog()
        session.rendezvous.shutdown(job_finished=False)

    def _give_up(self, message: str, close: bool = False) -> None:
        """``RecoveryExecutor.give_up``: NO_RESTART, closing the run FAILED first with ``close``."""
        assert self.session is not None
        self.session.events.emit(ev.NO_RESTART, reason=message)
        self._leave(CloseReason(CloseKind.FAILED, message) if close else None)
        self._ended(ParticipantEnd(Ending.GAVE_UP, message))


def _best_effort(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """A courtesy to the others on the way out (the fit loop's): the store may be gone."""
    try:
        call(*args, **kwargs)
    except (RuntimeError, OSError):
        pass


class InProcessCluster:
    """Participants of one run as threads of this process, over one TCPStore this harness hosts.

    ``run_id``, ``min_nodes``, ``max_nodes`` and ``settings`` (any :class:`RendezvousSettings`
    option or rendezvous timeout, e.g. ``keep_ranks=True``) make the run's settings; the timeouts
    default to short ones, the join timeouts only bound a test that goes wrong. ``step_seconds``:
    a training step's own work; ``hang_timeout_floor``: the round watchdog's hang timeout (by
    default longer than any test, so a frozen peer is found by its silent heartbeat, the path that
    does not depend on step times); ``spare_monitors``: every participant runs the hot spare's
    monitor while it waits in the rendezvous, as the fit loop does.

    Use it as a context manager or call :meth:`close`: it kills whoever is left, joins every
    thread and restores what it wrapped. One cluster at a time per process.
    """

    _open: InProcessCluster | None = None

    def __init__(self, run_id: str, min_nodes: int, max_nodes: int, *, heartbeat_interval: float = 0.1,
                 last_call_timeout: float = 0.05, previous_active_grace: float = 5.0, join_timeout: float = 30.0,
                 rejoin_timeout: float = 30.0, step_seconds: float = 0.01, hang_timeout_floor: float = 60.0,
                 spare_monitors: bool = True, spare_monitor_interval: float = 0.1, group_timeout: float = 60.0,
                 exit_barrier_timeout: float = 20.0, longest_freeze: float = 60.0,
                 max_failures_without_progress: int = 2, max_recoveries: int | None = None,
                 **settings: Any) -> None:
        if InProcessCluster._open is not None:
            raise RuntimeError("one InProcessCluster at a time: its store gate wraps BoundedStore for the process")
        # heartbeat_interval 0.1 (the default of the package): a participant is dead after 0.4 s of
        # silence, which a busy 2-core machine does not reach by starving a live heartbeat thread
        self.settings = RendezvousSettings.of(
            run_id, min_nodes, max_nodes, heartbeat_interval=heartbeat_interval, last_call_timeout=last_call_timeout,
            previous_active_grace=previous_active_grace, join_timeout=join_timeout, rejoin_timeout=rejoin_timeout,
            store_timeout=20.0, connect_timeout=20.0, store_failover=False, **settings)
        self.hang = HangSettings(hang_timeout_floor=hang_timeout_floor, watchdog_interval=0.1)
        self.step_seconds = step_seconds
        self.spare_monitors = spare_monitors
        self.spare_monitor_interval = spare_monitor_interval
        self.group_timeout = group_timeout
        self.exit_barrier_timeout = exit_barrier_timeout
        self.longest_freeze = longest_freeze
        self.max_failures_without_progress = max_failures_without_progress
        self.max_recoveries = max_recoveries
        #: every change of a participant's state is announced here (see :meth:`wait_until`)
        self.changed = threading.Condition()
        self.finish_requested = threading.Event()
        self.participants: dict[str, InProcessParticipant] = {}
        self._groups: dict[int, RoundGroup] = {}
        self._local_ids = itertools.count()
        self._restore: list[Callable[[], None]] = []
        self._threads_before = set(threading.enumerate())
        self._closed = False
        # port 0: the kernel picks a free port as the store binds it (no race between choosing and binding)
        self._server: dist.TCPStore | None = host_store("127.0.0.1", 0, datetime.timedelta(seconds=20))
        self.endpoint = parse_endpoint(f"127.0.0.1:{self._server.port}")
        # the test's own view of the run (its thread only); every participant of this process started
        # before any close, so all of them belong to incarnation 0 of a fresh store
        self._inspector: dist.TCPStore | None = dist.TCPStore(self.endpoint.host, self.endpoint.port, is_master=False,
                                                              timeout=datetime.timedelta(seconds=20))
        self.keys = RunKeys(run_id, 0)
        self._records: RunRecords | None = RunRecords(self._inspector, job_signer(), self.keys)
        gate = _StoreGate()
        gate.install()
        self._restore.append(gate.uninstall)
        InProcessCluster._open = self

    def __enter__(self) -> InProcessCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- participants

    def start(self, *names: str, wait_for_arrival: bool = True, timeout: float = 30.0) -> list[InProcessParticipant]:
        """Start a participant per name, in order; each one's scheduler node index is its number
        among all started, so earlier ones are preferred as actives. ``wait_for_arrival``: start the
        next only once this one arrived in the current round (or ended): roles then follow the order
        of ``names`` however a loaded machine schedules the threads."""
        started = []
        for name in names:
            if name in self.participants:
                raise ValueError(f"a participant named {name!r} exists already")
            local_id = next(self._local_ids)
            participant = InProcessParticipant(self, name, local_id, infra_rank=local_id)
            with self.changed:
                self.participants[name] = participant
            participant.thread.start()
            started.append(participant)
            if wait_for_arrival:
                assert self.wait_until(lambda p=participant: p.end is not None or self.arrived(p), timeout), \
                    f"{name} did not arrive within {timeout:g}s: {self.describe()}"
        return started

    def __getitem__(self, name: str) -> InProcessParticipant:
        return self.participants[name]

    def arrived(self, participant: InProcessParticipant) -> bool:
        """Whether ``participant`` arrived in the current round (its arrival record is in the store)."""
        records = self.records
        return participant.participant_id in {a.participant_id for a in records.arrivals(records.current_round())}

    @property
    def records(self) -> RunRecords:
        """The run's sealed state, read on the test's own connection (not after :meth:`lose_store`)."""
        assert self._records is not None, "the store is lost"
        return self._records

    def group_of(self, result: RoundResult) -> RoundGroup:
        """The process group of ``result``'s round (the same object for every rank of the round)."""
        with self.changed:
            group = self._groups.get(result.round)
            if group is None:
                group = self._groups[result.round] = RoundGroup(result.round, result.world_size, self.group_timeout,
                                                                self.finish_requested)
            return group

    def finish(self) -> None:
        """Let the job finish: the actives end ``fit()`` together after their next step."""
        self.finish_requested.set()

    # ----------------------------------------------------------------- faults

    def inject(self, participant: InProcessParticipant, owner: type, method: str, fault: str, *,
               before: bool = False, when: Callable[..., bool] = lambda *args, **kwargs: True) -> threading.Event:
        """Strike ``participant`` with ``fault`` ("kill" or "freeze") on its main thread, right after
        (``before``: right before) its first call of ``owner.method`` for which ``when(*args, **kwargs)``
        holds (``args[0]`` is the instance). Returns an event set when it struck. The method is
        wrapped until :meth:`close`; every other thread's calls pass through unchanged."""
        original = vars(owner)[method]
        struck = threading.Event()

        def strikes(args: tuple, kwargs: dict) -> bool:
            if threading.current_thread() is not participant.thread or struck.is_set() or not when(*args, **kwargs):
                return False
            struck.set()
            with self.changed:
                self.changed.notify_all()
            return True

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before and strikes(args, kwargs):
                participant._strike(fault)
            value = original(*args, **kwargs)
            if not before and strikes(args, kwargs):
                participant._strike(fault)
            return value

        setattr(owner, method, wrapper)
        self._restore.append(lambda: setattr(owner, method, original))
        return struck

    def lose_store(self) -> None:
        """The store goes away: the TCPStore this harness hosts is dropped, its server stops, and every
        connection to it fails from now on (a killed store process, as far as its clients can tell)."""
        # the server stops when its last reference goes: this one (nothing else holds the object)
        self._records, self._inspector, self._server = None, None, None

    # ----------------------------------------------------------------- waiting

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
        """Wait (at most ``timeout`` seconds) until ``predicate()`` holds; whether it does. Woken by every
        change a participant announces, and every 50 ms for what is read from the store."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.changed.wait(min(remaining, 0.05))
            return True

    def wait_for_ends(self, *participants: InProcessParticipant, timeout: float = 30.0) -> dict[str, int]:
        """Wait until every one of ``participants`` ended; their exit codes by name (asserts they all ended)."""
        assert self.wait_until(lambda: all(p.end is not None for p in participants), timeout), \
            f"not all of {[p.name for p in participants]} ended within {timeout:g}s: {self.describe()}"
        return {p.name: p.end.exit_code for p in participants if p.end is not None}

    def describe(self) -> str:
        """Every participant's state, for an assertion's message."""
        with self.changed:
            return "\n" + "\n".join(repr(p) for p in self.participants.values())

    # ----------------------------------------------------------------- the end

    def close(self, timeout: float = 30.0) -> None:
        """Kill whoever is left, join every participant's thread, restore what was wrapped, drop the store,
        and check that no thread the cluster started is left (idle store workers aside: they end once
        their connections, which the cluster still holds, are dropped). Raises AssertionError naming what is left."""
        if self._closed:
            return
        self._closed = True
        problems = []
        try:
            for participant in self.participants.values():
                if participant.end is None:
                    participant.kill(reset_connections=True)
            deadline = time.monotonic() + timeout
            for participant in self.participants.values():
                participant.thread.join(max(0.0, deadline - time.monotonic()))
                if participant.thread.is_alive():
                    problems.append(f"participant {participant.name} did not end within {timeout:g}s")
        finally:
            for restore in reversed(self._restore):
                restore()
            self._restore.clear()
            InProcessCluster._open = None
            self.lose_store()
        # the package's threads end within their own bounds (a watchdog's or a monitor's stop, a
        # bounded call): wait for them, then name any that is left
        deadline = time.monotonic() + timeout
        while True:
            left = [t for t in threading.enumerate()
                    if t not in self._threads_before and t.is_alive() and t.name != STORE_WORKER_THREAD]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        problems += [f"thread {t.name!r} still runs" for t in left]
        assert not problems, "; ".join(problems)
