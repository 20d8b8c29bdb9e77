"""Where the rendezvous store is: the endpoint (parsed once) and hosting or reaching the TCPStore."""

from __future__ import annotations

import datetime
import logging
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from lightning_ft._clock import monotonic
from lightning_ft._torch import STORE_PING_TIMEOUT as STORE_PING_TIMEOUT  # re-exported: the endpoint's ping
from lightning_ft._torch import connect_quietly
from lightning_ft._torch import store_ping as store_ping
from lightning_ft.deadlines import BoundedStore, call_with_timeout, connect_exit_bound, first_line
from lightning_ft.settings import Timeouts
from lightning_ft.settings.fields import RendezvousConfigError

log = logging.getLogger(__name__)

#: as torchrun's c10d backend
DEFAULT_PORT = 29400
#: how often an endpoint that refuses connections is asked again while its store host starts
_REFUSED_POLL = 0.1
#: how long an endpoint that accepts connections and answers nothing may stay silent before a
#: participant that has not reached its store yet gives up (83): a store host frozen that long
#: as the job starts is rarer than a port another program holds
SILENT_ENDPOINT_PATIENCE = 6.0
#: the first store request on a new connection must be answered within this: a program that
#: answers the ping (an echo) but is no store ends the start in seconds, not after store_timeout
FIRST_ANSWER_TIMEOUT = 5.0


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT) -> Endpoint:
    """Split ``host[:port]``; a clear error names ``--rdzv-endpoint`` when it is malformed."""
    if not endpoint or not endpoint.strip():
        raise RendezvousConfigError("rendezvous endpoint is empty; pass --rdzv-endpoint=HOST:PORT")
    host, sep, port_text = endpoint.strip().rpartition(":")
    if not sep:
        host, port_text = endpoint.strip(), str(default_port)
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise RendezvousConfigError(f"rendezvous endpoint {endpoint!r}: port {port_text!r} is not a number "
                                    "(--rdzv-endpoint=HOST:PORT)") from None
    if not 0 < port < 65536 or not host:
        raise RendezvousConfigError(f"rendezvous endpoint {endpoint!r} needs a host and a port in "
                                    "1..65535 (--rdzv-endpoint=HOST:PORT)")
    return Endpoint(host, port)


def resolve_host(host: str, timeout: float, retry_every: float = 1.0) -> str:
    """The address of ``host`` (its first ``getaddrinfo`` answer), retrying until ``timeout``.

    Name lookups are retried because a scheduler's DNS often knows a new node only seconds
    after it starts; each lookup is a bounded call, so a resolver that hangs (no network, a
    dead DNS server) cannot stretch the wait past ``timeout``. On failure a
    RendezvousConnectionError says what could not be resolved (c10d alone retried
    unresolvable names with IPv6 warnings past its own timeout).
    """
    deadline = monotonic() + timeout
    problem = "the lookup did not return"
    while True:
        answer = call_with_timeout(lambda: socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0],
                                   max(0.0, deadline - monotonic()), f"looking up {host!r}",
                                   unanswered="the resolver does not answer")
        if answer.ok:
            return str(answer.value)
        problem = answer.problem or problem
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise RendezvousConnectionError(
                f"cannot resolve the rendezvous host {host!r} within {timeout:g}s ({problem}); check --rdzv-endpoint "
                "/ LIGHTNING_FT_ENDPOINT")
        time.sleep(min(retry_every, remaining))


