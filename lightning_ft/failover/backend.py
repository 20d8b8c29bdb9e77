"""The rendezvous backend whose store fails over to a surviving participant.

Every connection of the process is a :class:`~.connection.FailoverStore` over one
:class:`~.switchboard.StoreSwitchboard` (where the store is now); once the participant exists a
:class:`~.candidates.FailoverParticipant` announces its presence and feeds the switchboard the
candidates of every round it completes. How a fail-over goes: :mod:`.switchboard`.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_ft.deadlines import BoundedStore
from lightning_ft.failover.candidates import FailoverParticipant
from lightning_ft.failover.connection import FailoverStore
from lightning_ft.failover.switchboard import StoreSwitchboard
from lightning_ft.rendezvous.barrier import BarrierRendezvous
from lightning_ft.schema.signing import Signer
from lightning_ft.settings import Timeouts
from lightning_ft.store.locator import JobEndpoints
from lightning_ft.store.tcp import Endpoint


class FailoverBackend:
    """A store that a surviving participant takes over when its host is lost."""

    name = "failover"

    def __init__(self, endpoint: Endpoint, job: JobEndpoints, first: BoundedStore, hosting: bool,
                 participant_id: str, timeouts: Timeouts, signer: Signer) -> None:
        self.switchboard = StoreSwitchboard(endpoint, first, hosting, participant_id, timeouts, signer, job)
        self._store = FailoverStore(self.switchboard, timeouts.store_timeout, first)
        self.participant: FailoverParticipant | None = None

    @property
    def store(self) -> FailoverStore:
        return self._store

    @property
    def hosting(self) -> bool:
        return self.switchboard.hosting

    def attach(self, rendezvous: BarrierRendezvous, on_switch: Callable[[bool], None]) -> None:
        self.participant = FailoverParticipant(self.switchboard, rendezvous)
        self.switchboard.on_switch.append(on_switch)

    def follow_newest(self) -> None:
        if self.participant is not None:
            self.participant.follow_newest()

    def close(self) -> None:
        """Stop the candidates' refresher and the presence listener (joined)."""
        if self.participant is not None:
            self.participant.close()
        self.switchboard.close()
