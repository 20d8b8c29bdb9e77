"""Signal handling that only records: the handler stores (signal, time) and returns.

Everything else happens in a watcher thread. Python runs signal handlers in the main
thread between bytecodes, so a main thread blocked in C++ (a collective, a long
backward) would delay them indefinitely. The watcher therefore also listens on the
interpreter's signal wakeup fd, which the C-level handler writes to the moment the
signal arrives; when another component already owns that fd (asyncio), the watcher
falls back to polling the recorded flag.
"""

from __future__ import annotations

import logging
import select
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from lightning_ft._clock import monotonic
from lightning_ft.deadlines import BackgroundThread
from lightning_ft.settings.timeouts import DEFAULT_TIMEOUTS

log = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.1
_STOP_SENTINEL = b"\x00"  # signal 0 does not exist, so this byte can never be a real signal
#: what ``signal.getsignal`` returns and ``signal.signal`` takes
SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalListener:
    """Installs recording handlers for ``signals`` and calls ``on_signal(signum, t)`` from a thread.

    ``t`` is the :func:`time.monotonic` time the signal was first seen. ``on_signal`` runs
    at most once per listener, never inside the signal handler.
    """

    def __init__(self, signals: Sequence[int], on_signal: Callable[[int, float], None]) -> None:
        self.signals = [signal.Signals(s) for s in signals]
        self._on_signal = on_signal
        self._recorded: tuple[int, float] | None = None  # written only by the handler
        self._first: tuple[int, float] | None = None
        self._first_lock = threading.Lock()
        self._previous: dict[int, SignalHandler] = {}
        self._previous_wakeup_fd = -1
        self._owns_wakeup_fd = False
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._watcher = _Watcher(self._watch)
        self.installed = False

    # -- the handler: records and returns, nothing else (no locks, no I/O, no collectives)
    def _handler(self, signum: int, frame: object) -> None:
        if self._recorded is None:
            self._recorded = (signum, monotonic())
        elif signum == signal.SIGINT:  # Ctrl-C again: the user wants out now, not at the agreed step
            signal.default_int_handler(signum, frame)  # type: ignore[arg-type]

    @property
    def received(self) -> tuple[int, float] | None:
        """(signum, monotonic time) of the first signal, as seen by the handler or the watcher."""
        return self._first or self._recorded

    def install(self) -> bool:
        """Install the handlers (main thread only). Returns False when that is impossible."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.warning("signal handlers can only be installed from the main thread; %s will not be handled",
                        ", ".join(s.name for s in self.signals))
            return False
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        try:
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
            self._owns_wakeup_fd = True
            if self._previous_wakeup_fd != -1:  # someone else (asyncio) relies on it: give it back, poll instead
                signal.set_wakeup_fd(self._previous_wakeup_fd)
                self._owns_wakeup_fd = False
        except (ValueError, OSError):
            self._owns_wakeup_fd = False
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)
        self._watcher.start()
        self.installed = True
        return True

    def uninstall(self, restore: dict[int, SignalHandler] | None = None) -> None:
        """Put back handlers (``restore[signum]`` if given, else what ``install`` replaced)."""
        if not self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("cannot restore signal handlers outside the main thread")
            return
        for signum in self.signals:
            target = (restore or {}).get(signum)
            if target is None:
                target = self._previous.get(signum, signal.SIG_DFL)
            if signal.getsignal(signum) == self._handler:
                signal.signal(signum, target)
        if self._owns_wakeup_fd:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._owns_wakeup_fd = False
        self._watcher.stopping.set()
        assert self._writer is not None  # install() made it
        try:
            self._writer.send(_STOP_SENTINEL)
        except OSError:
            pass
        self._watcher.stop(join=True)
        for sock in (self._reader, self._writer):
            if sock is not None:
                sock.close()
        self._reader = self._writer = None
        self.installed = False

    def _watch(self) -> None:
        reader = self._reader
        assert reader is not None  # install() made it before it started this thread
        wanted = {int(s) for s in self.signals}
        # Owning the wakeup fd, every signal and the stop sentinel arrive on the socket: block
        # on it (a thread that wakes 10 times a second competes with training for the GIL and
        # the CPU). Without it, the recorded flag must be polled.
        timeout = None if self._owns_wakeup_fd else _POLL_INTERVAL_S
        while not self._watcher.stopping.is_set():
            try:
                ready, _, _ = select.select([reader], [], [], timeout)
            except (OSError, ValueError):  # socket closed under us during uninstall
                return
            now = monotonic()
            if ready:
                try:
                    data = reader.recv(256)
                except (BlockingIOError, OSError):
                    data = b""
                for byte in data:
                    if byte in wanted:
                        self._note(byte, now)
            recorded = self._recorded
            if recorded is not None:
                self._note(*recorded)

    def _note(self, signum: int, when: float) -> None:
        with self._first_lock:
            if self._first is not None:
                return
            recorded = self._recorded  # the handler may have run first and seen it earlier
            if recorded is not None and recorded[1] < when:
                signum, when = recorded
            self._first = (signum, when)
        if self._watcher.stopping.is_set():
            return
        try:
            self._on_signal(signum, when)
        except Exception:  # the watcher must survive a failing callback
            log.exception("handling signal %s failed", signum)


class _Watcher(BackgroundThread):
    """The listener's thread: runs ``watch`` until :attr:`stopping` (which the listener wakes)."""

    def __init__(self, watch: Callable[[], None]) -> None:
        super().__init__("lightning-ft-signal-watcher", join_timeout=DEFAULT_TIMEOUTS.thread_stop_timeout)
        self._watch = watch

    def run(self) -> None:
        self._watch()


class HeldSignals:
    """Signals held while a round's process group forms, before the SIGTERM path's listener of
    that round is installed: recorded, not acted on. With the default action a SIGTERM there
    killed the process (-15: nothing saved, no 81). :meth:`release` puts the handlers back and
    returns what came, ``(signum, monotonic time)``, for the listener to act on when it installs.
    A second Ctrl-C while held interrupts at once, as everywhere else."""

    def __init__(self, signals: Sequence[int]) -> None:
        self.signals = [signal.Signals(s) for s in signals]
        self.received: tuple[int, float] | None = None
        self._previous: dict[int, SignalHandler] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = (signum, monotonic())
        elif signum == signal.SIGINT:
            signal.default_int_handler(signum, frame)

    def hold(self) -> bool:
        """Install the recording handlers (main thread only; False where that is impossible)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._record)
        return True

    def release(self) -> tuple[int, float] | None:
        """Put back the handlers :meth:`hold` replaced; returns the first signal held, if any."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._record:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        return self.received
