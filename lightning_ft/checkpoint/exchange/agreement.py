"""Choosing the snapshot to resume from, consistently across ranks."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.identity import ExpectedIdentity
from lightning_ft.checkpoint.memory.format import SnapshotError
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import choose_resume_step
from lightning_ft.checkpoint.tiers import (
    FETCH_DAMAGED,
    FETCH_FAILED,
    FETCH_OK,
    ResumeChoice,
    choose_resume_source,
    damage_message,
    judge_downloads,
    with_damage,
)

if TYPE_CHECKING:
    from lightning_ft.checkpoint.durable.tier import DurableTier

log = logging.getLogger(__name__)

#: bytes of a rank's reason for a failed download that every rank is told (the rest stays in its log)
_WHY_BYTES = 400


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
                       expect: ExpectedIdentity | None = None, below: int | None = None) -> ResumeChoice:
    """The step every rank resumes from and where this rank gets it (collective without a durable
    tier: one gather, as :func:`agree_on_step`; with one: two gathers, memory and durable steps;
    durable steps only of ``expect``'s model when given; only steps before ``below`` when given).

    Every rank of a job must pass a durable tier or none (the setting is per job). Logs one line
    saying which tier and why.
    """
    local_steps = [s for s in local_steps if below is None or s < below]
    if durable is None:
        step = agree_on_step(local_steps, rank)
        return ResumeChoice(step, "memory" if step is not None else "none",
                            "the newest step every rank holds in memory" if step is not None else "no snapshot")
    memory = gather_steps(local_steps)
    listed = durable.complete_steps(expect=expect)
    if listed is not None and below is not None:
        listed = [s for s in listed if s < below]
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


def _fetch(choice: ResumeChoice, durable: DurableTier | None, store: SnapshotStore,
           expect: ExpectedIdentity | None) -> tuple[int, str, Exception | None]:
    """This rank's download of the agreed step when the choice says so: (FETCH_* code, why, error).

    Damaged means the copy is there and is not what its manifest says (size, checksum, contents:
    :class:`SnapshotError`); anything else (unreachable storage, a missing shard) is unknown.
    """
    if choice.tier != "durable" or choice.step is None:
        return FETCH_OK, "", None
    try:
        if durable is None:
            raise RuntimeError("resume from the durable tier without a durable tier configured")
        durable.fetch_into(choice.step, store.rank, store, expect)
    except SnapshotError as exc:
        return FETCH_DAMAGED, str(exc), exc
    except Exception as exc:  # noqa: BLE001 - told to every rank, then raised
        log.error("rank %d: cannot download durable step %s: %s: %s", store.rank, choice.step,
                  type(exc).__name__, exc)
        return FETCH_FAILED, f"{type(exc).__name__}: {exc}", exc
    return FETCH_OK, "", None


def _download(choice: ResumeChoice, durable: DurableTier | None, store: SnapshotStore,
              expect: ExpectedIdentity | None) -> list[tuple[int, str]]:
    """Download this rank's shard when the choice says so; the (rank, why) of every rank that found
    its copy damaged (collective with a durable tier: one gather of every rank's code and reason).

    Raises the same RuntimeError on every rank when a download failed for another reason, so no
    rank is left waiting in the next collective.
    """
    code, why, error = _fetch(choice, durable, store, expect)
    if durable is None:
        if error is not None:
            raise error
        return []
    told = gather_steps([code, *why.encode()[:_WHY_BYTES]])
    failed, damaged = judge_downloads([(v[0], bytes(v[1:]).decode(errors="replace")) for v in told])
    if failed:
        raise RuntimeError(f"rank(s) {failed} could not get step {choice.step} from durable storage "
                           f"({durable.target.url}); no rank resumes (see those ranks' logs)") from error
    return damaged


def resume_from_newest_intact(local_steps: Sequence[int], durable: DurableTier | None, store: SnapshotStore,
                              rank: int, expect: ExpectedIdentity | None = None,
                              newer_than: int | None = None) -> ResumeChoice:
    """Agree on the newest step every rank can get and bring it into memory; when a rank finds its
    durable copy of it damaged, agree again below it (collective: every rank calls it, and every
    rank takes the same path, since each round's outcome is gathered).

    Bounded: every round agrees on a step older than the last, and only durable copies can be
    damaged, so there are at most as many rounds as durable steps. Then one WARNING line per rank
    names the damaged steps, the ranks that found them and why, and the step agreed below them;
    the choice returned names them too (``damaged``). When none is left intact its step is None,
    and the caller must not start from step 0 silently
    (:func:`~lightning_ft.checkpoint.tiers.every_copy_damaged`). A choice not newer than
    ``newer_than`` (the step already loaded from ``ckpt_path``) is returned without downloading it.
    """
    damaged: dict[int, str] = {}
    below: int | None = None
    while True:
        choice = with_damage(agree_across_tiers(local_steps, durable, rank, expect, below), damaged)
        step = choice.step
        taken = step is not None and (newer_than is None or step > newer_than)
        found = _download(choice, durable, store, expect) if taken else []
        if step is None or not found:
            if choice.damaged:
                log.warning("rank %d: %s", rank, damage_message(choice.damaged, step, taken))
            return choice
        damaged[step] = "; ".join(f"rank {r}: {why}" for r, why in found)
        below = step
