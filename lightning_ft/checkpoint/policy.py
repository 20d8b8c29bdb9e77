"""Pure decisions of the snapshot layer: no I/O, no clocks, no torch.distributed.

Everything here takes plain values and returns plain values, so the rules can be unit
tested exhaustively and the I/O code around them stays thin.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_ft.checkpoint.identity import (
    ExpectedIdentity,
    SnapshotIdentity,
    identity_mismatch,
)
from lightning_ft.schema.round import ReplicaMeta


def snapshots_to_delete(steps: Iterable[int], keep_last: int, protect: int | None = None) -> list[int]:
    """Steps to remove so that only the newest ``keep_last`` remain (``protect`` is never removed).

    ``protect`` is the snapshot just written: after a resume from an older step it can be
    older than leftovers, and deleting the state we just saved would be absurd.
    """
    ordered = sorted(set(steps), reverse=True)
    keep = set(ordered[:keep_last])
    if protect is not None:
        keep.add(protect)
        while len(keep) > keep_last and len(keep - {protect}) > 0:
            keep.discard(min(keep - {protect}))
    return sorted(s for s in ordered if s not in keep)


@dataclass(frozen=True)
class WritePlan:
    """How to write the snapshot for ``step``: which committed file to recycle, what to prune."""

    recycle: int | None
    delete_after_commit: list[int]


def plan_write(existing: Iterable[int], step: int, keep_last: int, held: Iterable[int] = ()) -> WritePlan:
    """Decide which committed snapshot (if any) can be overwritten in place for ``step``.

    Recycling a file that is about to be pruned anyway keeps its shared-memory pages
    allocated, which makes the copy ~3x faster than writing a fresh tmpfs file (page
    allocation dominates). A file is only recycled if another committed snapshot stays
    valid during the write, so a crash mid-write never leaves zero snapshots. ``held``
    steps are being read by someone else (the durable tier's upload): they may be removed
    (the reader keeps its open file) but never overwritten.
    """
    existing = sorted(set(existing))
    doomed = snapshots_to_delete([*existing, step], keep_last, protect=step)
    candidates = sorted((set(doomed) | ({step} & set(existing))) - set(held))
    recycle = None
    for cand in candidates:
        if any(s != cand for s in existing):
            recycle = cand
            break
    delete = [s for s in doomed if s != recycle]
    return WritePlan(recycle=recycle, delete_after_commit=delete)


def choose_resume_step(readable_per_rank: Sequence[Iterable[int]]) -> int | None:
    """Newest step that every rank can read, or None.

    All ranks run this on the same all-gathered input, so they reach the same answer
    without a second round of communication.
    """
    if not readable_per_rank:
        return None
    common = set(readable_per_rank[0])
    for steps in readable_per_rank[1:]:
        common &= set(steps)
    return max(common) if common else None


def steps_between_snapshots(every_n_seconds: float, seconds_per_step: float) -> int:
    """Step interval for a time-based schedule, rounded DOWN to a power of two.

    Ranks measure their own step time and never talk about it. A power-of-two interval
    means that if two ranks' estimates differ by up to 2x, the larger interval is a
    multiple of the smaller one, so they still write snapshots at common steps (and with
    keep_last >= 2 the newest common one is always retained). Rounding down keeps the
    loss window within ``every_n_seconds``.
    """
    if seconds_per_step <= 0:
        return 1
    ratio = every_n_seconds / seconds_per_step
    if ratio < 2:
        return 1
    return 1 << int(math.floor(math.log2(ratio)))


def snapshot_due(step: int, last_saved_step: int | None, every_n_steps: int | None,
                 time_interval_steps: int | None) -> bool:
    """Whether a periodic snapshot is due at ``step`` (a completed global step)."""
    if step <= 0 or step == last_saved_step:
        return False
    if every_n_steps is not None and step % every_n_steps == 0:
        return True
    return time_interval_steps is not None and step % time_interval_steps == 0


def pick_disk_checkpoint(candidates: Iterable[tuple[str, float]]) -> str | None:
    """Newest disk checkpoint by modification time from ``(path, mtime)`` pairs."""
    best = max(candidates, key=lambda pm: (pm[1], pm[0]), default=None)
    return best[0] if best else None


MEM_SCHEME = "mem://"


def parse_mem_url(path: object) -> Literal["latest"] | int | None:
    """``"mem://latest"`` (or ``"mem://"``) -> "latest", ``"mem://<step>"`` -> step, other paths -> None."""
    if not isinstance(path, str) or not path.startswith(MEM_SCHEME):
        return None
    rest = path[len(MEM_SCHEME):].strip("/")
    if rest in ("", "latest"):
        return "latest"
    if rest.isdigit():
        return int(rest)
    raise ValueError(f"bad in-memory checkpoint path {path!r}: expected 'mem://latest' or 'mem://<step>'")


def spare_needed(committed: int, keep_last: int) -> bool:
    """Whether the next snapshot would have to go into a fresh file (no file to recycle).

    Mirrors ``plan_write``: the next step recycles only when ``committed >= keep_last`` (one
    is doomed) and another one stays valid during the write (``committed >= 2``). Otherwise a
    preallocated spare file keeps the emergency save off the slow page-allocation path.
    """
    return committed < max(keep_last, 2)


# ---------------------------------------------------------------------- moving snapshots between ranks


@dataclass(frozen=True)
class TransferPlan:
    """Send the snapshot of ``step`` from ``source`` to every rank in ``receivers``."""

    step: int
    source: int
    receivers: tuple[int, ...]


def plan_snapshot_transfer(steps_per_rank: Sequence[Iterable[int]]) -> TransferPlan | None:
    """After a round forms: which snapshot to resume from and who must receive it.

    The newest step any rank holds wins (a survivor's newest state, not the newest state
    every rank happens to hold): ranks of one DDP job hold identical state per step, so a
    copy from any holder is as good as one's own. The lowest holder rank sends. ``None``
    when no rank holds a snapshot (fresh start).
    """
    held = [set(steps) for steps in steps_per_rank]
    every = set().union(*held) if held else set()
    if not every:
        return None
    newest = max(every)
    holders = [rank for rank, steps in enumerate(held) if newest in steps]
    receivers = tuple(rank for rank, steps in enumerate(held) if newest not in steps)
    return TransferPlan(newest, holders[0], receivers)


@dataclass(frozen=True)
class ShardTransferPlan:
    """Sharded state: resume at ``step``; each ``(source, receiver)`` sends rank ``receiver``'s
    shards of that step, which ``source`` holds and ``receiver`` lacks."""

    step: int
    transfers: tuple[tuple[int, int], ...]


def plan_shard_transfers(held_per_rank: Sequence[Iterable[tuple[int, int]]]) -> ShardTransferPlan | None:
    """After a group of sharded ranks forms: the step to resume from and the shards to move.

    ``held_per_rank[r]``: the ``(shard_rank, step)`` snapshots rank ``r`` can read (its own and
    those of other ranks on its host). Unlike replicated state, a step is usable only when every
    rank's shards of it exist somewhere: the newest such step wins (a newer step that lacks a
    shard would resume a model mixed from two steps). Each rank that lacks its own shards of
    that step receives them from the lowest rank that holds them -- a relaunch that placed the
    participants in another order, or a rank that replaced a lost one. ``None``: no complete step.
    """
    held = [set(pairs) for pairs in held_per_rank]
    world = len(held)
    holders: dict[tuple[int, int], list[int]] = {}
    for rank, pairs in enumerate(held):
        for shard, step in pairs:
            if 0 <= shard < world:  # shards of a larger world belong to no rank of this one
                holders.setdefault((shard, step), []).append(rank)
    complete = [step for step in {step for _, step in holders}
                if all((shard, step) in holders for shard in range(world))]
    if not complete:
        return None
    step = max(complete)
    transfers = tuple((holders[(rank, step)][0], rank) for rank in range(world) if (rank, step) not in held[rank])
    return ShardTransferPlan(step, transfers)


def replica_needed(active_domains: Sequence[str], factor: int) -> bool:
    """Does the newest snapshot need copies beyond the actives' own?

    Every DDP rank snapshots the same state, so each active already holds a copy.
    Extra copies (to hot spares) are needed while fewer than ``factor + 1`` participants,
    or fewer than ``factor + 1`` distinct failure domains, hold one: then losing one
    node (domain) could lose the newest state. ``factor`` = copies on *other*
    participants wanted for each snapshot.
    """
    if factor <= 0:
        return False
    return len(active_domains) < factor + 1 or len(set(active_domains)) < factor + 1


def should_pull_replica(my_domain: str, active_domains: Sequence[str], factor: int,
                        spare_index: int) -> bool:
    """Should this hot spare keep a copy of the published snapshot?

    A spare in a domain no active covers adds a failure domain and always pulls. Others
    pull only while the copy count is short, the first ``missing`` spares (by their index
    among spares, so spares need not talk to each other; a few extra copies are harmless).
    """
    if not replica_needed(active_domains, factor):
        return False
    if my_domain not in set(active_domains):
        return True
    missing = factor + 1 - len(active_domains)
    return spare_index < missing


#: chunk sizes a hot spare accepts in a replica's meta: it holds the snapshot plus one chunk
REPLICA_CHUNK_RANGE = (4096, 64 << 20)


def replica_refusal(meta: ReplicaMeta, expected: ExpectedIdentity, max_bytes: int) -> str | None:
    """Why a hot spare must not take the replica ``meta`` announces, from the meta alone (before
    any of its bytes is read or any memory is set aside for them); None if it may.

    A copy of another run or model would be kept as this job's newest step and chosen to
    resume from, then skipped by every rank at the resume (the model check): the job would
    restart from nothing. One larger than ``max_bytes`` (the spare's ``replica_max_bytes``)
    would take memory the spare never agreed to hold.
    """
    announced = SnapshotIdentity(run_id=meta.run_id, rank=0, step=meta.step, model=meta.model)
    mismatch = identity_mismatch(announced, expected)
    if mismatch is not None:
        return mismatch
    if meta.nbytes > max_bytes:
        return f"it announces {meta.nbytes} bytes, more than replica_max_bytes={max_bytes}"
    low, high = REPLICA_CHUNK_RANGE
    if not low <= meta.chunk_bytes <= high:
        return f"it announces chunks of {meta.chunk_bytes} bytes, outside {low}..{high}"
    return None


def replica_header_mismatch(meta: ReplicaMeta, header_step: int, header_bytes: int,
                            found: SnapshotIdentity) -> str | None:
    """Why a replica whose first chunk holds this header and identity is not what its meta
    announced (checked before the rest is read or allocated); None if it is."""
    for what, announced, held in (("step", meta.step, header_step), ("size", meta.nbytes, header_bytes),
                                  ("run id", meta.run_id, found.run_id), ("model", meta.model, found.model)):
        if announced != held:
            return f"its meta announces {what} {announced!r}, its snapshot header holds {held!r}"
    return None


def plan_shard_replicas(domains: Sequence[str], factor: int) -> tuple[tuple[int, ...], ...]:
    """Sharded state: which ranks keep a copy of each rank's snapshot (``holders[r]``).

    ``domains[r]``: rank ``r``'s failure domain. A copy helps only in another domain (one domain
    holds its ranks' snapshots in its own memory already), so the copies of a rank go to up to
    ``factor`` other domains, each a different one: a ring over the domains (in order of their
    first rank), each rank's copy to the rank at its own position in the next domain, so equal
    domains share the copies evenly. Fewer than ``factor`` other domains: fewer copies (none with
    one domain).
    """
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for rank, domain in enumerate(domains):
        if domain not in members:
            order.append(domain)
            members[domain] = []
        members[domain].append(rank)
    holders = []
    for rank, domain in enumerate(domains):
        here = order.index(domain)
        position = members[domain].index(rank)
        chosen = []
        for hop in range(1, min(factor, len(order) - 1) + 1):
            other = members[order[(here + hop) % len(order)]]
            chosen.append(other[position % len(other)])
        holders.append(tuple(chosen))
    return tuple(holders)
