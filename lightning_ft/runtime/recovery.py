"""What happens when a round fails, and every way out of a run: read the facts, decide, execute.

The launcher hands :class:`RecoveryExecutor` the exception that ended Lightning's ``_fit_impl``.
:func:`read_failure_facts` reads the world into :class:`~lightning_ft.runtime.decisions.FailureFacts`
(the exception chain, the watchdog's verdict, the store's notices, all bounded); the pure
decisions (:func:`~lightning_ft.runtime.decisions.classify_failure`,
:func:`~lightning_ft.runtime.decisions.decide_on_failure`,
:func:`~lightning_ft.runtime.decisions.decide_after_interruption`) return a
:class:`~lightning_ft.runtime.decisions.FailureOutcome`; the executor performs it:

* recover: interrupt the round (retire the group, callbacks' ``on_exception``), run Lightning's
  exception-path teardown (bounded), reset the Trainer to its state at ``fit()`` start, open
  the next round;
* leave: :meth:`RecoveryExecutor.leave` -- the one leave sequence (tell the others, stop this
  round's threads, shut down the rendezvous, retire the group) -- then re-raise a bug or a
  stop, or end with a :class:`~lightning_ft.exit_codes.FaultTolerantExit` carrying the code.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

from lightning_ft._clock import monotonic
from lightning_ft._lightning.callbacks import callbacks_of_type, first_callback_of_type
from lightning_ft._lightning.history import finalize_failed
from lightning_ft._lightning.pristine import PristineState
from lightning_ft._lightning.trainer import is_fitting
from lightning_ft._lightning.trainer_reset import reset_trainer_for_rerun, teardown_trainer
from lightning_ft._logging import StrategyLog, strategy_name
from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
from lightning_ft.deadlines import call_with_timeout, first_line
from lightning_ft.events import names as ev
from lightning_ft.exit_codes import ExitCode, FaultTolerantExit, HandOver, JobCannotGoOn, StragglerEvicted
from lightning_ft.process import ExitWatchdog, destroy_process_group, planned_exit_code
from lightning_ft.runtime.decisions import (
    Detector,
    FailureAction,
    FailureFacts,
    FailureKind,
    FailureOutcome,
    classify_failure,
    decide_after_interruption,
    decide_on_failure,
    looks_like_collective_error,
    looks_like_peer_gone,
    node_fault_errno,
)
from lightning_ft.runtime.run import RunState, RuntimeHost
from lightning_ft.runtime.session import RoundRuntime, Session
from lightning_ft.schema.round import VERDICT_KEY, decode_verdict, failed_key
from lightning_ft.schema.run import CloseKind, CloseReason
from lightning_ft.termination.callback import GracefulTermination

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})


def exception_chain(exc: BaseException) -> list[tuple[str, str]]:
    """``(type name, message)`` of ``exc`` and its causes/contexts (at most 10)."""
    return [(type(link).__name__, str(link)) for link in _links(exc)]


def chain_errnos(exc: BaseException) -> list[int | None]:
    """The ``errno`` of each OSError in ``exc``'s chain of causes/contexts (at most 10 links)."""
    return [link.errno for link in _links(exc) if isinstance(link, OSError)]


def _links(exc: BaseException) -> list[BaseException]:
    links: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(links) < 10:
        seen.add(id(current))
        links.append(current)
        current = current.__cause__ or current.__context__
    return links


