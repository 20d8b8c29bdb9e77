"""Reaching a store of the fail-over: bounded connects that say at once what they found.

A store connection of a fail-over participant (see :mod:`.switchboard`) is made in short
attempts, each after a plain-socket ping (:func:`~lightning_ft.store.tcp.store_ping`), so that
torch's client, which retries and logs a C++ backtrace per failed try, is only ever pointed at
something that answered as a store or said nothing yet:

* *refused*: nothing listens there any more -- its host is gone (:class:`StoreUnreachableError`);
* *closes new connections at once* (or answers as no store does): the store cannot take another
  connection -- at its file-descriptor limit, say, held there by idle connections of another
  user (:class:`StoreClosesConnectionsError`). If it still answers on the connections it has, it
  is no lost store and no successor takes it over: :class:`StoreRefusesConnectionsError`, a
  decided end (:func:`refuses_connections`);
* *silent* or a store: torch's client tries, for at most :data:`_CONNECT_ATTEMPT` at a time.
"""

from __future__ import annotations

import datetime
import functools
import socket
import threading
import time

import torch.distributed as dist

from lightning_ft._clock import monotonic
from lightning_ft._torch import connect_quietly
from lightning_ft.deadlines import Abandon, BoundedStore, StoreUnresponsiveError, call_with_timeout, connect_exit_bound
from lightning_ft.exit_codes import JobCannotGoOn
from lightning_ft.store.tcp import Endpoint, store_ping

#: how long one attempt of torch's client at connecting to a store that served already may take.
#: Short: torch retries inside one attempt, which then lasts up to 2.5x this
#: (deadlines.connect_exit_bound), and an attempt still under way when the process exits holds
#: its exit that long (one that returned during finalization would abort it)
_CONNECT_ATTEMPT = 1.0
#: store connections this process makes at once (see connect)
_CONNECTING = threading.BoundedSemaphore(4)
#: how long to wait before asking a store that closed a new connection again
_CLOSED_RETRY = 0.2


class StoreLostError(RuntimeError):
    """The rendezvous store is lost and no successor could take over; the message says why."""


class StoreUnreachableError(StoreLostError):
    """A new connection to the store of the current epoch failed (its host may be gone too): a
    fail-over may still find the store (a lost store as far as this connection can tell)."""


class StoreClosesConnectionsError(StoreUnreachableError):
    """The store's port accepted new connections and closed them at once (or answered as no store
    does) until the connect's bound: the message names the store and what it did."""


class StoreRefusesConnectionsError(StoreLostError, JobCannotGoOn):
    """The store answers on the connections it has but accepts no new one: it is not lost, so no
    successor takes it over, and nothing can go on that needs a new connection. A decided end of
    the job (NO_RESTART, 83), with the message naming the store."""


def is_lost_store_error(exc: BaseException) -> bool:
    """A store call failed as a lost store makes it fail (not a timeout of a ``wait`` for a key)."""
    return isinstance(exc, (StoreUnresponsiveError, StoreUnreachableError, dist.DistNetworkError, ConnectionError))


def refuses_connections(failure: StoreUnreachableError, moved: bool) -> bool:
    """After a failed connect and the fail-over it asked for: True when that is the end -- the store
    closes new connections and the fail-over did not move (the store answers on the connections it
    has: it is not lost). A failure of any other kind, or one after which the store moved, is
    tried again."""
    return isinstance(failure, StoreClosesConnectionsError) and not moved


def connect(endpoint: Endpoint, bound: float, timeout: float, probe_timeout: float, store_timeout: float,
            inline: bool = False, abandon: Abandon | None = None) -> BoundedStore:
    """A client of ``endpoint`` (a store that served already) whose calls are bounded by ``bound``,
    reached within ``timeout`` (see the module for what ends it sooner). A few connects at a time
    per process: after a fail-over every connection of the process reconnects at once, and torch's
    client connects in a burst time out together (measured: 300 at once in one process, a third
    got through within 10 s)."""
    if not _CONNECTING.acquire(timeout=timeout):
        raise StoreUnreachableError(f"cannot reach the rendezvous store at {endpoint}: no connection slot "
                                    f"within {timeout:g}s")
    try:
        return _connect(endpoint, bound, timeout, probe_timeout, store_timeout, inline, abandon)
    finally:
        _CONNECTING.release()


def _connect(endpoint: Endpoint, bound: float, timeout: float, probe_timeout: float, store_timeout: float,
             inline: bool, abandon: Abandon | None) -> BoundedStore:
    # torch's client retries a refused connection until its timeout (it waits for a store that
    # is still starting); every endpoint here served already, so a refusal means its host is
    # gone: say so now. A store that dies while a client connects would leave torch retrying
    # for the whole timeout (and a call under way holds the process's exit as long): so it
    # connects in short attempts, each after that check.
    deadline = monotonic() + timeout
    while True:
        found = store_ping(endpoint.host, endpoint.port, probe_timeout)
        if found == "refused":
            raise StoreUnreachableError(f"cannot reach the rendezvous store at {endpoint}: connection refused")
        abandoned = abandon is not None and abandon.is_set()
        if found.startswith("foreign"):
            if monotonic() >= deadline or abandoned:
                raise StoreClosesConnectionsError(
                    f"the rendezvous store at {endpoint} accepts no new connections (file-descriptor limit?): "
                    f"for {timeout:g}s a new connection was not served ({found.partition(': ')[2]})")
            time.sleep(_CLOSED_RETRY)
            continue
        attempt = max(0.5, min(_CONNECT_ATTEMPT, deadline - monotonic()))
        connecting = call_with_timeout(
            functools.partial(connect_quietly, functools.partial(
                dist.TCPStore, endpoint.host, endpoint.port, is_master=False,
                timeout=datetime.timedelta(seconds=attempt))),
            attempt + 1.0, f"connecting to the rendezvous store at {endpoint}", store_call=True,
            abandon=abandon, exit_bound=connect_exit_bound(attempt))
        if connecting.ok:
            break
        if monotonic() >= deadline or (abandon is not None and abandon.is_set()):
            raise StoreUnreachableError(f"cannot reach the rendezvous store at {endpoint} within {timeout:g}s: "
                                        f"{connecting.problem}")
    store = connecting.value
    store.set_timeout(datetime.timedelta(seconds=bound if inline else store_timeout))
    return BoundedStore(store, bound, inline=inline)


def refuses(endpoint: Endpoint, timeout: float) -> bool:
    """True when ``endpoint`` refuses a TCP connection: nothing listens there any more."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # silent, unreachable: not proven gone
        return False
