"""The fault-tolerance runtime: one object per process that a Lightning strategy holds.

:class:`FaultToleranceRuntime` owns everything fault tolerance does in one process -- the
rendezvous session and its rounds (:mod:`.session`), the loop that runs ``fit()`` round by round
and recovers (:mod:`.fit_loop`, :mod:`.recovery`), the round's watchdog and straggler watch, the
snapshots around a round (exchange when a group forms, the round-start snapshot, copies for hot
spares or other domains) and the callbacks of the SIGTERM path -- so that a strategy only
forwards Lightning's hooks to it. What differs between strategies is the state's layout
(:mod:`.layout`), handed in; what the runtime needs of the strategy is :class:`StrategySurface`.

Errors found off the training thread (a hung peer, a straggler verdict, a newer round) are
recorded as state by the watchdog and acted on at the training thread's next step boundary or
collective (the broken group raises there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch.distributed as dist

from lightning_ft._clock import monotonic
from lightning_ft._lightning.callbacks import first_callback_of_type
from lightning_ft._lightning.history import set_aside_abandoned_checkpoints, versioned_loggers
from lightning_ft._lightning.trainer import is_fitting, log_device_info
from lightning_ft._logging import StrategyLog, strategy_name
from lightning_ft.checkpoint.exchange.replication import ReplicaPublisher, replica_cipher
from lightning_ft.checkpoint.lightning.auto_resume import model_fingerprint_before_setup
from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
from lightning_ft.deadlines import raw_store
from lightning_ft.events import EventLog, NullEventLog, open_event_log
from lightning_ft.events import names as ev
from lightning_ft.exit_codes import HandOver, StragglerEvicted
from lightning_ft.runtime.elastic import grow_reason
from lightning_ft.runtime.fit_loop import RendezvousFitLoop, TorchrunFitLoop
from lightning_ft.runtime.layout import StateLayout
from lightning_ft.runtime.log_history import decide_log_versions, keep_log_history
from lightning_ft.runtime.random_streams import RandomStreams
from lightning_ft.runtime.run import RunState
from lightning_ft.runtime.run_metrics import earlier_launch, first_step_figures, log_figures
from lightning_ft.runtime.session import RoundRuntime, Session
from lightning_ft.runtime.settings import LaunchMode, StrategySettings
from lightning_ft.runtime.stage_state import align_module_state
from lightning_ft.runtime.transport import GroupTransport, init_round_group, init_torchrun_group, open_sockets
from lightning_ft.schema.round import PROCESS_GROUP, encode_member, member_key
from lightning_ft.schema.signing import SealedStore
from lightning_ft.settings.environment import local_rank, master_port
from lightning_ft.stragglers.watch import StragglerWatch
from lightning_ft.termination.callback import GracefulTermination, carry_signal
from lightning_ft.termination.handover import SeatCensus
from lightning_ft.termination.signals import HeldSignals

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})

#: the rank of a process that is not (or no longer) training: a hot spare, or after fit()
NO_RANK = -1


class StrategySurface(Protocol):
    """What the runtime needs of the Lightning strategy that holds it."""

    @property
    def lightning_module(self) -> Any: ...

    @property
    def root_device(self) -> Any: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def assign_rank(self, rank: int, world_size: int) -> None:
        """Make ``rank`` of ``world_size`` this process's rank everywhere Lightning reads it."""

    def group_backend(self) -> str:
        """The process-group backend for this strategy's device (``gloo``, ``nccl``)."""