def read_failure_facts(exc: BaseException, runtime: RoundRuntime, session: Session, detector: Detector | None,
                       bound: float) -> tuple[FailureFacts, Detector | None]:
    """The facts about a failed round, and who detected it (``detector``: this rank's watchdog's
    verdict, if it fired). The store's notices are read within ``bound`` seconds: a frozen store
    host must not keep this rank from deciding; no answer counts as no notices."""
    result = runtime.result
    transport_broken = runtime.transport is not None and runtime.transport.aborted

    def read_notices() -> tuple[str | None, Detector | None, bool]:
        found_error, found_detector = None, detector
        assert result is not None  # a round of the barrier rendezvous
        values = session.round_values(result)
        for rank in range(result.world_size):
            text = values.get(failed_key(rank)) if rank != result.rank else None
            if text is not None:
                found_error = f"rank {rank}: {text.decode(errors='replace')}"
                break
        # a peer's verdict names the failure unless this rank's own watchdog judged it (hang,
        # deadlock): a watchdog that only saw the peer open the next round must still read
        # why, or a deadlock the peer found would count as a lost peer
        own_judgement = found_detector is not None and found_detector.judges_a_stall
        raw_verdict = None if own_judgement else values.get(VERDICT_KEY)
        if raw_verdict is not None:  # a peer's watchdog broke the round
            verdict = decode_verdict(raw_verdict)
            found_detector = Detector(verdict.detector) if verdict is not None else found_detector
        closed = session.rendezvous.closed_reason()
        if found_error is None and closed is not None and closed.kind is CloseKind.FAILED:
            found_error = str(closed)
        return found_error, found_detector, session.rendezvous.current_round() > result.round

    peer_error, newer = None, False
    notices = call_with_timeout(read_notices, bound, "reading the store's notices")
    if notices.ok:
        peer_error, detector, newer = notices.value
    else:
        ft_log.warning("classifying the failure without the rendezvous store: %s", notices.problem)
    chain = exception_chain(exc)
    return FailureFacts(
        exception_type=type(exc).__name__,
        is_collective_error=looks_like_collective_error(chain) or transport_broken,
        is_stop=isinstance(exc, (SystemExit, KeyboardInterrupt)),
        peer_error=peer_error, newer_round=bool(newer), hang_detected=detector is Detector.HANG,
        deadlock_detected=detector is Detector.DEADLOCK,
        peer_gone=looks_like_peer_gone(chain) and not transport_broken,
        node_fault=node_fault_errno(chain_errnos(exc))), detector


