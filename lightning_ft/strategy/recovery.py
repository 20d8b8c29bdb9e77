"""What happens when a round fails: read the facts, decide, and perform the decision.

:class:`FailureHandler` is called by the launcher with the exception that ended Lightning's
``_fit_impl``. It reads the world into :class:`~lightning_ft.strategy.decisions.FailureFacts`
(the exception chain, the watchdog's verdict, the store's notices), asks the pure decisions
(:func:`~lightning_ft.strategy.decisions.classify_failure`,
:func:`~lightning_ft.strategy.decisions.decide_recovery`) and then either

* prepares the next round: break and retire the group, let callbacks see the interruption,
  run Lightning's exception-path teardown (bounded), reset the Trainer, open the round; or
* ends the process: re-raise a bug (after telling the others), or raise
  :class:`NoRestartError` (exit 83) with a message that says why.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

from lightning_ft._lightning.callbacks import callbacks_of_type
from lightning_ft._lightning.history import finalize_failed
from lightning_ft._lightning.pristine import PristineState
from lightning_ft._lightning.trainer_reset import reset_trainer_for_rerun
from lightning_ft.events import names as ev
from lightning_ft.exit_codes import ExitCode
from lightning_ft.process import ExitWatchdog, call_with_timeout, destroy_process_group, planned_exit_code
from lightning_ft.schema.round import VERDICT_KEY, decode_verdict, failed_key
from lightning_ft.schema.run import CloseKind
from lightning_ft.strategy.decisions import (
    FailureFacts,
    FailureKind,
    RecoveryAction,
    classify_failure,
    decide_recovery,
    looks_like_collective_error,
    looks_like_peer_gone,
    node_fault_errno,
)
from lightning_ft.strategy.session import RoundRuntime, Session
from lightning_ft.strategy.watchdog import RoundWatchdog
from lightning_ft.termination.callback import GracefulTermination

if TYPE_CHECKING:
    from lightning_ft.strategy.strategy import FaultTolerantDDPStrategy

log = logging.getLogger(__name__)

# the longest classifying a failure waits for the store's notices (failed peers, verdicts, the close)
_CLASSIFY_STORE_TIMEOUT_S = 2.0


class NodeFaultExit(SystemExit):
    """This node's resources failed; the process exits UNHEALTHY_NODE (82) with the message."""

    def __init__(self, message: str) -> None:
        super().__init__(int(ExitCode.UNHEALTHY_NODE))
        self.message = message

    def __str__(self) -> str:
        return self.message


class NoRestartError(SystemExit):
    """The job cannot go on (no hot spare left, a peer's own error, repeated failures).

    A ``SystemExit`` whose code is ``ExitCode.NO_RESTART`` (83), so an uncaught one ends the
    process with that status: "unrecoverable, do not requeue".
    """

    def __init__(self, message: str) -> None:
        super().__init__(int(ExitCode.NO_RESTART))
        self.message = message

    def __str__(self) -> str:
        return f"exit {int(ExitCode.NO_RESTART)} (NO_RESTART): {self.message}"


def exception_chain(exc: BaseException) -> list[tuple[str, str]]:
    """``(type name, message)`` of ``exc`` and its causes/contexts (at most 10)."""
    chain, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(chain) < 10:
        seen.add(id(current))
        chain.append((type(current).__name__, str(current)))
        current = current.__cause__ or current.__context__
    return chain


def chain_errnos(exc: BaseException) -> list[int | None]:
    """The ``errno`` of each OSError in ``exc``'s chain of causes/contexts (at most 10 links)."""
    numbers, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 10:
        seen.add(id(current))
        if isinstance(current, OSError):
            numbers.append(current.errno)
        current = current.__cause__ or current.__context__
    return numbers


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:300]


def give_up(strategy: "FaultTolerantDDPStrategy", message: str, cause: BaseException | None = None,
            close: bool = False) -> NoReturn:
    """End this process with NO_RESTART (83); with ``close``, close the rendezvous for good first."""
    session = strategy.session
    if close and session is not None:
        try:
            session.close(CloseKind.FAILED, message)
        except (RuntimeError, OSError) as exc:  # the store is gone: nobody is left to tell
            log.warning("ddp_ft: could not close the rendezvous (%s: %s)", type(exc).__name__, first_line(exc))
    round_id = strategy.round.round_id if strategy.round is not None else None
    strategy.event_log.emit(ev.NO_RESTART, round=round_id, reason=message)
    log.error("ddp_ft: giving up with exit code %d (NO_RESTART): %s", int(ExitCode.NO_RESTART), message)
    print(f"lightning_ft: NO_RESTART ({int(ExitCode.NO_RESTART)}): {message}", file=sys.stderr, flush=True)
    strategy.stop_round_threads()
    if session is not None:
        session.rendezvous.shutdown(job_finished=False)
    destroy_process_group()
    error = NoRestartError(message)
    if cause is not None:
        raise error from cause
    raise error