class FaultToleranceRuntime:
    """Fault tolerance for one process (see the module docstring).

    ``settings``: the validated settings; ``layout``: how the state lies across ranks;
    ``surface``: the strategy, for the few things only it knows.
    """

    def __init__(self, settings: StrategySettings, layout: StateLayout, surface: StrategySurface) -> None:
        self.settings = settings
        self.layout = layout
        self.surface = surface
        self.session: Session | None = None
        self.loop: RendezvousFitLoop | TorchrunFitLoop = (
            RendezvousFitLoop(self) if settings.mode is LaunchMode.RENDEZVOUS else TorchrunFitLoop(self))
        self._events: EventLog | NullEventLog | None = None
        self._replicas: ReplicaPublisher | None = None
        self._checkpoint: EmergencyCheckpoint | None = None
        self._printed_device_info = False
        #: this launch resumed from an earlier launch's snapshot and continues its logs
        self._continues_launch = False
        self._per_device = False
        self._streams = RandomStreams(settings.run_id) if settings.random_streams else None

    def train_on_devices(self, devices: int) -> None:
        """``Trainer(devices=N)``: the job counts N participants per node (see ``LaunchConfig.per_device``)."""
        if not self._per_device:
            self._per_device = True
            self.settings = self.settings.per_device(devices)

    # ------------------------------------------------------------------ what the process knows

    @property
    def run(self) -> RunState:
        """This process's run (its trainer, the current round, the failures so far)."""
        return self.loop.run

    @property
    def round(self) -> RoundRuntime | None:
        """The round this process trains in (None while it waits, and under torchrun before fit)."""
        return self.run.round

    @property
    def under_torchrun(self) -> bool:
        return self.settings.mode is LaunchMode.TORCHELASTIC

    @property
    def event_log(self) -> EventLog | NullEventLog:
        """This process's event log in the run directory (a null log when none is configured)."""
        if self._events is None:
            who = (self.session.participant_id if self.session is not None else
                   f"{socket.gethostname()}:{os.getpid()}:{local_rank()}")
            self._events = open_event_log(who, self.settings.events_dir)
        return self._events

    def _event_log_for(self, participant_id: str) -> EventLog | NullEventLog:
        if self._events is None or not self._events.enabled:
            self._events = open_event_log(participant_id, self.settings.events_dir)
        return self._events

    def open_session(self) -> Session:
        """Reach the rendezvous store and join the run as a participant (once per process)."""
        if self.session is None:
            self.session = Session.open(self.settings, self._event_log_for)
        return self.session

    @property
    def stop_store(self) -> Any:
        """The store the SIGTERM path agrees on a stop step through: a connection of the session's,
        which follows the store when it fails over; None before a session."""
        session = self.session
        # a tight bound here also bounds how long the exit waits for the stop watcher's call in flight
        return session.store.clone(self.settings.timeouts.stop_store_timeout) if session is not None else None

    def saved_state(self) -> str | None:
        """What a relaunch of the job resumes from, when this process cannot go on in-process:
        its newest snapshot of this fit (replicated state: any rank's will do), None without one
        -- and for sharded state, whose resume needs the lost rank's shards too."""
        trainer = self.run.trainer
        checkpoint = first_callback_of_type(trainer, EmergencyCheckpoint) if trainer is not None else None
        if checkpoint is None or not self.layout.resumes_from_live_state:
            return None
        if checkpoint.last_snapshot is not None:
            return f"the snapshot of step {checkpoint.last_snapshot.step}"
        resumed = checkpoint.resumed_from
        return f"the snapshot of step {resumed[0]}" if resumed is not None else None

    def cannot_reform(self) -> str | None:
        """Why a failed round cannot re-form in-process (None: it can); see the layout."""
        return self.layout.cannot_reform(self.surface.lightning_module)

    def rebuild_module(self) -> None:
        """After a failure: the module as a fresh process builds it before ``configure_model``."""
        self.layout.rebuild(self.surface.lightning_module, self.surface.root_device)

    @property
    def hand_over_seat(self) -> FaultToleranceRuntime | None:
        """What the SIGTERM path hands over through (:class:`~lightning_ft.termination.handover.HandOverSeat`);
        None where this process never re-forms in-process (torchrun's agent restarts the workers) or
        the job has no place for a hot spare (``min_nodes == max_nodes``: a stop is the whole job's)."""
        launch = self.settings.launch
        no_spares = launch.max_nodes is not None and launch.min_nodes is not None and \
            launch.max_nodes <= launch.min_nodes and not self.settings.rendezvous.elastic
        return None if self.under_torchrun or launch.max_nodes == 1 or no_spares else self

    def census(self) -> SeatCensus | None:
        """This round's live hot spares and gone ranks (:func:`seat_census`); None: none can take a place."""
        runtime, session = self.round, self.session
        if (runtime is None or runtime.result is None or session is None or self.cannot_reform() is not None
                or not self.layout.can_hand_over()):
            return None
        return seat_census(session.rendezvous, runtime.result)

    def min_world_size(self) -> int | None:
        """An elastic job may shrink to its ``min_nodes`` participants; None: its world size is fixed."""
        return self.settings.launch.min_nodes if self.settings.rendezvous.elastic else None

    def hand_over(self, leaving: bool, reason: str) -> None:
        """A hand-over verdict: leave or re-form at the next step boundary (or in the failure that comes first)."""
        if self.round is not None:
            self.round.hand_over = HandOver(leaving, reason)

    def leave_as_spare(self) -> None:
        """After fit() returns on a process that is not (or no longer) training: never act as rank 0."""
        self.surface.assign_rank(NO_RANK, 1)

    # ------------------------------------------------------------------ a round's group

    def setup_distributed(self) -> None:
        """Form this round's process group, share the newest snapshot, start the watchdog (under
        torchrun: the group torchrun's environment describes, and the snapshot exchange)."""
        if self.under_torchrun:
            before = open_sockets()
            init_torchrun_group(self.surface.group_backend(), self.surface.global_rank, self.surface.world_size,
                                self.settings.pg_timeout)
            assert self.round is not None  # started by the torchrun fit loop
            self.round.transport = GroupTransport(before, open_sockets(), master_port())
            resume_step = self._resumed_step(self._share_snapshots())
            trainer, rank = self.run.trainer, self.surface.global_rank
            agreed = None
            if versioned_loggers(trainer):  # torchrun's restarts are launches: one version across them
                agreed = trainer.strategy.broadcast(
                    decide_log_versions(trainer, self.settings.launch.run_id, resume_step) if rank == 0 else None)
            self._continues_launch = keep_log_history(trainer, agreed, rank, resume_step, follows_a_failure=False)
            return
        runtime, session = self.round, self.session
        if runtime is None or runtime.result is None or session is None:
            raise RuntimeError(f"{strategy_name()}: setup_distributed ran outside the strategy's launcher")
        result = runtime.result
        self.surface.assign_rank(result.rank, result.world_size)
        backend = self.surface.group_backend()
        start = time.perf_counter()
        with signals_held_for(self.run.trainer):
            runtime.transport = init_round_group(
                backend, result.rank, result.world_size,
                store=dist.PrefixStore(f"{result.store_prefix}/{PROCESS_GROUP}", raw_store(session.store)),
                init_timeout=self.settings.timeouts.init_timeout, pg_timeout=self.settings.pg_timeout,
                store_port=getattr(session.store, "port", None))
        seconds = time.perf_counter() - start
        self.event_log.emit(ev.GROUP_FORMED, round=result.round, rank=result.rank, world=result.world_size,
                            seconds=round(seconds, 4))
        ft_log.info("round %d: process group up as rank %d of %d in %.3fs (%s)", result.round,
                 result.rank, result.world_size, seconds, backend)
        assert self.settings.domain_id is not None  # resolved by resolve_settings
        session.round_values(result).put(member_key(result.rank),
                                         encode_member(session.participant_id, self.settings.domain_id))
        if result.rank == 0 and not self._printed_device_info:
            log_device_info(self.run.trainer)  # held back until rank 0 was known (see note_early_rank)
        self._printed_device_info = True
        resume_step = self._share_snapshots()
        self._keep_log_history(session, runtime, resume_step if runtime.follows_a_failure else
                               self._resumed_step(resume_step))
        launch = self.settings.launch
        grow = (launch.max_nodes, self.settings.elastic_grow_interval) \
            if self.settings.rendezvous.elastic and launch.max_nodes is not None else None
        runtime.start_watchdog(session, self.settings.hang, self.settings.timeouts, self._global_step,
                               stragglers=self.settings.stragglers if self.layout.watches_stragglers else None,
                               grow=grow)

    def align_stage_state(self) -> None:
        """Before the module is wrapped (``configure_model`` ran): a rank whose module state is older
        than another's -- it stood by in a fit -- receives it (runtime/stage_state.py)."""
        session, runtime, module = self.session, self.round, self.surface.lightning_module
        if (session is None or runtime is None or module is None or self.surface.world_size == 1
                or not self.layout.aligns_module_state):
            return
        received = align_module_state(module, session.trained_through, self.surface.root_device)
        if received is None:
            return
        source, stage = received
        if session.trained_through < stage:
            session.trained_through = stage
            self.event_log.emit(ev.STATE_RECEIVED, round=runtime.round_id, source=source, stage=stage)
            ft_log.info("rank %d stood by in the fit of stage %d: took its model state from rank %d",
                     self.surface.global_rank, stage, source)

    def note_early_rank(self, node_index: int) -> None:
        """Before the rendezvous nobody knows who is rank 0, yet Lightning's rank-zero output
        (the device lines in ``Trainer.__init__``, tips) would print on every process, spares
        included. Only the scheduler's node 0 prints then; without a numbering, rank 0 of the first
        round prints the device lines once it is known."""
        self.surface.assign_rank(0 if node_index == 0 else NO_RANK, 1)
        self._printed_device_info = node_index >= 0

    def _global_step(self) -> int | None:
        trainer = self.run.trainer
        return trainer.global_step if trainer is not None else None

    def _share_snapshots(self) -> int | None:
        """After the group formed: make the newest snapshot any rank holds available on every rank
        (as the layout defines it); returns its step (where training resumes), None without one."""
        checkpoint = first_callback_of_type(self.run.trainer, EmergencyCheckpoint)
        if checkpoint is None or not is_fitting(self.run.trainer):
            return None  # snapshots are a fit()'s: an evaluation starts from the model as it is
        round_id = self.round.round_id if self.round is not None else None
        step = self.layout.exchange(checkpoint, self.surface.global_rank, self.surface.world_size,
                                    lambda event, **f: self.event_log.emit(event, round=round_id, **f),
                                    model_fingerprint_before_setup(self.surface.lightning_module))
        if self.round is not None and self.round.follows_a_failure and not checkpoint.auto_resume:
            ft_log.info("turning on EmergencyCheckpoint auto-resume to continue after the failure")
            checkpoint.auto_resume = True
        return step

    def _resumed_step(self, newest: int | None) -> int | None:
        """The step a launch resumes from: the newest snapshot's when EmergencyCheckpoint restores it
        (auto-resume), else None -- a snapshot left over is not a resume (its logs start anew)."""
        checkpoint = first_callback_of_type(self.run.trainer, EmergencyCheckpoint)
        return newest if checkpoint is not None and checkpoint.auto_resume else None

    def _keep_log_history(self, session: Session, runtime: RoundRuntime, resume_step: int | None) -> None:
        """One log version per run on every participant (decided once, in the run's store); after a
        recovery or an earlier launch, continue its history."""
        trainer = self.run.trainer
        rank = self.surface.global_rank
        agreed = None
        if versioned_loggers(trainer):
            key, values = session.keys.log_versions, session.rendezvous.values
            if rank == 0 and not values.has(key):
                values.put_if_absent(key, decide_log_versions(trainer, self.settings.launch.run_id, resume_step))
            agreed = self._wait_for_value(values, key)
        self._continues_launch = keep_log_history(trainer, agreed, rank, resume_step, runtime.follows_a_failure)

    def _wait_for_value(self, values: SealedStore, key: str) -> bytes:
        """An authentic value another rank writes, polled in short slices (bounded by init_timeout)."""
        deadline = monotonic() + self.settings.timeouts.init_timeout
        while (raw := values.get(key)) is None:
            if monotonic() > deadline:
                raise RuntimeError(f"{strategy_name()}: no authentic value of {values.key(key)} within "
                                   f"init_timeout={self.settings.timeouts.init_timeout:g}s")
            time.sleep(0.01)
        return raw

    # ------------------------------------------------------------------ training

    def on_train_start(self) -> None:
        trainer, runtime = self.run.trainer, self.round
        checkpoint = first_callback_of_type(trainer, EmergencyCheckpoint)
        self._checkpoint = checkpoint
        if runtime is not None:
            self.layout.check_resumed(runtime.follows_a_failure,
                                      checkpoint is not None and checkpoint.resumed_from is not None)
        step = trainer.global_step
        if runtime is not None and (runtime.follows_a_failure or step > 0):
            self.event_log.emit(ev.RESTORED, round=runtime.round_id, step=step)
        if runtime is not None and runtime.work is not None:
            runtime.work.begin()
        rank = self.surface.global_rank
        resumed = checkpoint.resumed_from if checkpoint is not None else None
        continues = self._continues_launch or (runtime is not None and runtime.follows_a_failure)
        if continues and rank == 0 and resumed is not None:
            set_aside_abandoned_checkpoints(trainer, snapshot_created=resumed[1])
        if checkpoint is not None and not self.under_torchrun:
            assert runtime is not None  # the fit loop started the round
            self._snapshot_round_start(checkpoint, runtime, step)
        self._replicas = self._replica_publisher(checkpoint, rank)
        if runtime is not None and runtime.result is not None:
            round_id = runtime.round_id
            assert self.settings.domain_id is not None  # resolved by resolve_settings
            self.layout.start_round(checkpoint, step, rank, self.surface.world_size, self.settings.domain_id,
                                    self.settings.replication_factor,
                                    lambda event, **f: self.event_log.emit(event, round=round_id, **f))

    def _replica_publisher(self, checkpoint: EmergencyCheckpoint | None, rank: int) -> ReplicaPublisher | None:
        """Rank 0 publishes copies for hot spares; decided once per round, not per step."""
        factor, session = self.settings.replication_factor, self.session
        if (not factor or checkpoint is None or rank != 0 or not self.layout.replicates_through_store
                or self.under_torchrun or session is None):
            return None
        signer = session.rendezvous.signer
        cipher = replica_cipher(signer, factor)  # None without a job secret
        if cipher is None:
            return None
        return ReplicaPublisher(session.store.clone, signer, cipher, factor, self.settings.replica_max_bytes,
                                self.event_log.emit)

    def _snapshot_round_start(self, checkpoint: EmergencyCheckpoint, runtime: RoundRuntime, step: int) -> None:
        # A round must always have a snapshot to fall back to: without one, a failure before the
        # first periodic snapshot would restart optimizer and step from scratch on top of weights
        # DDP broadcast from a survivor's trained model. With it, "from the start" is a restore too.
        # A job of one participant never recovers in-process (no peer, no spare): it has no use
        # for it, and saving it would run the user's checkpoint hooks once more than under ddp.
        if self.settings.launch.max_nodes == 1:
            return
        store = checkpoint.store
        if store is None or not any(info.step == step for info in store.list()):
            checkpoint.save_now(self.run.trainer, reason=f"start of round {runtime.round_id}")

    def watch_gradients(self, module: Any) -> None:
        """After the model is wrapped: the straggler meter's gradient hooks (this round's)."""
        runtime = self.round
        if runtime is not None and runtime.work is not None and module is not None:
            runtime.work.watch_gradients(module)

    def on_train_batch_start(self, batch_idx: int) -> None:
        """At a step boundary: a hand-over verdict, or a straggler verdict against this rank, is acted on
        here; then this batch's random streams (runtime/random_streams.py)."""
        runtime = self.round
        if runtime is None:
            return
        pending, runtime.hand_over = runtime.hand_over, None
        grown = grow_reason(runtime.grow, self.run.trainer.global_step)
        if pending is None and grown is not None:
            pending = HandOver(False, grown, grow=True)
        if pending is not None:  # at a step boundary: the live state of every rank is this step
            self.layout.before_hand_over(self._checkpoint, self.run.trainer, self.progress)
            raise pending
        runtime.step_started()
        if self._streams is not None:
            self._streams.start_batch(self.surface.global_rank, self.run.trainer.global_step, batch_idx)
        if runtime.work is not None:
            runtime.work.micro_batch_started()
        watch = runtime.stragglers
        if watch is None:
            return
        if watch.evicted is not None:  # at a step boundary: the peers' live state is this step
            raise StragglerEvicted(f"evicted as a straggler at step {self.run.trainer.global_step}: {watch.evicted}")
        if self.surface.global_rank == 0 and watch.scores:
            log_work(watch, self.run.trainer)

    def timed_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The optimizer's closure, timed for the straggler meter when this round watches stragglers."""
        runtime = self.round
        work = runtime.work if runtime is not None else None
        return work.timed_closure(closure) if work is not None else closure

    def after_backward(self) -> None:
        """A micro-batch's backward returned (the straggler meter's accumulation measure)."""
        runtime = self.round
        if runtime is not None and runtime.work is not None:
            runtime.work.backward_done()

    def after_optimizer_step(self) -> None:
        """Forward, backward (with its all-reduce) and the update are done: the step completed."""
        runtime = self.round
        if runtime is None:
            return
        # Lightning counts the optimizer step as completed only after the strategy's returns
        step = self.run.trainer.global_step + 1
        if runtime.work is not None:
            runtime.work.step_finished(step)
        first_of_round = not runtime.progressed
        since_failure = runtime.step_finished()
        session = self.session
        # a job of one participant has no figures to report (no peer, no recovery): its logs stay as under ddp
        if first_of_round and runtime.result is not None and session is not None and \
                self.settings.launch.max_nodes != 1:
            figures = first_step_figures(self.run.trainer, session.store, session.keys.run_metrics,
                                         self.surface.world_size, self.surface.global_rank,
                                         runtime.follows_a_failure, since_failure, runtime.planned,
                                         None if runtime.follows_a_failure else earlier_launch(self._checkpoint))
            if self.surface.global_rank == 0:
                log_figures(self.run.trainer, figures.metrics(time.time()), step)
            if self._checkpoint is not None:
                self._checkpoint.run_figures = figures.totals()
        if since_failure is not None:
            self.event_log.emit(ev.FIRST_STEP_AFTER_RECOVERY, round=runtime.round_id, step=step,
                                seconds_since_failure=round(since_failure, 4))
            ft_log.info("first step after recovery completed (step %d, %.3fs after the failure)",
                     step, since_failure)
        if self._replicas is not None and runtime.result is not None:
            assert self._checkpoint is not None  # replicas are published only with one
            result = runtime.result
            self._replicas.offer(self._checkpoint.last_snapshot, result.round, result.store_prefix,
                                 result.world_size)
        self.layout.after_optimizer_step(self._checkpoint, self.run.trainer.global_step, self.progress)

    def progress(self) -> None:
        """A unit of progress (a collective entered or left, a validation batch): see the watchdog."""
        if self.round is not None:
            self.round.clock.touch()

    def stop_round_threads(self) -> None:
        """Stop the watchdog and wait (bounded) for a replica publication in flight."""
        if self.round is not None:
            self.round.stop_watchdog()
        if self._replicas is not None:
            self._replicas.stop()


