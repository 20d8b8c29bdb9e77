"""Who is a straggler and what to do about it: pure decisions on plain numbers.

A rank's *own work* in a step is the time it spends on the step itself -- loading the batch,
forward, backward, the optimizer -- and not waiting for its peers in the gradient all-reduce.
In synchronous data parallelism every rank finishes a step together, so only own work tells a
slow rank from the ranks that wait for it.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: ranks whose own work is within this factor of their peers' are never evicted (jitter, a slower model of GPU)
NEVER_BELOW = 1.3
#: share of a window's steps that may be fast for a slow rank to still count as persistently slow
SPIKE_SHARE = 0.2


@dataclass(frozen=True)
class WorkSummary:
    """One rank's own work over its last ``count`` steps (at most a window)."""

    #: the last step it measured
    step: int
    #: how many steps the figures cover
    count: int
    #: median own work per step (seconds)
    median: float
    #: own work that 80 % of the steps reached (the SPIKE_SHARE-quantile; seconds)
    low: float
    #: median time per step spent waiting for the peers (seconds)
    wait: float


def summarize(step: int, work: Sequence[float], wait: Sequence[float]) -> WorkSummary:
    """The summary of per-step own ``work`` and ``wait`` seconds (oldest first), ending at ``step``."""
    if not work:
        return WorkSummary(step, 0, 0.0, 0.0, 0.0)
    ordered = sorted(work)
    low = ordered[int(SPIKE_SHARE * len(ordered))]
    return WorkSummary(step, len(work), statistics.median(work), low, statistics.median(wait) if wait else 0.0)


@dataclass(frozen=True)
class StragglerVerdict:
    """Each rank's score (its own work over the median of its peers'), and the straggler if any."""

    scores: dict[int, float]
    straggler: int | None
    reason: str


def judge(summaries: Mapping[int, WorkSummary], factor: float, window: int) -> StragglerVerdict:
    """Is one rank persistently slower than its peers?

    Every rank needs a full ``window`` of steps. A rank's score is its median own work over the
    median of its peers' medians. The straggler is the rank with the highest score whose
    own work stayed at or above ``max(factor, NEVER_BELOW)`` times its peers' median in at least
    80 % of the window's steps (its low quantile): a spike in a few steps -- a data-loading
    hiccup, a snapshot, a garbage collection -- is not enough. Ties go to the lower rank.
    """
    threshold = max(factor, NEVER_BELOW)
    if len(summaries) < 2:
        return StragglerVerdict({}, None, "fewer than two ranks measured")
    short = sorted(rank for rank, s in summaries.items() if s.count < window)
    peers = {rank: statistics.median(s.median for other, s in summaries.items() if other != rank)
             for rank in summaries}
    scores = {rank: summary.median / peers[rank] if peers[rank] > 0 else 0.0 for rank, summary in summaries.items()}
    if short:
        return StragglerVerdict(scores, None, f"rank(s) {short} measured fewer than {window} steps")
    candidates = [(-scores[rank], rank) for rank, summary in summaries.items()
                  if peers[rank] > 0 and summary.low >= threshold * peers[rank]]
    if not candidates:
        top = max(scores, key=lambda r: (scores[r], -r))
        return StragglerVerdict(scores, None, f"highest score {scores[top]:.2f} (rank {top}) stays below "
                                              f"{threshold:g} in 80 % of {window} steps")
    _, rank = min(candidates)
    return StragglerVerdict(scores, rank, f"rank {rank}'s own work per step is {scores[rank]:.2f}x its peers' "
                                          f"median (>= {threshold:g}x in at least 80 % of the last {window} steps)")


class StragglerAction(enum.Enum):
    NONE = "none"
    #: tell: a warning and an event (no spare, or an eviction too recent)
    WARN = "warn"
    #: evict the straggler: it leaves, a hot spare takes its place
    EVICT = "evict"


def decide(verdict: StragglerVerdict, spares: int, step: int, last_eviction_step: int | None,
           window: int, authenticated: bool = True) -> tuple[StragglerAction, str]:
    """What to do about ``verdict`` at ``step``: evict only with a hot spare to take the place
    (so the job never shrinks below its actives, hence never below ``min_nodes``), at most once
    per ``window`` steps, and only in a job whose store values are ``authenticated`` (a job
    secret: without one an eviction in the store could be anyone's, so none is written or
    obeyed); else warn."""
    if verdict.straggler is None:
        return StragglerAction.NONE, verdict.reason
    if spares < 1:
        return StragglerAction.WARN, f"{verdict.reason}; no hot spare to replace it, so it stays"
    if not authenticated:
        return StragglerAction.WARN, (f"{verdict.reason}; this job has no secret, so straggler eviction only warns "
                                      "(an eviction in the store could be forged)")
    if last_eviction_step is not None and step - last_eviction_step < window:
        return StragglerAction.WARN, (f"{verdict.reason}; an eviction at step {last_eviction_step} is less than "
                                      f"{window} steps ago")
    return StragglerAction.EVICT, f"{verdict.reason}; a hot spare takes its place"
