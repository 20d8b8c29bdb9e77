"""Choosing the snapshot to resume from, consistently across ranks."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.identity import ExpectedIdentity
from lightning_ft.checkpoint.policy import choose_resume_step
from lightning_ft.checkpoint.store import SnapshotStore

log = logging.getLogger(__name__)


def gather_steps(steps: Sequence[int]) -> list[list[int]]:
    """Every rank's ``steps`` (all_gather over the default group), or ``[steps]`` when not distributed.

    Integers travel as int64 tensors (lengths first, then the padded lists), not through
    ``all_gather_object``, which unpickles what peers send with an unrestricted unpickler.
    Only call this where every rank calls it at the same point (resume paths); never from
    a signal handler or a per-rank emergency path.
    """
    steps = [int(s) for s in steps]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [steps]
    world = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(steps)], dtype=torch.int64))
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(max(longest, 1), dtype=torch.int64)
    padded[: len(steps)] = torch.tensor(steps, dtype=torch.int64)
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [values[: int(n.item())].tolist() for values, n in zip(gathered, lengths)]


def agree_on_step(local_steps: Sequence[int], rank: int | None = None) -> int | None:
    """Newest step every rank can read (collective: every rank calls it with its own steps).

    Ranks must resume from the same step: in DDP they hold identical weights and optimizer
    state, and a rank that resumed elsewhere would silently train a different model.
    """
    per_rank = gather_steps(local_steps)
    step = choose_resume_step(per_rank)
    if len(per_rank) > 1:
        log.info("rank %s: snapshot steps readable per rank %s -> resume step %s", rank, per_rank, step)
    return step


def agree_resume_step(store: SnapshotStore, include_peers: bool, expect: ExpectedIdentity | None = None) -> int | None:
    """Newest step with an intact snapshot (fitting ``expect``) readable by every rank (None if there is none)."""
    return agree_on_step(store.readable_steps(include_peers=include_peers, expect=expect), store.rank)
