"""The durable side of one ``EmergencyCheckpoint``: the tier, this rank's uploader, the timeline
of the current fit, the offers of committed snapshots and the SIGTERM flush."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

from lightning_ft._clock import monotonic
from lightning_ft.checkpoint.durable.persister import DurablePersister
from lightning_ft.checkpoint.durable.settings import DurableSettings
from lightning_ft.checkpoint.durable.tier import DurableTier, UploadResult
from lightning_ft.checkpoint.exchange.agreement import gather_steps
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.roots import RUN_ID_ENV_VARS
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.tiers import durable_copy_seconds, flush_fits

log = logging.getLogger(__name__)

_PEER_MARKERS_WAIT_S = 2.0  # SIGTERM flush: how long to look for the peers' markers of the stop step


class DurableCopies:
    """Durable copies of one rank's snapshots (``settings`` None: memory only).

    Without a configured run id (``run_id`` None) the durable tier is off, with a warning:
    durable copies could never be told apart from another job's.
    """

    def __init__(self, settings: DurableSettings | None, run_id: str | None) -> None:
        self.settings = settings
        #: the durable tier (None: memory only)
        self.tier: DurableTier | None = None
        if settings is not None:
            if run_id is None:
                log.warning("EmergencyCheckpoint: persist_to=%s is ignored: no run id is set (%s), so durable copies "
                            "could never be told apart from another job's", settings.url, ", ".join(RUN_ID_ENV_VARS))
            else:
                self.tier = DurableTier.from_settings(settings, run_id)
        #: this rank's background uploader (created by :meth:`start`)
        self.persister: DurablePersister | None = None
        self._timeline: str | None = None
        #: snapshots offered for upload in the current timeline (the first is copied at once)
        self.offered_in_timeline = 0
        self._upload_activity: tuple[bool, int] | None = None  # the persister's activity when the step began

    def start(self, snapshot_store: Callable[[], SnapshotStore], rank: int, emit: Callable[..., None]) -> None:
        """Create this rank's uploader once (at ``setup``); ``snapshot_store()``: the store that
        writes this rank's snapshots now."""
        if self.tier is not None and self.persister is None:
            assert self.settings is not None  # a tier is made from settings only
            self.persister = DurablePersister(self.tier, snapshot_store, rank, emit=emit,
                                              pacer=self.settings.pacer())

    def new_timeline(self) -> None:
        """A new stretch of training begins (``on_fit_start``; collective with a durable tier).

        One token per stretch of training, the same on every rank: shards of one step written
        by different stretches (the step trained again after a failure) never combine.
        secrets, not random: seed_everything makes `random` repeat the token in every run.
        """
        if self.tier is not None:
            self._timeline = f"{gather_steps([secrets.randbits(62)])[0][0]:016x}"
        self.offered_in_timeline = 0

    @property
    def offering(self) -> bool:
        """Whether committed snapshots are offered for upload (an uploader and a timeline exist)."""
        return self.persister is not None and self._timeline is not None and self.settings is not None

    def persist_seconds(self, snapshot_bytes: Callable[[], int]) -> float | None:
        """Seconds between durable copies (None: no uploader); ``snapshot_bytes()``: the size of one."""
        if self.persister is None or self.settings is None:
            return None
        nbytes = snapshot_bytes()
        # before the first upload: the bound uploads run at now (the pacer's, when pacing)
        copy = durable_copy_seconds(nbytes, self.persister.measured_bytes_per_second,
                                    self.persister.tier.max_bytes_per_second)
        return self.settings.interval_seconds(copy)

    def offer(self, info: SnapshotInfo, world_size: int) -> None:
        """Queue a committed snapshot for upload (call only while :attr:`offering`)."""
        assert self.persister is not None and self._timeline is not None
        self.offered_in_timeline += 1
        self.persister.offer(info, self._timeline, world_size)

    # ------------------------------------------------------------------ step times for the pacer
    def mark_step_start(self) -> None:
        """A training step begins: remember whether an upload runs (see ``DurablePersister.activity``)."""
        self._upload_activity = self.persister.activity() if self.persister is not None else None

    def observe_step(self, seconds: float) -> None:
        """The step begun at :meth:`mark_step_start` took ``seconds`` (fed to the upload pacer)."""
        if self.persister is not None and self._upload_activity is not None:
            self.persister.observe_step(seconds, self._upload_activity)

    # ------------------------------------------------------------------ SIGTERM
    def flush(self, info: SnapshotInfo, world_size: int, budget_left_s: float) -> tuple[str, str]:
        """Make ``info`` durable within ``budget_left_s`` when the measured upload rate says it fits
        (SIGTERM path, this rank only). Returns (the tier that now holds the state, why)."""
        persister = self.persister
        if persister is None or self._timeline is None:
            return "memory", "no durable tier"
        fits, why = flush_fits(info.nbytes, persister.measured_unbounded_bytes_per_second, budget_left_s)
        if not fits:
            return "memory", why
        deadline = monotonic() + budget_left_s
        result: UploadResult | None = persister.flush(info, self._timeline, world_size, deadline)
        if result is None:
            return "memory", f"durable copy of step {info.step} did not finish ({why})"
        # the peers flush the same stop step at the same time: their markers usually follow
        # within moments, and then this rank's record can say "durable" truthfully
        wait_until = min(deadline, monotonic() + _PEER_MARKERS_WAIT_S)
        complete = result.complete
        while not complete and monotonic() < wait_until:
            time.sleep(0.05)
            complete = persister.tier.publish_if_complete(info.step, self._timeline)
        if complete:
            return "durable", f"step {info.step} complete in durable storage ({why})"
        return "memory+shard", (f"this rank's shard of step {info.step} is durable; the step is complete once "
                                f"every rank's shard is ({why})")

    # ------------------------------------------------------------------ after a resume
    def drop_abandoned(self, resumed_step: int, rank: int, listed_everywhere: bool) -> None:
        """Training (re)starts at ``resumed_step``: rank 0 removes the manifests of newer durable
        steps of other timelines (a timeline the job left; ``DurableTier.drop_abandoned``).

        Only after an agreement in which every rank listed the durable steps
        (``listed_everywhere``): a listing that failed on one rank must never make rank 0
        delete the job's durable progress.
        """
        if self.tier is None or self._timeline is None or rank != 0 or not listed_everywhere:
            return
        self.tier.drop_abandoned(resumed_step, self._timeline)
