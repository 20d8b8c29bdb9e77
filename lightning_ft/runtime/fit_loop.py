"""How one process runs ``fit()`` under the runtime: the loops the strategy's launcher runs.

:class:`RendezvousFitLoop` (rendezvous mode) -- the loop around Lightning's ``_fit_impl``:

1. join the barrier rendezvous; a hot spare blocks there until a failure needs it, and
   returns from ``fit()`` (exit 0) when the job finishes or the rendezvous is closed for good;
2. an active participant runs ``_fit_impl``: the strategy's ``setup_distributed`` builds the
   round's group, shares the newest snapshot and starts the watchdog, and
   ``EmergencyCheckpoint``'s auto-resume restores the snapshot;
3. a failure goes to :class:`~lightning_ft.runtime.recovery.FailureHandler`, which either
   prepares the next round (back to 1, inside the same ``fit()`` call) or ends the process;
4. success: the actives pass torch's elastic exit barrier for the round, close the
   rendezvous for good (spares leave), acknowledge, and destroy the group.

:class:`TorchrunFitLoop` -- under torchrun: run ``fit`` once (torchrun restarts workers).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import lightning.pytorch as pl
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from lightning_ft._clock import monotonic
from lightning_ft._lightning.callbacks import first_callback_of_type
from lightning_ft._lightning.elastic import ElasticBatches
from lightning_ft._lightning.pristine import PristineState
from lightning_ft._lightning.trainer import is_fitting, is_tuner_exit, replace_checkpoint_path
from lightning_ft._lightning.trainer_reset import mark_finished
from lightning_ft._logging import StrategyLog, strategy_name
from lightning_ft.checkpoint.exchange.replication import replica_cipher
from lightning_ft.checkpoint.lightning.auto_resume import model_fingerprint_before_setup
from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
from lightning_ft.checkpoint.memory.holders import RunHeldError
from lightning_ft.checkpoint.service import replica_puller
from lightning_ft.deadlines import call_with_timeout, first_line
from lightning_ft.events import names as ev
from lightning_ft.exit_codes import ExitCode, FaultTolerantExit, JobCannotGoOn, JobEndedError
from lightning_ft.process import destroy_process_group
from lightning_ft.rendezvous.barrier import ActivesFinishedError, ParticipantExcludedError, RoundResult
from lightning_ft.runtime.decisions import (
    PEER_SILENT_AT_EXIT,
    EndAction,
    EndCause,
    Role,
    decide_on_rendezvous_end,
    elastic_accumulation,
    fit_already_finished,
    looks_like_collective_error,
)
from lightning_ft.runtime.exit_barrier import BarrierOutcome, PeerSilence, wait_at_exit_barrier
from lightning_ft.runtime.recovery import (
    RecoveryExecutor,
    exception_chain,
    give_up_without_session,
    save_live_state,
)
from lightning_ft.runtime.run import RunState, RuntimeHost
from lightning_ft.runtime.session import RoundRuntime, Session
from lightning_ft.runtime.settings import StrategyConfigError, StrategySettings
from lightning_ft.runtime.spare_monitor import SpareMonitor
from lightning_ft.runtime.stage_state import FitCheckpointPaths, checkpoint_path_for
from lightning_ft.schema.run import CloseKind
from lightning_ft.settings.environment import fit_run_id, torchelastic_restart_count
from lightning_ft.store.locator import NoRunningJob
from lightning_ft.termination.callback import GracefulTermination
from lightning_ft.termination.signals import SignalHandler

if TYPE_CHECKING:
    from lightning_ft.checkpoint.durable.tier import DurableTier

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})


class _SpareTerminated(BaseException):
    """SIGTERM arrived while this process waited in the rendezvous."""


def add_default_callbacks(trainer: Any, settings: StrategySettings) -> None:
    """Recovery needs snapshots and the SIGTERM path: add what the Trainer does not have. The
    user's own EmergencyCheckpoint without a run id of its own takes the strategy's."""
    checkpoint = first_callback_of_type(trainer, EmergencyCheckpoint)
    if checkpoint is None:
        trainer.callbacks.append(EmergencyCheckpoint(**settings.snapshot_kwargs()))
        ft_log.info("added EmergencyCheckpoint(every_n_steps=%s, every_n_seconds=%s, max_overhead=%s%s) for "
                 "recovery", settings.snapshot_every_n_steps, settings.snapshot_every_n_seconds,
                 settings.snapshot_max_overhead,
                 f", persist_to={settings.durable.persist_to}" if settings.durable.persist_to else "")
    else:
        given = settings.snapshot_arguments_given()
        if given:
            raise StrategyConfigError(
                f"{strategy_name()}: {', '.join(given)} configure the EmergencyCheckpoint the strategy adds, "
                "but the Trainer has one of its own: set them on that EmergencyCheckpoint instead")
        checkpoint.adopt_run_id(settings.run_id)
    if settings.graceful_termination and first_callback_of_type(trainer, GracefulTermination) is None:
        trainer.callbacks.append(GracefulTermination())
        ft_log.info("added GracefulTermination() for the SIGTERM path")
    if settings.rendezvous.elastic and first_callback_of_type(trainer, ElasticBatches) is None:
        trainer.callbacks.append(ElasticBatches())


def fit_accumulation_to_world(trainer: Any, settings: StrategySettings, world_size: int, accumulation: int) -> None:
    """Elastic: this round's per-rank gradient accumulation keeps the global batch of ``max_nodes``
    ranks accumulating the user's ``accumulation`` (see :func:`elastic_accumulation`)."""
    maximum = settings.launch.max_nodes
    if not settings.rendezvous.elastic or trainer is None or maximum is None or world_size < 1:
        return
    per_rank, problem = elastic_accumulation(world_size, maximum, accumulation)
    if problem is not None:
        ft_log.warning("elastic: %s", problem)
    if per_rank != trainer.accumulate_grad_batches:
        ft_log.warning("elastic: %d rank(s) train; each accumulates %d micro-batches per optimizer step (the "
                    "global batch of %d ranks x %d)", world_size, per_rank, maximum, accumulation)
    trainer.accumulate_grad_batches = per_rank


