"""Process lifetime: bounded waits, forced exits, and what happens at interpreter exit.

Neutral ground for every component (no Lightning import, no torch import at module load):

* :class:`ExitWatchdog` -- the one deadline thread: force ``os._exit(code)`` if the process
  is still alive at a deadline (a teardown stuck on a broken group, a barrier in another
  callback, a user thread).
* :func:`exit_now` -- flush what can be flushed and leave at once.
* :func:`destroy_process_group` -- the one place that destroys the default group.
* :func:`install_exit_hook` / :func:`plan_exit` -- at interpreter exit, destroy the default
  group (Lightning never does for gloo, whose threads alive at exit abort about 1 run in
  15) and, where a termination decided it, force the exit code.

Importing this module has no side effect; components that need the exit hook call
:func:`install_exit_hook` when they are constructed (see there for why then).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import NoReturn

from lightning_ft._clock import monotonic
from lightning_ft.deadlines import call_with_timeout
from lightning_ft.settings.timeouts import DEFAULT_TIMEOUTS

log = logging.getLogger(__name__)


def flush_output(timeout_s: float = DEFAULT_TIMEOUTS.flush_timeout) -> None:
    """Flush stdio and logging handlers, giving up after ``timeout_s`` (a stalled pipe must not block an exit)."""

    def _flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream must not stop the exit
                pass
        loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                           if isinstance(lg, logging.Logger)]
        for logger in loggers:
            for handler in logger.handlers:
                try:
                    handler.flush()
                except Exception:  # noqa: BLE001 - neither must a failing handler
                    pass

    call_with_timeout(_flush, timeout_s, "flushing output")


#: what must finish before this process leaves, however it leaves (the node's other ``devices=N``
#: processes: a scheduler ends a task's leftovers once the task's first process is gone); each
#: is called with the seconds it may take
_BEFORE_LEAVING: list[Callable[[float], None]] = []
#: how long those waits may take at interpreter exit, and in :func:`exit_now` -- which must leave
#: at once (a deadline's watchdog, an unhealthy node's exit): only what is nearly done is waited for
BEFORE_LEAVING_AT_EXIT_SECONDS = 120.0
BEFORE_LEAVING_EXIT_NOW_SECONDS = 5.0


def before_leaving(wait: Callable[[float], None]) -> None:
    """Run ``wait(seconds)`` before the process leaves: at interpreter exit and in :func:`exit_now`
    alike (with a shorter bound there)."""
    _BEFORE_LEAVING.append(wait)
    install_exit_hook()


def _run_before_leaving(seconds: float) -> None:
    while _BEFORE_LEAVING:
        wait = _BEFORE_LEAVING.pop()
        try:
            wait(seconds)
        except Exception:
            log.exception("lightning_ft: a wait before exit failed")


def die_with_parent(parent_pid: int) -> None:
    """Linux: have this process SIGKILLed when ``parent_pid`` (its parent) ends -- a node's
    ``devices=N`` processes share its fate, as they would if the node died. The parent waits for
    its children before it leaves (:func:`before_leaving`), so an ordinary exit never cuts one
    short. Elsewhere (no ``prctl``) nothing happens."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # it ended before the request above: leave as it would have made us
        os.kill(os.getpid(), signal.SIGKILL)


def exit_now(code: int) -> NoReturn:
    """Flush what can be flushed and leave immediately (no atexit, no finalizers).

    ``os._exit`` also skips C++ static destructors, so gloo's abort-at-exit (which needs
    interpreter finalization) cannot happen on this path and the process group need not
    be destroyed first. What :func:`before_leaving` registered runs first.
    """
    _run_before_leaving(BEFORE_LEAVING_EXIT_NOW_SECONDS)
    flush_output()
    os._exit(int(code))


class ExitWatchdog:
    """Forces ``os._exit(code_fn())`` if the process is still alive at the deadline.

    The deadline can only move earlier; :meth:`disarm` cancels it for good. Daemon threads
    keep running through ``atexit`` and while the interpreter waits for non-daemon
    threads, which are the places a "finished" process can still hang.
    """

    def __init__(self, code_fn: Callable[[], int], what: str) -> None:
        self._code_fn = code_fn
        self._what = what
        self._deadline: float | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._disarmed = False

    @classmethod
    def within(cls, seconds: float, code: int, what: str) -> ExitWatchdog:
        """A watchdog armed to exit with ``code`` unless disarmed within ``seconds``."""
        watchdog = cls(lambda: code, what)
        watchdog.arm(monotonic() + seconds)
        return watchdog

    def arm(self, deadline: float) -> None:
        with self._cond:
            if self._disarmed:
                return
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lightning-ft-exit-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def disarm(self) -> None:
        with self._cond:
            self._disarmed = True
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._disarmed:
                assert self._deadline is not None  # arm() set it before it started this thread; never unset
                remaining = self._deadline - monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if self._disarmed:
                return
        code = self._code_fn()
        log.error("%s: still not done at its deadline; forcing exit %d now", self._what, code)
        exit_now(code)


