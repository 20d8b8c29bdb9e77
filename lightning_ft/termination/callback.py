"""``GracefulTermination``: SIGTERM -> agreed stop step -> health probe -> emergency snapshot or immediate exit.

Flow on each rank (see docs/sigterm.md for the exit-code table):

1. The signal handler only records (signal, time). A watcher thread, woken through the
   signal wakeup fd, starts the node-health check at once, so the probes overlap the
   wait for the stop step.
2. At the next optimizer-step boundary the rank proposes ``stop = step + margin_steps``
   in the process group's store (``compare_set``, first writer wins) and wakes every
   rank's stop watcher (:mod:`~lightning_ft.termination.watcher`): a thread blocked in a
   store ``wait`` that reads the request, publishes it in an attribute and confirms it.
   The training thread reads that attribute at its boundaries and never calls the store
   in steady state. Before training the stop step, a rank that knows it waits until every
   rank confirmed, so all ranks stop after the same step (see
   :func:`~lightning_ft.termination.decision.decide_at_boundary`); no collective ever
   runs inside a signal handler.
3. Unhealthy node (as soon as the check says so, not waiting for the stop step):
   publish "unhealthy, exiting" in the store, then ``os._exit(UNHEALTHY_NODE)``
   without saving. Peers learn it from their watcher at their next boundary, or see a
   gloo error in their current collective and find the notice in ``on_exception``;
   either way they save the state of their last completed optimizer step.
4. Healthy node at the stop step: if the measured snapshot cost fits in what is left
   of the grace period, ``EmergencyCheckpoint.save_now`` and exit ``PREEMPTED`` (81);
   otherwise (or with no ``EmergencyCheckpoint`` configured, or when the save fails)
   exit ``128 + signal`` (143 for SIGTERM): stopped by the signal, nothing saved.

Every store call on the training thread runs under ``store_timeout_seconds``: a store that
does not answer (frozen host, dead server) makes the rank stop at the step it is at,
decide as in 4. and log why -- it never waits out the store's own op timeout (minutes).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

import lightning.pytorch as pl

from lightning_ft._clock import monotonic
from lightning_ft._lightning.callback_dispatch import skip_unused_batch_hooks
from lightning_ft._lightning.launcher import disarm_child_observer
from lightning_ft._lightning.trainer import log_step_metrics
from lightning_ft._logging import ensure_log_output
from lightning_ft._validation import require
from lightning_ft.deadlines import call_with_timeout
from lightning_ft.events import NullEventLog, open_event_log
from lightning_ft.events import names as ev
from lightning_ft.exit_codes import FaultTolerantExit, HandOver
from lightning_ft.health import NodeHealthCheck
from lightning_ft.health.probes import default_probes
from lightning_ft.process import install_exit_hook, plan_exit
from lightning_ft.settings import SettingsError, load
from lightning_ft.settings.environment import torchelastic_run_id, torchelastic_shutdown_timeout
from lightning_ft.termination.coordination import (
    LocalStopCoordinator,
    StopRequest,
    StoreStopCoordinator,
    coordinator_for,
)
from lightning_ft.termination.decision import BoundaryAction, decide_at_boundary, hands_over_on, resolve_grace_seconds
from lightning_ft.termination.execution import Termination, TerminationExecutor
from lightning_ft.termination.handover import HandOverAgreement, hand_over_seat
from lightning_ft.termination.settings import TerminationSettings, check_reserve
from lightning_ft.termination.signals import SignalListener
from lightning_ft.termination.watcher import StopWatcher

log = logging.getLogger(__name__)

_STORE_METHODS = ("compare_set", "check", "get", "set", "add", "multi_set", "wait", "delete_key")
_PREFIX = "GracefulTermination: "


class GracefulTermination(pl.Callback):
    """Stop every rank at the same step on SIGTERM; save an emergency snapshot only on a healthy node.

    Works with the defaults (no arguments); all arguments are keyword-only.

    Args:
        probes: node-health probes to run when the signal arrives; ``None`` = the built-in
            set configured from the environment (:func:`lightning_ft.health.default_probes`),
            ``[]`` = no probing (always healthy).
        store: a ``torch.distributed.Store`` to agree through instead of the default
            process group's store (must be fresh for each job run).
        signals: the signals that start a termination (SIGTERM, SIGINT: see ``decision.hands_over_on``)
        **settings: any setting of :class:`~lightning_ft.termination.settings.TerminationSettings`
            (``grace_seconds``, ``margin_steps``, ``save_safety_factor``, ``exit_reserve_seconds``,
            ``overrun_is_unhealthy``, ``exit_record_dir``) and the SIGTERM path's bounds of
            :class:`~lightning_ft.settings.Timeouts` (``health_timeout``, ``stop_store_timeout``:
            the longest a call on the training thread waits for the store on this path -- when
            the store does not answer the rank stops where it is and decides save-or-not as
            usual; ``exit_timeout``: once the decision is made the process is force-exited with
            the decided code if still alive after this long; ``announce_timeout``,
            ``watcher_close_timeout``). Each is documented there and in ``docs/sigterm.md``.
    """

    def __init__(
        self,
        *,
        probes: Sequence[Any] | None = None,
        store: Any | None = None,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
        **settings: Any,
    ) -> None:
        sources: dict[str, str] = {}
        self.settings = load(TerminationSettings, settings, error=ValueError, prefix=_PREFIX, sources=sources)
        timeouts = self.settings.timeouts
        if probes is not None and (isinstance(probes, (str, bytes)) or not hasattr(probes, "__iter__")):
            raise ValueError(f"{_PREFIX}probes must be a sequence of probes or None, got {probes!r}")
        try:
            self._health_check = NodeHealthCheck(
                default_probes() if probes is None else list(probes),
                timeout_s=timeouts.health_timeout, overrun_is_unhealthy=self.settings.overrun_is_unhealthy)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{_PREFIX}bad probes: {exc}") from None
        self.grace_seconds, self.grace_source = resolve_grace_seconds(
            self.settings.grace_seconds, sources.get("grace_seconds", "default"),
            torchelastic_shutdown_timeout() if torchelastic_run_id() else None)
        try:
            check_reserve(self.settings, self.grace_seconds, self.grace_source)
        except SettingsError as exc:
            raise ValueError(f"{_PREFIX}{exc}") from None
        _require(store is None or all(callable(getattr(store, m, None)) for m in _STORE_METHODS),
                 "store", f"None or a torch.distributed.Store (with {', '.join(_STORE_METHODS)})", store)
        self.signals = _validate_signals(signals)
        self.margin_steps = self.settings.margin_steps
        self.timeouts = timeouts
        self._store_override = store
        self._events: Any = NullEventLog()
        ensure_log_output()
        self.exit_record_dir = self.settings.exit_record_dir
        install_exit_hook()

        self._lock = threading.Lock()
        self._listener: SignalListener | None = None
        self._termination: Termination | None = None
        self._executor: TerminationExecutor | None = None
        self._trainer: pl.Trainer | None = None
        # the SIGTERM path's store connection (proposals, confirmations, notices): never the
        # training thread's own, so a call stuck on it stalls nothing but the bounded call
        self._coordinator: StoreStopCoordinator | LocalStopCoordinator = LocalStopCoordinator()
        self._watcher: StopWatcher | None = None
        self._hand_over = HandOverAgreement(self._coordinator, None, 0.0, 0.0)
        #: a signal of this rank's own that came after a hand-over verdict it survived: the next
        #: round's termination begins with it (a signal is never dropped)
        self._carried_signal: tuple[int, float] | None = None
        self._restore_handlers: dict[int, Any] = {}
        self._fit_active = False
        self._last_boundary_step = -1
        self._rank = 0
        self._world_size = 1
        skip_unused_batch_hooks(self)

    @property
    def health_check(self) -> NodeHealthCheck:
        return self._health_check

    @property
    def termination_in_progress(self) -> bool:
        """True once this rank knows of a termination (its own signal or a peer's stop request)."""
        return self._termination is not None

    # ---- installation ---------------------------------------------------------------
    # Lightning registers its own SIGTERM handler just before the run stage and calls it
    # *before* any handler that existed then; its handler broadcasts inside the signal
    # handler and deadlocks DDP when one non-zero rank is signalled. Installing in
    # on_sanity_check_start / on_train_start replaces it instead.

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def _install(self, trainer: pl.Trainer) -> None:
        if self._listener is not None:
            return
        self._trainer = trainer
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        self._termination = None
        shared = coordinator_for(trainer.strategy, self._rank, self._world_size, self._store_override)
        self._coordinator = shared.clone()
        self._watcher = None
        if isinstance(shared, StoreStopCoordinator):
            self._watcher = StopWatcher(shared, on_stop=self._on_peer_stop,
                                        close_timeout=self.timeouts.watcher_close_timeout)
            self._watcher.start()
        self._last_boundary_step = trainer.global_step
        # Lightning's teardown restores the handlers it found before fit; restore to
        # those as well, never to Lightning's own (collective-calling) handler.
        original = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", {}) or {}
        self._restore_handlers = {s: original.get(s) for s in self.signals}
        self._fit_active = True
        # the run's event log: the strategy's when it keeps one (ddp_ft: its events_dir, which may
        # come from an argument), else the one LIGHTNING_FT_EVENTS_DIR names
        self._events = getattr(trainer.strategy, "event_log", None) or open_event_log(f"rank{self._rank}")
        self._executor = TerminationExecutor(
            health_check=self._health_check, grace_seconds=self.grace_seconds, settings=self.settings,
            events=self._events, rank=self._rank, world_size=self._world_size, announcer=self._coordinator,
            current_step=self._current_step, fit_active=lambda: self._fit_active)
        self._listener = SignalListener(self.signals, self._on_signal)
        self._hand_over = HandOverAgreement(self._coordinator, hand_over_seat(trainer.strategy),
                                            self.settings.hand_over_settle_seconds, self.timeouts.stop_store_timeout)
        if self._listener.install():
            log.info("rank %d: handling %s (grace %.0f s from %s, health check %.1f s, %d probes)",
                     self._rank, "/".join(signal.Signals(s).name for s in self.signals), self.grace_seconds,
                     self.grace_source, self._health_check.timeout_s, len(self._health_check.probes))
        else:
            self._listener = None
        carried, self._carried_signal = self._carried_signal, None
        if carried is not None and self._listener is not None:
            self._on_signal(*carried)

    def _finish(self, trainer: pl.Trainer | None = None, exiting: bool = False) -> None:
        """Stop watching and put the pre-fit handlers back; nothing of ours stays installed.

        With ``exiting`` (the decision is made and the process is on its way out) the
        signals are ignored instead, here and in what Lightning's teardown restores: a
        second SIGTERM -- torchrun sends one to every worker as soon as one worker exits
        non-zero, a scheduler may repeat it -- would otherwise kill the process with
        -15 during interpreter shutdown and replace the exit code we decided. SIGKILL
        and our exit watchdog still bound the exit.
        """
        self._fit_active = False
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            assert isinstance(self._coordinator, StoreStopCoordinator)  # the only kind a watcher is made for
            # woken on the way out too: the interpreter's exit waits for its store wait anyway (one
            # that returns during finalization aborts the process), and a wake is one quick call
            watcher.close(self._coordinator)
        if self._listener is None:
            return
        restore = dict(self._restore_handlers)
        if exiting:
            restore = {s: signal.SIG_IGN for s in self.signals}
            original = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
            if isinstance(original, dict):
                original.update(restore)
        self._listener.uninstall(restore=restore)
        self._listener = None

    # ---- learning about a termination ---------------------------------------------------

    def _on_signal(self, signum: int, seen_at: float) -> None:  # watcher thread
        if not self._fit_active:
            return  # between rounds: the next round's install carries it (see _supersede)
        name = signal.Signals(signum).name
        step = self._current_step()
        log.warning("rank %d: %s received during step %d; starting the health check, stopping at an agreed step",
                    self._rank, name, step + 1)
        self._events.emit(ev.TERMINATION_SIGNAL, signal=name, step=step)
        self._begin(signum, seen_at, f"{name} received")
        coordinator = self._coordinator
        if isinstance(coordinator, StoreStopCoordinator) and self._hand_over.possible and hands_over_on(signum):
            # for the hand-over verdict: this rank leaves if peers and spares can go on without it
            call_with_timeout(coordinator.mark_signalled, self.timeouts.announce_timeout,
                              f"rank {self._rank}: recording the signal", unanswered="going on without it",
                              log_problem=True)

    def _on_peer_stop(self, stop: StopRequest) -> None:  # stop-watcher thread
        # start the health check now, not at the next step boundary; after fit, nothing to stop
        if self._fit_active:
            self._begin(stop.signum, monotonic(), f"stop requested by rank {stop.rank}")

    def _current_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else -1

    def _begin(self, signum: int, started_at: float, cause: str) -> Termination:
        with self._lock:
            if self._termination is not None:
                return self._termination
            termination = Termination(signum, started_at, cause)
            self._termination = termination
        if disarm_child_observer():
            log.info("rank %d: disabled Lightning's child-process observer for the termination", self._rank)
        assert self._executor is not None  # made in setup(), before anything can begin a termination
        self._executor.start(termination)
        return termination

    # ---- the step boundary ----------------------------------------------------------

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._listener is None:
            return
        step = trainer.global_step
        if step == self._last_boundary_step:  # inside a gradient-accumulation window: not a boundary
            return
        self._last_boundary_step = step
        termination = self._termination
        if termination is None:
            received = self._listener.received
            if received is not None:  # the signal watcher has not run yet
                termination = self._begin(received[0], received[1], f"{signal.Signals(received[0]).name} received")
            else:
                watcher = self._watcher
                stop = watcher.request if watcher is not None else None
                if stop is None:
                    return  # the steady state: a few attribute reads, no store call
                termination = self._begin(stop.signum, monotonic(), f"stop requested by rank {stop.rank}")
        try:
            self._at_boundary(trainer, termination, step)
        except FaultTolerantExit:
            # the stop ends fit() before Lightning logs this step's metrics: a relaunch resumes
            # after this step, so its row would be missing from the logs for good
            log_step_metrics(trainer)
            raise

    def _at_boundary(self, trainer: pl.Trainer, termination: Termination, step: int) -> None:
        """A termination is known: agree on the stop step, hold before it until all know it, stop at it."""
        stop = termination.stop
        watcher = self._watcher
        if stop is None:
            stop = watcher.request if watcher is not None else None
            if stop is not None:
                log.warning("rank %d: at step %d; peer asked to stop after step %d (%s)",
                            self._rank, step, stop.step, stop.reason)
            else:
                stop = self._propose(termination, step)
                if stop is None:  # the store did not answer: stopped (never returns)
                    return
            termination.stop = stop
            self._events.emit(ev.STOP_AGREED, step=step, stop_step=stop.step, proposer=stop.rank, reason=stop.reason)
        unhealthy = watcher.unhealthy if watcher is not None else {}
        action = decide_at_boundary(step=step, stop_step=stop.step, peer_unhealthy=bool(unhealthy),
                                    all_confirmed=termination.all_confirmed)
        if action is BoundaryAction.HOLD:
            unhealthy = self._hold_until_confirmed(trainer, termination, step)
            if not unhealthy:
                return  # every rank knows the stop step: train it
        elif action is BoundaryAction.CONTINUE:
            return
        if unhealthy:
            where = f"stopping at step {step}: peer(s) exited unhealthy {unhealthy}"
        elif step > stop.step:
            log.warning("rank %d: already past the agreed stop (%d > %d); stopping now", self._rank, step, stop.step)
            where = f"stopping at step {step}, past the agreed stop step {stop.step}"
        else:
            where = f"reached the agreed stop step {step}"
        if self._handed_over(trainer, termination, step, unhealthy):
            return
        self._stop_here(trainer, termination, step, where)

    def _propose(self, termination: Termination, step: int) -> StopRequest | None:
        """Propose ``step + margin`` (bounded); the agreed request, or stop here if the store does not answer."""
        coordinator, proposal = self._coordinator, step + propose_margin(self.margin_steps, self._world_size)
        reason = f"rank {self._rank}: {termination.cause}"
        if isinstance(coordinator, LocalStopCoordinator):
            return coordinator.propose(proposal, termination.signum, reason)
        signalled = self._signalled() and self._hand_over.possible
        outcome = call_with_timeout(lambda: coordinator.propose(proposal, termination.signum, reason, signalled),
                                    self.timeouts.stop_store_timeout, "proposing the stop step in the store")
        if not outcome.ok:
            log.error("rank %d: %s; no agreed stop step: stopping at step %d", self._rank, outcome.problem, step)
            self._stop_here(self._trainer, termination, step,
                            f"stopping at step {step} without an agreed stop step: {outcome.problem}")
        stop: StopRequest = outcome.value
        log.warning("rank %d: at step %d; agreed stop after step %d (proposed by rank %d: %s)",
                    self._rank, step, stop.step, stop.rank, stop.reason)
        return stop

    def _hold_until_confirmed(self, trainer: pl.Trainer, termination: Termination,
                              step: int) -> dict[int, list[str]]:
        """Before the stop step: wait (bounded) until every rank confirmed it; returns unhealthy peers.

        Stops here (never returns) when the confirmations do not come in time: a rank that
        does not know the stop step might train past it, so nobody trains it.
        """
        stop = termination.stop
        assert stop is not None  # agreed on by _at_boundary before it holds
        unhealthy, problem = wait_for_confirmations(self._coordinator, self.timeouts.stop_store_timeout, stop)
        if problem is None:
            termination.all_confirmed = not unhealthy
            return unhealthy
        log.error("rank %d: %s; stopping at step %d instead of %d", self._rank, problem, step, stop.step)
        self._stop_here(trainer, termination, step, f"stopping at step {step} before the agreed stop step "
                                                    f"{stop.step}: {problem}")
        return {}  # not reached

    def _signalled(self) -> bool:
        """This rank received a signal itself (not only a peer's stop request) that hands it over."""
        return self._listener is not None and (got := self._listener.received) is not None and hands_over_on(got[0])

    def _handed_over(self, trainer: pl.Trainer, termination: Termination, step: int,
                     unhealthy: dict[int, list[str]]) -> bool:
        """At the stop (or a peer's unhealthy exit): act on the hand-over verdict; False: the job stops."""
        if not self._hand_over.possible:
            return False
        verdict = self._hand_over.settle(termination.started_at, step, self._signalled(), unhealthy, self._events)
        if not verdict.hands_over:
            return False
        if self._rank in verdict.leavers:
            termination.exit_code_if_killed = 0  # forced out when the way out takes too long: still handed over
            self._finish(trainer, exiting=True)
            return True
        self._supersede(trainer, termination)
        return True

    def _supersede(self, trainer: pl.Trainer, termination: Termination | None) -> None:
        """This rank trains on in the next round (a hand-over's survivor, a planned re-form): the termination
        ends without an exit; a signal of its own begins the next round's."""
        listener = self._listener
        self._finish(trainer)  # not fit-active from here: no signal begins a termination any more
        if termination is not None:  # its health check and its watchdog no longer end this process
            termination.superseded = True
            termination.watchdog.disarm()
        self._carried_signal = listener.received if listener is not None else None
        self._termination = None

    def _stop_here(self, trainer: pl.Trainer | None, termination: Termination, step: int, where: str) -> NoReturn:
        assert self._executor is not None  # made in setup(), before any termination
        code, decision = self._executor.decide_and_execute(trainer, termination, step, where)
        self._finish(trainer, exiting=True)
        # The code is forced at interpreter exit (os._exit after the atexit handlers), not left to
        # SystemExit: on Python < 3.14 a daemon thread that returns from a store call while the
        # interpreter finalizes (the stop watcher when the store server goes away with the job)
        # takes the process down with SIGABRT, which would replace the decided code.
        plan_exit(destroy_process_group=True, force_code=code)
        termination.watchdog.arm(monotonic() + self.timeouts.exit_timeout)
        raise FaultTolerantExit(code, decision.describe())

    # ---- the exception path and the end of fit -----------------------------------------

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._listener is None or isinstance(exception, FaultTolerantExit):
            return
        if isinstance(exception, HandOver):  # a re-form the runtime planned (an elastic grow): go on with it
            return self._supersede(trainer, self._termination)
        termination = self._termination
        received = self._listener.received
        if termination is None and received is not None:
            termination = self._begin(received[0], received[1], f"{signal.Signals(received[0]).name} received")
        peers: dict[int, list[str]] = {}
        if self._world_size > 1:
            # A peer that left (unhealthy, or killed) makes our current collective fail;
            # the store says whether that is part of a termination (bounded: it may be gone too).
            coordinator, watcher = self._coordinator, self._watcher
            outcome = call_with_timeout(lambda: (coordinator.poll(), coordinator.unhealthy_peers()),
                                        self.timeouts.stop_store_timeout, "asking the store about a termination")
            if outcome.ok:
                stop, peers = outcome.value
            else:
                log.warning("rank %d: %s; using what the stop watcher knew", self._rank, outcome.problem)
                stop, peers = (watcher.request, dict(watcher.unhealthy)) if watcher is not None else (None, {})
            if termination is None and stop is not None:
                termination = self._begin(stop.signum, monotonic(), f"stop requested by rank {stop.rank}")
            if termination is not None and termination.stop is None:
                termination.stop = stop
        if termination is None:  # an ordinary failure: not ours to handle
            self._finish()
            return
        step = trainer.global_step
        if self._world_size > 1 and self._handed_over(trainer, termination, step, peers):
            return  # the strategy re-forms (or this rank leaves) as the verdict says
        where = (f"{type(exception).__name__} during the termination (unhealthy peers: {peers or 'none'}); "
                 f"saving from the last completed step {step}")
        assert self._executor is not None  # made in setup(), before any termination
        code, _ = self._executor.decide_and_execute(trainer, termination, step, where, mid_step=True)
        self._finish(trainer, exiting=True)
        # Lightning re-raises the original exception (exit status 1); make the status ours.
        plan_exit(destroy_process_group=True, force_code=code)
        termination.watchdog.arm(monotonic() + self.timeouts.exit_timeout)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        termination = self._termination
        if termination is not None:
            log.warning("rank %d: training finished at step %d before the agreed stop (%s); nothing to save",
                        self._rank, trainer.global_step, termination.stop)
            termination.watchdog.disarm()
        self._finish()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._finish()


def propose_margin(margin_steps: int, world_size: int) -> int:
    """Steps between the proposing boundary and the proposed stop step.

    Any margin >= 1 keeps the agreement exact: the proposer holds before the stop step until every
    rank confirmed it (decide_at_boundary). A margin of 1 stops soonest: the hold before step+1
    lasts until the peers' watchers read the request -- a few store round trips, as they block in a
    store wait that the proposal ends. Checks run only at optimizer-step boundaries (global_step
    changed), so ranks never stop inside an accumulation window, where the accumulated gradients
    would be lost. A larger margin gives the confirmations time to arrive while training goes on, at
    the price of one step of the grace period per unit. A single process has nobody to wait for and
    stops at its first boundary.
    """
    return margin_steps if world_size > 1 else 0


def wait_for_confirmations(coordinator: StoreStopCoordinator | LocalStopCoordinator, timeout: float,
                           stop: StopRequest) -> tuple[dict[int, list[str]], str | None]:
    """Wait (bounded) until every rank confirmed ``stop``: ``(unhealthy peers, None)`` when they did
    or a peer left unhealthy meanwhile, ``({}, problem)`` when the confirmations did not come."""

    def _wait() -> tuple[bool, dict[int, list[str]]]:
        confirmed = coordinator.wait_until_all_confirmed(timeout)
        return confirmed, coordinator.unhealthy_peers()

    started = monotonic()
    # the outer bound is a little longer: the inner wait returns False by itself when the
    # store answers but a rank did not confirm
    outcome = call_with_timeout(_wait, timeout + 0.5, "waiting for every rank to confirm the stop step")
    if outcome.problem is not None:
        return {}, outcome.problem
    confirmed, unhealthy = outcome.value
    if unhealthy:
        return unhealthy, None
    if not confirmed:
        return {}, f"not every rank confirmed the stop step within {timeout:g} s"
    log.info("rank %d: every rank confirmed the stop after step %d (waited %.0f ms)", coordinator.rank, stop.step,
             (monotonic() - started) * 1000)
    return {}, None


def _validate_signals(signals: Sequence[int]) -> tuple[signal.Signals, ...]:
    try:
        values = tuple(signal.Signals(s) for s in signals)
    except (TypeError, ValueError):
        raise ValueError(f"GracefulTermination: `signals` must be signal numbers, got {signals!r}") from None
    _require(bool(values), "signals", "at least one signal", signals)
    bad = [s.name for s in values if s in (signal.SIGKILL, signal.SIGSTOP)]
    _require(not bad, "signals", "catchable signals (not SIGKILL/SIGSTOP)", signals)
    return values


def _require(ok: bool, name: str, expected: str, value: Any) -> None:
    require(ok, name, expected, value, prefix=_PREFIX)


__all__ = ["GracefulTermination"]


def carry_signal(callback: GracefulTermination, received: tuple[int, float]) -> None:
    """A signal that came while the round's group formed (held, see ``HeldSignals``): ``callback``
    acts on it as its listener installs, like one carried from a round before."""
    if callback._carried_signal is None:
        callback._carried_signal = received