class RecoveryExecutor:
    """Performs the decisions about this process's failed rounds, and its ways out of the run."""

    def __init__(self, host: RuntimeHost, run: RunState, session: Session, pristine: PristineState | None = None,
                 module: Any = None) -> None:
        self._host = host
        self._run = run
        self._session = session
        self._pristine = pristine
        self._module = module

    # ------------------------------------------------------------------ a failed round

    def handle(self, exc: BaseException, trainer: Any) -> float:
        """Prepare the next round and return the failure's ``monotonic()``, or raise what ends fit()."""
        now = monotonic()
        run, session, settings = self._run, self._session, self._host.settings
        runtime = run.round
        assert runtime is not None and runtime.result is not None
        if isinstance(exc, (JobCannotGoOn, StragglerEvicted)):  # decided, not a failure to classify
            runtime.stop_watchdog()
            _call_on_exception(trainer, exc)  # e.g. the SIGTERM path's watcher ends with the round
            if isinstance(exc, StragglerEvicted):
                self._leave_evicted(exc, trainer)
            self.give_up(str(exc), cause=exc, close=True)  # every rank found it alike: the job ends, said why
        if isinstance(exc, HandOver):  # decided by every rank alike at a step boundary
            self._hand_over(exc, trainer)
            return now
        step = trainer.global_step if trainer is not None else 0
        failures_without_progress = run.count_failure(step)
        watchdog = runtime.stop_watchdog()
        own_detector = watchdog.triggered[0] if watchdog is not None and watchdog.triggered else None
        facts, detector = read_failure_facts(exc, runtime, session, own_detector,
                                             settings.timeouts.failure_notice_timeout)
        kind = classify_failure(facts)
        outcome = decide_on_failure(kind)
        if outcome.action is not FailureAction.INTERRUPT:
            self._leave_at_once(outcome, kind, exc, facts, step)
        detector = detector or Detector.COLLECTIVE
        # this rank's watchdog reported its own verdict when it fired; a verdict read from a peer
        # (the store's) is this rank's to report
        reported = own_detector is not None and own_detector.judges_a_stall
        self._interrupt(trainer, exc, kind, detector, step, reported)
        planned = runtime.hand_over  # the SIGTERM path's verdict, reached while the collective failed
        if planned is not None and planned.leaving:
            self._leave_handed_over(planned, trainer)
        outcome = decide_after_interruption(kind, _termination_in_progress(trainer), failures_without_progress,
                                            settings.max_failures_without_progress, run.recoveries,
                                            settings.max_recoveries, self._host.cannot_reform())
        result = runtime.result
        if outcome.action is FailureAction.RAISE:  # a termination takes over: leave as it decided
            session.events.emit(ev.STOPPED, round=result.round, reason="termination in progress during a peer failure")
            self.leave(CloseReason(CloseKind.STOPPED, outcome.reason))
            raise exc
        session.events.emit(ev.DECISION, round=result.round, kind=kind.value, action=outcome.action.value,
                            reason=outcome.reason)
        if (outcome.action is FailureAction.RECOVER and self._host.layout.resumes_from_live_state
                and is_fitting(trainer)):
            # before anything resets the Trainer: the survivors' live state is the step the next
            # round resumes from (the snapshot exchange sends the newest step to whoever lacks it).
            # Not with sharded state: the lost rank's shards exist only at a snapshot step, so the
            # next round resumes at the newest step whose shards all exist, never at a live one.
            save_live_state(trainer, f"{kind.value} in round {result.round}")
        self._teardown(trainer, runtime)
        if outcome.action is FailureAction.NO_RESTART:
            peer = f" ({facts.peer_error})" if facts.peer_error else ""
            self.give_up(f"{outcome.reason}{peer}", cause=exc, close=True)
        self._prepare_next_round(trainer, f"{kind.value} in round {result.round}: {type(exc).__name__}: "
                                          f"{first_line(exc)}")
        return now

    def _hand_over(self, exc: HandOver, trainer: Any) -> None:
        """A hand-over verdict at a step boundary: a leaver leaves (exit 0); the others re-form with
        the spares from their live state, as after a lost peer but planned -- no step is lost."""
        runtime = self._run.round
        assert runtime is not None and runtime.result is not None
        # before anyone opens the next round (a leaver too: with no survivor, the spares alone form
        # it): the run's figures count a planned re-form as no recovery
        self._mark_planned(runtime.result.round + 1, "grow" if exc.grow else "hand_over")
        if exc.leaving:
            self._leave_handed_over(exc, trainer)
        result, step = runtime.result, trainer.global_step
        runtime.stop_watchdog()
        self._session.events.emit(ev.GROW if exc.grow else ev.HAND_OVER, round=result.round, step=step,
                                  reason=exc.reason)
        ft_log.warning("round %d re-forms after step %d (%s)", result.round, step, exc.reason)
        runtime.retire_group()
        _call_on_exception(trainer, exc)
        finalize_failed(trainer)
        if self._host.layout.resumes_from_live_state and is_fitting(trainer):
            save_live_state(trainer, f"hand-over in round {result.round}")
        self._teardown(trainer, runtime)
        self._prepare_next_round(trainer, f"hand-over in round {result.round}: {exc.reason}", failure=False)

    def _mark_planned(self, round_id: int, why: str) -> None:
        try:
            self._session.rendezvous.records.mark_planned(round_id, why)
        except (RuntimeError, OSError) as exc:  # the store gone: opening the round says so next
            ft_log.debug("could not record round %d as planned (%s): %s", round_id, why, exc)

    def _leave_handed_over(self, exc: HandOver, trainer: Any) -> NoReturn:
        """This rank was signalled and a hot spare takes its place: leave the job for good (withdrawn)
        with exit 0 -- nothing failed, the job goes on."""
        runtime = self._run.round
        message = f"handed over to a hot spare: {exc.reason}"
        self._session.events.emit(ev.HANDED_OVER, round=runtime.round_id if runtime is not None else None,
                                  step=trainer.global_step if trainer is not None else None, reason=exc.reason)
        ft_log.warning("%s; leaving with exit code 0", message)
        print(f"lightning_ft: HANDED_OVER (0): {message}", file=sys.stderr, flush=True)
        if runtime is not None:
            runtime.stop_watchdog()
        self.leave(withdraw=message)
        raise FaultTolerantExit(ExitCode.SUCCESS, message) from None

    def _interrupt(self, trainer: Any, exc: BaseException, kind: FailureKind, detector: Detector, step: int,
                   reported: bool) -> None:
        """Report the failure (unless this rank's watchdog did: ``reported``); retire the group;
        callbacks and loggers learn of the interruption as Lightning would tell them
        (GracefulTermination decides here whether a peer's failure is part of a termination)."""
        runtime = self._run.round
        assert runtime is not None and runtime.result is not None
        error_text = f"{type(exc).__name__}: {first_line(exc)}"
        if not reported:
            self._session.events.emit(ev.FAILURE_DETECTED, round=runtime.result.round, step=step, error=error_text,
                                      detector=detector.value, stalled=[],
                                      step_seconds=runtime.clock.median_seconds())
        ft_log.warning("round %d failed at step %s (%s, detected by %s): %s", runtime.result.round, step,
                    kind.value, detector.value, error_text)
        runtime.retire_group()  # nothing may wait on the broken group from here on (see retire_group)
        _call_on_exception(trainer, exc)
        finalize_failed(trainer)

    def _prepare_next_round(self, trainer: Any, reason: str, failure: bool = True) -> None:
        """Every participant of the next round -- survivor or spare -- starts from what a fresh
        process would have: pristine callbacks, loggers, datamodule and module state.
        ``failure``: the round failed (False: a planned re-form, which is no recovery)."""
        run, session = self._run, self._session
        result = run.round.result if run.round is not None else None
        assert result is not None
        reset_trainer_for_rerun(trainer)
        if self._pristine is not None:
            self._pristine.restore(trainer, self._module)
        self._host.rebuild_module()  # after the pristine state: it shares the module tree it restores
        if failure:
            run.recoveries += 1
        try:
            session.open_round(result.round, reason)
        except (RuntimeError, OSError) as store_error:  # torch's DistNetworkError/DistStoreError
            self.give_up(f"lost the rendezvous store at {self._host.settings.launch.endpoint} "
                         f"({type(store_error).__name__}: {first_line(store_error)}) while recovering from a "
                         f"{reason}; the job cannot re-form its group")

    def _leave_at_once(self, outcome: FailureOutcome, kind: FailureKind, exc: BaseException, facts: FailureFacts,
                       step: int) -> NoReturn:
        """This rank's own failure (a bug, a stop, a failed node): tell the others and leave."""
        runtime = self._run.round
        assert runtime is not None and runtime.result is not None
        result, session = runtime.result, self._session
        text = f"{type(exc).__name__}: {first_line(exc)}"
        if outcome.action is FailureAction.UNHEALTHY:
            message = f"this node cannot go on ({facts.node_fault}: {text}); leaving as an unhealthy node"
            ft_log.error("%s, exit code %d", message, int(ExitCode.UNHEALTHY_NODE))
            print(f"lightning_ft: UNHEALTHY_NODE ({int(ExitCode.UNHEALTHY_NODE)}): {message}", file=sys.stderr,
                  flush=True)
            session.events.emit(ev.NODE_FAULT, round=result.round, step=step, error=text, errno=facts.node_fault)
            self.leave(unhealthy=f"{facts.node_fault}: {text}")
            raise FaultTolerantExit(ExitCode.UNHEALTHY_NODE, message)
        close = None
        if outcome.close is CloseKind.FAILED:
            reason = f"rank {result.rank} raised {text}"
            session.events.emit(ev.DECISION, round=result.round, kind=kind.value, action=outcome.action.value,
                                reason=f"{CloseKind.FAILED.label}: {reason}")
            close = CloseReason(CloseKind.FAILED, reason)
        elif outcome.close is CloseKind.STOPPED:
            session.events.emit(ev.STOPPED, round=result.round, reason=f"{CloseKind.STOPPED.label}: {text}")
            close = CloseReason(CloseKind.STOPPED, text)
        if close is not None and close.kind is CloseKind.FAILED and self._host.settings.launch.max_nodes == 1:
            # the job's only participant: nobody to tell, and the script may catch the error and go
            # on to a later stage (as under ddp), which needs the rendezvous open: the stage ends
            self._host.stop_round_threads()
            try:
                session.rendezvous.records.finish_round(result.round)
            except (RuntimeError, OSError) as error:
                ft_log.warning("could not record the end of round %d: %s", result.round, first_line(error))
            ft_log.info("%s; not recovering (%s); a later stage of the job may still run", text, kind.value)
            raise exc
        if close is not None and close.kind is CloseKind.FAILED:
            session.failed_with = f"stage {session.stages_started - 1}: {close.text}"
        # Lightning runs on_exception hooks and its teardown, as for any error: the group stays
        self.leave(close, failed=text if outcome.publish_error else None, destroy_group=False)
        ft_log.info("%s; not recovering (%s)", text, kind.value)
        raise exc

    def _leave_evicted(self, exc: StragglerEvicted, trainer: Any) -> NoReturn:
        """This rank was evicted as a straggler: leave the job for good (withdrawn, never placed again)
        without closing it -- its peers see a lost peer and a hot spare takes the place."""
        runtime = self._run.round
        message = str(exc)
        self._session.events.emit(ev.EVICTED, round=runtime.round_id if runtime is not None else None,
                                  step=trainer.global_step if trainer is not None else None, reason=message)
        ft_log.warning("%s; leaving with exit code %d (EVICTED)", message, int(ExitCode.EVICTED))
        marker = self._host.settings.stragglers.straggler_marker
        if marker:  # the health-marker hook: this node reads as unhealthy until someone looks at it
            try:
                with open(marker, "w") as f:
                    f.write(f"evicted as a straggler from run {self._host.settings.run_id}: {message}\n")
            except OSError as error:
                ft_log.warning("could not write the straggler marker %s: %s", marker, error)
        print(f"lightning_ft: EVICTED ({int(ExitCode.EVICTED)}): {message}", file=sys.stderr, flush=True)
        self.leave(withdraw=message)
        raise FaultTolerantExit(ExitCode.EVICTED, message) from exc

    def _teardown(self, trainer: Any, runtime: RoundRuntime) -> None:
        # what Lightning's _call_and_handle_interrupt does after on_exception, minus re-raising;
        # bounded: a teardown stuck on the broken group would leave this process alive but useless
        timeout = self._host.settings.timeouts.init_timeout
        guard = ExitWatchdog.within(timeout, 1, f"{strategy_name()}: teardown after a failure (bound "
                                                f"{timeout:.0f}s); exiting so the others see this participant gone")
        try:
            teardown_trainer(trainer)
        except Exception as exc:  # noqa: BLE001 - a broken group may make parts of teardown fail
            ft_log.warning("teardown after the failure raised %s: %s", type(exc).__name__, exc)
        finally:
            guard.disarm()
        runtime.retire_group()

    # ------------------------------------------------------------------ ways out

    def leave(self, close: CloseReason | None = None, *, unhealthy: str | None = None, failed: str | None = None,
              withdraw: str | None = None, destroy_group: bool = True) -> None:
        """The leave sequence: tell the others (this rank's error, the close, an unhealthy node, a
        withdrawal),
        stop this round's threads, shut down the rendezvous, retire and destroy the group. Telling
        is best effort: a store that is gone is logged, never raised."""
        session, runtime = self._session, self._run.round
        result = runtime.result if runtime is not None else None
        try:
            if failed is not None and result is not None:
                session.round_values(result).put(failed_key(result.rank), failed)
            if unhealthy is not None:
                session.rendezvous.report_unhealthy(unhealthy)
            if withdraw is not None:
                session.rendezvous.withdraw(withdraw)
            if close is not None:
                session.close(close.kind, close.text)
        except (RuntimeError, OSError) as exc:  # the store is gone: nobody is left to tell
            ft_log.warning("could not tell the rendezvous that this participant leaves (%s: %s)",
                        type(exc).__name__, first_line(exc))
        self._host.stop_round_threads()
        session.rendezvous.shutdown(job_finished=False)
        if destroy_group:
            if runtime is not None:
                runtime.retire_group()
            destroy_process_group()

    def requeue(self, message: str, saved: str) -> NoReturn:
        """The job cannot go on in-process, but what a relaunch resumes from is saved (``saved``):
        end with PREEMPTED (81), the code a requeue policy acts on, instead of NO_RESTART (83)."""
        text = f"{message}; {saved} is saved: a relaunch resumes from it"
        runtime = self._run.round
        self._host.event_log.emit(ev.STOPPED, round=runtime.round_id if runtime is not None else None,
                                  reason=text, code=int(ExitCode.PREEMPTED))
        ft_log.error("cannot go on in-process; exit code %d (PREEMPTED, requeue): %s", int(ExitCode.PREEMPTED),
                  text)
        print(f"lightning_ft: PREEMPTED ({int(ExitCode.PREEMPTED)}): {text}", file=sys.stderr, flush=True)
        self.leave(None)
        raise FaultTolerantExit(ExitCode.PREEMPTED, text)

    def give_up(self, message: str, cause: BaseException | None = None, close: bool = False) -> NoReturn:
        """End this process with NO_RESTART (83); with ``close``, close the rendezvous for good first."""
        runtime = self._run.round
        self._host.event_log.emit(ev.NO_RESTART, round=runtime.round_id if runtime is not None else None,
                                  reason=message)
        ft_log.error("giving up with exit code %d (NO_RESTART): %s", int(ExitCode.NO_RESTART), message)
        print(f"lightning_ft: NO_RESTART ({int(ExitCode.NO_RESTART)}): {message}", file=sys.stderr, flush=True)
        self.leave(CloseReason(CloseKind.FAILED, message) if close else None)
        raise FaultTolerantExit(ExitCode.NO_RESTART, message) from cause


