"""Elastic jobs grow back: a participant that arrives while the job trains takes a place at a step boundary.

A node that arrives later (a requeued task, a new pod) finds the round formed and waits in it as
a standby participant. Rank 0's round watchdog -- a thread with its own store connection, never
the training thread -- looks for such arrivals at most every ``_LOOK_EVERY_S`` seconds and, when
the round is at least ``elastic_grow_interval`` old (the job's first round: at once -- a node
started with the job but after its start window closed joins it now, not 30 s later, and that
grow can happen once) and the job is below ``max_nodes``, publishes
the step to re-form after: about one second of training ahead (``grow_at``, first writer wins).
Every rank's watchdog reads that value, and each training thread raises a planned re-form
(:class:`~lightning_ft.exit_codes.HandOver`, nobody leaving) at the first step boundary at or
past it: the next round forms from the live state with the newcomers in it (elastic: everyone
trains), the gradient accumulation follows the new world size and the data is re-sharded by
position. Every rank reads the value at each poll of its watchdog once the round may grow, well
within that second; a rank that reads it too late anyway trains the next step alone: its
collective fails at once (the others left the group) and it recovers from the same live state,
as from a lost peer -- the agreement costs exactness of timing, never state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from lightning_ft._clock import monotonic
from lightning_ft._logging import StrategyLog
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.schema.signing import SealedStore

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})

#: the round's key for the step to re-form after (first writer wins)
GROW_KEY = "elastic/grow_at"
#: how often rank 0 looks for newcomers (two store reads each time)
_LOOK_EVERY_S = 1.0
#: how far ahead the re-form step lies: about this much training, at least _MIN_STEPS_AHEAD steps
_SECONDS_AHEAD = 1.0
_MIN_STEPS_AHEAD = 2


def steps_ahead(step_seconds: float | None) -> int:
    """How many steps ahead of rank 0's step the re-form lies: the others must read it before."""
    if step_seconds is None or step_seconds <= 0:
        return 10
    return max(_MIN_STEPS_AHEAD, math.ceil(_SECONDS_AHEAD / step_seconds))


class GrowWatch:
    """One rank's side of growing back (see the module docstring); ``tick`` runs in the round watchdog."""

    def __init__(self, *, rank: int, world_size: int, max_world_size: int, round_id: int, round_values: SealedStore,
                 records: RunRecords, grow_interval: float, global_step: Callable[[], int | None],
                 step_seconds: Callable[[], float | None]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.max_world_size = max_world_size
        self.round_id = round_id
        self.values = round_values
        self.records = records
        self.grow_interval = grow_interval
        self.global_step = global_step
        self.step_seconds = step_seconds
        self.started = monotonic()
        self._looked_at = 0.0
        #: the step after which the round re-forms with the newcomers (read by the training thread)
        self.grow_at: int | None = None

    def tick(self) -> None:
        if self.grow_at is not None or self.world_size >= self.max_world_size:
            return
        now = monotonic()
        if self.round_id > 0 and now - self.started < self.grow_interval:
            return
        if self.rank == 0 and now - self._looked_at >= _LOOK_EVERY_S:
            self._looked_at = now
            self._propose()
        # every poll once the round may grow (one store read each): the step lies ~1 s of training
        # ahead, so every rank reads it before it gets there and re-forms as planned
        raw = self.values.get(GROW_KEY)
        if raw is not None:
            try:
                self.grow_at = int(raw.decode())
            except ValueError:
                ft_log.warning("ignored a damaged elastic grow step in the store: %r", raw[:40])

    def _propose(self) -> None:
        newcomers = self.records.spares_of_round(self.round_id, self.world_size)
        step = self.global_step()
        if not newcomers or step is None:
            return
        at = step + steps_ahead(self.step_seconds())
        self.values.put_if_absent(GROW_KEY, str(at))
        ft_log.warning("elastic: %d participant(s) arrived while %d train; re-forming after step %d",
                    newcomers, self.world_size, at)


def grow_reason(watch: Any, step: int) -> str | None:
    """Why the round re-forms at this step boundary (None: it does not)."""
    at = getattr(watch, "grow_at", None)
    if at is None or step < at:
        return None
    return f"elastic: participants arrived; re-forming after step {step} to take them in"
