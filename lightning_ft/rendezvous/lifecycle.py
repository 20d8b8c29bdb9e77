"""A run's end on the store: the acknowledgements the store's host waits for before it goes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lightning_ft._clock import monotonic
from lightning_ft.rendezvous.decisions import split_extras
from lightning_ft.rendezvous.records import RunRecords

log = logging.getLogger(__name__)


def expected_acknowledgements(records: RunRecords, max_nodes: int | None = None) -> list[str]:
    """Participants of the newest round (arrived, not withdrawn, not extra): who should acknowledge."""
    arrivals = records.arrivals(records.current_round())
    if max_nodes is not None:
        arrivals, _ = split_extras(arrivals, max_nodes)
    return [a.participant_id for a in arrivals]


def wait_for_acknowledgements(records: RunRecords, timeout: float, max_nodes: int | None = None,
                              clock: Callable[[], float] = monotonic,
                              sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait until every participant acknowledged shutdown, at most ``timeout`` seconds.

    Ends as soon as all acknowledged (no fixed sleep). Returns whether they all did. Only
    sealed acknowledgements of the participants themselves count: a store client cannot cut
    the wait short.
    """
    expected = expected_acknowledgements(records, max_nodes)
    start = clock()
    acked: set[str] = set()
    while True:
        acked |= records.acknowledged([p for p in expected if p not in acked], all_or_none=True)
        if len(acked) >= len(expected) or clock() - start >= timeout:
            break
        sleep(0.01)
    if len(acked) < len(expected):
        acked = records.acknowledged(expected)
    waited = clock() - start
    if len(acked) >= len(expected):
        log.info("store host: all %d participant(s) acknowledged shutdown after %.3fs", len(expected), waited)
        return True
    log.warning("store host: %d of %d participant(s) acknowledged within store_grace_timeout=%.1fs (missing: %s); "
                "letting the store go", len(acked), len(expected), timeout,
                ", ".join(sorted(set(expected) - acked)[:8]))
    return False
