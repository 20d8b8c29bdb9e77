"""Where this job's rendezvous store is: the one home of that question.

A job is launched with one endpoint or a short list of them (``LIGHTNING_FT_ENDPOINT=h1:p,h2:p``:
e.g. the first hosts of SLURM's node list, or the first pods of a Kubernetes headless service).
The first is where a fresh job hosts its store. The store's *places* are each listed endpoint and
its next ports (:data:`SPREAD`). When the store's host is lost, the participant that takes the
store over serves it at the first place it can bind on its own host (the lost endpoint itself,
when the successor shares its host or the host was restarted; the next port, when a frozen host
still holds it), else at the port it announced (:mod:`lightning_ft.failover.switchboard`), and
writes which run and epoch it serves. A node started later with the same launch settings -- a
replacement, a requeued node, a pod restarted in place -- asks every place and joins the store of
the highest epoch, instead of hosting a second store (and a second job of the same run id) at the
first endpoint, or joining a stale one that a thawed store host still serves there.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous.api import RendezvousError

from lightning_ft._clock import monotonic
from lightning_ft._torch import store_ping
from lightning_ft.deadlines import BoundedStore, first_line
from lightning_ft.schema.run import decode_number
from lightning_ft.schema.signing import SealedStore, Signer
from lightning_ft.settings import Timeouts
from lightning_ft.settings.fields import RendezvousConfigError
from lightning_ft.store.tcp import DEFAULT_PORT, Endpoint, connect_store, listen_on, parse_endpoint

log = logging.getLogger(__name__)

#: more would make every newcomer's look-up and every fail-over's bind attempts longer for nothing:
#: the store moves to the first listed endpoint a live participant can bind
MAX_ENDPOINTS = 16
#: a successor serves at a listed endpoint's port or one of the next ``SPREAD - 1``: a store host
#: that was frozen (and thawed since) still holds the listed port itself, serving a stale store
SPREAD = 4
#: how long a place other than the first endpoint may take to answer a newcomer's ping
PLACE_PING_TIMEOUT = 0.5
#: how long a restarted node (``rejoin``) looks for its running job's store before it concludes that
#: there is none: a fail-over that is under way opens the successor within a few seconds
REJOIN_PATIENCE = 10.0
_REJOIN_POLL = 0.5
#: how often a successor tries again to bind a listed endpoint that a dying store host still holds
_REBIND_EVERY = 0.02


@dataclass(frozen=True)
class JobEndpoints:
    """The endpoints a job was launched with, in order (the first: where a fresh job hosts its store)."""

    endpoints: tuple[Endpoint, ...]

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("a job needs at least one rendezvous endpoint")

    @classmethod
    def of(cls, where: Endpoint | JobEndpoints | Sequence[Endpoint]) -> JobEndpoints:
        if isinstance(where, JobEndpoints):
            return where
        if isinstance(where, Endpoint):
            return cls((where,))
        return cls(tuple(where))

    @property
    def first(self) -> Endpoint:
        return self.endpoints[0]

    @property
    def host(self) -> str:
        return self.first.host

    @property
    def port(self) -> int:
        return self.first.port

    def places(self) -> tuple[Endpoint, ...]:
        """Where this job's store may serve, in order of preference: each listed endpoint, then the
        next ports of each (:data:`SPREAD`)."""
        return tuple(Endpoint(e.host, e.port + j) for j in range(SPREAD) for e in self.endpoints
                     if e.port + j < 65536)

    def names(self) -> frozenset[str]:
        """Every place as ``host:port`` (a successor serving at one is followed: the job itself
        named it, not a value read from the wire)."""
        return frozenset(str(e) for e in self.places())

    def __str__(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    def answering(self) -> list[Endpoint]:
        """The places where a rendezvous store answers, in order. Asked one after the other: a place
        where nothing listens refuses at once (the common case: a few microseconds each, no thread
        per place at every participant's start); one that accepts and says nothing (a frozen store
        host) is given :data:`PLACE_PING_TIMEOUT`, the first endpoint the ping's own bound."""
        return [e for e in self.places()
                if _ping(e, None if e == self.first else PLACE_PING_TIMEOUT) == "store"]

    def bind_here(self, patience: float = 0.0, probe_timeout: float = 0.2) -> tuple[Endpoint, socket.socket] | None:
        """A listening socket on the first place this process can take: its host is an
        address of this machine and nothing listens there (a store host that died released it).
        None when there is none. A frozen store host still holds its port (it accepts and never
        answers), so this never takes a store over from a process that could come back; a killed
        one releases its port a moment after its connections closed (its descriptors are closed one
        by one as it ends), so a port still held by a holder that does not answer silently is tried
        again for up to ``patience`` seconds."""
        for endpoint in self.places():
            deadline = monotonic() + patience
            while True:
                try:
                    return endpoint, listen_on(_numeric(endpoint.host), endpoint.port)
                except OSError as exc:
                    log.debug("cannot serve the store at the job's endpoint %s here: %s", endpoint, first_line(exc))
                    if exc.errno != errno.EADDRINUSE or monotonic() >= deadline or \
                            _ping(endpoint, probe_timeout) in ("silent", "store"):
                        break
                    time.sleep(_REBIND_EVERY)
        return None


