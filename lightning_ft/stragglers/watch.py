"""The straggler watch of one round: share each rank's own work, judge, and evict or warn.

Driven by the round watchdog's thread (its store connection, no collective, nothing on the
training thread but the meter's clock reads): every rank publishes its window's summary
(:func:`~lightning_ft.schema.round.work_key`) about once a second and reads whether it was
evicted; rank 0 reads every rank's summary as often and asks the policy
(:mod:`lightning_ft.stragglers.policy`). An eviction is written once per round
(:data:`~lightning_ft.schema.round.EVICT_KEY`); the evicted rank leaves at its next step
boundary (the strategy raises :class:`~lightning_ft.exit_codes.StragglerEvicted` there), its
peers see a lost peer and a hot spare takes the place, resuming from their live state.

Only with a job secret: an eviction is then sealed and bound to the run, its incarnation, the
round and the launch (:class:`~lightning_ft.schema.round.EvictionScope`), and one that fails
either check is ignored. Without a secret any store client could write one, so eviction only
warns: rank 0 writes none, and nothing read from the store makes a rank leave or write its
marker (an eviction found there is ignored, with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lightning_ft._clock import monotonic
from lightning_ft._logging import StrategyLog
from lightning_ft.events import names as ev
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.schema.round import (
    EVICT_KEY,
    EvictionScope,
    decode_eviction,
    decode_work,
    encode_eviction,
    encode_work,
    work_key,
)
from lightning_ft.schema.signing import SealedStore
from lightning_ft.stragglers.meter import WorkMeter
from lightning_ft.stragglers.policy import StragglerAction, WorkSummary, decide, judge

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})


class StragglerWatch:
    """This rank's part; :meth:`tick` is called by the round watchdog on every poll."""

    def __init__(self, meter: WorkMeter, *, rank: int, world_size: int, scope: EvictionScope, factor: float,
                 window: int, round_values: SealedStore, records: RunRecords, emit: Callable[..., None],
                 publish_interval: float | None = None, judge_interval: float | None = None,
                 clock: Callable[[], float] = monotonic) -> None:
        self.meter = meter
        self.rank = rank
        self.world_size = world_size
        self.scope = scope
        self.round_id = scope.round_id
        #: evictions are written and obeyed (a job secret: see the module)
        self.authenticated = round_values.signer.enabled
        self._ignored_eviction = False
        self.factor = factor
        self.window = window
        self.round_values = round_values
        self.records = records
        self.emit = emit
        # about once a second; slower with thousands of ranks, so that together they stay near
        # 1,000 publications (and as many reads of the eviction) per second on the store
        self.publish_interval = publish_interval or max(1.0, world_size / 1000)
        self.judge_interval = judge_interval or self.publish_interval
        self.clock = clock
        #: why this rank was evicted (None: it was not); read by the training thread
        self.evicted: str | None = None
        #: rank 0: every rank's latest summary and score (for the Trainer's loggers)
        self.summaries: dict[int, WorkSummary] = {}
        self.scores: dict[int, float] = {}
        self._published_at = float("-inf")
        self._published_step = -1
        self._reported_step = -1
        self._judged_at = float("-inf")
        self._warned: tuple[int, int] | None = None  # (rank, step) of the last warning

    def tick(self) -> None:
        """Publish, read the eviction, judge -- each at its own pace."""
        now = self.clock()
        if now - self._published_at >= self.publish_interval:
            self._published_at = now
            self._publish()
            self._read_eviction()
        if self.rank == 0 and now - self._judged_at >= self.judge_interval:
            self._judged_at = now
            self._judge()

    def _read_eviction(self) -> None:
        """Whether this rank was evicted: only an authentic eviction bound to this round counts."""
        raw = self.round_values.get(EVICT_KEY)  # with a secret: None unless sealed with it
        if raw is None or self.evicted is not None:
            return
        eviction = decode_eviction(raw, self.scope) if self.authenticated else None
        if eviction is None:
            if not self._ignored_eviction:
                self._ignored_eviction = True
                why = ("it is bound to another run, incarnation, round or launch, or not an eviction"
                       if self.authenticated else "this job has no secret, so straggler eviction only warns "
                       "(a store client could have written it)")
                ft_log.warning("ignored the eviction in store key %s: %s", self.round_values.key(EVICT_KEY), why)
            return
        if eviction.rank == self.rank:
            self.evicted = eviction.reason

    def _publish(self) -> None:
        summary = self.meter.summary()
        if summary.count == 0 or summary.step == self._published_step:
            return
        self.round_values.put(work_key(self.rank), encode_work(summary.step, summary.count, summary.median,
                                                               summary.low, summary.wait))
        self._published_step = summary.step
        if summary.step - self._reported_step >= self.window:
            self._reported_step = summary.step
            self.emit(ev.WORK, round=self.round_id, step=summary.step, steps=summary.count,
                      busy_seconds=round(summary.median, 6), wait_seconds=round(summary.wait, 6))

    def _judge(self) -> None:
        summaries = {0: self.meter.summary()}
        names = [work_key(rank) for rank in range(1, self.world_size)]
        values = self.round_values.multi_get_if_all_present(names)  # never waits for a rank yet to publish
        if values is None:
            return
        for rank, raw in enumerate(values, start=1):
            decoded = decode_work(raw) if raw is not None else None
            if decoded is not None:
                summaries[rank] = WorkSummary(*decoded)
        if len(summaries) < self.world_size or any(s.count == 0 for s in summaries.values()):
            return  # every rank measured some steps first
        verdict = judge(summaries, self.factor, self.window)
        self.summaries, self.scores = summaries, verdict.scores
        if verdict.straggler is None:
            return
        step = summaries[0].step
        action, reason = decide(verdict, self._spares(), step, None, self.window, self.authenticated)
        straggler = verdict.straggler
        if action is StragglerAction.EVICT:
            # the first eviction bound to this round wins; anything else there (forged, replayed) is replaced
            winner = self.round_values.replace(EVICT_KEY, lambda raw: decode_eviction(raw, self.scope) is not None,
                                               encode_eviction(self.scope, straggler, step, reason))
            if decode_eviction(winner, self.scope) == (straggler, step, reason):
                ft_log.warning("evicting rank %d as a straggler at step %d: %s", straggler, step, reason)
                self.emit(ev.STRAGGLER, round=self.round_id, rank=straggler, step=step, action=action.value,
                          score=round(verdict.scores[straggler], 3), reason=reason)
            return
        if self._warned is not None and self._warned[0] == straggler and step - self._warned[1] < self.window:
            return  # said within this window already
        self._warned = (straggler, step)
        ft_log.warning("rank %d is a straggler at step %d: %s", straggler, step, reason)
        self.emit(ev.STRAGGLER, round=self.round_id, rank=straggler, step=step, action=action.value,
                  score=round(verdict.scores[straggler], 3), reason=reason)

    def _spares(self) -> int:
        """Hot spares that could take a place now: live participants of the run beyond its actives."""
        return self.records.spares_of_round(self.round_id, self.world_size)