def stand_by_result(trainer: Any) -> Any:
    """What a Trainer call returns on a participant that stood by while the actives ran it: ``fit()``
    returns None, ``validate``/``test``/``predict`` an empty list of results."""
    return None if is_fitting(trainer) else []


class RendezvousFitLoop:
    """Runs ``fit`` in this process inside the rendezvous/recovery loop (see the module docstring)."""

    def __init__(self, host: RuntimeHost) -> None:
        self._host = host
        #: this process's run (the launcher owns it; the strategy reads it)
        self.run = RunState()
        self._executor: RecoveryExecutor | None = None
        self._callbacks_added = False
        self._barrier_seconds = 0.0  # the last exit barrier's wait
        self._accumulation = 1  # the user's gradient accumulation (an elastic job's rounds change the Trainer's)

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Run one stage of the job (this Trainer call: ``fit``, ``validate``, ``test`` or ``predict``)
        over the job's participants: the actives of the stage's round run ``function``, a hot spare
        stands by until they finished and returns :func:`stand_by_result`."""
        host, run = self._host, self.run
        run.trainer = trainer
        session = self._open_session()
        if session.failed_with is not None:
            raise JobEndedError(f"{strategy_name()}: run {host.settings.run_id!r} ended in {session.failed_with} (this "
                                "process's error); its other participants have left, so no later fit(), "
                                "validate(), test() or predict() can run in it: start a new run (run id)")
        stage, fit = session.next_stage(is_fitting(trainer))
        if not self._callbacks_added and trainer is not None:
            self._callbacks_added = True
            add_default_callbacks(trainer, host.settings)
        checkpoint = first_callback_of_type(trainer, EmergencyCheckpoint)
        if checkpoint is not None:
            try:
                session.note_snapshot_root(checkpoint.root, host.settings.keep_snapshots_when_finished)
            except RunHeldError as exc:  # a second job of this run id on this host: refused at once
                raise StrategyConfigError(f"{strategy_name()}: {exc}") from None
            if fit is not None:
                checkpoint.keep_under(fit_run_id(host.settings.run_id, fit))
        module = next((a for a in args if isinstance(a, pl.LightningModule)), None)
        datamodule = next((a for a in args if isinstance(a, pl.LightningDataModule)), None)
        # what a relaunched process would start this stage with; a recovery returns to it
        pristine = PristineState.capture(trainer, module, datamodule, keep=(EmergencyCheckpoint, GracefulTermination))
        if trainer is not None:  # the user's, before an elastic round changes it
            self._accumulation = int(trainer.accumulate_grad_batches)
        self._executor = RecoveryExecutor(host, run, session, pristine, module)
        while True:
            result = self._join_round(session, stage)
            if result is None:
                return stand_by_result(trainer)  # a spare that was not needed (or the job ended)
            after_failure = session.rendezvous.stages.follows_a_failure(result.round)
            planned = session.rendezvous.records.planned(result.round) if after_failure and result.rank == 0 else None
            run.start_round(RoundRuntime(result, result.round, run.failure_at, after_failure=after_failure,
                                         planned=planned))
            fit_accumulation_to_world(trainer, host.settings, result.world_size, self._accumulation)
            if result.round == 0 and not session.was_active and is_fitting(trainer):
                _leave_if_the_run_finished(session, trainer)
            session.was_active = True
            tuner_exit = None
            try:
                try:
                    output = function(*self._with_checkpoint_path(session, trainer, args), **kwargs)
                except Exception as exc:  # a tuner's end passes; the rest goes to the executor
                    if not is_tuner_exit(exc):
                        raise
                    tuner_exit = exc  # lr_find / scale_batch_size ended their trial fit: it completed
                self._pass_exit_barrier(session, result)
            except BaseException as exc:  # noqa: BLE001 - every exception is classified by the executor
                run.failure_at = self._executor.handle(exc, trainer)
                continue  # recovered: re-form the group and run the stage again
            self._finish_stage(session, result, stage)
            if trainer is not None and host.settings.rendezvous.elastic:
                trainer.accumulate_grad_batches = self._accumulation  # the user's again, for a later stage
            if tuner_exit is not None:
                raise tuner_exit  # Lightning's caller ends the tuner's fit() with it
            return output

    def _with_checkpoint_path(self, session: Session, trainer: Any, args: tuple) -> tuple:
        """``args`` with a ``ckpt_path`` this process cannot resolve itself (``"best"`` after a fit it
        stood by in) replaced by what the fit's rank 0 published (see runtime/stage_state.py)."""
        raw = session.rendezvous.values.get(session.keys.fit_checkpoint_paths)
        published = FitCheckpointPaths.decode(raw) if raw is not None else None
        return replace_checkpoint_path(trainer, args, lambda requested, model_given: checkpoint_path_for(
            requested, model_given, published, session.trained_through))

    def _open_session(self) -> Session:
        host = self._host
        try:
            return host.open_session()
        except NoRunningJob as exc:  # a restarted node whose job ended: nothing of it is lost, nothing to do
            message = f"{exc}; this node is not needed"
            ft_log.warning("%s", message)
            host.event_log.emit(ev.SPARE_EXIT, reason=message)
            raise FaultTolerantExit(ExitCode.SUCCESS, message) from None
        except RendezvousError as exc:
            give_up_without_session(host, f"cannot reach the rendezvous store: {exc}", cause=exc)

    # ------------------------------------------------------------------ joining a round

    def _join_round(self, session: Session, stage: int) -> RoundResult | None:
        """Block until active in a round of ``stage``; ``None`` when this process should leave the
        Trainer call cleanly (the stage ended without it, or the job ended)."""
        rendezvous = session.rendezvous
        previous_handler = _install_sigterm_raiser()
        monitor = None
        try:
            # inside: the store can die (or freeze) right here as anywhere else in the rendezvous
            monitor = self._start_spare_monitor(session)
            if session.was_active:
                session.follow_newest_store()  # the others may have moved while this process was frozen
            timeout = rendezvous.settings.timeouts.join_timeout_for(was_active=session.was_active)
            if not rendezvous.stages.enter(stage, timeout):
                self._stage_over(session, f"stage {stage} ended before this participant reached it")
                return None
            while True:
                result = rendezvous.join_round()
                session.saw_round = True
                session.events.emit(ev.ROUND_COMPLETE, round=result.round, rank=result.rank,
                                    world=result.world_size, standby=not result.is_active)
                if result.is_active:
                    return result
                rendezvous.wait_while_standby(result.round)
        except ActivesFinishedError as exc:
            self._stage_over(session, str(exc))
        except (RendezvousGracefulExitError, RendezvousClosedError) as exc:
            self._rendezvous_ended(session, EndCause.CLOSED, str(exc))
        except RendezvousTimeoutError as exc:
            self._rendezvous_ended(session, EndCause.TIMED_OUT, str(exc))
        except _SpareTerminated:
            self._rendezvous_ended(session, EndCause.SIGTERM, "SIGTERM while waiting in the rendezvous")
        except JobCannotGoOn as exc:  # decided (e.g. a store that takes no new connection): said why, 83
            assert self._executor is not None
            self._executor.give_up(str(exc), cause=exc, close=True)
        except (RuntimeError, OSError) as exc:  # the store itself (DistStoreError is a RuntimeError)
            self._rendezvous_ended(session, EndCause.STORE_LOST,
                                   f"lost the rendezvous store at {self._host.settings.launch.endpoint}: "
                                   f"{type(exc).__name__}: {first_line(exc)}")
        except RendezvousError as exc:  # extra participant, unhealthy
            if isinstance(exc, ParticipantExcludedError) and not session.was_active:
                ft_log.log(logging.WARNING if getattr(exc, "job_full", False) else logging.ERROR, "%s", exc)
                # it takes no part any more: no heartbeat beating on after fit() (one beat in
                # flight when the interpreter finalized aborted the process)
                rendezvous.stop_heartbeat()
                session.events.emit(ev.SPARE_EXIT, reason=str(exc))
                self._leave_as_spare()
                return None
            self._give_up(f"rendezvous failed: {exc}")
        finally:
            _restore_sigterm(previous_handler)  # first: a SIGTERM from here on is the caller's to handle
            if monitor is not None:
                monitor.stop()
        return None  # the rendezvous ended: leave fit()

    def _role(self, session: Session) -> Role:
        """What this process was in the job so far (any stage, any Trainer)."""
        if session.was_active:
            return Role.TRAINED
        return Role.STANDBY if session.saw_round else Role.UNASSIGNED

    def _rendezvous_ended(self, session: Session, cause: EndCause, reason: str) -> None:
        """Leave fit() with the exit code the end of the rendezvous implies (see decide_on_rendezvous_end)."""
        rendezvous = session.rendezvous
        role = self._role(session)
        if cause is EndCause.SIGTERM:
            _best_effort(rendezvous.withdraw, reason, stopping=True)
        closed = None
        if cause in (EndCause.CLOSED, EndCause.ACTIVES_FINISHED):
            try:
                closed = rendezvous.closed_reason()
            except (RuntimeError, OSError):
                closed = None
        action = decide_on_rendezvous_end(role, cause, closed.kind if closed else None)
        session.saw_job_finish = closed is not None and closed.kind is CloseKind.FINISHED
        text = str(closed) if closed is not None else reason
        if action is EndAction.NO_RESTART:
            too_few = closed is not None and closed.kind is CloseKind.TOO_FEW_NODES
            message = (f"no hot spare left to replace the lost participant(s): {closed}" if too_few
                       else f"the job cannot go on: {text}")
            # what is missing is the job's resources (nodes, the store), not its soundness (a bug,
            # a crash loop: closed FAILED): with its state saved, a relaunch resumes -- requeue
            lost_resources = too_few or cause in (EndCause.STORE_LOST, EndCause.TIMED_OUT)
            saved = self._host.saved_state() if lost_resources and role is Role.TRAINED else None
            if saved is not None:
                assert self._executor is not None
                self._executor.requeue(message, saved)
            self._give_up(message)
        _best_effort(rendezvous.shutdown, job_finished=False)
        if action is EndAction.STOPPED:
            session.events.emit(ev.STOPPED, reason=text)
            ft_log.warning("leaving fit() stopped, with exit code %d (nothing of this participant's to "
                        "save): %s", int(ExitCode.STOPPED), text)
            self._leave_as_spare()
            raise FaultTolerantExit(ExitCode.STOPPED, f"stopped while waiting in the rendezvous: {text}")
        session.events.emit(ev.SPARE_EXIT, reason=text)
        if cause is EndCause.STORE_LOST:
            ft_log.warning("hot spare leaves fit() (exit 0; the actives report the job's outcome): %s", text)
        else:
            ft_log.info("leaving fit() (%s): %s", "job over" if role is Role.TRAINED else "hot spare not needed",
                     text)
        self._leave_as_spare()
        return None

    def _stage_over(self, session: Session, reason: str) -> None:
        """The actives finished this stage without this participant: it stands by for the next one
        (it stays in the rendezvous; the job ends for it at process exit)."""
        session.last_stage_completed = True
        session.events.emit(ev.SPARE_EXIT, reason=reason)
        ft_log.info("hot spare not needed in this stage: %s", reason)
        self._leave_as_spare()

    def _give_up(self, message: str) -> NoReturn:
        assert self._executor is not None
        self._executor.give_up(message)

    def _leave_as_spare(self) -> None:
        self._host.leave_as_spare()
        trainer = self.run.trainer
        if trainer is not None:
            mark_finished(trainer)
        destroy_process_group()

    def _start_spare_monitor(self, session: Session) -> SpareMonitor:
        host = self._host
        settings = host.settings
        checkpoint = first_callback_of_type(self.run.trainer, EmergencyCheckpoint)
        assert settings.domain_id is not None  # resolved by resolve_settings
        # sharded state is never copied through the store (its copies go to ranks in other domains
        # over the process group): a spare pulls nothing, and no warning says store copies are off
        factor = settings.replication_factor if host.layout.replicates_through_store else 0
        replicas = replica_puller(checkpoint.snapshots if checkpoint is not None else None, settings.domain_id,
                                  factor, session.events.emit,
                                  cipher=replica_cipher(session.rendezvous.signer, factor),
                                  model=model_fingerprint_before_setup(self.run.trainer.lightning_module),
                                  max_bytes=settings.replica_max_bytes)
        monitor = SpareMonitor(rdzv_store=session.store.clone(), keys=session.keys, signer=session.rendezvous.signer,
                               dead_after=session.rendezvous.settings.liveness.all_silent_after,
                               open_round=session.open_round, replicas=replicas,
                               proves_gone=session.rendezvous.proves_gone,
                               gone_after=session.rendezvous.settings.liveness.dead_after,
                               join_timeout=settings.timeouts.thread_stop_timeout)
        monitor.start()
        return monitor

    # ------------------------------------------------------------------ success

    def _pass_exit_barrier(self, session: Session, result: RoundResult) -> None:
        """The stage's work is done on this active: wait for the round's other actives to be done too
        (runtime/exit_barrier.py). A newer round opened meanwhile, or -- in an evaluation -- a peer lost
        before it arrived, raises a ``DistError``: the recovery runs the stage again with the peer's
        replacement. A peer that never arrives otherwise (a fit's peer lost at the very end, a frozen
        store) is no reason to fail: bounded, and on we go."""
        host = self._host
        host.stop_round_threads()
        timeout = host.settings.timeouts.exit_barrier_timeout
        peers = None
        if not is_fitting(self.run.trainer):
            peers = PeerSilence(session.round_values(result), session.rendezvous.records, result.rank,
                                result.world_size, session.rendezvous.settings.liveness.frozen_peer_after)
        start = monotonic()
        outcome = call_with_timeout(
            lambda: wait_at_exit_barrier(session.round_store(result), session.rendezvous.records, result.round,
                                         result.world_size, timeout, peers),
            timeout + 1.0, f"{strategy_name()}: exit barrier of round {result.round} (bound {timeout:.0f}s)",
            unanswered="going on without it", log_problem=True, store_call=True)
        self._barrier_seconds = round(monotonic() - start, 4)
        if not outcome.ok or outcome.value.passed:
            return
        barrier: BarrierOutcome = outcome.value
        if barrier.newer_round is not None:
            raise dist.DistError(f"round {barrier.newer_round} opened before every active of round {result.round} "
                                 "finished its part of the stage (a peer was lost): running the stage again")
        raise dist.DistError(f"rank(s) {list(barrier.silent)} of round {result.round} {PEER_SILENT_AT_EXIT} (lost "
                             "before finishing their part of the stage): running the stage again")

    def _finish_stage(self, session: Session, result: RoundResult, stage: int) -> None:
        """The stage completed on every active (the exit barrier passed): release the standbys (the
        round is finished), and stand ready for the next stage."""
        run = self.run
        if is_fitting(run.trainer):
            session.trained_through = stage
            tier = _durable_tier(run.trainer)
            session.fit_finished = (tier, run.trainer.global_step, run.trainer.current_epoch) if tier else None
            if result.rank == 0:  # read by whoever runs a later stage without knowing the paths
                _best_effort(session.rendezvous.values.put, session.keys.fit_checkpoint_paths,
                             checkpoint_paths(run.trainer, stage).encode())
        _best_effort(session.rendezvous.records.finish_round, result.round)
        session.finished_as_active = session.last_stage_completed = True
        step = run.trainer.global_step if run.trainer is not None else None
        session.events.emit(ev.FINISHED, round=result.round, rank=result.rank, step=step,
                            seconds=self._barrier_seconds,
                            step_seconds=run.round.clock.median_seconds() if run.round else None)
        # the round's group lives on until the next stage forms its own (init_round_group) or the
        # process exits (plan_exit): a user's code after fit() may take collectives -- FSDP's full
        # state dict, a metric's sync -- as under Lightning's own strategies
        kind = "fit" if is_fitting(run.trainer) else getattr(run.trainer.state.fn, "value", "stage")
        ft_log.info("%s() (stage %d) finished in round %d as rank %d at step %s", kind, stage, result.round,
                 result.rank, step)