def listen_on(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` (its address, not every interface) and ``port``.

    TCPStore alone listens on every interface whatever host it is given; handing it this
    socket (``master_listen_fd``) makes "``--host 127.0.0.1``" mean loopback only.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_port(host: str) -> socket.socket:
    """A TCP socket bound to a free port of ``host`` and not listening: the port is this process's
    (connecting to it is refused) until :func:`host_store` serves a store on it.

    Without ``SO_REUSEADDR`` on purpose: no other socket, of any process, can bind the port while
    this one holds it (Linux lets two sockets share a port only when both set it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, timeout: datetime.timedelta, multi_tenant: bool = True,
               reserved: socket.socket | None = None) -> dist.TCPStore:
    """Host a TCPStore that listens on ``host`` only (port 0: a free one; ``store.port`` tells), or
    on ``reserved`` (a socket of :func:`reserve_port`; ``host`` and ``port`` are then its own)."""
    if reserved is not None:
        sock = reserved
        sock.listen(512)
    else:
        sock = listen_on(host, port)
    bound_port = sock.getsockname()[1]
    try:
        # the store takes the descriptor over; the Python object must not close it
        return dist.TCPStore(host, bound_port, is_master=True, wait_for_workers=False, timeout=timeout,
                             multi_tenant=multi_tenant, master_listen_fd=sock.detach())
    except BaseException:
        sock.close()
        raise


def _wait_for_a_store(endpoint: Endpoint, host: str, port: int, deadline: float) -> None:
    """Before torch connects: wait while nothing listens at the endpoint (its host may still be
    starting; torch's own retries would log a C++ backtrace each), fail at once when something
    that is no rendezvous store holds it, and say at once when it stays silent (then the
    bounded connect decides)."""
    while (found := store_ping(host, port)) == "refused" and monotonic() < deadline:
        time.sleep(_REFUSED_POLL)
    if found == "refused":
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {endpoint} within connect_timeout: nothing listens there "
            "(connections refused); is the store host running? (--rdzv-endpoint / LIGHTNING_FT_ENDPOINT)")
    if found.startswith("foreign"):
        raise RendezvousConnectionError(
            f"the rendezvous endpoint {endpoint} is held by a program that is not a rendezvous store "
            f"({found.partition(': ')[2]}): another job or service uses port {port}; choose a free port "
            "(--rdzv-endpoint / LIGHTNING_FT_ENDPOINT)")
    if found == "silent":
        patience = min(SILENT_ENDPOINT_PATIENCE, max(0.0, deadline - monotonic()))
        log.warning("the rendezvous endpoint %s accepts connections but does not answer as a store within %gs: "
                    "its store host is frozen or overloaded, or another program holds port %d; waiting up to "
                    "%gs more for it", endpoint, STORE_PING_TIMEOUT, port, patience)
        silent_until = monotonic() + patience
        while found == "silent" and monotonic() < silent_until:
            found = store_ping(host, port, max(0.1, min(STORE_PING_TIMEOUT, silent_until - monotonic())))
        if found != "store":
            raise RendezvousConnectionError(
                f"the rendezvous endpoint {endpoint} accepts connections but has answered nothing as a store for "
                f"{STORE_PING_TIMEOUT + patience:.0f}s ({found}): another program holds port {port}, or the store "
                "host is frozen; choose a free port (--rdzv-endpoint / LIGHTNING_FT_ENDPOINT)")


def connect_store(endpoint: Endpoint, is_host: bool | None, timeouts: Timeouts) -> tuple[BoundedStore, bool]:
    """Host the TCPStore at the endpoint, or connect to whoever hosts it; every call on the
    returned store is bounded by ``timeouts.store_timeout`` (:class:`~lightning_ft.deadlines.BoundedStore`).

    ``is_host=None`` (the default) hosts when the port can be bound here and connects
    otherwise, like torch's c10d backend: the first agent to bind the endpoint hosts.
    Returns the store and whether this process hosts it. Reaching it is bounded by
    ``timeouts.connect_timeout``.
    """
    connect_timeout = timeouts.connect_timeout
    deadline = monotonic() + connect_timeout
    host, port = resolve_host(endpoint.host, connect_timeout), endpoint.port
    timeout = datetime.timedelta(seconds=timeouts.store_timeout)
    if is_host is not False:
        try:
            store = host_store(host, port, timeout)
            log.info("hosting the rendezvous store at %s", endpoint)
            return BoundedStore(store, timeouts.store_timeout), True
        except (RuntimeError, OSError) as exc:
            if is_host:
                raise RendezvousConnectionError(
                    f"is_host=true but the rendezvous store cannot listen on {endpoint}: {first_line(exc)}") from None
            log.debug("not hosting the store at %s (%s); connecting as a client", endpoint, first_line(exc))
    _wait_for_a_store(endpoint, host, port, deadline)
    remaining = max(1.0, deadline - monotonic())
    # bounded: a frozen store host's kernel still accepts the connection, and the client then
    # waits for the handshake's answer without limit. torch's own connect retries end after
    # ``remaining``; the margin is for a loaded machine.
    connecting = call_with_timeout(
        lambda: connect_quietly(
            lambda: dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=remaining))),
        remaining + 5.0, f"connecting to the rendezvous store at {endpoint}",
        unanswered="its host is frozen or overloaded, or the connection hangs", store_call=True,
        exit_bound=connect_exit_bound(remaining))
    if not connecting.ok:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {endpoint} within connect_timeout={connect_timeout:g}s "
            f"(--rdzv-endpoint); is the store host running, and is port {port} its? ({connecting.problem})")
    store = connecting.value
    _first_answer(store, endpoint, min(timeouts.store_timeout, FIRST_ANSWER_TIMEOUT))
    store.set_timeout(timeout)
    return BoundedStore(store, timeouts.store_timeout), False


def _first_answer(store: dist.TCPStore, endpoint: Endpoint, seconds: float) -> None:
    """One request that any TCPStore answers at once, under a short timeout of the client's own
    (no call is left waiting in torch): an endpoint that answered the ping but is no store (a
    program that echoes bytes) is named now, in one line, instead of after store_timeout."""
    store.set_timeout(datetime.timedelta(seconds=seconds))
    # bounded here too: torch's check() does not honour the client's timeout (a store host that
    # froze after the ping would hold the training thread)
    answered = call_with_timeout(lambda: store.check(["lightning_ft/first-answer"]), seconds,
                                 f"the first store request to {endpoint}", store_call=True,
                                 exit_bound=connect_exit_bound(seconds))
    if not answered.ok:
        raise RendezvousConnectionError(
            f"the rendezvous endpoint {endpoint} answered the ping but not a store request within {seconds:g}s "
            f"({answered.problem}): another program holds port {endpoint.port}, or the store host is frozen or "
            "overloaded; choose a free port (--rdzv-endpoint / LIGHTNING_FT_ENDPOINT)")
