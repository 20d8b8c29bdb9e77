"""The one way lightning_ft bounds a wait, and the one shape of its background threads.

* :class:`BoundedWorker` -- a daemon thread that runs calls in order, each waited for at most
  its bound. A call that overruns keeps running (Python cannot interrupt it) and its late
  answer is dropped; while it is stuck, later calls on that worker fail at once instead of
  queueing bound after bound.
* :func:`call_with_timeout` -- one call on a worker of its own: the value, or why there is none.
* :class:`BoundedStore` -- a ``torch.distributed`` Store client whose every call goes through a
  worker: a frozen store (its host SIGSTOPped, a dead machine whose connection stays open)
  answers nothing, and a TCPStore client would wait for it without limit. Every store
  connection lightning_ft opens is one of these. At interpreter exit no call on one starts
  any more, and the calls in flight are waited for (:func:`close_store_calls`).
* :class:`BackgroundThread` -- start, stop and a bounded join for the project's daemon threads.
* :class:`ServiceThread` -- the thread object under both: its ``stop()`` ends this process's
  part in its job and then the thread, for code that stops leftover daemon threads (Lightning's
  own tests do).

Bounds come from :class:`lightning_ft.settings.Timeouts`. No Lightning, no torch import here.
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from lightning_ft._clock import monotonic
from lightning_ft._torch import connect_quietly, store_ping

log = logging.getLogger(__name__)


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, shortened (torch appends C++ stacks to its errors)."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:limit]


class DeadlineExceeded(RuntimeError):
    """A bounded call did not return in time (or an earlier call on its worker still has not)."""


class StoreUnresponsiveError(DeadlineExceeded):
    """A store call did not return within its bound: the store (or its host) is frozen or gone."""


class StoreRefusedError(RuntimeError):
    """A new connection to the store was refused: nothing listens at its endpoint any more (a
    ``RuntimeError`` like the ``DistNetworkError`` torch's own connect would raise)."""


class InterpreterExitingError(RuntimeError):
    """A store call asked for after the interpreter began to exit (see :func:`close_store_calls`)."""


class _ExitGate:
    """Calls that must not be running while the interpreter finalizes: the store calls.

    Why: on Python < 3.14 a daemon thread that comes back from a C++ call after finalization
    began is ended with ``pthread_exit`` inside pybind11's ``~gil_scoped_release``, a noexcept
    destructor: the forced unwind calls ``std::terminate`` and the whole process aborts
    ("terminate called without an active exception", SIGABRT) -- whatever exit code it was
    about to return. A store call does come back, with the store's answer or its error, and
    one made by a background thread (a heartbeat's last beat) can still be on its way when the
    main thread, which has nothing left to ask the store, reaches the end of the interpreter.
    atexit handlers run before finalization, while every thread still runs; :meth:`close` is one.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: call -> (the monotonic time its caller stops waiting, the caller's thread name)
        self._in_flight: dict[int, tuple[float, str]] = {}
        self._next = 0
        self._closed = False
        self._hooked = False

    def hook(self) -> None:
        """Close the gate at interpreter exit (registered once, when the first store client is made:
        atexit runs handlers last-in first-out, so those registered later -- which may still use
        the store -- run before it)."""
        with self._cond:
            if self._hooked:
                return
            self._hooked = True
        atexit.register(self.close)

    def enter(self, deadline: float, caller: str) -> int | None:
        """Admit a call whose caller waits until ``deadline``; None once the gate is closed."""
        with self._cond:
            if self._closed:
                return None
            self._next += 1
            self._in_flight[self._next] = (deadline, caller)
            return self._next

    def leave(self, call: int) -> None:
        with self._cond:
            del self._in_flight[call]
            self._cond.notify_all()

    def close(self) -> int:
        """Admit no call from now on, and wait until every call in flight returned or its caller's
        bound ended (a call stuck past its bound is not waited for). Returns how many are left."""
        start = monotonic()
        with self._cond:
            self._closed = True
            callers = sorted({caller for _, caller in self._in_flight.values()})
            told = False
            while self._in_flight:
                remaining = max(deadline for deadline, _ in self._in_flight.values()) - monotonic()
                if remaining <= 0:
                    break
                if not told and monotonic() - start >= 1.0:  # say why the exit takes this long
                    told = True
                    log.warning("interpreter exit: waiting up to %.0f s more for %d store call(s) under way (%s): "
                                "one that returned after the interpreter is gone would abort the process",
                                remaining, len(self._in_flight),
                                ", ".join(sorted({caller for _, caller in self._in_flight.values()})))
                self._cond.wait(remaining if told else min(remaining, max(0.0, start + 1.0 - monotonic())))
            left = sorted(caller for _, caller in self._in_flight.values())
        if left:
            # an answer that comes during finalization aborts the process (see above)
            log.warning("interpreter exit: %d store call(s) of %s still without an answer after their bound "
                        "(the store is frozen or gone)", len(left), ", ".join(left))
        elif callers:
            log.debug("interpreter exit: waited %.3fs for store calls in flight of %s", monotonic() - start,
                      ", ".join(callers))
        return len(left)


_STORE_CALLS = _ExitGate()


def close_store_calls() -> int:
    """Start no store call any more and wait (bounded) for those in flight; returns how many are left.

    Runs by itself at interpreter exit (an atexit handler, registered with the first
    :class:`BoundedStore`); a later call on any ``BoundedStore`` raises
    :class:`InterpreterExitingError`. Each call in flight is waited for until it returns or its
    own bound ends -- no longer than its caller would have waited.
    """
    return _STORE_CALLS.close()


class Abandon:
    """Set once to abandon every call that waits under it (e.g. its store was replaced by a
    fail-over): the callers wake at once, with no polling while they wait."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._is_set = False
        self._waiters: set[threading.Event] = set()

    def is_set(self) -> bool:
        return self._is_set

    def set(self) -> None:
        with self._lock:
            self._is_set = True
            waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            waiter.set()

    def watch(self, waiter: threading.Event) -> None:
        """Set ``waiter`` when this is set (at once if it is already)."""
        with self._lock:
            if not self._is_set:
                self._waiters.add(waiter)
                return
        waiter.set()

    def unwatch(self, waiter: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(waiter)


#: what a :meth:`ServiceThread.stop` does first (the runtime registers: end this process's
#: sessions, as interpreter exit does)
_STOP_HOOKS: list[Callable[[], None]] = []


def on_service_thread_stop(hook: Callable[[], None]) -> None:
    """Run ``hook`` first whenever someone stops one of our threads from outside (once each)."""
    if hook not in _STOP_HOOKS:
        _STOP_HOOKS.append(hook)


class ServiceThread(threading.Thread):
    """A daemon thread of lightning_ft that outside code can end: :meth:`stop`.

    A process's threads of ours serve its job until interpreter exit (a script's later stage may
    need them). Code that stops the daemon threads a piece of work left behind -- Lightning's test
    fixtures call ``stop()`` on each and then require it dead -- gets what interpreter exit does:
    the job ends for this process (the hooks), this thread's own loop ends (``stop``), and the
    call returns once the thread is gone (within ``join_timeout``).
    """

    def __init__(self, target: Callable[..., Any], name: str, args: tuple = (),
                 stop: Callable[[], None] | None = None, join_timeout: float = 5.0) -> None:
        super().__init__(target=target, name=name, args=args, daemon=True)
        self._stop_loop = stop
        self.join_timeout = join_timeout

    def stop(self) -> None:
        """End this process's part in the job, then this thread; returns once it ended."""
        for hook in list(_STOP_HOOKS):
            hook()
        if self._stop_loop is not None:
            self._stop_loop()
        if self is not threading.current_thread() and self.ident is not None:
            self.join(self.join_timeout)


def _serve(calls_queue: queue.SimpleQueue, gate: _ExitGate | None, calls: int | None) -> None:
    """A :class:`BoundedWorker`'s thread: run the calls in order (``calls``: how many before it ends;
    None, until the worker is gone)."""
    while calls is None or calls > 0:
        item = calls_queue.get()
        if item is None:
            return
        future, fn, deadline, caller = item
        if calls is not None:
            calls -= 1
        if not future.set_running_or_notify_cancel():
            continue
        admitted = None
        if gate is not None:
            admitted = gate.enter(deadline, caller)
            if admitted is None:
                future.set_exception(InterpreterExitingError("the interpreter is exiting: no store call starts"))
                continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)
        finally:
            if gate is not None and admitted is not None:
                gate.leave(admitted)


class BoundedWorker:
    """Runs calls one after another on a daemon thread; each caller waits at most its bound.

    ``exit_gate``: admit each call through it (store calls: see :class:`_ExitGate`).
    """

    def __init__(self, name: str, calls: int | None = None, exit_gate: _ExitGate | None = None) -> None:
        #: (future, fn, when its caller stops waiting, the caller's thread name); None ends the thread
        self._calls: queue.SimpleQueue[tuple[Future, Callable[[], Any], float, str] | None] = queue.SimpleQueue()
        self._stuck: Future | None = None
        # the thread holds the queue and the gate, not this object: once nobody holds the worker
        # (its store connection was dropped), the finalizer ends the thread instead of leaving it
        # idle for the life of the process
        calls_queue = self._calls
        self._thread = ServiceThread(_serve, name, args=(calls_queue, exit_gate, calls),
                                     stop=lambda: calls_queue.put(None))
        self._thread.start()
        weakref.finalize(self, self._calls.put, None)

    def call(self, fn: Callable[[], Any], bound: float, what: str,
             error: type[DeadlineExceeded] = DeadlineExceeded, abandon: Abandon | None = None,
             exit_bound: float | None = None) -> Any:
        """``fn()``'s value (or its exception) if it returns within ``bound`` seconds, else ``error``
        (``what`` says what got no answer, e.g. "the store did not answer get()"). ``abandon``:
        once set, stop waiting at once (e.g. the store was replaced). ``exit_bound``: how long the
        exit gate waits for this call at interpreter exit (default ``bound``; a store ``wait``
        that may last an hour is waited for only as long as a call)."""
        stuck = self._stuck
        if stuck is not None and not stuck.done():
            raise error(f"{what}: an earlier call has had no answer for more than {bound:g}s (frozen or gone)")
        if abandon is not None and abandon.is_set():  # replaced before it started: do not start it
            raise error(f"{what}: abandoned, the store was replaced before it started")
        future: Future = Future()
        now = monotonic()
        deadline = now + bound
        # one wait for whichever comes first -- the answer, the abandon, the deadline -- instead of
        # waking every few tenths to ask: thousands of waiting callers in a process each woken ten
        # times a second cost more CPU than their calls (measured at 1,024 participants)
        woken = threading.Event()
        future.add_done_callback(lambda _done: woken.set())
        self._calls.put((future, fn, now + (bound if exit_bound is None else exit_bound),
                         threading.current_thread().name))
        if abandon is not None:
            abandon.watch(woken)
        try:
            woken.wait(max(0.0, deadline - monotonic()))  # signal handlers run while it waits
        finally:
            if abandon is not None:
                abandon.unwatch(woken)
        if future.done():
            return future.result()
        gave_up = abandon is not None and abandon.is_set()
        if not future.cancel():
            self._stuck = future
        if gave_up:
            raise error(f"{what}: abandoned, the store was replaced while it waited") from None
        raise error(f"{what} within {bound:g}s (frozen or gone)") from None


def connect_exit_bound(timeout: float) -> float:
    """How long a torch store client's constructor given ``timeout`` may really take: it retries
    a refused or failed connect after a random back-off, and the last try starts with a full
    timeout of its own (measured: 1 s -> up to 1.95 s, 5 s -> 10.5 s, 10 s -> 23.9 s). The exit gate
    waits that long for a connect under way: one that returns during finalization aborts."""
    return 2.5 * timeout + 1.0


class BoundedCall:
    """The outcome of :func:`call_with_timeout`: ``value`` if it returned in time, else ``problem``."""

    __slots__ = ("value", "problem")

    def __init__(self, value: Any = None, problem: str | None = None) -> None:
        self.value = value
        self.problem = problem

    @property
    def ok(self) -> bool:
        return self.problem is None


def call_with_timeout(fn: Callable[[], Any], timeout_s: float, what: str,
                      unanswered: str = "the store does not answer", log_problem: bool = False,
                      store_call: bool = False, abandon: Abandon | None = None,
                      exit_bound: float | None = None) -> BoundedCall:
    """Run ``fn`` on a worker of its own and wait at most ``timeout_s`` for its value.

    ``problem`` says what went wrong, in words fit for a log line and a decision's reasons
    (``unanswered`` is the remark on a call that did not return in time); ``log_problem``
    also logs it as a warning (for callers that only need to know whether it worked).
    ``store_call``: ``fn`` talks to a torch store (e.g. connects a client): it passes the exit
    gate of store calls (see :class:`_ExitGate`). ``abandon``: once set, stop waiting at once.
    ``exit_bound``: how long the exit gate waits for it (default ``timeout_s``).
    """
    gate = None
    if store_call:  # like every store call: none starts once the interpreter exits, and exit waits
        _STORE_CALLS.hook()  # (up to ``exit_bound``) for one under way -- a torch store call that
        gate = _STORE_CALLS  # returns during finalization aborts the process
    try:
        outcome = BoundedCall(BoundedWorker("lightning-ft-bounded", calls=1, exit_gate=gate).call(
            fn, timeout_s, what, abandon=abandon, exit_bound=exit_bound))
    except DeadlineExceeded as exc:
        outcome = BoundedCall(problem=str(exc) if abandon is not None and abandon.is_set() else
                              f"{what} did not finish within {timeout_s:g} s ({unanswered})")
    except Exception as exc:  # noqa: BLE001 - reported to the caller, which decides
        outcome = BoundedCall(problem=f"{what} failed: {type(exc).__name__}: {first_line(exc, 200)}")
    if log_problem and not outcome.ok:
        log.warning("%s", outcome.problem)
    return outcome


#: A ``torch.distributed.Store`` client, or a :class:`BoundedStore` in front of one (which forwards
#: the same calls through ``__getattr__``). ``Any``: no type states both, and torch's stub of
#: ``Store`` lacks ``multi_set`` and says ``str`` for values its binding takes as ``bytes`` too.
StoreClient = Any


class BoundedStore:
    """A Store client whose calls return -- or raise StoreUnresponsiveError -- within ``bound`` seconds.

    Every call runs on this client's :class:`BoundedWorker` (a TCPStore client is used from one
    thread at a time); ``raw`` is the plain client, for torch's own use (``PrefixStore`` for a
    process group, which must not outlive a bound of ours).
    """

    _METHODS = ("set", "get", "add", "compare_set", "check", "multi_get", "multi_set", "delete_key",
                "num_keys", "wait", "list_keys", "append")

    def __init__(self, store: Any, bound: float, inline: bool = False) -> None:
        self.raw = store
        self.bound = bound
        #: calls run on the caller's thread, bounded by the client's own socket timeout: for a
        #: background thread that may block (a heartbeat), where a hand-off to the worker per call
        #: cost ~6x the call's CPU on a busy machine. A fail-over shuts down a replaced store's
        #: connections, so such a call stuck on it returns then.
        self.inline = inline
        #: set when a fail-over replaced this store: its calls waiting then give up at once
        self.abandon: Abandon | None = None
        _STORE_CALLS.hook()
        self._worker = None if inline else BoundedWorker("lightning_ft-store-client", exit_gate=_STORE_CALLS)

    def _call(self, name: str, *args: Any, exit_bound: float | None = None) -> Any:
        method = getattr(self.raw, name)
        if name == "clone":  # a new client connects: its failure is ours to say (see connect_quietly)
            method = functools.partial(connect_quietly, method)
        exit_bound = self.bound if exit_bound is None else exit_bound
        if self._worker is None:
            admitted = _STORE_CALLS.enter(monotonic() + exit_bound, threading.current_thread().name)
            if admitted is None:
                raise InterpreterExitingError("the interpreter is exiting: no store call starts")
            try:
                return method(*args)
            finally:
                _STORE_CALLS.leave(admitted)
        bound = self.bound
        if name == "wait" and len(args) > 1:  # a wait with a timeout of its own is bounded by it, plus ours
            bound += args[1].total_seconds()
        return self._worker.call(lambda: method(*args), bound, f"the rendezvous store did not answer {name}()",
                                 StoreUnresponsiveError, self.abandon, exit_bound=exit_bound)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in BoundedStore._METHODS:
            return lambda *args: self._call(name, *args)
        return getattr(self.raw, name)

    def clone(self, bound: float | None = None, inline: bool = False) -> BoundedStore:
        """Another connection to the same store (torch's ``TCPStore.clone``), bounded alike or by
        ``bound``; ``inline``: its calls run on the caller's thread (see :attr:`inline`)."""
        # torch's clone connects a new client with the store's own timeout and retries, each
        # retry logged with a C++ backtrace when nothing listens any more: asked first, quietly
        host, port = getattr(self.raw, "host", None), getattr(self.raw, "port", None)
        if isinstance(host, str) and isinstance(port, int) and \
                store_ping(host, port, min(self.bound, 2.0)) == "refused":
            raise StoreRefusedError(f"the rendezvous store at {host}:{port} refuses connections (it is gone)")
        timeout = getattr(self.raw, "timeout", None)
        exit_bound = connect_exit_bound(timeout.total_seconds()) if timeout is not None else None
        return BoundedStore(self._call("clone", exit_bound=exit_bound), self.bound if bound is None else bound,
                            inline=inline)


def raw_store(store: Any) -> Any:
    """The plain torch Store behind ``store`` (for torch APIs that need a c10d Store): a
    :class:`BoundedStore`'s, or a fail-over store's current one (anything with a ``raw``)."""
    return getattr(store, "raw", store)


class BackgroundThread:
    """A daemon thread that runs :meth:`run` until :meth:`stop`; the join is bounded.

    Subclasses implement :meth:`run` and wait with ``self.stopping.wait(interval)`` (True once
    stopped), so a stop takes effect within one interval.
    """

    def __init__(self, name: str, join_timeout: float) -> None:
        self.name = name
        self.join_timeout = join_timeout
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread (a no-op while it runs)."""
        if self.alive:
            return
        self.stopping.clear()
        self._thread = ServiceThread(self.run, self.name, stop=self.stopping.set, join_timeout=self.join_timeout)
        self._thread.start()

    def stop(self, join: bool = True) -> None:
        """Ask the thread to end and, with ``join``, wait for it at most ``join_timeout`` (never
        from the thread itself)."""
        self.stopping.set()
        thread = self._thread
        if join and thread is not None and thread is not threading.current_thread():
            thread.join(self.join_timeout)
