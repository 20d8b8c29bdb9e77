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

from lightning_ft.checkpoint.exchange.agreement import gather_steps
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import TransferPlan, plan_snapshot_transfer
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
        raise RuntimeError(f"ddp_ft: snapshot exchange expected {world_size} ranks, the default group has "
                           f"{len(gathered)}")
    plan = plan_snapshot_transfer(gathered)
    emit(ev.SNAPSHOT_PLAN, step=plan.step if plan else None, source=plan.source if plan else None,
         receivers=list(plan.receivers) if plan else [])
    if plan is None or not plan.receivers:
        return plan
    if rank == plan.source:
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
            raise RuntimeError(f"ddp_ft: snapshot of step {plan.step} vanished on rank {rank} before it could "
                               "be sent to the ranks that lack it")
        log.info("rank %d: sent snapshot step %d (%d bytes) to rank(s) %s in %.3fs", rank, plan.step, nbytes,
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
        store.write_bytes(buffer.numpy().data)  # a memoryview of the received bytes
        seconds = time.perf_counter() - start
        emit(ev.SNAPSHOT_RECEIVED, step=plan.step, from_rank=plan.source, bytes=nbytes, seconds=round(seconds, 4))
        log.info("rank %d: received snapshot step %d (%d bytes) from rank %d in %.3fs", rank, plan.step, nbytes,
                 plan.source, seconds)
    return plan
