"""Pure decisions about the checkpoint tiers: memory -> a peer's copy -> durable storage.

No I/O, no clocks, no torch.distributed: callers read the world into plain values (steps,
markers, sizes, measured seconds), ask, and perform the answer. Covered by unit tests on
plain values (``tests/test_checkpoint_tiers.py``).

Vocabulary:

* a *shard* is one rank's snapshot file of one step, copied verbatim to durable storage;
* a *timeline* is one stretch of training between two resumes, named by a random token rank 0
  broadcasts when ``fit()`` starts. Shards of one step written by different timelines (a step
  trained again after a failure) are never combined into one durable step. On storage it is the
  directory under a step and the field named ``segment`` of markers and manifests (the name
  earlier versions gave it, kept so that what they wrote stays readable);
* a durable step is *complete* when every rank ``0..world_size-1`` of one timeline has a done
  marker for it (written only after its shard was uploaded and verified); the job-level
  manifest of the step is written after that, and only manifests are read on resume.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_ft.checkpoint.policy import steps_between_snapshots

# ---------------------------------------------------------------------- durable completeness


@dataclass(frozen=True)
class ShardMarker:
    """What a done marker says: this rank's shard of ``step`` (written by ``timeline``) is durable."""

    step: int
    timeline: str
    rank: int
    world_size: int
    nbytes: int
    #: the shard's checksum (``snapshot-crc32:<hex>``: its snapshot header's CRC, see durable.shard_checksum)
    checksum: str = ""
    #: the fingerprint of the model the shard holds (identity.model_fingerprint)
    model: str = ""


@dataclass(frozen=True)
class Completion:
    """A durable step whose every shard is durable: the timeline that wrote them and its world size."""

    step: int
    timeline: str
    world_size: int
    #: (rank, shard size in bytes, checksum), one per rank in rank order
    shards: tuple[tuple[int, int, str], ...]
    #: the fingerprint of the model every shard holds
    model: str = ""


def complete_steps(markers: Iterable[ShardMarker]) -> dict[int, Completion]:
    """Steps whose shards of one timeline cover ranks ``0..W-1`` with one agreed world size ``W``
    and one model.

    Markers of different timelines never combine (a step trained twice after a failure may hold
    other bytes). When several timelines completed the same step, the greatest timeline token
    wins, so every caller picks the same one.
    """
    groups: dict[tuple[int, str], dict[int, ShardMarker]] = {}
    for marker in markers:
        groups.setdefault((marker.step, marker.timeline), {})[marker.rank] = marker
    result: dict[int, Completion] = {}
    for (step, timeline), by_rank in sorted(groups.items()):
        worlds = {m.world_size for m in by_rank.values()}
        models = {m.model for m in by_rank.values()}
        if len(worlds) != 1 or len(models) != 1:
            continue
        world = worlds.pop()
        if world < 1 or set(by_rank) != set(range(world)):
            continue
        result[step] = Completion(step, timeline, world,
                                  tuple((r, by_rank[r].nbytes, by_rank[r].checksum) for r in range(world)),
                                  models.pop())
    return result


@dataclass(frozen=True)
class RetentionPlan:
    """What to remove from durable storage, in this order: manifests first, then shard directories."""

    manifests: list[int] = field(default_factory=list)
    #: whole step directories (every timeline in them)
    step_dirs: list[int] = field(default_factory=list)
    #: (step, timeline) directories of kept steps that the step's manifest does not name
    timeline_dirs: list[tuple[int, str]] = field(default_factory=list)


