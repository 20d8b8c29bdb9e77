"""Hand-over: a SIGTERM that reached some actives while hot spares wait to take their places.

A notice to one node (a spot reclaim, a maintenance drain) should not stop a job that has a
spare ready. At its stop point each rank asks :class:`HandOverAgreement` for the verdict of this
termination: the first rank to ask waits until ``hand_over_settle_seconds`` have passed since the
termination began (signals of one preemption reach the nodes of a job within milliseconds of each
other; the settle time lets them all be counted), reads who was signalled (each signalled rank
recorded itself in the termination's key space), who left unhealthy and how many hot spares are
ready, asks :func:`~lightning_ft.termination.decision.decide_hand_over`, and publishes the answer
(first writer wins). Every rank acts on the published verdict, so they all act alike: the leavers
leave at the next step boundary with exit 0 (the job goes on: no scheduler rule may read it as a
failure), the others re-form with spares from their live state -- no step is trained again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

from lightning_ft._clock import monotonic
from lightning_ft._text import printable
from lightning_ft.deadlines import call_with_timeout
from lightning_ft.events import names as ev
from lightning_ft.schema.termination import HandOverVerdict
from lightning_ft.termination.coordination import LocalStopCoordinator, StoreStopCoordinator
from lightning_ft.termination.decision import decide_hand_over, hand_over_verdict_problem

log = logging.getLogger(__name__)


class SeatCensus(NamedTuple):
    """What a hand-over can count on, by liveness (see :meth:`HandOverSeat.census`)."""

    #: live hot spares that could take a place now
    spares_ready: int
    #: ranks of the round that are gone (died a moment ago: not yet a failure anyone acted on)
    actives_gone: frozenset[int] = frozenset()


class HandOverSeat(Protocol):
    """What a strategy that re-forms in-process offers the SIGTERM path (its ``hand_over_seat``)."""

    def census(self) -> SeatCensus | None:
        """Live hot spares, and the round's ranks that are gone; None: this job cannot hand over."""

    def hand_over(self, leaving: bool, reason: str) -> None:
        """Act on a hand-over verdict at the next step boundary: leave (``leaving``) or re-form."""

    def min_world_size(self) -> int | None:
        """An elastic job's ``min_nodes`` (it may shrink to it); None: the world size is fixed."""


def hand_over_seat(strategy: Any) -> HandOverSeat | None:
    """The strategy's seat for hand-overs, None for a strategy without one (plain DDP)."""
    seat = getattr(strategy, "hand_over_seat", None)
    return seat if seat is not None and callable(getattr(seat, "hand_over", None)) else None


class HandOverAgreement:
    """One rank's side of the hand-over verdict (see the module docstring); one per ``fit()``."""

    def __init__(self, coordinator: StoreStopCoordinator | LocalStopCoordinator, seat: HandOverSeat | None,
                 settle_s: float, timeout_s: float) -> None:
        self._coordinator = coordinator
        self._seat = seat
        self._settle_s = settle_s
        self._timeout_s = timeout_s

    @property
    def possible(self) -> bool:
        return self._seat is not None and isinstance(self._coordinator, StoreStopCoordinator)

    def settle(self, started_at: float, step: int, self_signalled: bool, unhealthy: Iterable[int],
               events: Any) -> HandOverVerdict:
        """The verdict (see :meth:`verdict`), recorded; when it hands over, the strategy is told to act
        on it at the next step boundary (leave, or re-form with the spares)."""
        verdict = self.verdict(started_at, self_signalled, unhealthy)
        rank, seconds = self._coordinator.rank, monotonic() - started_at
        leaving = rank in verdict.leavers if verdict.hands_over else None
        events.emit(ev.HAND_OVER_VERDICT, step=step, hands_over=verdict.hands_over, leavers=list(verdict.leavers),
                    leaving=leaving, reason=verdict.reason, seconds_since_signal=round(seconds, 6))
        if self._seat is None or not verdict.hands_over:
            log.warning("rank %d: no hand-over: %s", rank, verdict.reason)
            return verdict
        log.warning("rank %d: hand-over after step %d, %.0f ms after the termination began: %s; this rank %s", rank,
                    step, seconds * 1000, verdict.reason, "leaves (exit 0)" if leaving else "goes on with the spares")
        self._seat.hand_over(bool(leaving), verdict.reason)
        return verdict

    def verdict(self, started_at: float, self_signalled: bool, unhealthy: Iterable[int] = ()) -> HandOverVerdict:
        """The verdict every rank acts on (bounded); "the whole job stops" when none can be had."""
        coordinator, seat = self._coordinator, self._seat
        if seat is None or not isinstance(coordinator, StoreStopCoordinator):
            return HandOverVerdict((), "this job cannot hand over: the whole job stops")
        known_unhealthy = set(unhealthy)

        def _agree() -> HandOverVerdict:
            published = coordinator.hand_over_verdict()
            if published is not None:
                return published
            settle = started_at + self._settle_s - monotonic()
            if settle > 0:  # the other signals of the same preemption arrive meanwhile
                time.sleep(settle)
                published = coordinator.hand_over_verdict()
                if published is not None:
                    return published
            signalled = coordinator.signalled_ranks() | ({coordinator.rank} if self_signalled else set())
            census = seat.census()
            # a rank that died during the settle leaves too: the leavers must not count on it to
            # carry the state on (with every active leaving, the whole job stops and saves)
            gone = known_unhealthy | set(coordinator.unhealthy_peers()) | (census.actives_gone if census else set())
            verdict = decide_hand_over(world_size=coordinator.world_size, signalled=signalled, unhealthy=gone,
                                       spares_ready=census.spares_ready if census else None,
                                       min_world_size=seat.min_world_size())
            return coordinator.publish_hand_over(verdict)

        outcome = call_with_timeout(_agree, self._timeout_s + self._settle_s, "agreeing on a hand-over")
        if not outcome.ok:
            log.warning("rank %d: %s; the whole job stops", coordinator.rank, outcome.problem)
            return HandOverVerdict((), f"no hand-over verdict ({outcome.problem}): the whole job stops")
        verdict: HandOverVerdict = outcome.value
        problem = hand_over_verdict_problem(verdict, world_size=coordinator.world_size, rank=coordinator.rank,
                                            own_reason_to_leave=self_signalled or coordinator.rank in known_unhealthy)
        if problem is not None:
            log.warning("rank %d: the published hand-over verdict is refused (%s): the whole job stops; it said: %s",
                        coordinator.rank, problem, printable(verdict.reason[:300]))
            return HandOverVerdict((), f"the published hand-over verdict is refused ({problem}): the whole job stops")
        return HandOverVerdict(verdict.leavers, printable(verdict.reason[:300]))
