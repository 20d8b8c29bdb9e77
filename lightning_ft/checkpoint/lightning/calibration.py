"""The snapshot schedule of one ``EmergencyCheckpoint``: measured step and save times, and the
intervals every rank agrees on from them at the calibration steps (:mod:`lightning_ft.checkpoint.tiers`)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from lightning_ft.checkpoint.exchange.agreement import gather_steps
from lightning_ft.checkpoint.tiers import (
    FIRST_CALIBRATION,
    Schedule,
    ScheduleProposal,
    agree_schedule,
    calibration_due,
    persist_interval_steps,
    propose_schedule,
)
from lightning_ft.events import names as ev

log = logging.getLogger(__name__)

_EMA = 0.3  # weight of the newest step-time sample


class ScheduleCalibration:
    """Step time (an exponential average), the last few save times, and the agreed :class:`Schedule`.

    ``every_n_steps``, ``every_n_seconds``, ``max_overhead``, ``max_seconds_at_risk``: as for
    ``EmergencyCheckpoint`` (the last applies where :meth:`calibrate` is told the state is sharded).
    """

    #: what step times are measured with (a test sets the time its steps take with it)
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self, every_n_steps: int | None, every_n_seconds: float | None,
                 max_overhead: float | None, max_seconds_at_risk: float | None = None) -> None:
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.max_overhead = max_overhead
        self.max_seconds_at_risk = max_seconds_at_risk
        self._durations: deque[float] = deque(maxlen=5)
        self._clock: tuple[float, int] | None = None  # (time, global_step) at the last step change
        self.seconds_per_step: float | None = None
        #: the schedule all ranks agreed on at the last calibration step (None: not yet in this fit)
        self.schedule: Schedule | None = None
        self._train_start_step = 0
        self._calibrated_step: int | None = None

    def budget_schedule(self) -> bool:
        return bool(self.max_overhead) and self.every_n_steps is None and self.every_n_seconds is None

    def calibrates(self) -> bool:
        """Whether ranks agree on a schedule at the calibration steps. Only settings of the code
        decide (every rank runs the same), never the environment: a rank that skipped the
        collective its peers entered would desynchronise the group. every_n_steps needs no
        agreement."""
        return self.every_n_seconds is not None or self.budget_schedule()

    # ------------------------------------------------------------------ measurements
    def record_save(self, seconds: float) -> None:
        """What a synchronous save of this rank's state took (or would take)."""
        self._durations.append(seconds)

    def estimated_save_seconds(self) -> float | None:
        """Slowest of the last few save durations (conservative for budget decisions); None before the first."""
        return max(self._durations) if self._durations else None

    def start(self, step: int) -> None:
        """Training (re)starts at ``step``: the clock starts, and every rank of a (re)started fit
        calibrates at the same steps from here, survivors and a spare alike; until the first
        calibration only every_n_steps applies."""
        self._clock = (self.clock(), step)
        self._train_start_step, self._calibrated_step, self.schedule = step, None, None

    def step_time(self, step: int) -> float | None:
        """At a batch's end: seconds per step since the last step change (None: no step
        completed since); folded into :attr:`seconds_per_step`."""
        now = self.clock()
        if self._clock is None or step <= self._clock[1]:
            return None
        sample = (now - self._clock[0]) / (step - self._clock[1])
        prev = self.seconds_per_step
        self.seconds_per_step = sample if prev is None else _EMA * sample + (1 - _EMA) * prev
        return sample

    def restart_clock(self, step: int) -> bool:
        """At a batch's end, after its own save: start timing the next step if ``step`` is new
        (True). Measured after the save so the snapshot time is not counted as step time (the
        wait for a background copy at the next optimizer step is: training waited)."""
        if self._clock is not None and step == self._clock[1]:
            return False
        self._clock = (self.clock(), step)
        return True

    # ------------------------------------------------------------------ the agreement
    def due(self, step: int) -> bool:
        """Whether ranks agree on the schedule at ``step`` (once per step; every rank reaches it)."""
        if self.calibrates() and step != self._calibrated_step and calibration_due(step, self._train_start_step):
            self._calibrated_step = step
            return True
        return False

    def first_needs_a_save(self, step: int) -> bool:
        """Whether the calibration at ``step`` is a budget schedule's first: it needs a save measured."""
        return self.budget_schedule() and step - self._train_start_step == FIRST_CALIBRATION

    def calibrate(self, step: int, rank: int, persist_seconds: float | None, emit: Callable[..., None],
                  sharded: bool = False) -> None:
        """Agree with every rank on the schedule (collective: every rank calls it at the same step);
        ``sharded``: a lost rank's progress since its last snapshot is lost with it (every rank
        passes the same), so ``max_seconds_at_risk`` bounds the interval."""
        save_seconds = self.estimated_save_seconds()
        proposal = propose_schedule(seconds_per_step=self.seconds_per_step, save_seconds=save_seconds,
                                    every_n_steps=self.every_n_steps, every_n_seconds=self.every_n_seconds,
                                    max_overhead=self.max_overhead, persist_seconds=persist_seconds,
                                    max_seconds_at_risk=self.max_seconds_at_risk if sharded else None)
        rows = gather_steps(proposal.as_list())
        schedule = agree_schedule([ScheduleProposal(*row) for row in rows], self.every_n_steps)
        changed, self.schedule = schedule != self.schedule, schedule
        if not changed or rank != 0:
            return
        sps = self.seconds_per_step or 0.0
        fields = dict(step=step, snapshot_every_n_steps=schedule.snapshot_interval or self.every_n_steps,
                      persist_every_n_steps=schedule.persist_every, seconds_per_step=round(sps, 6),
                      save_seconds=None if save_seconds is None else round(save_seconds, 6),
                      bounded_by_risk=schedule.bounded_by_risk)
        emit(ev.SNAPSHOT_SCHEDULE, **fields)
        every = fields["snapshot_every_n_steps"]
        share = f", a save {save_seconds:.3f} s = {100 * save_seconds / (every * sps):.2f} % of training time" \
            if every and sps and save_seconds else ""
        durable = f"; durable copies every {schedule.persist_every} steps" if schedule.persist_every else ""
        if sharded and every and sps:
            bound = f" (max_seconds_at_risk={self.max_seconds_at_risk:g})" if schedule.bounded_by_risk else ""
            durable += (f"; at most {every * sps:.1f} s of work at risk{bound}: sharded state has no live copy "
                        "to fall back on")
        log.info("EmergencyCheckpoint: at step %d, snapshots every %s steps (%.2f s%s)%s", step, every,
                 (every or 0) * sps, share, durable)

    @property
    def snapshot_interval(self) -> int | None:
        """Steps between periodic snapshots from the agreed schedule (None: none agreed, or none from it)."""
        return self.schedule.snapshot_interval if self.schedule is not None else None

    def persist_every(self, persist_seconds: Callable[[], float | None]) -> int | None:
        """Steps between durable copies (None: none due yet); ``persist_seconds()``: the seconds
        between durable copies, asked only without an agreement (``every_n_steps``)."""
        if self.schedule is not None:
            return self.schedule.persist_every
        if self.calibrates():
            return None  # the first agreement is still to come
        # every_n_steps: this rank's own power-of-two multiple of it (ranks whose estimates
        # differ still share the larger interval's steps)
        return persist_interval_steps(persist_seconds() or 0.0, self.seconds_per_step or 0.0, self.every_n_steps or 1)
