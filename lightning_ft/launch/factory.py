"""One factory builds a participant of a run, for the strategy's session and the torchrun handler alike.

:func:`open_participant` reaches (or hosts) the rendezvous store at the endpoint, puts the run's
rendezvous state behind the backend the settings choose (:class:`~lightning_ft.store.backend.StoreBackend`,
or :class:`~lightning_ft.failover.backend.FailoverBackend` with ``store_failover``), builds the
barrier rendezvous over it and lets the backend attach to it. Every store call of the result is
bounded (a frozen store host makes a call fail, never hang).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_ft.failover.backend import FailoverBackend
from lightning_ft.rendezvous.barrier import BarrierRendezvous
from lightning_ft.rendezvous.participant import ParticipantInfo
from lightning_ft.rendezvous.records import publish_launch_id
from lightning_ft.rendezvous.settings import RendezvousSettings
from lightning_ft.schema.signing import job_signer
from lightning_ft.store.backend import RendezvousBackend, StoreBackend
from lightning_ft.store.locator import JobEndpoints, NoRunningJob, connect_job_store
from lightning_ft.store.tcp import Endpoint


@dataclass
class Participant:
    """One process's part in a run: its identity, its rendezvous and where the run's state lives."""

    info: ParticipantInfo
    rendezvous: BarrierRendezvous
    backend: RendezvousBackend
    #: ``callback(hosting)`` after the store moved (fail-over backend only)
    on_switch: list[Callable[[bool], None]] = field(default_factory=list)

    @property
    def store(self) -> Any:
        """The store client every connection of this process is cloned from."""
        return self.backend.store

    @property
    def hosting(self) -> bool:
        return self.backend.hosting

    def close(self) -> None:
        """After the rendezvous was left for good: stop every thread and listener of the
        participant (its store connections end with their last holder)."""
        self.rendezvous.stop_heartbeat()
        self.backend.close()


def open_participant(endpoint: Endpoint | JobEndpoints, is_host: bool | None, info: ParticipantInfo,
                     settings: RendezvousSettings, rejoin: bool = False) -> Participant:
    """Reach (``is_host`` False), host (True) or either (None: host when the port can be bound
    here) the job's store at ``endpoint`` -- wherever a fail-over moved it among the job's listed
    endpoints (:mod:`lightning_ft.store.locator`) -- and build ``info``'s participant with
    ``settings``. Raises ``RendezvousError`` when the store cannot be reached (``rejoin``: only a
    running job's store is joined, :class:`~lightning_ft.store.locator.NoRunningJob` when none answers)."""
    job = JobEndpoints.of(endpoint)
    first, hosting, reached = connect_job_store(job, is_host, settings.timeouts, settings.run_id, job_signer(),
                                                rejoin=rejoin)
    if hosting:  # a new store is a new launch (see read_launch_id)
        publish_launch_id(first, job_signer())
    backend: RendezvousBackend = (
        FailoverBackend(reached, job, first, hosting, info.participant_id, settings.timeouts, job_signer())
        if settings.store_failover else StoreBackend(first, hosting))
    store = backend.store
    try:
        rendezvous = BarrierRendezvous(store, settings, info, is_store_host=hosting,
                                       heartbeat_store_factory=lambda: store.clone(inline=True), rejoin=rejoin)
    except NoRunningJob:  # the job whose store answered ended before this restarted node started
        backend.close()
        raise
    rendezvous.open_connections()
    participant = Participant(info, rendezvous, backend)

    def switched(now_hosting: bool) -> None:
        rendezvous.is_store_host = now_hosting
        for callback in participant.on_switch:
            callback(now_hosting)

    backend.attach(rendezvous, switched)
    return participant
