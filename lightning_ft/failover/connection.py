"""A store connection that follows the store when it fails over (see :mod:`.switchboard`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from lightning_ft.deadlines import BoundedStore, first_line
from lightning_ft.failover.reach import (
    StoreLostError,
    StoreRefusesConnectionsError,
    StoreUnreachableError,
    is_lost_store_error,
    refuses_connections,
)
from lightning_ft.failover.switchboard import StoreSwitchboard


class FailoverStore:
    """A store connection that follows the :class:`StoreSwitchboard`: the drop-in for a
    :class:`~lightning_ft.deadlines.BoundedStore` (same calls, same bound)."""

    def __init__(self, switchboard: StoreSwitchboard, bound: float, store: BoundedStore | None = None,
                 inline: bool = False) -> None:
        self.switchboard = switchboard
        self.bound = bound
        self.inline = inline
        self._lock = threading.Lock()
        self._epoch = switchboard.epoch if store is not None else -1
        self._store: BoundedStore
        if store is not None:
            self._store = store
            self._follow(self._epoch, store)
        else:
            self._current()  # connects (following a fail-over if the store is gone)

    def _follow(self, epoch: int, store: BoundedStore) -> None:
        # a call stuck on a store that was replaced (frozen host) is abandoned, not waited out
        store.abandon = self.switchboard.epoch_ended(epoch)

    def _current(self) -> BoundedStore:
        with self._lock:
            for attempt in range(3):
                epoch = self.switchboard.epoch
                if self._epoch == epoch:
                    return self._store
                try:
                    # quick the first time only: once the switchboard found the store answering,
                    # a slow accept is load (everyone reconnects at once), not a dead host
                    moved = self._epoch >= 0 and attempt == 0
                    self._epoch, self._store = self.switchboard.connect(self.bound, moved=moved, inline=self.inline)
                    self._follow(self._epoch, self._store)
                except StoreUnreachableError as exc:  # the new store's host may be gone as well
                    self.switchboard.fail_over(epoch, str(exc))
                    if refuses_connections(exc, moved=self.switchboard.epoch != epoch):
                        # it answers on the connections it has (else the fail-over would have
                        # moved it): not lost, full -- nothing that needs a connection can go on
                        raise StoreRefusesConnectionsError(str(exc)) from None
            raise StoreLostError(f"the rendezvous store kept moving while this connection followed it (epoch "
                                 f"{self.switchboard.epoch})")

    @property
    def raw(self) -> Any:
        """The plain torch client of the current store (for torch's own use, e.g. ``PrefixStore``)."""
        return self._current().raw

    def _call(self, name: str, *args: Any) -> Any:
        for attempt in (1, 2):
            store, epoch = self._current(), self._epoch
            try:
                result = getattr(store, name)(*args)
            except Exception as exc:
                if attempt == 2 or not is_lost_store_error(exc):
                    raise
                self.switchboard.fail_over(epoch, f"{name}() failed: {type(exc).__name__}: {first_line(exc)}")
                continue
            self.switchboard.mirror.record(name, args, result)
            return result
        raise AssertionError("unreachable")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in BoundedStore._METHODS:
            return lambda *args: self._call(name, *args)
        return getattr(self._current(), name)

    def clone(self, bound: float | None = None, inline: bool = False) -> FailoverStore:
        """Another connection that follows the same switchboard, bounded alike or by ``bound``
        (``inline``: see ``BoundedStore.inline``)."""
        return FailoverStore(self.switchboard, self.bound if bound is None else bound, inline=inline)
