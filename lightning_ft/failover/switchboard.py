"""The rendezvous store fails over to a surviving participant.

A TCPStore client is fixed to one host:port, so every holder of a store connection in a
process (rendezvous, heartbeats, watchdog, replicas, the SIGTERM path) gets a
:class:`~.connection.FailoverStore`: one :class:`StoreSwitchboard` per process behind them knows where the
store is now, and all its connections move together.

How a fail-over goes (epoch ``e`` -> ``e + 1``):

1. A store call fails as a lost store does (connection reset or refused, or no answer within
   its bound) and a fresh connection confirms the store is gone (one failed connection is not
   a lost store).
2. Every participant announced, when it joined, a *presence* endpoint (a small listener that
   says whether this process is alive and which store it follows; its kernel refusing a
   connection proves the process gone) and a *successor* endpoint: a port it holds from then on
   (bound, not listening: :func:`~lightning_ft.store.tcp.reserve_port`) where it would serve the
   store. The candidates are the last round's participants, in the order of that round's
   arrivals log -- an order every participant read from the store before it was lost. Each
   participant walks the order: a candidate that is gone is skipped, one that is silent (frozen,
   unreachable) too; the first one alive is the successor and is told so at once.
3. The successor serves a new TCPStore on the port it announced. Participants connect -- only
   ever to an endpoint a candidate announced (:func:`~lightning_ft.failover.rebuild.announced_store`),
   never to one a presence answer or a store names --, check that the store serves the epoch
   (a sealed number under the launch's keys), hand it their *view* (every key they wrote or read
   on the lost store, see :class:`Mirror`) and register. It opens only with a quorum
   (:func:`~lightning_ft.failover.rebuild.may_serve`: a majority of the participants not proven
   gone, one of them active), rebuilds the state from the views
   (:func:`~lightning_ft.failover.rebuild.merge_views`) and marks the epoch open; otherwise it
   writes why it gave up, and everyone raises :class:`StoreLostError` (the truthful exit of a
   lost store).
4. Connections reconnect to the new endpoint on their next call and retry the call once.

A running process group needs no store, so training goes on while this happens; the next
round's process group is built on the new store.

Every fail-over key is under the launch's scope (run id, incarnation, the launch's random id:
:func:`~lightning_ft.schema.failover.failover_scope`), so with a job secret a value sealed for
another job, launch or epoch does not verify. Without a secret nothing is authenticated, and a
participant moves only to a successor computed from what it read while its store lived: the
candidates and the endpoints they announced.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from lightning_ft._clock import monotonic
from lightning_ft.deadlines import Abandon, BoundedStore, first_line
from lightning_ft.failover.listener import Presence
from lightning_ft.failover.presence import PeerStatus, PresenceProof, ask_each, local_address_towards, probe
from lightning_ft.failover.reach import (
    StoreClosesConnectionsError,
    StoreLostError,
    StoreRefusesConnectionsError,
    StoreUnreachableError,
    is_lost_store_error,
    refuses,
)
from lightning_ft.failover.reach import connect as connect_client
from lightning_ft.failover.rebuild import Mirror, announced_store, may_serve, merge_views
from lightning_ft.schema.failover import (
    EpochKeys,
    decode_registration,
    decode_view,
    encode_registration,
    encode_view,
    epoch_key,
    failover_scope,
)
from lightning_ft.schema.run import decode_number, encode_number
from lightning_ft.schema.signing import SealedStore, Signer
from lightning_ft.settings import Timeouts
from lightning_ft.sockets import break_connections_to
from lightning_ft.store.locator import JobEndpoints, locator_key
from lightning_ft.store.tcp import Endpoint, host_store, parse_endpoint, reserve_port

log = logging.getLogger(__name__)

#: how often a participant asks the successor whether it serves yet, and reads whether it opened
_POLL = 0.02
#: how often the successor probes the participants that did not register yet
_PROBE_EVERY = 0.2

__all__ = ["Candidate", "StoreClosesConnectionsError", "StoreLostError", "StoreRefusesConnectionsError",
           "StoreSwitchboard", "StoreUnreachableError", "is_lost_store_error", "probe"]


class Candidate(NamedTuple):
    """A participant that may host the store next, as it announced itself when it joined."""

    participant_id: str
    presence: str
    #: where it would serve the store (the port it holds for that)
    store: str = ""


class StoreSwitchboard:
    """Where this process's rendezvous store is now, and the fail-over that moves it (see the module).

    ``hosting``: this process serves the store of the current epoch. ``active``: this
    participant held a rank in the last round it took part in (its registration says so).
    ``on_switch(hosting)`` callbacks run after a fail-over.
    """

    def __init__(self, endpoint: Endpoint, first: BoundedStore, hosting: bool, participant_id: str,
                 timeouts: Timeouts, signer: Signer, job: JobEndpoints | None = None) -> None:
        self.endpoint = endpoint
        #: where the job was launched to find its store: a successor serves at the first of them it
        #: can bind, so that nodes started later find the job (:mod:`lightning_ft.store.locator`)
        self.job = job if job is not None else JobEndpoints.of(endpoint)
        #: set when the store of that epoch is replaced: calls still waiting on it give up
        self._epoch_ended: dict[int, Abandon] = {}
        self._epoch_lock = threading.Lock()
        self._epoch = 0
        self.hosting = hosting
        self.active = False
        #: the actives of the last round this participant completed (see ``may_serve``)
        self.actives: frozenset[str] = frozenset()
        self.participant_id = participant_id
        self.timeouts = timeouts
        self.signer = signer
        self.mirror = Mirror()
        self.candidates: list[Candidate] = []
        self.on_switch: list[Callable[[bool], None]] = []
        #: False once this participant left the rendezvous: a store lost after that is not taken over
        self.participating: Callable[[], bool] = lambda: True
        self.failovers: list[tuple[int, float, str]] = []  # (epoch, seconds, successor)
        self._lock = threading.Lock()
        self._lost: str | None = None
        self._servers: list[Any] = []  # the stores this process serves (alive as long as it is)
        self._serving: tuple[int, str] | None = None
        self._suspecting = False
        self._probe_store: BoundedStore | None = self._probe_connection(first)
        #: what presence answers prove, and the fail-over keys' scope: bound to the launch by bind_launch
        self.proof = PresenceProof(signer)
        self.scope: str | None = None
        self.run_id = ""
        self.presence = Presence(self, local_address_towards(endpoint), timeouts)
        #: the port this process would serve the store on (announced with its presence); used once
        self._reserved: socket.socket | None = reserve_port(self.presence.host)
        self.successor = f"{self.presence.host}:{self._reserved.getsockname()[1]}"

    def bind_launch(self, run_id: str, incarnation: int, launch_id: str) -> None:
        """Bind presence answers and every fail-over key to this launch (before any candidate is known)."""
        self.proof = PresenceProof(self.signer, run_id, incarnation, launch_id)
        self.scope = failover_scope(run_id, incarnation, launch_id)
        self.run_id = run_id

    # ----------------------------------------------------------------- connections

    def _probe_later(self, store: BoundedStore) -> None:
        """Open the probe connection to a store just moved to on a thread of its own: right after a
        fail-over every connection of the process reconnects, and this one is needed only at the
        next loss."""
        self._probe_store = None

        def open_probe() -> None:
            self._probe_store = self._probe_connection(store)

        threading.Thread(target=open_probe, name="lightning_ft-probe-connection", daemon=True).start()

    def _probe_connection(self, store: BoundedStore) -> BoundedStore | None:
        """A connection of its own for :meth:`_answers`, bounded by a few probe bounds."""
        try:
            return store.clone(4 * self.timeouts.probe_timeout)
        except Exception as exc:  # noqa: BLE001 - without one, a failed call counts as a lost store
            log.debug("no probe connection to the store: %s", first_line(exc))
            return None

    @property
    def epoch(self) -> int:
        """The number of the store fail-overs this process followed (0: the first store)."""
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        with self._epoch_lock:
            self._epoch = epoch
            ended = [self._epoch_ended.pop(e) for e in list(self._epoch_ended) if e != epoch]
        for signal in ended:
            signal.set()

    def epoch_ended(self, epoch: int) -> Abandon:
        """Set once this process no longer follows the store of ``epoch``."""
        with self._epoch_lock:
            signal = self._epoch_ended.setdefault(epoch, Abandon())
            if epoch == self._epoch:
                return signal
            del self._epoch_ended[epoch]
        signal.set()
        return signal

    def connect(self, bound: float, moved: bool = False, inline: bool = False) -> tuple[int, BoundedStore]:
        """A new connection (calls bounded by ``bound``; ``inline``: see ``BoundedStore.inline``) to
        the store of the current epoch; ``moved``: it replaces one to an earlier store (see :meth:`_client`)."""
        epoch, endpoint = self.epoch, self.endpoint
        if self._lost is not None:
            raise StoreLostError(self._lost)
        # a fail-over while it connects replaces that endpoint: stop waiting for it then (the
        # connection's lock would keep every other call of that connection waiting as long)
        return epoch, self._client(endpoint, bound, quick=moved, inline=inline, abandon=self.epoch_ended(epoch))

    def _client(self, endpoint: Endpoint, bound: float, quick: bool = False,
                within: float | None = None, inline: bool = False, abandon: Abandon | None = None) -> BoundedStore:
        """A client of ``endpoint`` whose calls are bounded by ``bound`` (:func:`~.reach.connect`);
        reaching it is bounded by ``within`` (default: the call bound, at least ten probe bounds;
        ``quick``: twenty -- a store just failed over to, whose host may have died since: a killed
        host's listening socket can live on in a child, which accepts and never answers). Not
        tighter: dozens of participants connecting at once make a store slow to accept, not gone."""
        quick_bound = 20 * self.timeouts.probe_timeout
        timeout = within if within is not None else \
            (quick_bound if quick else max(quick_bound / 2, min(bound, self.timeouts.connect_timeout)))
        return connect_client(endpoint, bound, max(1.0, timeout), self.timeouts.probe_timeout,
                              self.timeouts.store_timeout, inline, abandon)

    def presence_status(self) -> tuple[int, str]:
        return self._serving if self._serving is not None else (self.epoch, str(self.endpoint))

    # ----------------------------------------------------------------- the fail-over

    def fail_over(self, from_epoch: int, why: str) -> None:
        """Move every connection of this process off the store of ``from_epoch`` (a no-op when that
        happened already, or when the store still answers). Raises StoreLostError when no
        successor can serve."""
        if not self._lock.acquire(timeout=self.timeouts.failover_timeout + 2 * self.timeouts.probe_timeout):
            raise StoreLostError(f"the rendezvous store is lost ({why}) and the fail-over did not end in time")
        try:
            if self.epoch != from_epoch:
                return
            if self._lost is not None:
                raise StoreLostError(self._lost)
            if self._answers(self.endpoint):
                return
            if not self.participating():
                raise StoreLostError(f"the rendezvous store at {self.endpoint} is gone ({why}) after this "
                                     "participant left the rendezvous: nothing to take over")
            started, lost = monotonic(), self.endpoint
            deadline = started + self.timeouts.failover_timeout
            try:
                successor = self._fail_over(from_epoch, why, deadline)
            except StoreLostError as exc:
                if self.epoch == from_epoch and self._answers_again(deadline):
                    # nobody could take over, yet the store answers after all: it was slow (an
                    # overloaded machine makes the store and every presence silent alike), not
                    # gone. Going on beats ending this participant (seen at 2,048 on 2 cores).
                    log.warning("rendezvous store at %s answers again after %.1fs: no fail-over (%s)",
                                self.endpoint, monotonic() - started, first_line(exc))
                    return
                self._lost = str(exc)
                log.error("store fail-over from epoch %d failed: %s", from_epoch, exc)
                raise
            seconds = monotonic() - started
            self.failovers.append((self.epoch, seconds, successor))
            if lost != self.endpoint:  # a store served again at the lost one's endpoint keeps its connections
                _break_connections(lost)
            log.warning("rendezvous store: failed over to %s (epoch %d, %s) in %.2fs after: %s", self.endpoint,
                        self.epoch, "hosted here" if self.hosting else f"hosted by {successor}", seconds, why)
        finally:
            self._lock.release()
        for callback in self.on_switch:
            callback(self.hosting)

    def suspect(self, epoch: int) -> None:
        """A peer reports the store of ``epoch`` lost: check it (and fail over) on a thread of its own."""
        if epoch != self.epoch or self._suspecting or self._lost is not None:
            return
        self._suspecting = True

        def check() -> None:
            try:
                self.fail_over(epoch, "a peer reported the store lost")
            except Exception as exc:  # noqa: BLE001 - the callers' own store calls report it
                log.debug("fail-over on a peer's report: %s", first_line(exc))
            finally:
                self._suspecting = False

        threading.Thread(target=check, name="lightning_ft-failover", daemon=True).start()

    def _answers(self, endpoint: Endpoint) -> bool:
        """Whether the store of the current epoch still answers, on a connection kept for asking:
        one broken connection (or a slow answer on a tight bound) is not a lost store. A fresh
        connection would not tell: the listening socket of a killed host can outlive it in a
        child process, which accepts connections and never answers."""
        if self.hosting:
            return True  # served by this process: it is here as long as we are
        probe_store = self._probe_store
        if probe_store is None:
            return False
        try:
            probe_store.check(["lightning_ft_failover/probe"])
        except Exception:  # noqa: BLE001 - any failure: the store does not answer
            return False
        return True

    def _answers_again(self, deadline: float) -> bool:
        """True when the store of the current epoch answers a probe before ``deadline`` (at least one
        is made); False at once when its host refuses connections (the kernel says it is gone)."""
        while True:
            if self._answers(self.endpoint):
                return True
            if monotonic() >= deadline or refuses(self.endpoint, self.timeouts.probe_timeout):
                return False
            time.sleep(0.2)

    def _fail_over(self, from_epoch: int, why: str, deadline: float) -> str:
        log.warning("rendezvous store at %s lost (%s): failing over to a participant", self.endpoint, why)
        dead: set[str] = set()
        remaining = list(self.candidates)
        if not remaining or self.scope is None:
            raise StoreLostError(f"the rendezvous store at {self.endpoint} is lost ({why}) before any round "
                                 "completed: no participant is known to take it over")
        while remaining:
            target, index = None, 0
            for index, candidate in enumerate(remaining):  # noqa: B007 - the index is used after the loop
                if candidate.participant_id == self.participant_id:
                    target = candidate
                    break
                status = self.probe(candidate, f"FAILOVER {from_epoch}")
                if status.state == "dead":
                    dead.add(candidate.participant_id)
                elif status.state == "alive":
                    target = candidate
                    break
            if target is None:
                break
            if target.participant_id == self.participant_id:
                self._serve(from_epoch + 1, deadline, dead)
                return self.participant_id
            moved = self._await_successor(target, from_epoch, deadline)
            if moved is not None:
                self._register(moved[0], parse_endpoint(moved[1]), deadline)
                return target.participant_id
            remaining = remaining[index + 1:]
        raise StoreLostError(f"the rendezvous store at {self.endpoint} is lost ({why}) and no participant of the "
                             f"last round can take it over (gone: {len(dead)}, the others silent)")

    def _await_successor(self, target: Candidate, from_epoch: int, deadline: float) -> tuple[int, str] | None:
        """Wait until ``target`` serves a store newer than ``from_epoch``: ``(epoch, host:port)``, or
        None when it is gone, does not within the fail-over's bound, or names a store at an
        endpoint no candidate announced (never followed: see the module)."""
        while monotonic() < deadline:
            status = self.probe(target, f"FAILOVER {from_epoch}")
            if status.state == "dead":
                return None
            if status.state == "alive" and status.epoch > from_epoch and status.store:
                if not announced_store(status.store, self.announced()):
                    log.warning("rendezvous store: %s names a store at %s, an endpoint no fail-over candidate "
                                "announced; not following it", target.participant_id, status.store[:80])
                    return None
                return status.epoch, status.store
            time.sleep(_POLL)
        return None

    def announced(self) -> set[str]:
        """Where a successor may serve: the endpoints the candidates announced, and the job's own."""
        return {c.store for c in self.candidates} | self.job.names()

    def probe(self, candidate: Candidate, request: str) -> PeerStatus:
        """Ask ``candidate``'s presence (:func:`~.presence.probe`): "alive" only for its authentic answer."""
        return probe(candidate.presence, request, self.timeouts.probe_timeout, candidate.participant_id, self.proof)

    def _register(self, epoch: int, endpoint: Endpoint, deadline: float) -> None:
        remaining = max(1.0, deadline - monotonic())
        store = self._client(endpoint, remaining, within=remaining)
        values = SealedStore(store, self.signer)
        assert self.scope is not None  # a fail-over needs candidates, known only once bound
        keys = EpochKeys(self.scope, epoch)
        served = decode_number(values.get(epoch_key(self.scope)))
        if served != epoch:
            raise StoreLostError(f"the store at {endpoint} serves epoch {served}, not {epoch} as its host said")
        values.put(keys.view(self.participant_id), encode_view(self.mirror.view()))
        values.append(keys.registered, encode_registration(self.participant_id, self.active))
        while monotonic() < deadline:
            # a successor either opens or gives up; the one value a participant reads on every turn
            abandoned = values.get(keys.abandoned)
            if abandoned is not None:
                raise StoreLostError(f"the successor store at {endpoint} gave up: {abandoned.decode(errors='replace')}")
            if values.get(keys.open) is not None:
                self.endpoint, self.epoch, self.hosting = endpoint, epoch, False
                self._probe_later(store)
                return
            time.sleep(_POLL)
        raise StoreLostError(f"the successor store at {endpoint} did not open within "
                             f"failover_timeout={self.timeouts.failover_timeout:g}s")

    def _serve(self, epoch: int, deadline: float, dead: set[str]) -> None:
        server, endpoint = self._serve_on_announced_port(epoch)
        store = BoundedStore(server, self.timeouts.store_timeout)
        values = SealedStore(store, self.signer)
        assert self.scope is not None  # a fail-over needs candidates, known only once bound
        keys = EpochKeys(self.scope, epoch)
        values.put(epoch_key(self.scope), encode_number(epoch))
        values.put(locator_key(self.run_id), encode_number(epoch))  # where nodes started later look
        values.put(keys.view(self.participant_id), encode_view(self.mirror.view()))
        values.append(keys.registered, encode_registration(self.participant_id, self.active))
        self._serving = (epoch, str(endpoint))  # the presence listener tells callers from here on
        registered = self._await_quorum(values, keys, epoch, deadline, dead)
        rebuilt = _rebuild(store, values, keys, [pid for pid in registered if pid != self.participant_id],
                           self.mirror.view())
        values.put(keys.open, f"{len(registered)} registered, {len(dead)} gone, {rebuilt} keys")
        _say_opened(epoch, str(endpoint), registered, len(dead), rebuilt, self.actives)
        self.endpoint, self.epoch, self.hosting = endpoint, epoch, True
        self._probe_store = None

    def _serve_on_announced_port(self, epoch: int) -> tuple[Any, Endpoint]:
        """Serve a store at the first of the job's places this process can bind (where nodes
        started later look for it), else on the port this process announced (once: a second
        fail-over to it, which only a store it served and lost could need, has no announced port left)."""
        timeout = datetime.timedelta(seconds=self.timeouts.store_timeout)
        probe = self.timeouts.probe_timeout
        listed = self.job.bind_here(patience=4 * probe, probe_timeout=probe / 2)
        if listed is not None:
            endpoint, sock = listed
            server = host_store(endpoint.host, 0, timeout, reserved=sock)
            self._servers.append(server)
            return server, endpoint
        reserved, self._reserved = self._reserved, None
        if reserved is None:
            raise StoreLostError(f"this participant was to host the rendezvous store of epoch {epoch} but served "
                                 "one already: the port it announced is used")
        server = host_store(self.presence.host, 0, timeout, reserved=reserved)
        self._servers.append(server)
        return server, parse_endpoint(self.successor)

    def _await_quorum(self, values: SealedStore, keys: EpochKeys, epoch: int, deadline: float,
                      dead: set[str]) -> dict[str, bool]:
        """Wait (bounded by ``deadline``) until the registrations make a quorum and everyone not gone
        registered, or ``last_call_timeout`` after the quorum; returns who registered (-> active).
        Else writes why it gives up and raises StoreLostError."""
        participants = [c.participant_id for c in self.candidates]
        quorum_at: float | None = None
        probed_at = 0.0
        while True:
            registered = {r.participant_id: r.active for r in
                          (decode_registration(raw) for raw in values.records(keys.registered)) if r is not None}
            now = monotonic()
            verdict = may_serve(participants, registered, dead, self.actives)
            if not verdict.serve and now - probed_at >= _PROBE_EVERY:
                # who is gone counts for the quorum; the probe also tells the living to move
                probed_at = now
                dead |= self._gone([c for c in self.candidates
                                    if c.participant_id not in registered and c.participant_id not in dead], epoch - 1)
                verdict = may_serve(participants, registered, dead, self.actives)
            if verdict.serve:
                quorum_at = now if quorum_at is None else quorum_at
                everyone = all(p in registered or p in dead for p in participants)
                if everyone or now - quorum_at >= self.timeouts.last_call_timeout:
                    return registered
            if now > deadline:
                values.put(keys.abandoned, verdict.reason or "no quorum in time")
                self._serving = None
                raise StoreLostError(f"this participant was to host the rendezvous store of epoch {epoch} but "
                                     f"cannot serve it: {verdict.reason or 'no quorum in time'} within "
                                     f"failover_timeout={self.timeouts.failover_timeout:g}s")
            time.sleep(_POLL)

    def _gone(self, candidates: list[Candidate], epoch: int) -> set[str]:
        """Which of ``candidates`` are gone (their presence refused), asked in parallel; the living
        are told that the store of ``epoch`` is lost."""
        states = ask_each(candidates, lambda c: self.probe(c, f"FAILOVER {epoch}").state)
        return {c.participant_id for c, state in zip(candidates, states, strict=True) if state == "dead"}

    # ----------------------------------------------------------------- after a partition

    def follow(self, epoch: int, where: str) -> bool:
        """Move every connection to the store of ``epoch`` at ``where`` -- a newer one that others
        follow (:func:`~lightning_ft.failover.partition.follow_newest` decides) -- once it serves that
        epoch (its sealed number, under this launch's keys). True when this process moved."""
        assert self.scope is not None  # candidates are known only once bound
        with self._lock:
            if self.epoch >= epoch:
                return False
            endpoint = parse_endpoint(where)
            store = self._client(endpoint, self.timeouts.store_timeout)
            if decode_number(SealedStore(store, self.signer).get(epoch_key(self.scope))) != epoch:
                return False
            log.warning("rendezvous store: the others failed over to %s (epoch %d) while this process followed "
                        "epoch %d; following it", endpoint, epoch, self.epoch)
            lost = self.endpoint
            self.endpoint, self.epoch, self.hosting = endpoint, epoch, False
            self._probe_later(store)
            if lost != endpoint:
                _break_connections(lost)
        for callback in self.on_switch:
            callback(False)
        return True

    def close(self) -> None:
        self.presence.stop()
        reserved, self._reserved = self._reserved, None
        if reserved is not None:
            reserved.close()


def _say_opened(epoch: int, endpoint: str, registered: dict[str, bool], gone: int, rebuilt: int,
                actives: frozenset[str]) -> None:
    log.info("rendezvous store of epoch %d serves at %s: %d participant(s) registered, %d gone, %d key(s) rebuilt",
             epoch, endpoint, len(registered), gone, rebuilt)
    if not any(registered.values()):
        log.warning("rendezvous store of epoch %d opened by spares alone: every active of the last round is gone "
                    "(%s); the job goes on from the newest snapshot they hold", epoch, ", ".join(sorted(actives)))


def _rebuild(store: BoundedStore, values: SealedStore, keys: EpochKeys, others: list[str], own: Any) -> int:
    """Write the state rebuilt from this successor's own view and those of the ``others`` that
    registered; returns how many keys."""
    views = [own]
    # every registration follows its view's write: the keys are there (multi_get waits for missing ones)
    for raw in values.multi_get([keys.view(p) for p in others]):
        view = decode_view(raw) if raw is not None else None
        if view is not None:
            views.append(view)
    merged = list(merge_views(views).items())
    for start in range(0, len(merged), 512):
        chunk = merged[start:start + 512]
        store.multi_set([k for k, _ in chunk], [v for _, v in chunk])
    return len(merged)


def _break_connections(endpoint: Endpoint) -> None:
    """Shut down this process's connections to a replaced store: calls still waiting on them (a
    frozen host's) fail at once instead of returning at any later moment -- one that returns
    while the interpreter finalizes aborts the process."""
    try:
        hosts = {str(info[4][0]) for info in socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)}
        broken = break_connections_to(endpoint.port, hosts | {f"::ffff:{h}" for h in hosts})
        log.debug("shut down %d connection(s) to the replaced store at %s", broken, endpoint)
    except Exception as exc:  # noqa: BLE001 - best effort: the calls then end on their own
        log.debug("could not shut down the connections to %s: %s", endpoint, first_line(exc))

