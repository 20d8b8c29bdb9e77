"""A run's life on the store beyond its rounds: which incarnation a participant belongs to,
and the acknowledgements the store's host waits for before it goes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from lightning_ft.rendezvous.decisions import choose_incarnation
from lightning_ft.schema.run import CloseReason, RunKeys, incarnation_key
from lightning_ft.schema.signing import SealedStore, Signer

log = logging.getLogger(__name__)


def resolve_incarnation(store: Any, signer: Signer, run_id: str, started_at: float) -> int:
    """The incarnation of ``run_id`` a participant started at ``started_at`` belongs to (see
    :func:`~lightning_ft.rendezvous.decisions.choose_incarnation`); opens the next one if needed."""
    counter = incarnation_key(run_id)
    values = SealedStore(store, signer)
    current = store.add(counter, 0)
    while True:
        raw = values.get(values.unlisted(RunKeys(run_id, current).closed_for_good))
        closed = CloseReason.decode(raw) if raw is not None else None
        chosen = choose_incarnation(current, closed.closed_at if closed is not None else None, started_at)
        if chosen == current:
            return current
        moved = int(store.compare_set(counter, str(current), str(chosen)))
        if moved == chosen:
            log.info("run %s: incarnation %d was closed for good (%s) before this process started; this is a new "
                     "launch of the run id: incarnation %d", run_id, current, closed, chosen)
            return chosen
        current = moved  # someone else moved it: judge the new one


def expected_acknowledgements(store: Any, keys: RunKeys) -> int:
    """Participants of the newest round (arrived, not withdrawn): who should acknowledge shutdown."""
    round_id = int(store.compare_set(keys.round, "", "0"))
    return store.add(keys.arrived(round_id), 0) - store.add(keys.withdrawn(round_id), 0)


def wait_for_acknowledgements(store: Any, keys: RunKeys, timeout: float,
                              clock: Callable[[], float] = time.monotonic,
                              sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait until every participant acknowledged shutdown, at most ``timeout`` seconds.

    Ends as soon as all acknowledged (no fixed sleep). Returns whether they all did.
    """
    expected = expected_acknowledgements(store, keys)
    start = clock()
    acks = store.add(keys.shutdown_acks, 0)
    while acks < expected and clock() - start < timeout:
        sleep(0.01)
        acks = store.add(keys.shutdown_acks, 0)
    waited = clock() - start
    if acks >= expected:
        log.info("store host: all %d participant(s) acknowledged shutdown after %.3fs", expected, waited)
        return True
    log.warning("store host: %d of %d participant(s) acknowledged within store_grace_timeout=%.1fs; "
                "letting the store go", acks, expected, timeout)
    return False