def give_up_without_session(host: RuntimeHost, message: str, cause: BaseException | None = None) -> NoReturn:
    """NO_RESTART (83) before this process has a session (the store cannot be reached)."""
    host.event_log.emit(ev.NO_RESTART, round=None, reason=message)
    ft_log.error("giving up with exit code %d (NO_RESTART): %s", int(ExitCode.NO_RESTART), message)
    print(f"lightning_ft: NO_RESTART ({int(ExitCode.NO_RESTART)}): {message}", file=sys.stderr, flush=True)
    host.stop_round_threads()
    destroy_process_group()
    raise FaultTolerantExit(ExitCode.NO_RESTART, message) from cause


def save_live_state(trainer: Any, reason: str) -> None:
    """Snapshot the last optimizer-step boundary from the live state, when the Trainer keeps
    snapshots (see ``EmergencyCheckpoint.save_live_state``; it says why when it cannot)."""
    checkpoint = first_callback_of_type(trainer, EmergencyCheckpoint)
    if checkpoint is not None:
        checkpoint.save_live_state(trainer, reason)


def _call_on_exception(trainer: Any, exc: BaseException) -> None:
    for callback in list(trainer.callbacks):
        try:
            callback.on_exception(trainer, trainer.lightning_module, exc)
        except Exception as hook_error:  # noqa: BLE001 - one callback must not stop the recovery
            ft_log.warning("%s.on_exception raised %s: %s", type(callback).__name__,
                        type(hook_error).__name__, hook_error)


def _termination_in_progress(trainer: Any) -> bool:
    # a termination decided the exit (possibly already torn down its callback), or one is running
    if planned_exit_code() is not None:
        return True
    return any(cb.termination_in_progress for cb in callbacks_of_type(trainer, GracefulTermination))