class FailureHandler:
    """Handles the failures of one process's rounds (see the module docstring)."""

    def __init__(self, strategy: "FaultTolerantDDPStrategy", session: Session, pristine: PristineState,
                 module: Any) -> None:
        self._strategy = strategy
        self._session = session
        self._pristine = pristine
        self._module = module

    def handle(self, exc: BaseException, trainer: Any, failures_without_progress: int) -> float:
        """Prepare the next round and return the failure's ``time.monotonic()``, or raise what ends fit()."""
        now = time.monotonic()
        strategy, session = self._strategy, self._session
        runtime = strategy.round
        watchdog = runtime.stop_watchdog()
        facts = self._facts(exc, runtime, watchdog)
        kind = classify_failure(facts)
        detector = watchdog.triggered[0] if watchdog is not None and watchdog.triggered else "collective"
        step = trainer.global_step if trainer is not None else None
        result = runtime.result
        if kind is FailureKind.NODE_FAULT:
            self._leave_unhealthy(facts.node_fault, exc, runtime, step)
        if kind in (FailureKind.STOP, FailureKind.LOCAL_ERROR):
            self._end_on_exception(kind, exc, runtime)
            raise exc  # Lightning runs on_exception hooks and its teardown, as for any error
        error_text = f"{type(exc).__name__}: {first_line(exc)}"
        if detector not in ("hang", "deadlock"):  # the watchdog reported it already, when it fired
            session.events.emit(ev.FAILURE_DETECTED, round=result.round, step=step, error=error_text,
                                detector=detector, stalled=[], step_seconds=runtime.clock.median_seconds())
        log.warning("ddp_ft: round %d failed at step %s (%s, detected by %s): %s", result.round, step, kind.value,
                    detector, error_text)
        runtime.retire_group()  # nothing may wait on the broken group from here on (see retire_group)
        # callbacks and loggers learn about the interruption as Lightning would tell them
        # (GracefulTermination decides here whether a peer's failure is part of a termination)
        _call_on_exception(trainer, exc)
        finalize_failed(trainer)
        if _termination_in_progress(trainer):
            session.close(CloseKind.STOPPED, "a termination is in progress (SIGTERM path)")
            session.events.emit(ev.STOPPED, round=result.round, reason="termination in progress during a peer failure")
            strategy.stop_round_threads()
            session.rendezvous.shutdown(job_finished=False)
            destroy_process_group()
            raise exc
        settings = strategy.settings
        decision = decide_recovery(kind, failures_without_progress, settings.max_failures_without_progress,
                                   strategy.recoveries, settings.max_recoveries)
        session.events.emit(ev.DECISION, round=result.round, kind=kind.value, action=decision.action.value,
                            reason=decision.reason)
        self._teardown(trainer, runtime)
        if decision.action is not RecoveryAction.RECOVER:
            peer = f" ({facts.peer_error})" if facts.peer_error else ""
            give_up(strategy, f"{decision.reason}{peer}", cause=exc, close=True)
        reset_trainer_for_rerun(trainer)
        # every participant of the next round -- survivor or spare -- starts from what a fresh
        # process would have: pristine callbacks, loggers, datamodule and module state
        self._pristine.restore(trainer, self._module)
        strategy.recoveries += 1
        try:
            session.open_round(result.round, f"{kind.value} in round {result.round}: {error_text}")
        except (RuntimeError, OSError) as store_error:  # torch's DistNetworkError/DistStoreError
            give_up(strategy, f"lost the rendezvous store at {settings.launch.endpoint} "
                              f"({type(store_error).__name__}: {first_line(store_error)}) while recovering from "
                              f"a {kind.value} in round {result.round}; the job cannot re-form its group")
        return now

    def _facts(self, exc: BaseException, runtime: RoundRuntime, watchdog: RoundWatchdog | None) -> FailureFacts:
        chain = exception_chain(exc)
        detector = watchdog.triggered[0] if watchdog is not None and watchdog.triggered is not None else None
        transport_broken = runtime.transport is not None and runtime.transport.aborted
        peer_error = newer = None
        result, session = runtime.result, self._session

        def read_notices() -> tuple[str | None, str | None, bool]:
            found_error, found_detector = None, detector
            values = session.round_values(result)
            for rank in range(result.world_size):
                text = values.get(failed_key(rank)) if rank != result.rank else None
                if text is not None:
                    found_error = f"rank {rank}: {text.decode(errors='replace')}"
                    break
            # a peer's verdict names the failure unless this rank's own watchdog judged it (hang,
            # deadlock): a watchdog that only saw the peer open the next round ("rendezvous")
            # must still read why, or a deadlock the peer found would count as a lost peer
            own_judgement = found_detector is not None and found_detector != "rendezvous"
            raw_verdict = None if own_judgement else values.get(VERDICT_KEY)
            if raw_verdict is not None:  # a peer's watchdog broke the round
                verdict = decode_verdict(raw_verdict)
                found_detector = verdict.detector if verdict is not None else found_detector
            closed = session.rendezvous.closed_reason()
            if found_error is None and closed is not None and closed.kind is CloseKind.FAILED:
                found_error = str(closed)
            return found_error, found_detector, session.rendezvous.current_round() > result.round

        # bounded: a frozen store host must not keep this rank from deciding (on the SIGTERM
        # path, GracefulTermination saves from here on); no answer counts as no notices
        notices = call_with_timeout(read_notices, _CLASSIFY_STORE_TIMEOUT_S, "reading the store's notices")
        if notices.ok:
            peer_error, detector, newer = notices.value  # type: ignore[misc]
        else:
            log.warning("ddp_ft: classifying the failure without the rendezvous store: %s", notices.problem)
        return FailureFacts(
            exception_type=type(exc).__name__,
            is_collective_error=looks_like_collective_error(chain) or transport_broken,
            is_stop=isinstance(exc, (SystemExit, KeyboardInterrupt)),
            peer_error=peer_error, newer_round=bool(newer), hang_detected=detector == "hang",
            deadlock_detected=detector == "deadlock",
            peer_gone=looks_like_peer_gone(chain) and not transport_broken,
            node_fault=node_fault_errno(chain_errnos(exc)))

    def _end_on_exception(self, kind: FailureKind, exc: BaseException, runtime: RoundRuntime) -> None:
        """Tell the others this job is over (spares leave, peers do not mistake it for a lost node)."""
        session, result = self._session, runtime.result
        text = f"{type(exc).__name__}: {first_line(exc)}"
        try:
            if kind is FailureKind.LOCAL_ERROR:
                session.round_values(result).put(failed_key(result.rank), text)
                reason = f"rank {result.rank} raised {text}"
                session.events.emit(ev.DECISION, round=result.round, kind=kind.value, action="raise",
                                    reason=f"{CloseKind.FAILED.label}: {reason}")
                session.close(CloseKind.FAILED, reason)
            else:
                session.events.emit(ev.STOPPED, round=result.round, reason=f"{CloseKind.STOPPED.label}: {text}")
                session.close(CloseKind.STOPPED, text)
        except (RuntimeError, OSError) as store_error:
            log.warning("ddp_ft: could not tell the rendezvous that the job ended: %s", store_error)
        self._strategy.stop_round_threads()
        session.rendezvous.shutdown(job_finished=False)
        log.info("ddp_ft: %s; not recovering (%s)", text, kind.value)

    def _leave_unhealthy(self, errno_name: str | None, exc: BaseException, runtime: RoundRuntime,
                         step: int | None) -> NoReturn:
        """This node's storage failed: leave as an unhealthy node (82) so the others go on without it.

        Not the user's bug (which would end the job for everyone) and not worth retrying here:
        the node is counted lost for good, its peers see a lost peer and recover with a spare
        (or end NO_RESTART when none is left), and the scheduler learns to avoid this node.
        """
        strategy, session, result = self._strategy, self._session, runtime.result
        text = f"{type(exc).__name__}: {first_line(exc)}"
        message = f"this node cannot go on ({errno_name}: {text}); leaving as an unhealthy node"
        log.error("ddp_ft: %s, exit code %d", message, int(ExitCode.UNHEALTHY_NODE))
        print(f"lightning_ft: UNHEALTHY_NODE ({int(ExitCode.UNHEALTHY_NODE)}): {message}", file=sys.stderr, flush=True)
        session.events.emit(ev.NODE_FAULT, round=result.round, step=step, error=text, errno=errno_name)
        try:
            session.rendezvous.report_unhealthy(f"{errno_name}: {text}")
        except (RuntimeError, OSError) as store_error:
            log.warning("ddp_ft: could not report this node unhealthy: %s", store_error)
        strategy.stop_round_threads()
        session.rendezvous.shutdown(job_finished=False)
        runtime.retire_group()
        destroy_process_group()
        raise NodeFaultExit(message)

    def _teardown(self, trainer: Any, runtime: RoundRuntime) -> None:
        # what Lightning's _call_and_handle_interrupt does after on_exception, minus re-raising;
        # bounded: a teardown stuck on the broken group would leave this process alive but useless
        timeout = self._strategy.settings.timeouts.init_timeout
        guard = ExitWatchdog.within(timeout, 1, f"ddp_ft: teardown after a failure (bound {timeout:.0f}s); exiting "
                                                "so the others see this participant gone")
        try:
            trainer._teardown()
        except Exception as exc:  # noqa: BLE001 - a broken group may make parts of teardown fail
            log.warning("ddp_ft: teardown after the failure raised %s: %s", type(exc).__name__, exc)
        finally:
            guard.disarm()
        trainer.state.stage = None
        runtime.retire_group()


def _call_on_exception(trainer: Any, exc: BaseException) -> None:
    for callback in list(trainer.callbacks):
        try:
            callback.on_exception(trainer, trainer.lightning_module, exc)
        except Exception as hook_error:  # noqa: BLE001 - one callback must not stop the recovery
            log.warning("ddp_ft: %s.on_exception raised %s: %s", type(callback).__name__,
                        type(hook_error).__name__, hook_error)


def _termination_in_progress(trainer: Any) -> bool:
    # a termination decided the exit (possibly already torn down its callback), or one is running
    if planned_exit_code() is not None:
        return True
    return any(cb.termination_in_progress for cb in callbacks_of_type(trainer, GracefulTermination))
