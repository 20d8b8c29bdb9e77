"""Carrying out a termination on one rank: the health verdict, save or not, the records, the exit.

:class:`GracefulTermination` (the callback) learns about a termination and finds the step to
stop at; :class:`TerminationExecutor` does the rest: it runs the health check in a thread as
soon as the termination begins, leaves at once when the node is unhealthy (after telling its
peers), and at the stop step decides with
:func:`~lightning_ft.termination.decision.decide_on_termination` whether the emergency
snapshot fits into what is left of the grace period, takes it, and records the outcome (event
log, exit record). Every exit is bounded by the termination's :class:`ExitWatchdog`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from lightning_ft._clock import monotonic
from lightning_ft._lightning.callbacks import first_callback_of_type
from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
from lightning_ft.deadlines import call_with_timeout
from lightning_ft.events import names as ev
from lightning_ft.health import HealthReport, NodeHealthCheck, ProbeResult
from lightning_ft.process import ExitWatchdog, exit_now
from lightning_ft.termination.coordination import LocalStopCoordinator, StopRequest, StoreStopCoordinator
from lightning_ft.termination.decision import (
    Action,
    Decision,
    budget_left,
    decide_on_termination,
    not_saved_exit_code,
)
from lightning_ft.termination.exit_records import launch_record_dir, write_exit_record
from lightning_ft.termination.settings import TerminationSettings

log = logging.getLogger(__name__)


class Termination:
    """One termination in progress on this rank."""

    def __init__(self, signum: int, started_at: float, cause: str) -> None:
        self.signum = signum
        self.started_at = started_at  # monotonic() when this rank first knew
        self.cause = cause
        self.stop: StopRequest | None = None
        #: every rank confirmed it knows ``stop`` (so this rank may train the stop step)
        self.all_confirmed = False
        self.report: HealthReport | None = None
        self.report_ready = threading.Event()
        # what a forced exit (watchdog) should report right now: nothing saved yet
        self.exit_code_if_killed = not_saved_exit_code(signum)
        self.watchdog = ExitWatchdog(lambda: self.exit_code_if_killed, "lightning_ft termination")
        #: this rank went on training without stopping (a hand-over survivor): its health verdict no
        #: longer ends the process
        self.superseded = False


class TerminationExecutor:
    """The decisions and actions of a termination on one rank (one per ``fit()``).

    ``announcer`` tells peers about an unhealthy exit (a coordinator on its own store
    connection, usable from the health thread); ``events`` is the run's event log;
    ``current_step()`` the trainer's global step; ``fit_active()`` whether training still runs.
    """

    def __init__(self, *, health_check: NodeHealthCheck, grace_seconds: float, settings: TerminationSettings,
                 events: Any, rank: int, world_size: int, announcer: StoreStopCoordinator | LocalStopCoordinator,
                 current_step: Callable[[], int], fit_active: Callable[[], bool]) -> None:
        self.health_check = health_check
        self.grace_seconds = grace_seconds
        self.exit_reserve_seconds = settings.exit_reserve_seconds
        self.save_safety_factor = settings.save_safety_factor
        self.exit_record_dir = settings.exit_record_dir
        self._announce_timeout = settings.timeouts.announce_timeout
        self.events = events
        self.rank = rank
        self.world_size = world_size
        self._announcer = announcer
        self._current_step = current_step
        self._fit_active = fit_active
        self._unhealthy_exit_lock = threading.Lock()

    def start(self, termination: Termination) -> None:
        """Arm the exit deadline and start the health check at once (it overlaps the wait for the stop step)."""
        termination.watchdog.arm(termination.started_at + max(0.0, self.grace_seconds - self.exit_reserve_seconds / 2))
        threading.Thread(target=self._run_health_check, args=(termination,),
                         name="lightning-ft-health", daemon=True).start()

    def _run_health_check(self, termination: Termination) -> None:  # health thread
        report = self.health_check.run(deadline=termination.started_at + self.health_check.timeout_s)
        termination.report = report
        termination.report_ready.set()
        self.events.emit(ev.HEALTH_REPORT, healthy=report.healthy, reasons=report.reasons,
                         duration_s=round(report.duration_s, 6))
        after_ms = (monotonic() - termination.started_at) * 1000
        if report.healthy:
            log.warning("rank %d: health check: %s; ready %.0f ms after the signal", self.rank,
                        report.summary(), after_ms)
        elif self._fit_active() and not termination.superseded:
            self.exit_unhealthy(termination, report)
        else:
            log.warning("rank %d: health check: %s (training already over; not exiting)", self.rank,
                        report.summary())

    def exit_unhealthy(self, termination: Termination, report: HealthReport) -> None:
        """Publish "unhealthy, exiting" and leave at once, without saving. Never returns."""
        with self._unhealthy_exit_lock:  # a second caller blocks here until the process is gone
            decision = decide_on_termination(
                healthy=False, health_reasons=report.reasons, has_emergency_checkpoint=False,
                budget_left_s=0.0, estimated_save_s=None, signum=termination.signum)
            step = self._current_step()
            log.error("rank %d: %s; health check took %.0f ms, exiting %.0f ms after the signal at step %d",
                      self.rank, decision.describe(), report.duration_s * 1000,
                      (monotonic() - termination.started_at) * 1000, step)
            if self.world_size > 1:
                announcer = self._announcer
                call_with_timeout(lambda: announcer.announce_unhealthy(step, termination.signum, report.reasons),
                                  self._announce_timeout, f"rank {self.rank}: announcing the unhealthy exit",
                                  unanswered="going on without it", log_problem=True)
            seconds = monotonic() - termination.started_at

            def _record() -> None:
                self.events.emit(ev.UNHEALTHY_EXIT, exit_code=decision.exit_code, reasons=list(decision.reasons),
                                 step=step, seconds_since_signal=round(seconds, 6))
                self._write_exit_record(decision.exit_code, decision, step)

            call_with_timeout(_record, self._announce_timeout, f"rank {self.rank}: recording the unhealthy exit",
                              unanswered="going on without it", log_problem=True)
            exit_now(decision.exit_code)

    def decide_and_execute(self, trainer: Any, termination: Termination, step: int, where: str,
                           mid_step: bool = False) -> tuple[int, Decision]:
        """At the stop step: exit if unhealthy, else save when it fits, record, and return the exit code.
        ``mid_step``: the stop comes from inside a step (a peer's failure during the termination);
        the snapshot is then the last step boundary's, from the live state when it still is that."""
        report = self._await_report(termination)
        if not report.healthy:
            self.exit_unhealthy(termination, report)
        checkpoint = first_callback_of_type(trainer, EmergencyCheckpoint)
        estimate = None
        if checkpoint is not None:
            try:
                # a periodic snapshot still copying in the background is finished first, so the
                # budget below is what is left for the emergency save itself
                checkpoint.commit_pending("termination")
                estimate = checkpoint.estimated_save_seconds()
            except Exception:
                log.exception("rank %d: EmergencyCheckpoint's pending snapshot or save estimate failed", self.rank)
        left = budget_left(grace_s=self.grace_seconds, signal_time=termination.started_at,
                           now=monotonic(), exit_reserve_s=self.exit_reserve_seconds)
        decision = decide_on_termination(
            healthy=True, has_emergency_checkpoint=checkpoint is not None, budget_left_s=left,
            estimated_save_s=estimate, signum=termination.signum, save_safety_factor=self.save_safety_factor)
        elapsed_ms = (monotonic() - termination.started_at) * 1000
        log.warning("rank %d: %s, %.0f ms after %s; health: %s; decision: %s", self.rank, where, elapsed_ms,
                    termination.cause, report.summary(), decision.describe())
        # where and why this rank stopped (the agreed step, an unhealthy peer, a store that did
        # not answer) belongs to the record of the decision
        decision = Decision(decision.action, decision.exit_code, (where, *decision.reasons))
        tier = "none"
        if decision.action is Action.SAVE_THEN_EXIT:
            assert checkpoint is not None  # decided only when there is an EmergencyCheckpoint
            decision = self._save(trainer, checkpoint, termination, step, decision, mid_step)
            if decision.action is Action.SAVE_THEN_EXIT:
                decision, tier = self._flush_durable(checkpoint, termination, decision)
        else:
            log.warning("rank %d: exiting with %d without a snapshot", self.rank, decision.exit_code)
        code = decision.exit_code
        termination.exit_code_if_killed = code
        self.events.emit(ev.TERMINATION_DECISION, step=step, action=decision.action.value, exit_code=code,
                         tier=tier, reasons=list(decision.reasons),
                         seconds_since_signal=round(monotonic() - termination.started_at, 6))
        self._write_exit_record(code, decision, step)
        return code, decision

    def _save(self, trainer: Any, checkpoint: EmergencyCheckpoint, termination: Termination, step: int,
              decision: Decision, mid_step: bool = False) -> Decision:
        """Take the emergency snapshot; a failure turns the decision into "not saved"."""
        started = monotonic()
        reason = f"{termination.cause}; stop after step {step}"
        try:
            info = checkpoint.save_live_state(trainer, reason) if mid_step else None
            info = info or checkpoint.save_now(trainer, reason=reason)
        except Exception as exc:
            code = not_saved_exit_code(termination.signum)
            log.exception("rank %d: emergency snapshot failed; exiting with %d (state NOT saved)", self.rank, code)
            return Decision(Action.EXIT_WITHOUT_SAVE, code,
                            (*decision.reasons, f"snapshot failed: {type(exc).__name__}: {exc}"))
        log.warning("rank %d: emergency snapshot of step %d committed in %.3f s (%s); exiting with %d",
                    self.rank, step, monotonic() - started, info, decision.exit_code)
        return decision

    def _flush_durable(self, checkpoint: EmergencyCheckpoint, termination: Termination,
                       decision: Decision) -> tuple[Decision, str]:
        """After the committed memory save: copy it durably if that fits the grace budget left.

        The exit code stays the memory save's (81): it is true whatever the flush does, and a
        forced exit during the flush reports it too. The tier holding the state goes into the
        reasons (exit record) and the event.
        """
        info = checkpoint.last_snapshot
        termination.exit_code_if_killed = decision.exit_code  # the memory save committed
        if info is None or checkpoint.persister is None:
            return decision, "memory"
        left = budget_left(grace_s=self.grace_seconds, signal_time=termination.started_at,
                           now=monotonic(), exit_reserve_s=self.exit_reserve_seconds)
        started = monotonic()
        try:
            tier, why = checkpoint.flush_durable(info, self.world_size, left)
        except Exception as exc:  # noqa: BLE001 - the memory save stands; the flush is a bonus
            tier, why = "memory", f"durable flush failed: {type(exc).__name__}: {exc}"
        log.warning("rank %d: state of step %d held by tier %s after %.3f s: %s", self.rank, info.step, tier,
                    monotonic() - started, why)
        return Decision(decision.action, decision.exit_code, (*decision.reasons, f"tier {tier}: {why}")), tier

    def _await_report(self, termination: Termination) -> HealthReport:
        # NodeHealthCheck returns by its deadline; the slack only covers thread start-up.
        check = self.health_check
        remaining = termination.started_at + check.timeout_s + 0.5 - monotonic()
        if termination.report_ready.wait(max(0.0, remaining)) and termination.report is not None:
            return termination.report
        healthy = not check.overrun_is_unhealthy
        result = ProbeResult("health-check", healthy, "no report by the deadline", check.timeout_s, overran=True)
        return HealthReport(healthy, (result,), check.timeout_s)

    def _write_exit_record(self, code: int, decision: Decision, step: int) -> None:
        targets = [d for d in (self.exit_record_dir, launch_record_dir()) if d]
        for directory in dict.fromkeys(os.path.abspath(d) for d in targets):
            try:
                write_exit_record(directory, self.rank, code, decision.action.value, decision.reasons, step)
            except (OSError, ValueError) as exc:  # ValueError: not a private directory of this user
                log.warning("rank %d: cannot write the exit record to %s: %s", self.rank, directory, exc)
