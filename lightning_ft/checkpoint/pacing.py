"""Pure decisions about pacing durable uploads: the token bucket, and the upload rate that keeps
the steps overlapping an upload within their share of step time (``persist_max_overhead``).

No I/O, no clocks: the persister reads its measurements into plain values and asks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


def bucket_delay(tokens: float, elapsed_s: float, rate: float, burst: float, nbytes: int) -> tuple[float, float]:
    """Token bucket: (seconds to wait before sending ``nbytes``, tokens left once they are sent).

    ``tokens`` were left after the previous send, ``elapsed_s`` ago; the bucket refills at
    ``rate`` bytes/s up to ``burst``. A chunk larger than ``burst`` is allowed (after the
    wait that its size costs), so any chunk size works.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    available = min(burst, tokens + max(0.0, elapsed_s) * rate)
    if available >= nbytes:
        return 0.0, available - nbytes
    return (nbytes - available) / rate, 0.0


# ---------------------------------------------------------------------- upload pacing

#: share of step time the steps an upload overlaps may lose against the others (default)
DEFAULT_PERSIST_OVERHEAD = 0.02
#: the paced bound never goes below this (an upload must still finish)
PACING_FLOOR_BYTES_PER_SECOND = 16 * 2**20
#: the first upload's bound when pacing, at most the configured bound
PACING_START_BYTES_PER_SECOND = 64 * 2**20


def next_upload_rate(rate: float, slowdown: float, budget: float, floor: float, ceiling: float) -> float:
    """The upload bandwidth bound after the steps uploads overlapped were ``slowdown`` (0.03: 3 %)
    slower than the steps without one, for a ``budget`` of that share.

    Inside [budget/2, budget] the bound stays. Outside, it is scaled to aim at 3/4 of the budget,
    because the compute an upload costs is about proportional to the bytes it moves (measured in
    benchmarks/RESULTS.md: the same compute lost per copy at 64 to 512 MiB/s), so the slowdown is
    about proportional to the rate; by at most 4x down or 2x up per adjustment, so that one noisy
    measurement cannot swing it far. Always within [floor, ceiling].
    """
    floor = min(floor, ceiling)
    if budget / 2 <= slowdown <= budget:
        return min(ceiling, max(floor, rate))
    target = 0.75 * budget
    factor = min(2.0, max(0.25, target / max(slowdown, target / 2)))
    return min(ceiling, max(floor, rate * factor))


@dataclass(frozen=True)
class PacingVerdict:
    """One adjustment of the upload bandwidth bound and the measurement behind it."""

    #: None: the bound was raised to keep up with the copies, not judged by step times
    slowdown: float | None
    busy_steps: int
    idle_steps: int
    rate_before: float
    rate_after: float


class UploadPacer:
    """Keeps training steps that overlap an upload within ``budget`` of the steps that do not, by
    adjusting the upload bandwidth bound (bytes/s) between ``floor`` and ``ceiling``.

    Fed one step duration at a time with whether an upload ran through the whole step
    (:meth:`observe`). Step times are noisy (a few % from step to step is common) and the
    effect looked for is 2 %, so it acts only on evidence: the slowdown of the busy steps' mean
    over the idle steps' mean (each without its slowest tenth: an epoch end or a validation run
    inside one step is not the upload's doing), more than one standard error of that estimate
    above the budget (slower: training is protected on weaker evidence, a slower upload only
    makes the durable copy later) or two standard errors below half of it (faster). Until then it keeps
    collecting busy steps (the newest ``max_steps``) and the idle ones among the last
    ``idle_window`` steps (older ones would compare today's steps with a machine that was
    faster or slower then); after a verdict the busy ones start afresh, because the rate they
    were measured at changed. A verdict that would not move the bound (it is at a limit) is
    dropped the same way, without a verdict.

    ``keep_up`` (bytes/s, given with each step) raises the floor to what a copy needs to finish
    well inside the interval between copies: below it uploads would run back to back, leaving
    no idle steps to compare with and the durable copy ever further behind.
    """

    def __init__(self, ceiling: float, budget: float = DEFAULT_PERSIST_OVERHEAD,
                 floor: float = PACING_FLOOR_BYTES_PER_SECOND, start: float = PACING_START_BYTES_PER_SECOND,
                 min_steps: int = 8, max_steps: int = 512, idle_window: int = 256) -> None:
        if not ceiling > 0 or not 0 < budget < 1 or min_steps < 2:
            raise ValueError(f"need ceiling > 0, 0 < budget < 1 and min_steps >= 2, got {ceiling}, {budget} "
                             f"and {min_steps}")
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.budget = budget
        self.rate = min(ceiling, max(self.floor, start))
        self.min_steps = min_steps
        self.idle_window = idle_window
        self._steps = 0
        self._idle: deque[tuple[int, float]] = deque()  # (step count when seen, seconds)
        self._busy: deque[float] = deque(maxlen=max_steps)

    def observe(self, seconds: float, busy: bool, keep_up: float = 0.0) -> PacingVerdict | None:
        """Record one step; returns a verdict when the steps so far show the rate must change."""
        if not seconds > 0 or math.isinf(seconds):
            return None
        floor = min(self.ceiling, max(self.floor, keep_up))
        if self.rate < floor:
            # copies would run back to back: then no step is idle and no verdict could come
            verdict = PacingVerdict(None, len(self._busy), len(self._idle), self.rate, floor)
            self._busy.clear()
            self.rate = floor
            return verdict
        self._steps += 1
        if busy:
            self._busy.append(seconds)
        else:
            self._idle.append((self._steps, seconds))
        while self._idle and self._idle[0][0] <= self._steps - self.idle_window:
            self._idle.popleft()
        if len(self._busy) < self.min_steps or len(self._idle) < self.min_steps:
            return None
        idle = [s for _, s in self._idle]
        slowdown, error = slowdown_estimate(list(self._busy), idle)
        if slowdown - error <= self.budget and slowdown + 2 * error >= self.budget / 2:
            return None  # within the budget, or not yet clear
        rate = next_upload_rate(self.rate, slowdown, self.budget, floor, self.ceiling)
        verdict = PacingVerdict(slowdown, len(self._busy), len(idle), self.rate, rate)
        self._busy.clear()
        if rate == self.rate:
            return None  # at a limit already
        self.rate = rate
        return verdict


def slowdown_estimate(busy: Sequence[float], idle: Sequence[float], trim: float = 0.1) -> tuple[float, float]:
    """(mean of ``busy`` / mean of ``idle`` - 1, its standard error), each without its slowest ``trim``."""
    def trimmed(values: Sequence[float]) -> list[float]:
        ordered = sorted(values)
        return ordered[:max(2, len(ordered) - int(len(ordered) * trim))]

    # plain float sums, not statistics.variance (exact fractions, ~1 ms for 768 values): this
    # runs on the training thread at every step once both kinds of step are in
    def mean_and_variance_of_mean(values: list[float]) -> tuple[float, float]:
        mean = math.fsum(values) / len(values)
        variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
        return mean, variance / len(values)

    (mean_b, var_b), (mean_i, var_i) = (mean_and_variance_of_mean(trimmed(values)) for values in (busy, idle))
    return mean_b / mean_i - 1, math.sqrt(var_b + var_i) / mean_i


