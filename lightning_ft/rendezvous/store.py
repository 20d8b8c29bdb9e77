"""Where the rendezvous store is: the endpoint (parsed once) and hosting or reaching the TCPStore."""

from __future__ import annotations

import datetime
import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from lightning_ft.rendezvous.settings import RendezvousConfigError

log = logging.getLogger(__name__)

#: as torchrun's c10d backend
DEFAULT_PORT = 29400
#: bound on one store request once connected (a request, not a wait: waits poll in slices).
#: A healthy store answers in milliseconds; one that takes this long is frozen or gone, and
#: the participant acts on that (a spare leaves, a survivor gives up) instead of hanging.
STORE_OP_TIMEOUT = 30.0


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
    after it starts; each lookup runs in a helper thread so that a resolver that hangs (no
    network, a dead DNS server) cannot stretch the wait past ``timeout``. On failure a
    RendezvousConnectionError says what could not be resolved (c10d alone retried
    unresolvable names with IPv6 warnings past its own timeout).
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        answer: dict[str, object] = {}

        def lookup() -> None:
            try:
                answer["address"] = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
            except (OSError, UnicodeError) as exc:
                answer["error"] = exc

        worker = threading.Thread(target=lookup, name="lightning_ft-resolve", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if "address" in answer:
            return str(answer["address"])
        last_error = answer.get("error", last_error)  # type: ignore[assignment]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = f"{type(last_error).__name__}: {last_error}" if last_error else "the lookup did not return"
            raise RendezvousConnectionError(
                f"cannot resolve the rendezvous host {host!r} within {timeout:g}s ({why}); check --rdzv-endpoint "
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


def connect_store(endpoint: Endpoint, is_host: bool | None, connect_timeout: float,
                  op_timeout: float = STORE_OP_TIMEOUT) -> tuple[dist.Store, bool]:
    """Host the TCPStore at the endpoint, or connect to whoever hosts it.

    ``is_host=None`` (the default) hosts when the port can be bound here and connects
    otherwise, like torch's c10d backend: the first agent to bind the endpoint hosts.
    Returns the store and whether this process hosts it.
    """
    deadline = time.monotonic() + connect_timeout
    host, port = resolve_host(endpoint.host, connect_timeout), endpoint.port
    timeout = datetime.timedelta(seconds=op_timeout)
    if is_host is not False:
        try:
            store = host_store(host, port, timeout)
            log.info("hosting the rendezvous store at %s", endpoint)
            return store, True
        except (RuntimeError, OSError) as exc:
            if is_host:
                raise RendezvousConnectionError(
                    f"is_host=true but the rendezvous store cannot listen on {endpoint}: {exc}") from exc
            log.debug("not hosting the store at %s (%s); connecting as a client", endpoint, exc)
    remaining = max(1.0, deadline - time.monotonic())
    # in a thread of its own: a frozen store host's kernel still accepts the connection, and
    # the client then waits for the handshake's answer without limit
    connecting: Future = Future()

    def _connect() -> None:
        try:
            connecting.set_result(dist.TCPStore(host, port, is_master=False,
                                                timeout=datetime.timedelta(seconds=remaining)))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            connecting.set_exception(exc)

    threading.Thread(target=_connect, name="lightning_ft-store-connect", daemon=True).start()
    try:
        # torch's own connect retries end after ``remaining``; the margin is for a loaded machine
        store = connecting.result(timeout=remaining + 5.0)
    except TimeoutError:
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {endpoint} within connect_timeout={connect_timeout}s: "
            f"no answer (its host is frozen or overloaded, or the connection hangs)") from None
    except (RuntimeError, OSError) as exc:
        # the first line only: torch appends its C++ stack to the message
        detail = (str(exc).strip().splitlines() or [""])[0]
        raise RendezvousConnectionError(
            f"cannot reach the rendezvous store at {endpoint} within connect_timeout={connect_timeout}s "
            f"(--rdzv-endpoint); is the store host running? ({type(exc).__name__}: {detail})") from None
    store.set_timeout(timeout)
    return store, False


class StoreUnresponsiveError(RuntimeError):
    """A store call did not return within its bound: the store (or its host) is frozen or gone."""


class BoundedStore:
    """A TCPStore client whose calls return -- or raise StoreUnresponsiveError -- within ``bound``
    seconds.

    A TCPStore client waits for an answer without limit when the server is frozen (its host
    SIGSTOPped, a dead machine whose connection is still open): its timeout covers waiting
    for a key, not a server that never answers. Every call here runs on one worker thread of
    this client and is waited for at most ``bound``; a stuck call keeps the worker (later
    calls queue behind it and time out too) until the store answers or the process ends.
    ``raw`` is the plain client, for torch's own use (``PrefixStore`` for a process group).
    """

    _METHODS = ("set", "get", "add", "compare_set", "check", "multi_get", "multi_set", "delete_key",
                "num_keys", "wait")

    def __init__(self, store: Any, bound: float) -> None:
        self.raw = store
        self.bound = bound
        self._stuck: Future | None = None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name="lightning_ft-store-client", daemon=True)
        self._worker.start()

    def _serve(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def _call(self, name: str, *args: Any) -> Any:
        stuck = self._stuck
        if stuck is not None and not stuck.done():
            # a call already waited out its bound and still has no answer: later calls would
            # only queue behind it, so they fail at once instead of adding bound after bound
            raise StoreUnresponsiveError(f"the rendezvous store did not answer {name}(): an earlier call has "
                                         f"had no answer for more than {self.bound:g}s (frozen or gone)")
        future: Future = Future()
        self._calls.put((future, getattr(self.raw, name), args))
        try:
            return future.result(timeout=self.bound)
        except TimeoutError:
            if not future.cancel():
                self._stuck = future
            raise StoreUnresponsiveError(f"the rendezvous store did not answer {name}() within {self.bound:g}s "
                                         "(frozen or gone)") from None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in BoundedStore._METHODS:
            return lambda *args: self._call(name, *args)
        return getattr(self.raw, name)

    def clone(self, bound: float | None = None) -> "BoundedStore":
        """Another connection to the same store (torch's ``TCPStore.clone``), bounded alike or by ``bound``."""
        return BoundedStore(self._call("clone"), self.bound if bound is None else bound)


def raw_store(store: Any) -> Any:
    """The plain torch Store behind ``store`` (for torch APIs that need a c10d Store)."""
    return store.raw if isinstance(store, BoundedStore) else store
