"""Choosing the snapshot to resume from, consistently across ranks."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from lightning_ft.checkpoint.policy import choose_resume_step
from lightning_ft.checkpoint.store import SnapshotStore

log = logging.getLogger(__name__)


def gather_from_ranks(obj: Any) -> list[Any]:
    """``obj`` of every rank (all_gather over the default group), or ``[obj]`` when not distributed.

    Only call this where every rank calls it at the same point (resume paths); never from
    a signal handler or a per-rank emergency path.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree_resume_step(store: SnapshotStore, include_peers: bool) -> int | None:
    """Newest step with an intact snapshot readable by every rank (None if there is none).

    Ranks must resume from the same step: in DDP they hold identical weights and optimizer
    state, and a rank that resumed elsewhere would silently train a different model.
    """
    local = store.readable_steps(include_peers=include_peers)
    per_rank = gather_from_ranks(local)
    step = choose_resume_step(per_rank)
    if len(per_rank) > 1:
        log.info("rank %d: snapshot steps readable per rank %s -> resume step %s",
                 store.rank, per_rank, step)
    return step