def _durable_tier(trainer: Any) -> DurableTier | None:
    checkpoint = first_callback_of_type(trainer, EmergencyCheckpoint) if trainer is not None else None
    return checkpoint.durable if checkpoint is not None else None


def _leave_if_the_run_finished(session: Session, trainer: Any) -> None:
    """A node that starts a run whose training a job finished already (a replacement started in the
    job's last moments, a restart after it) leaves with 0 instead of training it again: the durable
    tier records the finish (read on every rank: each decides alike)."""
    tier = _durable_tier(trainer)
    finished = tier.finished() if tier is not None else None
    if not fit_already_finished(finished, trainer.max_steps, trainer.max_epochs):
        return
    assert tier is not None and finished is not None
    message = (f"run {tier.run_id!r} finished at step {finished[0]} (recorded at "
               f"{tier.target.describe(tier.finished_path())}): this node is not needed; to train it again, "
               "use another run id or a larger max_steps")
    ft_log.warning("%s", message)
    _best_effort(session.rendezvous.shutdown, job_finished=True, reason=message)
    raise FaultTolerantExit(ExitCode.SUCCESS, message)


class TorchrunFitLoop:
    """Under torchrun: run ``fit`` once; destroy the group at the end (Lightning never does for gloo)."""

    def __init__(self, host: RuntimeHost) -> None:
        self._host = host
        #: this process's run (the launcher owns it; the strategy reads it)
        self.run = RunState()
        self._callbacks_added = False

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        host, run = self._host, self.run
        run.trainer = trainer
        # torchrun's worker-group restarts play the part of rounds; it starts workers only on active nodes
        restarts = torchelastic_restart_count()
        runtime = RoundRuntime(None, restarts, after_failure=restarts > 0)
        run.start_round(runtime)
        if not self._callbacks_added and trainer is not None:
            self._callbacks_added = True
            add_default_callbacks(trainer, host.settings)
        try:
            output = function(*args, **kwargs)
        except BaseException as exc:
            if looks_like_collective_error(exception_chain(exc)):
                # torchrun restarts this worker; Lightning's teardown must not wait on the broken group.
                # The restarted workers resume from /dev/shm: leave them this rank's live state.
                ft_log.warning("collective failed (%s: %s); torchrun restarts the workers",
                            type(exc).__name__, first_line(exc))
                save_live_state(trainer, "collective failure under torchrun")
                runtime.retire_group()
            raise
        # the group lives on (see _finish_stage); the run's outcome for `lightning-ft report
        # --exit-code` (rendezvous mode: _finish_stage)
        host.event_log.emit(ev.FINISHED, round=runtime.round_id, rank=trainer.global_rank if trainer else None,
                                step=trainer.global_step if trainer is not None else None)
        return output


