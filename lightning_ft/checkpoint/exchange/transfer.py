"""Moving snapshots between the ranks of a newly formed group (a collective on the default group).

After a round forms, every rank must hold the snapshot it will resume from -- a hot spare
that just joined has none, a survivor may have lost its copy. :func:`exchange_snapshots`
plans with :func:`~lightning_ft.checkpoint.policy.plan_snapshot_transfer` and sends the
verified file bytes point to point.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_ft._logging import strategy_name
from lightning_ft.checkpoint.exchange.agreement import gather_steps
from lightning_ft.checkpoint.identity import ExpectedIdentity
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import ShardTransferPlan, TransferPlan, plan_shard_transfers, plan_snapshot_transfer
from lightning_ft.events import names as ev

log = logging.getLogger(__name__)


def exchange_snapshots(store: SnapshotStore, rank: int, world_size: int, emit: Callable[..., None],
                       model: str | None = None) -> TransferPlan | None:
    """Make the newest snapshot any rank holds available on every rank (collective).

    All ranks agree on the newest step of this run (snapshots recording another run id, or
    another ``model`` fingerprint when one is given, are not offered: a copy every rank would
    skip at the resume must not be chosen over the job's own older one; one all_gather of the
    step lists as tensors); the lowest rank that holds it sends
    the verified file bytes point-to-point to each rank that lacks it (a hot spare that just
    joined, a survivor whose copy was lost). Receivers check the bytes and commit them as
    their own snapshot (keeping the sender's identity), so the ordinary resume path finds it.
    Nothing received is unpickled here.
    """
    expect = store.expected_identity(model=model)
    local = store.readable_steps(include_peers=True, expect=expect)
    gathered = gather_steps(local)
    if len(gathered) != world_size:
        raise RuntimeError(f"{strategy_name()}: snapshot exchange expected {world_size} ranks, the default group has "
                           f"{len(gathered)}")
    plan = plan_snapshot_transfer(gathered)
    emit(ev.SNAPSHOT_PLAN, step=plan.step if plan else None, source=plan.source if plan else None,
         receivers=list(plan.receivers) if plan else [])
    if plan is None or not plan.receivers:
        return plan
    if rank == plan.source:
        _send_snapshot(store, plan, rank, emit, expect)
    elif rank in plan.receivers:
        _receive_snapshot(store, plan, rank, emit)
    return plan


def exchange_shards(store: SnapshotStore, rank: int, world_size: int, emit: Callable[..., None],
                    model: str | None = None) -> ShardTransferPlan | None:
    """Sharded state: make every rank hold its own shards of the newest step whose shards all
    exist somewhere (collective over the default group; see
    :func:`~lightning_ft.checkpoint.policy.plan_shard_transfers`).

    Each rank offers the ``(shard rank, step)`` snapshots it can read -- its own directory and
    those of other ranks on its host (a participant placed at another rank by a relaunch finds
    its old shards there) -- of this run and ``model``; one all_gather of integers. Each transfer
    sends the verified file bytes point to point (all sends and receives posted at once, so no
    order of them can deadlock); the receiver commits them as its own snapshot. Nothing
    received is unpickled here. Returns the plan (None: no complete step).
    """
    expect = store.expected_identity(model=model)
    by_shard = {(info.rank, info.step): info for info in store.readable_in_every_rank_dir(expect)}
    gathered = gather_steps([value for shard, step in by_shard for value in (shard, step)])
    if len(gathered) != world_size:
        raise RuntimeError(f"{strategy_name()}: shard exchange expected {world_size} ranks, the default group has "
                           f"{len(gathered)}")
    plan = plan_shard_transfers([list(zip(flat[0::2], flat[1::2], strict=True)) for flat in gathered])
    emit(ev.SNAPSHOT_PLAN, step=plan.step if plan else None,
         transfers=[list(t) for t in plan.transfers] if plan else [])
    if plan is None:
        return plan
    # copies of other ranks' shards newer than the resume step belong to an abandoned timeline
    for shard, step in store.discard_newer_in_other_rank_dirs(plan.step):
        log.info("rank %d: removed the copy of rank %d's shards of step %d: newer than the resume step %d",
                 rank, shard, step, plan.step)
    if not plan.transfers:
        return plan
    _move_shards(store, plan, by_shard, rank, emit)
    return plan


def _send_snapshot(store: SnapshotStore, plan: TransferPlan, rank: int, emit: Callable[..., None],
                   expect: ExpectedIdentity) -> None:
    """The source's side: the verified bytes of the plan's step to every receiver (size first;
    -1 tells them it could not be read)."""
    start = time.perf_counter()
    with contextlib.ExitStack() as held:
        payload: torch.Tensor | None = None
        info = store.find(plan.step, include_peers=True, expect=expect)
        if info is not None:
            try:
                payload = held.enter_context(store.bytes_to_send(info))
            except Exception as exc:  # noqa: BLE001 - told to the receivers as size -1
                log.error("rank %d: cannot read snapshot step %d for transfer: %s", rank, plan.step, exc)
        nbytes = payload.numel() if payload is not None else -1
        for receiver in plan.receivers:
            dist.send(torch.tensor([nbytes], dtype=torch.int64), dst=receiver)
            if payload is not None:
                dist.send(payload, dst=receiver)
                emit(ev.SNAPSHOT_SENT, step=plan.step, to_rank=receiver, bytes=nbytes,
                     seconds=round(time.perf_counter() - start, 4))
        payload = None  # the last reference to the map's view goes before the map is closed
    if nbytes < 0:
        raise RuntimeError(f"{strategy_name()}: snapshot of step {plan.step} vanished on rank {rank} before it could "
                           "be sent to the ranks that lack it")
    log.info("rank %d: sent snapshot step %d (%d bytes) to rank(s) %s in %.3fs", rank, plan.step, nbytes,
             list(plan.receivers), time.perf_counter() - start)


def _receive_snapshot(store: SnapshotStore, plan: TransferPlan, rank: int, emit: Callable[..., None]) -> None:
    """A receiver's side: the bytes, checked and committed as this rank's own snapshot."""
    start = time.perf_counter()
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=plan.source)
    nbytes = int(size.item())
    if nbytes < 0:
        raise RuntimeError(f"{strategy_name()}: rank {plan.source} could not send the snapshot of step {plan.step}")
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    dist.recv(buffer, src=plan.source)
    store.write_bytes(buffer.numpy().data)  # a memoryview of the received bytes
    seconds = time.perf_counter() - start
    emit(ev.SNAPSHOT_RECEIVED, step=plan.step, from_rank=plan.source, bytes=nbytes, seconds=round(seconds, 4))
    log.info("rank %d: received snapshot step %d (%d bytes) from rank %d in %.3fs", rank, plan.step, nbytes,
             plan.source, seconds)


def _move_shards(store: SnapshotStore, plan: ShardTransferPlan, by_shard: dict[tuple[int, int], SnapshotInfo],
                 rank: int, emit: Callable[..., None]) -> None:
    """Every transfer of ``plan`` at once: sizes first (one all_reduce; -1: a source could not read
    its file), then all sends and receives posted together; receivers commit what they got."""
    start = time.perf_counter()
    with contextlib.ExitStack() as held:
        sizes = torch.zeros(len(plan.transfers), dtype=torch.int64)
        payloads: dict[int, torch.Tensor] = {}
        for index, (source, receiver) in enumerate(plan.transfers):
            if source != rank:
                continue
            try:
                payloads[index] = held.enter_context(store.bytes_to_send(by_shard[(receiver, plan.step)]))
                sizes[index] = payloads[index].numel()
            except Exception as exc:  # noqa: BLE001 - told to the receiver as size -1
                log.error("rank %d: cannot read rank %d's shards of step %d for transfer: %s", rank, receiver,
                          plan.step, exc)
                sizes[index] = -1
        dist.all_reduce(sizes)  # each entry is written by its source only
        failed = [plan.transfers[i] for i in range(len(plan.transfers)) if sizes[i] < 0]
        if failed:
            raise RuntimeError(f"{strategy_name()}: shards of step {plan.step} vanished before they could be sent "
                               f"(source, receiver): {failed}")
        requests, received = [], {}
        for index, (source, receiver) in enumerate(plan.transfers):
            if source == rank:
                requests.append(dist.isend(payloads[index], dst=receiver))
            if receiver == rank:
                received[index] = torch.empty(int(sizes[index]), dtype=torch.uint8)
                requests.append(dist.irecv(received[index], src=source))
        for request in requests:
            assert request is not None  # isend/irecv return None only to ranks outside the group
            request.wait()
        payloads.clear()  # the last references to the maps' views go before the maps are closed
    seconds = round(time.perf_counter() - start, 4)
    for index, (source, receiver) in enumerate(plan.transfers):
        if source == rank:
            emit(ev.SNAPSHOT_SENT, step=plan.step, to_rank=receiver, bytes=int(sizes[index]), seconds=seconds)
        if receiver == rank:
            store.write_bytes(received[index].numpy().data, taken_by=rank)
            emit(ev.SNAPSHOT_RECEIVED, step=plan.step, from_rank=source, bytes=int(sizes[index]), seconds=seconds)
            log.info("rank %d: received its shards of step %d (%d bytes) from rank %d in %.3fs", rank, plan.step,
                     int(sizes[index]), source, seconds)
