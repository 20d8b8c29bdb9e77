"""I/O over the process group: breaking a hung gloo group, and moving snapshots between ranks."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.store import SnapshotStore
from lightning_ft.strategy.decisions import TransferPlan, plan_snapshot_transfer

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[int, str]:
    """This process's socket file descriptors -> their kernel identity (``socket:[inode]``)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found  # no procfs: the group cannot be broken from outside (see GroupTransport)
    for name in names:
        try:
            target = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


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
            if before.get(fd) == ident:
                continue
            try:
                probe = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if probe.type != socket.SOCK_STREAM:
                    continue
                try:
                    peer = probe.getpeername()
                except OSError:
                    continue  # a listener
                local = probe.getsockname()
                if store_port is not None and store_port in (_port(peer), _port(local)):
                    continue
                self._sockets[fd] = ident
            finally:
                probe.close()
        self.aborted = False

    @property
    def socket_count(self) -> int:
        return len(self._sockets)

    def abort(self) -> int:
        """Shut down the group's connections; returns how many were shut down."""
        self.aborted = True
        current = open_sockets()
        count = 0
        for fd, ident in self._sockets.items():
            if current.get(fd) != ident:
                continue
            try:
                probe = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                probe.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                pass
            finally:
                probe.close()
        return count


def _port(address) -> int | None:
    return address[1] if isinstance(address, tuple) and len(address) >= 2 else None


def exchange_snapshots(store: SnapshotStore, rank: int, world_size: int,
                       emit: Callable[..., None]) -> TransferPlan | None:
    """Make the newest snapshot any rank holds available on every rank (collective).

    All ranks agree on the newest step (one ``all_gather_object``); the lowest rank that
    holds it sends the verified file bytes point-to-point to each rank that lacks it (a hot
    spare that just joined, a survivor whose copy was lost). Receivers commit the bytes as
    their own snapshot, so the ordinary resume path finds it.
    """
    local = store.readable_steps(include_peers=True)
    gathered: list[list[int] | None] = [None] * world_size
    dist.all_gather_object(gathered, local)
    plan = plan_snapshot_transfer([steps or [] for steps in gathered])
    emit("snapshot_plan", step=plan.step if plan else None, source=plan.source if plan else None,
         receivers=list(plan.receivers) if plan else [])
    if plan is None or not plan.receivers:
        return plan
    if rank == plan.source:
        start = time.perf_counter()
        blob = b""
        info = store.find(plan.step, include_peers=True)
        if info is not None:
            try:
                blob = store.read_bytes(info)
            except Exception as exc:  # noqa: BLE001 - told to the receivers as size -1
                log.error("rank %d: cannot read snapshot step %d for transfer: %s", rank, plan.step, exc)
                blob = b""
        for receiver in plan.receivers:
            size = torch.tensor([len(blob) if blob else -1], dtype=torch.int64)
            dist.send(size, dst=receiver)
            if blob:
                dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=receiver)
                emit("snapshot_sent", step=plan.step, to_rank=receiver, bytes=len(blob),
                     seconds=round(time.perf_counter() - start, 4))
        if not blob:
            raise RuntimeError(f"ddp_ft: snapshot of step {plan.step} vanished on rank {rank} before it could "
                               "be sent to the ranks that lack it")
        log.info("rank %d: sent snapshot step %d (%d bytes) to rank(s) %s in %.3fs", rank, plan.step, len(blob),
                 list(plan.receivers), time.perf_counter() - start)
    elif rank in plan.receivers:
        start = time.perf_counter()
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=plan.source)
        nbytes = int(size.item())
        if nbytes < 0:
            raise RuntimeError(f"ddp_ft: rank {plan.source} could not send the snapshot of step {plan.step}")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(buffer, src=plan.source)
        store.write_bytes(memoryview(buffer.numpy()))
        seconds = time.perf_counter() - start
        emit("snapshot_received", step=plan.step, from_rank=plan.source, bytes=nbytes, seconds=round(seconds, 4))
        log.info("rank %d: received snapshot step %d (%d bytes) from rank %d in %.3fs", rank, plan.step, nbytes,
                 plan.source, seconds)
    return plan