def destroy_process_group() -> None:
    """Destroy the default process group if there is one; never raises."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            log.debug("destroyed the default process group")
    except Exception as exc:  # noqa: BLE001 - a broken group may refuse; exiting matters more
        log.debug("destroying the process group failed: %s: %s", type(exc).__name__, exc)


# --- configuration errors ----------------------------------------------------------------
_config_error_types: tuple[type[BaseException], ...] = ()


def end_uncaught_configuration_errors(kinds: tuple[type[BaseException], ...], code: int) -> None:
    """An uncaught exception of ``kinds`` (a bad setting, raised while the Trainer builds the
    strategy) ends the program with ``code`` and one line on stderr instead of a 20-30 line
    traceback through Lightning's constructors and exit code 1: what a scheduler and a user read
    is what is wrong. Any other exception reaches the previous hook (idempotent; an interactive
    shell, which shows exceptions itself, is unaffected)."""
    global _config_error_types
    if _config_error_types:
        _config_error_types = tuple(dict.fromkeys((*_config_error_types, *kinds)))
        return
    _config_error_types = kinds
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        # an interactive session (python -i, the plain REPL) shows the error and goes on
        if not isinstance(error, _config_error_types) or hasattr(sys, "ps1") or sys.flags.interactive:
            previous(kind, error, trace)
            return
        print(f"lightning_ft: configuration error ({code}): {error}", file=sys.stderr, flush=True)
        exit_now(code)

    sys.excepthook = hook


# --- at interpreter exit ----------------------------------------------------------------
@dataclass
class _ExitPlan:
    destroy_process_group: bool = False
    force_code: int | None = None
    quick_teardown: bool = False


_exit_plan = _ExitPlan()
_hook_installed = False


def install_exit_hook() -> None:
    """Register the interpreter-exit handler (idempotent).

    Called when a strategy or termination callback is constructed, i.e. before the training
    run registers its own handlers (loggers that start during fit). ``atexit`` runs
    handlers last-in first-out, so ours runs after theirs -- which matters when it forces
    the exit code with ``os._exit``, skipping whatever would run after it.
    """
    global _hook_installed
    if not _hook_installed:
        atexit.register(_at_exit)
        _hook_installed = True


def plan_exit(*, destroy_process_group: bool = True, force_code: int | None = None,
              quick_teardown: bool = False) -> None:
    """At interpreter exit: destroy the default process group; optionally force the exit code.

    ``force_code`` is for exits that Lightning reports as an ordinary exception (a peer
    vanished during a termination): the traceback is printed as usual, then the process
    exits with the decided code instead of 1.

    ``quick_teardown``: collect the garbage once, then freeze every object still alive, so
    the interpreter's own finalization does not traverse them again. A process that imported
    torch and Lightning holds ~300,000 objects the cyclic GC tracks, and finalization
    collects several times while it clears the modules: 0.4-1.5 s of a 0.5-1.7 s exit here,
    after the process already told everyone what they need (see
    ``benchmarks/bench_exit.py``). What is lost is only what Python never promises: objects
    still alive at exit that sit in reference cycles are not finalized (everything that is
    garbage at this point is, and refcounted objects are freed as usual).
    """
    install_exit_hook()
    if destroy_process_group:
        _exit_plan.destroy_process_group = True
    if force_code is not None:
        _exit_plan.force_code = int(force_code)
    if quick_teardown:
        _exit_plan.quick_teardown = True


def planned_exit_code() -> int | None:
    """The exit code :func:`plan_exit` forced for interpreter exit, or None."""
    return _exit_plan.force_code


def _at_exit() -> None:
    _run_before_leaving(BEFORE_LEAVING_AT_EXIT_SECONDS)
    if _exit_plan.destroy_process_group:
        destroy_process_group()
    if _exit_plan.force_code is not None:
        exit_now(_exit_plan.force_code)
    if _exit_plan.quick_teardown:
        import gc

        gc.collect()  # finalizers of today's garbage run (files flushed), as finalization would run them
        gc.freeze()  # what is alive now is not traversed again by finalization's collections