def parse_endpoints(text: str, default_port: int = DEFAULT_PORT) -> JobEndpoints:
    """``host[:port][,host[:port]...]`` -> :class:`JobEndpoints` (duplicates dropped, order kept);
    a clear error (``RendezvousConfigError``) names what is malformed."""
    parsed: list[Endpoint] = []
    for part in text.split(","):
        endpoint = parse_endpoint(part, default_port)
        if endpoint not in parsed:
            parsed.append(endpoint)
    if len(parsed) > MAX_ENDPOINTS:
        raise RendezvousConfigError(f"rendezvous endpoint list {text[:120]!r} names {len(parsed)} endpoints; at most "
                                    f"{MAX_ENDPOINTS} (the first hosts of the job are enough)")
    return JobEndpoints(tuple(parsed))


def _ping(endpoint: Endpoint, timeout: float | None) -> str:
    try:
        return store_ping(endpoint.host, endpoint.port) if timeout is None else \
            store_ping(endpoint.host, endpoint.port, timeout)
    except OSError as exc:  # a name that does not resolve: nothing of this job there
        return f"foreign: {first_line(exc)}"


def _numeric(host: str) -> str:
    """``host`` as an address when it is one; a name is looked up (only a listed name of this
    job's own hosts gets here, during a fail-over)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)[0][4][0])
    except socket.gaierror:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


def locator_key(run_id: str) -> str:
    """Where a store that a fail-over opened says which run and epoch it serves (sealed)."""
    return f"lightning_ft_launch/{run_id}/epoch"


class NoRunningJob(RendezvousError):
    """A restarted node (``rejoin``) found no store of its run at any of the job's places: the job
    it belonged to ended (or was lost whole, which its scheduler handles), and it must not start
    one of its own."""


def connect_job_store(where: Endpoint | JobEndpoints, is_host: bool | None, timeouts: Timeouts,
                      run_id: str = "", signer: Signer | None = None, rejoin: bool = False,
                      patience: float = REJOIN_PATIENCE) -> tuple[BoundedStore, bool, Endpoint]:
    """Reach this job's store wherever it is among its places, or host it at the first listed
    endpoint (``is_host`` as :func:`~lightning_ft.store.tcp.connect_store`): ``(store, hosting, endpoint)``.

    A store that a fail-over opened says so (:func:`locator_key`: this run, its epoch). A newcomer
    joins the store of the highest epoch among those that answer -- the running job's -- rather
    than host a second store at the first endpoint (a second job of the same run id beside the
    live one), or join a stale one that a thawed store host still serves there.

    ``rejoin`` (a node a scheduler restarted while its job runs): only ever join, never host, and
    raise :class:`NoRunningJob` when no store of the run answers within ``patience`` seconds."""
    job = JobEndpoints.of(where)
    if rejoin:
        return _rejoin(job, timeouts, run_id, signer or Signer(None), patience)
    if is_host is not True:
        found = job.answering()
        if found and found != [job.first]:
            best = _newest_store(found, job.first, timeouts, run_id, signer or Signer(None))
            if best is not None:
                store, endpoint, epoch = best
                if endpoint != job.first or epoch > 0:
                    log.info("the job's rendezvous store serves at %s (epoch %d of its fail-overs); joining it there",
                             endpoint, epoch)
                return store, False, endpoint
    store, hosting = connect_store(job.first, is_host, timeouts)
    return store, hosting, job.first


def _rejoin(job: JobEndpoints, timeouts: Timeouts, run_id: str, signer: Signer,
            patience: float) -> tuple[BoundedStore, bool, Endpoint]:
    deadline = monotonic() + patience
    while True:
        found = job.answering()
        best = _newest_store(found, job.first, timeouts, run_id, signer) if found else None
        if best is not None:
            store, endpoint, epoch = best
            log.info("rejoining the running job: its rendezvous store serves at %s (epoch %d of its fail-overs)",
                     endpoint, epoch)
            return store, False, endpoint
        if monotonic() >= deadline:
            raise NoRunningJob(f"no rendezvous store of run {run_id!r} answers at the job's endpoints ({job}, and "
                               f"the next {SPREAD - 1} ports of each) within {patience:g}s: there is no running job "
                               "to rejoin")
        time.sleep(_REJOIN_POLL)


def _newest_store(found: list[Endpoint], first: Endpoint, timeouts: Timeouts, run_id: str,
                  signer: Signer) -> tuple[BoundedStore, Endpoint, int] | None:
    """Of the stores that answer, the one serving this run at the highest fail-over epoch (the
    first endpoint's store counts as epoch 0 without a record; another place only with one)."""
    best: tuple[BoundedStore, Endpoint, int] | None = None
    for endpoint in found:
        try:
            store, _ = connect_store(endpoint, False, timeouts)
            epoch = decode_number(SealedStore(store, signer).get(locator_key(run_id)))
        except Exception as exc:  # noqa: BLE001 - a place that does not answer in time is no candidate
            log.debug("the store at %s did not say which run it serves: %s", endpoint, first_line(exc))
            continue
        if epoch is None and endpoint != first:
            continue  # another job's store, or a program on a neighbouring port
        if best is None or (epoch or 0) > best[2]:
            best = (store, endpoint, epoch or 0)
    return best