#: how often the exit barrier looks at the store (its last member's key, the current round)


def checkpoint_paths(trainer: Any, stage: int) -> FitCheckpointPaths:
    """What ``ckpt_path="best"``/``"last"`` name on this process now (its first ``ModelCheckpoint``)."""
    callback = getattr(trainer, "checkpoint_callback", None)
    return FitCheckpointPaths(stage, str(getattr(callback, "best_model_path", "") or ""),
                              str(getattr(callback, "last_model_path", "") or ""))


def _best_effort(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """A courtesy to the others on the way out; the store may be gone."""
    try:
        call(*args, **kwargs)
    except (RuntimeError, OSError) as exc:
        ft_log.debug("%s on the way out: %s", getattr(call, "__name__", call), exc)


def _install_sigterm_raiser() -> SignalHandler:
    if threading.current_thread() is not threading.main_thread():
        return None

    def raise_in_main(signum: int, frame: FrameType | None) -> NoReturn:
        raise _SpareTerminated()

    try:
        return signal.signal(signal.SIGTERM, raise_in_main)
    except (ValueError, OSError):
        return None


def _restore_sigterm(previous: SignalHandler) -> None:
    if previous is None:
        return
    try:
        signal.signal(signal.SIGTERM, previous)
    except (ValueError, OSError, TypeError):
        pass
