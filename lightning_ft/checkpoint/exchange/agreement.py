"""Choosing the snapshot to resume from, consistently across ranks."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.identity import ExpectedIdentity
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import choose_resume_step
from lightning_ft.checkpoint.tiers import ResumeChoice, choose_resume_source

if TYPE_CHECKING:
    from lightning_ft.checkpoint.durable.tier import DurableTier

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
    return [values[: int(n.item())].tolist() for values, n in zip(gathered, lengths, strict=True)]


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


def agree_across_tiers(local_steps: Sequence[int], durable: DurableTier | None, rank: int,
                       expect: ExpectedIdentity | None = None) -> ResumeChoice:
    """The step every rank resumes from and where this rank gets it (collective without a durable
    tier: one gather, as :func:`agree_on_step`; with one: two gathers, memory and durable steps;
    durable steps only of ``expect``'s model when given).

    Every rank of a job must pass a durable tier or none (the setting is per job). Logs one line
    saying which tier and why.
    """
    if durable is None:
        step = agree_on_step(local_steps, rank)
        return ResumeChoice(step, "memory" if step is not None else "none",
                            "the newest step every rank holds in memory" if step is not None else "no snapshot")
    memory = gather_steps(local_steps)
    listed = durable.complete_steps(expect=expect)
    # -1: this rank could not list the durable storage (steps are >= 0)
    stored = gather_steps([-1] if listed is None else listed)
    unreachable = [r for r, steps in enumerate(stored) if -1 in steps]
    stored = [[s for s in steps if s >= 0] for steps in stored]
    choice = choose_resume_source(memory, stored, rank if len(memory) > 1 else 0)
    if unreachable:
        choice = ResumeChoice(choice.step, choice.tier,
                              f"{choice.reason}; rank(s) {unreachable} could not list the durable storage",
                              durable_listed_everywhere=False)
    if choice.step is not None:
        log.info("rank %s: resume step %d from the %s tier: %s", rank, choice.step, choice.tier, choice.reason)
    else:
        log.info("rank %s: nothing to resume from: %s", rank, choice.reason)
    return choice


def bring_into_memory(choice: ResumeChoice, durable: DurableTier | None, store: SnapshotStore,
                      expect: ExpectedIdentity | None = None) -> None:
    """After :func:`agree_across_tiers` (with the same ``expect``): download this rank's durable
    shard when the choice says so.

    Collective with a durable tier (every rank calls it after the same agreement): the ranks
    then tell each other whether they have the step, so a failed download on one rank stops
    every rank with the same error instead of leaving the others waiting in the next collective.
    """
    error: Exception | None = None
    if choice.tier == "durable" and choice.step is not None:
        try:
            if durable is None:
                raise RuntimeError("resume from the durable tier without a durable tier configured")
            durable.fetch_into(choice.step, store.rank, store, expect)
        except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised
            log.error("rank %d: cannot download durable step %s: %s: %s", store.rank, choice.step,
                      type(exc).__name__, exc)
            error = exc
    if durable is None:
        if error is not None:
            raise error
        return
    failed = [r for r, flags in enumerate(gather_steps([0 if error is None else 1])) if flags and flags[0]]
    if failed:
        raise RuntimeError(f"rank(s) {failed} could not get step {choice.step} from durable storage "
                           f"({durable.target.url}); no rank resumes (see those ranks' logs)") from error
