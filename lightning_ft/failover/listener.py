"""A participant's presence listener (the protocol: :mod:`lightning_ft.failover.presence`).

It must not become the fault of the fail-over it serves. So it serves every connection at once
on one thread (non-blocking sockets, a poll loop): each connection has ``request_deadline``
(:data:`REQUEST_DEADLINE`, at most half the probe bound) in all to send its request and take
its answer, after which it is dropped; connections are bounded per peer address and in all
(the oldest is dropped for a new one), so idle or trickling clients cannot hold a probe past
its bound. No input ends it: requests are parsed strictly, each connection's trouble is caught
and logged at debug, and a failure of the loop itself is logged at ERROR and the loop
restarted (listening again on the same port if the listening socket broke); if it cannot go
on, it says so at ERROR.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
from typing import Any, Protocol

from lightning_ft._clock import monotonic
from lightning_ft.deadlines import BackgroundThread, first_line
from lightning_ft.failover.presence import MAX_REQUEST, PresenceProof, parse_request
from lightning_ft.settings import Timeouts
from lightning_ft.store.tcp import listen_on

log = logging.getLogger(__name__)

#: how long a connection may take to send its request and take its answer, in all (at most half
#: the probe bound: a probe waits this long at most for a listener busy with other clients)
REQUEST_DEADLINE = 0.2
#: connections served at once from one peer address, and in all: beyond that the oldest is dropped
PER_PEER = 64
MAX_CONNECTIONS = 256
#: connections accepted per turn of the loop before it serves the ones it holds
_ACCEPT_BATCH = 64
#: how often an idle listener wakes to see whether its participant left. Not shorter: thousands
#: of listeners in a process, each woken every second to ask, cost more CPU than the rendezvous
_IDLE_WAKE = 10.0
#: accept errors that say this process is out of descriptors or memory for now, not that the
#: listening socket broke
_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# poll needs no descriptor of its own (epoll does): thousands of listeners may share a process
_Selector: type[selectors.BaseSelector] = getattr(selectors, "PollSelector", selectors.DefaultSelector)


class PresenceOwner(Protocol):
    """What the listener asks of the process's switchboard."""

    participant_id: str
    #: bound to the launch before the listener starts
    proof: PresenceProof

    def presence_status(self) -> tuple[int, str]: ...

    def suspect(self, epoch: int) -> None: ...

    def participating(self) -> bool: ...


class _Connection:
    """One client of the listener: what it sent so far, what is left to send it, its deadline."""

    __slots__ = ("sock", "peer", "deadline", "inbox", "outbox")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.inbox = b""
        self.outbox = b""


