"""The place a run's rendezvous state lives, as an interface (torch's ``RendezvousBackend`` is the model).

The barrier rendezvous is pure protocol over a store: it never knows whether that store is one
TCPStore for the life of the job or one that moves to a surviving participant when its host dies.
What it holds is a :class:`RendezvousBackend`: the store client every connection of the process
is made from, whether this process hosts it, and the two moments a backend may act -- once the
participant exists (:meth:`~RendezvousBackend.attach`), and before a participant that trained
re-joins (:meth:`~RendezvousBackend.follow_newest`). Two implementations:

* :class:`StoreBackend` -- one TCPStore at the endpoint; losing it ends the job truthfully;
* :class:`lightning_ft.failover.backend.FailoverBackend` -- the store fails over to a participant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from lightning_ft.deadlines import BoundedStore


class RendezvousBackend(Protocol):
    """Where the rendezvous state of one process's run lives (see the module docstring)."""

    #: ``store`` (plain) or ``failover``
    name: str

    @property
    def store(self) -> Any:
        """The store client of the process; more connections are its ``clone()``\\ s."""

    @property
    def hosting(self) -> bool:
        """This process serves the store (now: a fail-over may move it)."""

    def attach(self, rendezvous: Any, on_switch: Callable[[bool], None]) -> None:
        """Once the participant (``rendezvous``: its ``BarrierRendezvous``) exists;
        ``on_switch(hosting)`` runs whenever the store moved."""

    def follow_newest(self) -> None:
        """Before a participant that trained re-joins: follow the store the others moved to while
        this process could not (it was frozen), if they did."""

    def close(self) -> None:
        """The participant left the run for good: stop the backend's threads and listeners."""


class StoreBackend:
    """One TCPStore at the endpoint for the life of the job."""

    name = "store"

    def __init__(self, store: BoundedStore, hosting: bool) -> None:
        self._store = store
        self._hosting = hosting

    @property
    def store(self) -> BoundedStore:
        return self._store

    @property
    def hosting(self) -> bool:
        return self._hosting

    def attach(self, rendezvous: Any, on_switch: Callable[[bool], None]) -> None:
        """A plain store never moves."""

    def follow_newest(self) -> None:
        """A plain store never moves."""

    def close(self) -> None:
        """Nothing of its own runs (the store's connections go with their last holder)."""
