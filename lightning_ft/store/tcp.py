"""Where the rendezvous store is: the endpoint (parsed once) and hosting or reaching the TCPStore."""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from lightning_ft._clock import monotonic
from lightning_ft._torch import tcpstore_ping, tcpstore_pong
from lightning_ft.deadlines import BoundedStore, call_with_timeout, connect_exit_bound, first_line
from lightning_ft.settings import Timeouts
from lightning_ft.settings.fields import RendezvousConfigError

log = logging.getLogger(__name__)

#: as torchrun's c10d backend
DEFAULT_PORT = 29400


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


def host_store(host: str, port: int, timeout: datetime.timedelta, multi_tenant: bool = True) -> dist.TCPStore:
    """Host a TCPStore that listens on ``host`` only (port 0: a free one; ``store.port`` tells)."""
    sock = listen_on(host, port)
    bound_port = sock.getsockname()[1]
    try:
        # the store takes the descriptor over; the Python object must not close it
        return dist.TCPStore(host, bound_port, is_master=True, wait_for_workers=False, timeout=timeout,
                             multi_tenant=multi_tenant, master_listen_fd=sock.detach())
    except BaseException:
        sock.close()
        raise


#: how long a store is given to answer a ping before the endpoint is reported as not answering
STORE_PING_TIMEOUT = 2.0


def store_ping(host: str, port: int, timeout: float = STORE_PING_TIMEOUT) -> str:
    """Whether a rendezvous store answers at ``host:port``, asked with a plain socket before torch
    connects (whose client, pointed at something else, waits out its whole timeout and logs C++
    backtraces meanwhile): "store", "refused" (nothing listens: its host may not be up yet),
    "silent" (it accepted and said nothing: a frozen store host, or another program), or
    "foreign: <what it did>" (it answered, or closed, as no TCPStore does). One overall deadline."""
    nonce = secrets.randbits(32)
    deadline = monotonic() + timeout
    answer = b""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(tcpstore_ping(nonce))
            while len(answer) < 4:
                remaining = deadline - monotonic()
                if remaining <= 0:
                    return "silent"
                sock.settimeout(remaining)
                chunk = sock.recv(64)
                if not chunk:
                    return f"foreign: it closed the connection{' after ' + repr(answer[:16]) if answer else ''}"
                answer += chunk
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "silent"
    except OSError as exc:
        return f"foreign: {type(exc).__name__}: {exc}"
    return "store" if answer == tcpstore_pong(nonce) else f"foreign: it answered {answer[:16]!r}"


def _check_the_endpoint_is_a_store(endpoint: Endpoint, host: str, port: int) -> None:
    """Fail at once when the endpoint is held by something that is not a rendezvous store; say at
    once that it does not answer when it stays silent (then the bounded connect decides)."""
    found = store_ping(host, port)
    if found.startswith("foreign"):
        raise RendezvousConnectionError(
            f"the rendezvous endpoint {endpoint} is held by a program that is not a rendezvous store "
            f"({found.partition(': ')[2]}): another job or service uses port {port}; choose a free port "
            "(--rdzv-endpoint / LIGHTNING_FT_ENDPOINT)")
    if found == "silent":
        log.warning("the rendezvous endpoint %s accepts connections but does not answer as a store within %gs: "
                    "its store host is frozen or overloaded, or another program holds port %d; waiting up to "
                    "connect_timeout for it", endpoint, STORE_PING_TIMEOUT, port)


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
    _check_the_endpoint_is_a_store(endpoint, host, port)
    remaining = max(1.0, deadline - monotonic())
    # bounded: a frozen store host's kernel still accepts the connection, and the client then
    # waits for the handshake's answer without limit. torch's own connect retries end after
    # ``remaining``; the margin is for a loaded machine.
    connecting = call_with_timeout(
        lambda: dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=remaining)),
        remaining + 5.0, f"connecting to the rendezvous store at {endpoint}",
        unanswered="its host is frozen or overloaded, or the connection hangs", store_call=True,
        exit_bound=connect_exit_bound(remaining))
    if not connecting.ok:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {endpoint} within connect_timeout={connect_timeout:g}s "
            f"(--rdzv-endpoint); is the store host running, and is port {port} its? ({connecting.problem})")
    store = connecting.value
    store.set_timeout(timeout)
    return BoundedStore(store, timeouts.store_timeout), False