class Presence(BackgroundThread):
    """This participant's presence listener (see the module): answers who it is and the store it
    follows (or serves during its own fail-over), and starts a check on ``FAILOVER <epoch>``.
    Every connection at once, each within :attr:`request_deadline`; no input ends it."""

    def __init__(self, owner: PresenceOwner, host: str, timeouts: Timeouts) -> None:
        super().__init__("lightning_ft-presence", timeouts.thread_stop_timeout)
        self.owner = owner
        self.host = host
        self.request_deadline = min(REQUEST_DEADLINE, timeouts.probe_timeout / 2)
        self._sock = self._listen(0)
        self.port: int = self._sock.getsockname()[1]
        self.endpoint = f"{host}:{self.port}"
        #: the loop's failures so far (each logged at ERROR, the loop restarted)
        self.failures = 0
        #: in order of arrival, so the first has the nearest deadline
        self._connections: dict[int, _Connection] = {}
        self._per_peer: dict[str, int] = {}
        self._selector: selectors.BaseSelector | None = None

    def _listen(self, port: int) -> socket.socket:
        sock = listen_on(self.host, port)
        sock.setblocking(False)
        return sock

    # ----------------------------------------------------------------- the thread

    def run(self) -> None:
        """Serve until stopped or the participant left. A failure of the loop itself is logged at
        ERROR and the loop restarted, on a new socket of the same port if the listening one broke;
        if it cannot go on, it says so at ERROR (the others then count this participant as gone)."""
        ended = False
        try:
            while not ended and not self.stopping.is_set():
                try:
                    ended = self._serve()
                except Exception:  # the listener must outlive anything (logged with its traceback)
                    self.failures += 1
                    log.error("the presence listener at %s failed (%d time(s)); restarting it", self.endpoint,
                              self.failures, exc_info=True)
                    # backs off from a failure that repeats at once, without holding a probe long
                    if self.stopping.wait(min(1.0, 0.01 * self.failures)):
                        return
                    ended = not self._listening() and not self._listen_again()
        finally:
            if not self.stopping.is_set() and self._owner_participating():
                log.error("the presence listener at %s ended: the other participants now count this one as "
                          "gone or silent in a store fail-over", self.endpoint)

    def _owner_participating(self) -> bool:
        """The owner's participating(), False when even that fails."""
        try:
            return self.owner.participating()
        except Exception:  # noqa: BLE001 - asked while saying why the listener ended
            return False

    def _listening(self) -> bool:
        try:
            return self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        except OSError:
            return False

    def _listen_again(self) -> bool:
        """A new listening socket on the same port (its endpoint is published): True once it listens."""
        self._sock.close()  # frees the port for the new one
        try:
            self._sock = self._listen(self.port)
        except OSError as exc:
            log.error("the presence listener at %s cannot listen again: %s", self.endpoint, first_line(exc))
            return False
        log.error("the presence listener at %s listens again", self.endpoint)
        return True

    def _serve(self) -> bool:
        """The loop: True when it ended as it should (stopped, or the participant left)."""
        with _Selector() as selector:
            self._selector = selector
            selector.register(self._sock, selectors.EVENT_READ)
            try:
                while not self.stopping.is_set():
                    if not self.owner.participating():
                        self._sock.close()  # left the rendezvous: refused from now on, i.e. gone for the others
                        return True
                    for key, _ in selector.select(self._wait()):
                        if key.data is None:
                            if not self._accept_pending():
                                return True
                        else:
                            self._serve_connection(key.data)
                    self._drop_expired()
                return True
            finally:
                for conn in list(self._connections.values()):
                    self._drop(conn)
                self._selector = None

    def _wait(self) -> float:
        """Until the nearest deadline of a connection (the first: they arrive in deadline order)."""
        for conn in self._connections.values():
            return max(0.0, conn.deadline - monotonic())
        return _IDLE_WAKE

    def _accept_pending(self) -> bool:
        """Take the connections waiting to be accepted (a batch); False once stopped."""
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if self.stopping.is_set():
                    return False
                if exc.errno not in _RESOURCES:
                    raise  # the listening socket broke: run() restarts it
                log.debug("presence listener at %s: %s; dropping the oldest connection", self.endpoint, exc)
                if self._connections:
                    self._drop(next(iter(self._connections.values())))
                else:
                    self.stopping.wait(0.01)  # the pending one stays queued: not a busy loop meanwhile
                return True
            self._admit(sock, address)
        return True

    def _admit(self, sock: socket.socket, address: Any) -> None:
        peer = str(address[0]) if isinstance(address, tuple) and address else str(address)
        conn = _Connection(sock, peer, monotonic() + self.request_deadline)
        try:
            sock.setblocking(False)
            assert self._selector is not None  # admitted only while the loop runs
            self._selector.register(sock, selectors.EVENT_READ, conn)
        except Exception as exc:  # noqa: BLE001 - one connection's trouble never ends the listener
            log.debug("presence listener at %s: could not take a connection from %s: %s", self.endpoint, peer, exc)
            sock.close()
            return
        self._connections[sock.fileno()] = conn
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        # the oldest goes: a probe's request comes at once, a client that holds a slot does not
        if self._per_peer[peer] > PER_PEER:
            self._drop(next(c for c in self._connections.values() if c.peer == peer))
        if len(self._connections) > MAX_CONNECTIONS:
            self._drop(next(iter(self._connections.values())))
        if conn.sock.fileno() in self._connections:
            self._serve_connection(conn)  # its request is usually here already

    def _serve_connection(self, conn: _Connection) -> None:
        if self._connections.get(conn.sock.fileno()) is not conn:
            return  # dropped earlier in this turn (an event of the same poll)
        try:
            if conn.outbox:
                self._send(conn)
            else:
                self._receive(conn)
        except Exception as exc:  # noqa: BLE001 - one connection's trouble never ends the listener
            log.debug("presence listener at %s: dropped a connection from %s: %s", self.endpoint, conn.peer,
                      first_line(exc) or type(exc).__name__)
            self._drop(conn)

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(MAX_REQUEST - len(conn.inbox))
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self._drop(conn)
            return
        conn.inbox += data
        line, newline, _ = conn.inbox.partition(b"\n")
        if not newline and len(conn.inbox) < MAX_REQUEST:
            return  # more to come, within the deadline
        request = parse_request(line) if newline else None
        if request is None:
            log.debug("presence listener at %s: no answer to %r... from %s", self.endpoint, conn.inbox[:40],
                      conn.peer)
            self._drop(conn)
            return
        epoch, store = self.owner.presence_status()
        conn.outbox = self.owner.proof.answer(self.owner.participant_id, epoch, store, request.nonce)
        assert self._selector is not None  # served only while the loop runs
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)
        if request.epoch is not None:
            self.owner.suspect(request.epoch)  # after the answer: the prober is waiting for it

    def _send(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            self._drop(conn)  # answered

    def _drop_expired(self) -> None:
        now = monotonic()
        for conn in list(self._connections.values()):
            if conn.deadline > now:
                break
            log.debug("presence listener at %s: dropped a connection from %s: not done within %.2fs",
                      self.endpoint, conn.peer, self.request_deadline)
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        fd = conn.sock.fileno()
        if self._connections.get(fd) is conn:
            del self._connections[fd]
            left = self._per_peer.pop(conn.peer, 1) - 1
            if left > 0:
                self._per_peer[conn.peer] = left
            if self._selector is not None:
                try:
                    self._selector.unregister(conn.sock)
                except (KeyError, ValueError):
                    pass  # never registered
        conn.sock.close()

    def stop(self, join: bool = True) -> None:
        """Close the listener: from now on connecting is refused (this participant is gone)."""
        self.stopping.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the loop
        except OSError:
            pass  # not listening (any more)
        super().stop(join)
        self._sock.close()
