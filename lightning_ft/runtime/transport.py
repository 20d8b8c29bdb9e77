"""The process group of one round: creating it, breaking it when a peer hangs, retiring it.

Lightning never destroys a gloo group and cannot swap one under a live DDP model, so the
strategy owns the group's whole life here: :func:`init_round_group` builds it from the
round's store prefix (no ``MASTER_PORT``), :class:`GroupTransport` can end a collective that
waits on a frozen peer, and :func:`retire_group` takes a broken group out of service without
the destructor deadlock described there. Destroying at interpreter exit is
:func:`lightning_ft.process.destroy_process_group`.
"""

from __future__ import annotations

import datetime
import logging
import socket

import torch.distributed as dist

from lightning_ft._clock import monotonic
from lightning_ft._torch import all_groups, set_default_group_timeout
from lightning_ft.process import destroy_process_group
from lightning_ft.sockets import open_sockets, shut_down, with_socket

log = logging.getLogger(__name__)

#: how long a group broken by a failure is kept alive after it was retired (see retire_group): its
#: gloo workers finish the failed collectives within moments of the connections' shutdown
RETIRED_GROUP_GRACE = 5.0

#: process groups broken by a failure, with when each was retired (see retire_group)
_BROKEN_GROUPS: list[tuple[float, object]] = []



class GroupTransport:
    """The TCP connections gloo opened for one process group, so a hung collective can be ended.

    Why: a gloo collective blocked on a frozen peer (SIGSTOP, hung host) waits for the
    process-group timeout; neither ``ProcessGroup.abort()`` nor ``shutdown()`` nor a new
    timeout wakes it (measured, torch 2.13). Shutting down the group's peer sockets does:
    the blocked collective raises "Connection closed by peer" at once, exactly as if the
    peer had died, and the ordinary recovery path takes over.

    Which sockets: those created while ``init_process_group`` ran (gloo connects its full
    mesh there), that are connected (not the listener: shutting that down makes gloo abort
    the process), and that do not talk to the rendezvous store. Each is re-identified by its
    inode before shutdown, so a reused descriptor is never touched.
    """

    def __init__(self, before: dict[int, str], after: dict[int, str], store_port: int | None) -> None:
        self._sockets: dict[int, str] = {}
        for fd, ident in after.items():
            if before.get(fd) != ident and with_socket(fd, lambda sock: _is_group_connection(sock, store_port)):
                self._sockets[fd] = ident
        self.aborted = False

    def abort(self) -> int:
        """Shut down the group's connections; returns how many were shut down."""
        self.aborted = True
        current = open_sockets()
        count = 0
        for fd, ident in self._sockets.items():
            if current.get(fd) == ident and with_socket(fd, shut_down):
                count += 1
        return count


def _is_group_connection(sock: socket.socket, store_port: int | None) -> bool:
    if sock.type != socket.SOCK_STREAM:
        return False
    try:
        peer = sock.getpeername()
    except OSError:
        return False  # a listener
    return store_port is None or store_port not in (_port(peer), _port(sock.getsockname()))


def _port(address: object) -> int | None:
    return address[1] if isinstance(address, tuple) and len(address) >= 2 else None


def init_round_group(backend: str, rank: int, world_size: int, store: dist.Store, init_timeout: float,
                     pg_timeout: datetime.timedelta | None, store_port: int | None) -> GroupTransport:
    """Create the default group of a round over ``store`` (a prefix of the rendezvous store).

    ``init_timeout`` bounds the creation (a peer that never arrives); the group's own
    timeout is then set to ``pg_timeout`` (as ``DDPStrategy(timeout=...)``).
    """
    destroy_process_group()  # a stale group from an earlier round or fit()
    release_retired_groups()
    before = open_sockets()
    timeout = datetime.timedelta(seconds=init_timeout)
    if pg_timeout is not None:
        timeout = min(timeout, pg_timeout)
    dist.init_process_group(backend, rank=rank, world_size=world_size, store=store, timeout=timeout)
    if pg_timeout is not None and pg_timeout != timeout:
        set_default_group_timeout(pg_timeout)
    return GroupTransport(before, open_sockets(), store_port)


def init_torchrun_group(backend: str, rank: int, world_size: int, pg_timeout: datetime.timedelta | None) -> None:
    """Create the default group under torchrun (``MASTER_ADDR``/``MASTER_PORT`` from its agent),
    unless one exists already."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=pg_timeout)


def retire_group(transport: GroupTransport | None) -> None:
    """Fail every pending collective of the current group, and retire the group.

    The group object is kept alive (``_BROKEN_GROUPS``), not destroyed. Why: when the
    last reference to a ``ProcessGroupGloo`` goes -- normally when Lightning's teardown
    unwraps ``DistributedDataParallel`` and drops its reducer -- its destructor joins the
    gloo worker threads while holding the GIL, and a worker thread still finishing a
    failed all-reduce needs the GIL to free it: a deadlock (seen under torchrun, gdb:
    ``~ProcessGroupGloo`` -> ``thread::join`` vs ``~AsyncAllreduceWork`` -> ``take_gil``).
    Kept alive, it is destroyed once its threads went idle: as a later round's group is created
    after a newer failure retired its own, or :data:`RETIRED_GROUP_GRACE` seconds after it was
    retired (:func:`release_retired_groups`), else at interpreter exit -- never one per recovery
    until then (a long job's recoveries would each keep a group's threads and descriptors).
    """
    if transport is not None:
        transport.abort()
    try:
        if dist.is_available() and dist.is_initialized():
            # the default group and every subgroup (a device mesh's): each has gloo worker threads
            now = monotonic()
            _BROKEN_GROUPS.extend((now, group) for group in all_groups())
    except (RuntimeError, ValueError, AttributeError):
        pass
    destroy_process_group()


def release_retired_groups(grace: float = RETIRED_GROUP_GRACE) -> int:
    """Drop this module's references to the groups retired before the newest retirement, and to
    those of the newest once ``grace`` seconds old (their failed collectives ended long since:
    destroying them joins idle worker threads); returns how many. At most one failure's groups are
    kept, however fast failures come. Called on the training thread as a round's group is created."""
    if not _BROKEN_GROUPS:
        return 0
    newest = max(retired_at for retired_at, _ in _BROKEN_GROUPS)
    keep_from = newest if newest > monotonic() - grace else float("inf")
    released = [group for retired_at, group in _BROKEN_GROUPS if retired_at < keep_from]
    _BROKEN_GROUPS[:] = [(retired_at, group) for retired_at, group in _BROKEN_GROUPS if retired_at >= keep_from]
    count = len(released)
    del released  # the last references: each group's destructor runs here, on this thread
    if count:
        log.debug("released %d process group(s) retired after a failure", count)
    return count