def plan_durable_retention(manifests: Mapping[int, str], step_dirs: Iterable[int],
                           timelines_of_kept: Mapping[int, Iterable[str]], keep_last: int) -> RetentionPlan:
    """Keep the newest ``keep_last`` complete steps (``manifests``: step -> timeline) and what they name.

    * manifests beyond the newest ``keep_last`` go (never the newest one: ``keep_last >= 1``);
    * a step directory goes when it is older than the newest complete step and no kept manifest
      names it: a torn or abandoned upload (a rank killed mid-upload, a step of a timeline
      abandoned by a resume). Newer incomplete steps stay: their uploads may be in flight;
    * in a kept step's directory, timelines its manifest does not name go (the same step
      uploaded by a timeline that never completed it).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    complete = sorted(manifests)
    if not complete:
        return RetentionPlan()
    kept = set(complete[-keep_last:])
    newest = complete[-1]
    drop_manifests = [s for s in complete if s not in kept]
    drop_dirs = sorted(s for s in set(step_dirs) if s < newest and s not in kept)
    drop_timelines = sorted((s, t) for s in kept for t in timelines_of_kept.get(s, ()) if t != manifests[s])
    return RetentionPlan(drop_manifests, drop_dirs, drop_timelines)


def abandoned_manifests(manifests: Mapping[int, str], resumed_step: int, current_timeline: str) -> list[int]:
    """Complete steps newer than the step training resumed from, written by another timeline.

    They belong to a timeline the job left (it resumed from an older state, e.g. an explicit
    ``ckpt_path``); keeping them would make the next restart jump onto that timeline.
    """
    return sorted(s for s, t in manifests.items() if s > resumed_step and t != current_timeline)


# ---------------------------------------------------------------------- resume: which tier


@dataclass(frozen=True)
class ResumeChoice:
    """The step every rank resumes from, where this rank gets it, and why (for the log line)."""

    step: int | None
    tier: str  # "memory" | "durable" | "none"
    reason: str
    #: every rank could list the durable storage (so what it lacks is really not there)
    durable_listed_everywhere: bool = True
    #: (step, why) of the newer durable steps found damaged on download, newest first
    damaged: tuple[tuple[int, str], ...] = ()


def _newest(steps: Iterable[int]) -> str:
    steps = list(steps)
    return f"step {max(steps)}" if steps else "nothing"


def choose_resume_source(memory_per_rank: Sequence[Iterable[int]], durable_per_rank: Sequence[Iterable[int]],
                         rank: int) -> ResumeChoice:
    """The newest step every rank can get, from its memory tier (own or a peer's copy) or durably.

    ``memory_per_rank[r]``: steps rank ``r`` can read from memory (its own directory and peers'
    on its host); ``durable_per_rank[r]``: complete durable steps rank ``r`` can list (a rank
    that cannot reach the durable storage reports none). Every rank calls this with the same
    all-gathered input, so all choose the same step; each then takes it from its own memory
    when it has it (cheapest), else from durable storage.
    """
    if len(memory_per_rank) != len(durable_per_rank) or not memory_per_rank:
        raise ValueError("memory_per_rank and durable_per_rank must have one entry per rank")
    memory = [set(m) for m in memory_per_rank]
    durable = [set(d) for d in durable_per_rank]
    common = set.intersection(*(m | d for m, d in zip(memory, durable, strict=True)))
    mine_mem, mine_dur = memory[rank], durable[rank]
    if not common:
        detail = f"memory here holds {_newest(mine_mem)}, durable storage {_newest(mine_dur)}"
        if any(memory) or any(durable):
            return ResumeChoice(None, "none", f"no step every rank can get ({detail})")
        return ResumeChoice(None, "none", "no snapshot in memory or durable storage")
    step = max(common)
    in_memory_everywhere = set.intersection(*memory) if memory else set()
    if step in mine_mem:
        why = ("the newest step every rank holds in memory" if step in in_memory_everywhere
               else "the newest step every rank can get (some ranks take it from durable storage)")
        newer_durable = [s for s in mine_dur if s > step]
        extra = f"; durable storage has newer {max(newer_durable)} but not every rank can get it" \
            if newer_durable else ""
        return ResumeChoice(step, "memory", f"{why}{extra}")
    return ResumeChoice(step, "durable",
                        f"the newest step every rank can get; memory here holds {_newest(mine_mem)} "
                        f"(an empty memory tier means a new node or a lost /dev/shm)")


#: what one rank's download of the agreed durable step came to (one code per rank, gathered)
FETCH_OK, FETCH_FAILED, FETCH_DAMAGED = 0, 1, 2


def judge_downloads(outcomes: Sequence[tuple[int, str]]) -> tuple[list[int], list[tuple[int, str]]]:
    """From every rank's (code, why) of its download: the ranks that stop the resume, and the
    (rank, why) of those that found the copy damaged.

    A download that failed for another reason (storage unreachable, a shard missing) is unknown,
    not damaged: then every rank that did not get the step stops the resume (as before damage was
    told apart). Only when every failure is damage may the ranks try an older step.
    """
    damaged = [(r, why) for r, (code, why) in enumerate(outcomes) if code == FETCH_DAMAGED]
    if any(code not in (FETCH_OK, FETCH_DAMAGED) for code, _ in outcomes):
        return [r for r, (code, _) in enumerate(outcomes) if code != FETCH_OK], damaged
    return [], damaged


def with_damage(choice: ResumeChoice, damaged: Mapping[int, str]) -> ResumeChoice:
    """``choice``, made below the durable steps found damaged (step -> why), naming them."""
    if not damaged:
        return choice
    steps = sorted(damaged, reverse=True)
    names = ", ".join(map(str, steps))
    reason = (f"{choice.reason}; newer durable step(s) {names} damaged" if choice.step is not None
              else f"every durable copy every rank can get is damaged (step(s) {names}); {choice.reason}")
    return ResumeChoice(choice.step, choice.tier, reason, choice.durable_listed_everywhere,
                        tuple((s, damaged[s]) for s in steps))


def damage_message(damaged: Sequence[tuple[int, str]], step: int | None, taken: bool) -> str:
    """The one line after the durable steps ``damaged`` ((step, why), newest first) were passed
    over: which, why, and the step agreed below them (``taken``: resumed from, else not newer
    than the checkpoint already loaded; None: none)."""
    if len(damaged) == 1:
        what, it = f"durable step {damaged[0][0]} is damaged ({damaged[0][1]})", "it"
    else:
        what = (f"durable steps {', '.join(str(s) for s, _ in damaged)} are damaged ("
                + "; ".join(f"step {s}: {why}" for s, why in damaged) + ")")
        it = "them"
    if step is None:
        return f"{what}; no intact copy before {it} is left"
    if taken:
        return f"{what}; resuming from step {step}, the newest intact copy before {it}"
    return f"{what}; the newest step before {it} every rank can get is {step}, not newer than the checkpoint loaded"


def every_copy_damaged(damaged: Sequence[tuple[int, str]], where: str) -> str:
    """The error when nothing intact is left below the damaged durable steps: which, why, what to do."""
    steps = ", ".join(str(step) for step, _ in damaged)
    details = "; ".join(f"step {step}: {why}" for step, why in damaged)
    return (f"every durable copy every rank can get under {where} is damaged (steps {steps}) and no older snapshot "
            f"is left to resume from ({details}). Not starting from step 0 instead: to start over from step 0, "
            f"remove those steps' manifests (<run id>/manifests/) or use another run id")


# ---------------------------------------------------------------------- schedules


def power_of_two_at_least(value: float) -> int:
    """Smallest power of two >= ``value`` (1 for anything <= 1)."""
    if value <= 1:
        return 1
    return 1 << math.ceil(math.log2(value))


def snapshot_interval_for_budget(save_seconds: float, seconds_per_step: float, budget: float) -> int:
    """Steps between in-memory snapshots so that saving costs at most ``budget`` of training time.

    The smallest power of two ``n`` with ``save_seconds <= budget * n * seconds_per_step``: a
    save blocks training for ``save_seconds`` once every ``n`` steps. Powers of two let ranks
    whose estimates differ still share snapshot steps (the larger interval is a multiple of
    the smaller), and the ranks agree on the largest one anyway (see ``calibration_due``).
    """
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if seconds_per_step <= 0 or save_seconds <= 0:
        return 1
    return power_of_two_at_least(save_seconds / (budget * seconds_per_step))


def daly_interval_seconds(cost_seconds: float, mtbf_seconds: float) -> float:
    """Daly's optimal checkpoint interval (compute time between checkpoints) for cost ``C`` and MTBF ``M``.

    ``sqrt(2CM) * (1 + sqrt(C/2M)/3 + C/(18M)) - C`` for ``C < 2M``, else ``M`` (Daly 2006, the
    higher-order refinement of Young's ``sqrt(2CM)``). Never below ``2C``, so a durable copy
    is never due before the previous one could finish.
    """
    if mtbf_seconds <= 0:
        raise ValueError(f"mtbf_seconds must be > 0, got {mtbf_seconds}")
    c, m = max(cost_seconds, 0.0), float(mtbf_seconds)
    if c >= 2 * m:
        return max(m, 2 * c)
    t = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    return max(t, 2 * c)


def persist_interval_steps(interval_seconds: float, seconds_per_step: float, base_steps: int = 1) -> int:
    """Steps between durable copies: ``base_steps`` times a power of two covering ``interval_seconds``.

    ``base_steps`` is the explicit ``every_n_steps`` of the memory tier (1 otherwise), so a
    durable step is always a multiple of it; ranks agree on the largest value.
    """
    if base_steps < 1:
        raise ValueError(f"base_steps must be >= 1, got {base_steps}")
    if seconds_per_step <= 0:
        return base_steps
    return base_steps * power_of_two_at_least(interval_seconds / (seconds_per_step * base_steps))


#: steps after the start of a fit at which ranks agree on their intervals (one small collective each)
FIRST_CALIBRATION = 8

#: share of training time periodic in-memory snapshots may cost (the ``ddp_ft`` strategy's default schedule)
DEFAULT_SNAPSHOT_OVERHEAD = 0.005
#: mean time between failures of a whole job assumed for the durable tier's Daly interval
DEFAULT_MTBF_SECONDS = 4 * 3600.0


@dataclass(frozen=True)
class ScheduleProposal:
    """One rank's view of the snapshot schedule, from its own measurements (0: no opinion).

    Integers, so ranks exchange them as one small tensor (see :func:`agree_schedule`).
    """

    #: steps between snapshots so that saving stays within the overhead budget
    budget_steps: int = 0
    #: steps that fit into ``every_n_seconds`` (a power of two, rounded down)
    window_steps: int = 0
    #: steps between durable copies
    persist_steps: int = 0
    #: steps that fit into ``max_seconds_at_risk`` (a power of two, rounded down): the budget
    #: interval's bound where a lost rank's work since its last snapshot cannot be recovered
    risk_steps: int = 0

    def as_list(self) -> list[int]:
        return [self.budget_steps, self.window_steps, self.persist_steps, self.risk_steps]


@dataclass(frozen=True)
class Schedule:
    """What every rank uses until the next calibration point."""

    #: steps between periodic snapshots from ``every_n_seconds`` or the overhead budget (None: neither)
    snapshot_interval: int | None
    #: steps between durable copies (None: no durable tier); every durable step is a snapshot step
    persist_every: int | None
    #: the save budget's interval was lowered to this by ``max_seconds_at_risk`` (None: it was not)
    bounded_by_risk: bool = False


def propose_schedule(*, seconds_per_step: float | None, save_seconds: float | None, every_n_steps: int | None,
                     every_n_seconds: float | None, max_overhead: float | None,
                     persist_seconds: float | None, max_seconds_at_risk: float | None = None) -> ScheduleProposal:
    """This rank's proposal: the overhead budget applies only without an explicit schedule
    (``every_n_steps``/``every_n_seconds``); ``persist_seconds`` None means no durable tier;
    ``max_seconds_at_risk`` (None: no bound) caps the budget's interval, for state whose
    progress since the last snapshot dies with a lost rank (sharded state has no live copy)."""
    if not seconds_per_step or seconds_per_step <= 0:
        return ScheduleProposal()
    budget = risk = 0
    if max_overhead and every_n_steps is None and every_n_seconds is None and save_seconds is not None:
        budget = snapshot_interval_for_budget(save_seconds, seconds_per_step, max_overhead)
        if max_seconds_at_risk:
            risk = steps_between_snapshots(max_seconds_at_risk, seconds_per_step)
    window = steps_between_snapshots(every_n_seconds, seconds_per_step) if every_n_seconds else 0
    persist = 0
    if persist_seconds is not None:
        persist = persist_interval_steps(persist_seconds, seconds_per_step, every_n_steps or 1)
    return ScheduleProposal(budget, window, persist, risk)


def agree_schedule(proposals: Sequence[ScheduleProposal], every_n_steps: int | None) -> Schedule:
    """The schedule every rank adopts from every rank's proposal (each rank runs this on the same input).

    * ``every_n_seconds``: the smallest window interval, so no rank's loss window exceeds it;
    * the overhead budget: the largest budget interval, so no rank's saves exceed the budget,
      but at most the smallest ``risk_steps``, so no rank risks more than ``max_seconds_at_risk``
      of work (the bound wins over the budget: losing the work costs more than saving it);
    * durable copies: the largest interval, raised to a multiple of the snapshot interval (both
      are powers of two, or multiples of ``every_n_steps`` by a power of two) so every durable
      step is a step every rank snapshots.
    """
    windows = [p.window_steps for p in proposals if p.window_steps > 0]
    budgets = [p.budget_steps for p in proposals if p.budget_steps > 0]
    interval = min(windows) if windows else max(budgets) if budgets else None
    risks = [p.risk_steps for p in proposals if p.risk_steps > 0]
    bounded = not windows and interval is not None and bool(risks) and min(risks) < interval
    if bounded:
        interval = min(risks)
    persists = [p.persist_steps for p in proposals if p.persist_steps > 0]
    persist = max(persists) if persists else None
    if persist is not None and every_n_steps is None and interval is not None:
        persist = max(persist, interval)
    return Schedule(interval, persist, bounded)


def durable_copy_seconds(nbytes: int, measured_bytes_per_second: float | None,
                         max_bytes_per_second: float | None) -> float:
    """Expected time of one durable copy: measured rate, else the bandwidth bound, else 1 GiB/s."""
    rate = measured_bytes_per_second or max_bytes_per_second or float(2**30)
    return nbytes / rate



def calibration_due(step: int, start_step: int) -> bool:
    """Whether ``step`` is a calibration point of a fit that started at ``start_step``.

    Offsets 8, 16, 32, 64, ...: early enough that the first snapshot comes soon, then ever
    rarer (about log2(steps) small collectives over a whole run) while the measured step and
    save times settle. Every rank reaches the same global steps, so all calibrate together.
    """
    offset = step - start_step
    return offset >= FIRST_CALIBRATION and offset & (offset - 1) == 0


def persist_due(step: int, persist_every: int | None) -> bool:
    """A durable copy is due at ``step`` (a step every rank snapshots, so shards line up)."""
    return persist_every is not None and persist_every >= 1 and step > 0 and step % persist_every == 0


# ---------------------------------------------------------------------- SIGTERM: flush or not


def flush_fits(nbytes: int, measured_bytes_per_second: float | None, budget_left_s: float,
               safety_factor: float = 1.5) -> tuple[bool, str]:
    """Whether a durable copy of ``nbytes`` fits into what is left of the grace period, and why.

    Unmeasured (no upload finished yet in this process): try, bounded by the deadline (the
    upload is cancelled when the time is up and the step is then not durable).
    """
    if budget_left_s <= 0:
        return False, f"no time left for a durable copy ({budget_left_s:.2f} s)"
    if not measured_bytes_per_second:
        return True, f"upload speed not measured yet; trying within {budget_left_s:.1f} s"
    needed = nbytes / measured_bytes_per_second * safety_factor
    if needed > budget_left_s:
        return False, (f"a durable copy would not fit: needs ~{needed:.2f} s at the measured "
                       f"{measured_bytes_per_second / 2**20:.0f} MiB/s (x{safety_factor:g}), "
                       f"{budget_left_s:.2f} s left")
    return True, f"durable copy needs ~{needed:.2f} s, {budget_left_s:.2f} s left"


# ---------------------------------------------------------------------- is the memory tier big enough


def snapshot_copies(keep_last: int, preallocate: bool, persisting: bool) -> int:
    """Snapshot files one rank can hold at once in its root: the kept ones, the spare, and
    (durable tier on) the one being uploaded plus the one waiting for it."""
    return keep_last + (1 if preallocate else 0) + (2 if persisting else 0)


def space_shortfall(free_bytes: int, reusable_bytes: int, snapshot_bytes: int, copies: int,
                    ranks_sharing: int = 1) -> int:
    """Bytes missing for ``copies`` snapshots of ``snapshot_bytes`` per rank (0: it fits).

    ``reusable_bytes``: what this run's existing snapshot files there already occupy (they are
    overwritten or pruned, so they count as room); ``ranks_sharing``: ranks of this host
    writing into the same filesystem.
    """
    need = snapshot_bytes * copies * max(1, ranks_sharing)
    return max(0, need - free_bytes - reusable_bytes)


def shard_rank_to_fetch(rank: int, world_size: int) -> int:
    """Whose shard of a durable step this rank downloads: its own, else rank 0's (the job now has
    more ranks than the one that wrote the step; DDP ranks hold the same state)."""
    return rank if 0 <= rank < world_size else 0


def upload_decision(busy_with: int | None, offered: int, last_uploaded: int | None) -> str:
    """What the uploader does with a newly committed snapshot of step ``offered``.

    ``"start"`` (idle), ``"supersede"`` (an upload is running: remember only the newest offer,
    started when the running one ends; an older waiting offer is dropped, a new snapshot never
    queues behind old ones), ``"skip"`` (that step is being or was uploaded already).
    """
    if offered == busy_with or offered == last_uploaded:
        return "skip"
    return "start" if busy_with is None else "supersede"


# ---------------------------------------------------------------------- protected or not


def protection_gaps(*, periodic: bool, persist_to: str | None, auto_resume: bool) -> list[str]:
    """What leaves a run's progress unprotected under these snapshot settings (empty: nothing).

    ``periodic``: periodic snapshots are taken (a step, time or overhead schedule); without
    them a failure goes back to the start of the round (or an older snapshot), and a durable
    tier copies nothing, since it copies periodic snapshots.
    """
    gaps = []
    if not periodic:
        gaps.append("no periodic snapshots (every_n_steps, every_n_seconds and max_overhead are all off), so a "
                    "failure loses every step since the start of the round")
        if persist_to:
            gaps.append(f"persist_to={persist_to} copies nothing: durable copies are made of periodic snapshots")
    if not auto_resume:
        gaps.append("auto_resume=False: a restart does not resume from the snapshots")
    return gaps


def first_durable_copy_due(offered_in_timeline: int) -> bool:
    """The first snapshot of a stretch of training is copied durably at once, whatever the
    interval, so that even a short run has a durable copy (every rank's first periodic snapshot
    is at the same step: the schedule is the same on every rank)."""
    return offered_in_timeline == 0