def seat_census(rendezvous: Any, result: Any) -> SeatCensus:
    """The hot spares of ``result``'s round whose heartbeat beats, and its ranks whose heartbeat
    stood still and whose process the fail-over proves gone (a stalled live rank is not gone;
    without store fail-over no rank counts as gone)."""
    census = rendezvous.records.census(result, rendezvous.settings.heartbeat_every)
    silent = dict(census.silent_actives)
    if not silent or rendezvous.proves_gone is None:  # without a proof nobody counts as gone
        return SeatCensus(census.spares)
    proven = rendezvous.proves_gone(list(silent.values()))
    return SeatCensus(census.spares, frozenset(rank for rank, pid in silent.items() if pid in proven))


def log_work(watch: StragglerWatch, trainer: Any) -> None:
    """Rank 0: every rank's own work and wait, and their straggler scores, to the Trainer's loggers."""
    summaries, scores = watch.summaries, watch.scores
    watch.scores = {}  # each judgement is logged once
    metrics = {"ft/straggler_score": max(scores.values())}
    for rank, summary in summaries.items():
        metrics[f"ft/busy_seconds/rank{rank}"] = summary.median
        metrics[f"ft/wait_seconds/rank{rank}"] = summary.wait
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


@contextlib.contextmanager
def signals_held_for(trainer: Any) -> Iterator[None]:
    """Hold SIGTERM/SIGINT while the round's process group forms (torch blocks there, up to the
    init timeout when a peer never comes) when this fit's SIGTERM path will act on them: with the
    default action a SIGTERM there killed the process (-15, nothing saved); held, the round's
    :class:`GracefulTermination` takes it once training starts."""
    callback = first_callback_of_type(trainer, GracefulTermination)
    held = HeldSignals(callback.signals) if callback is not None else None
    held = held if held is not None and held.hold() else None
    try:
        yield
    finally:
        received = held.release() if held is not None else None
        if received is not None and callback is not None:
            ft_log.warning("%s came while the round's process group formed: the SIGTERM path takes it once "
                           "training starts", signal.Signals(received[0]).name)
            carry_signal(callback, received)
