"""One rank's background uploader of committed snapshots to the durable tier (:mod:`.tier`)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from lightning_ft._clock import monotonic
from lightning_ft.checkpoint.durable.tier import DurableTier, UploadResult
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.files import open_snapshot_file
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.pacing import UploadPacer
from lightning_ft.checkpoint.tiers import upload_decision
from lightning_ft.events import names as ev

log = logging.getLogger(__name__)


class DurablePersister:
    """One rank's background uploader: the newest committed snapshot supersedes older offers.

    :meth:`offer` runs on the training thread and only records the snapshot (holding its file
    against recycling); a daemon thread uploads. While an upload runs, newer offers replace one
    another and only the newest is uploaded next, so a new snapshot never queues behind old
    ones. A thread, not a sidecar process: the snapshot file lives in this rank's shared-memory
    root, held and released by this process's store; see docs/snapshots.md for the trade-off.
    """

    def __init__(self, tier: DurableTier, snapshot_store: Callable[[], SnapshotStore], rank: int,
                 emit: Callable[..., None] | None = None, pacer: UploadPacer | None = None) -> None:
        """``pacer``: adjusts ``tier.max_bytes_per_second`` from the step times the trainer reports
        (:meth:`observe_step`); it sets the bound now (its starting rate)."""
        self.tier = tier
        self.pacer = pacer
        if pacer is not None:
            tier.max_bytes_per_second = pacer.rate
        self._uploads_started = 0
        # time between the last two offers and the last offer's size: the pacer never slows a
        # copy so far that it would not finish well before the next one is offered
        self._last_offer_time: float | None = None
        self._offer_interval: float | None = None
        self._last_offer_bytes: int | None = None
        # the store that writes this rank's snapshots now (it changes when a recovery changes the
        # rank); a hold is released on the store it was taken on
        self._snapshot_store = snapshot_store
        self.rank = rank
        self._emit = emit or (lambda *a, **k: None)
        self._cv = threading.Condition()
        self._pending: tuple[SnapshotInfo, str, int, int, SnapshotStore] | None = None  # + open fd, holder
        self._busy: int | None = None
        self._thread: threading.Thread | None = None
        self.last_durable_step: int | None = None
        self.last_uploaded_step: int | None = None
        #: bytes/s of the last finished upload (upload + verify), None before the first
        self.measured_bytes_per_second: float | None = None
        #: the same without the time the bandwidth bound made it wait: what a flush, which runs
        #: unbounded, can expect
        self.measured_unbounded_bytes_per_second: float | None = None
        # set while a flush runs: the upload in flight and the flush's own go unbounded (the
        # training is stopped; only the grace period counts now)
        self._unbounded = False
        self.failures = 0
        self.skipped = 0

    def offer(self, info: SnapshotInfo, timeline: str, world_size: int) -> str:
        """Queue ``info`` for upload; returns the :func:`lightning_ft.checkpoint.tiers.upload_decision` taken."""
        with self._cv:
            decision = upload_decision(self._busy, info.step, self.last_uploaded_step)
            if decision == "skip" or (self._pending is not None and self._pending[0].step == info.step):
                return "skip"
            try:
                # opened now, on the training thread: the file may be pruned before the upload
                # starts, but the open file keeps its bytes
                fd, _ = open_snapshot_file(info.path, for_write=False)
            except (OSError, fmt.SnapshotError) as exc:
                log.warning("rank %d: snapshot of step %d not copied durably: %s", self.rank, info.step, exc)
                return "skip"
            holder = self._snapshot_store()
            holder.hold(info.step)
            now = monotonic()  # an accepted offer: the interval between copies the pacer keeps up with
            if self._last_offer_time is not None:
                self._offer_interval = now - self._last_offer_time
            self._last_offer_time, self._last_offer_bytes = now, info.nbytes
            if self._pending is not None:
                log.debug("rank %d: durable copy of step %d superseded by step %d", self.rank,
                          self._pending[0].step, info.step)
                self._drop_pending()
                self.skipped += 1
            self._pending = (info, timeline, world_size, fd, holder)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="lightning_ft-persist")
                self._thread.start()
            self._cv.notify_all()
            return decision

    def _drop_pending(self) -> None:
        """Forget the waiting offer (caller holds the lock; there is one)."""
        assert self._pending is not None
        info, _, _, fd, holder = self._pending
        self._pending = None
        os.close(fd)
        holder.release(info.step)

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._pending is None:
                    self._thread = None
                    self._cv.notify_all()
                    return
                pending, self._pending = self._pending, None
                self._busy = pending[0].step
                self._uploads_started += 1
            try:
                info, timeline, world_size, fd, holder = pending
                self._upload(info, timeline, world_size, deadline=None, fd=fd)
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()
                holder.release(info.step)

    def _upload(self, info: SnapshotInfo, timeline: str, world_size: int, deadline: float | None,
                fd: int | None = None) -> UploadResult | None:
        try:
            result = self.tier.upload(info, timeline, world_size, deadline=deadline, fd=fd, rate=self._rate)
        except Exception as exc:  # noqa: BLE001 - a failed copy never stops training; the next one may work
            self.failures += 1
            log.warning("rank %d: durable copy of step %d failed (not durable): %s: %s", self.rank, info.step,
                        type(exc).__name__, exc)
            self._emit(ev.DURABLE_FAILED, step=info.step, error=f"{type(exc).__name__}: {exc}")
            return None
        self.last_uploaded_step = info.step
        self.measured_bytes_per_second = result.nbytes / max(result.seconds, 1e-6)
        self.measured_unbounded_bytes_per_second = result.unbounded_bytes_per_second
        if result.complete:
            self.last_durable_step = info.step
        self._emit(ev.DURABLE_UPLOAD, step=info.step, bytes=result.nbytes, seconds=round(result.seconds, 4),
                   complete=result.complete)
        log.debug("rank %d: shard of step %d durable in %.3f s (%.1f MiB/s)%s", self.rank, info.step,
                  result.seconds, self.measured_bytes_per_second / 2**20, "; step complete" if result.complete else "")
        return result

    def activity(self) -> tuple[bool, int]:
        """(an upload is running, uploads started so far): mark a step's start with it, then pass
        it to :meth:`observe_step` at the step's end."""
        with self._cv:
            return self._busy is not None, self._uploads_started

    def observe_step(self, seconds: float, since: tuple[bool, int]) -> None:
        """One training step took ``seconds``; ``since``: :meth:`activity` at its start. A step
        one upload ran through, or one no upload touched, feeds the pacer; one an upload
        started or ended in says nothing and is left out."""
        if self.pacer is None:
            return
        running, started = self.activity()
        if started != since[1] or running != since[0]:
            return
        verdict = self.pacer.observe(seconds, busy=running, keep_up=self._keep_up_bytes_per_second())
        if verdict is None:
            return
        self.tier.max_bytes_per_second = verdict.rate_after
        slowdown = None if verdict.slowdown is None else round(verdict.slowdown, 4)
        fields = dict(slowdown=slowdown, busy_steps=verdict.busy_steps, idle_steps=verdict.idle_steps,
                      mib_per_second=round(verdict.rate_after / 2**20, 1),
                      mib_per_second_before=round(verdict.rate_before / 2**20, 1))
        self._emit(ev.DURABLE_PACING, **fields)
        why = ("to keep up with the copies" if verdict.slowdown is None else
               f"steps during durable copies were {100 * verdict.slowdown:+.1f} % slower (budget "
               f"{100 * self.pacer.budget:.1f} %)")
        log.debug("rank %d: %s: upload bound %.0f -> %.0f MiB/s", self.rank, why, verdict.rate_before / 2**20,
                  verdict.rate_after / 2**20)

    def _keep_up_bytes_per_second(self) -> float:
        """The rate at which the last offered snapshot is copied in half the time between the
        last two offers (0 before there are two)."""
        if self._offer_interval is None or self._last_offer_bytes is None:
            return 0.0
        return self._last_offer_bytes / max(0.5 * self._offer_interval, 1e-3)

    def _rate(self) -> float | None:
        return None if self._unbounded else self.tier.max_bytes_per_second

    def idle(self) -> bool:
        with self._cv:
            return self._thread is None and self._pending is None

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running (True) or ``timeout`` passed (False)."""
        deadline = monotonic() + timeout
        with self._cv:
            while self._thread is not None or self._pending is not None:
                left = deadline - monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def flush(self, info: SnapshotInfo, timeline: str, world_size: int, deadline: float) -> UploadResult | None:
        """Make ``info`` durable on the calling thread before ``deadline`` (SIGTERM path).

        Runs without the bandwidth bound (the training is stopped), and lifts it for a running
        upload, which it waits for first (an upload of the same step counts); queued older offers
        are dropped. Returns None if it did not become durable in time.
        """
        with self._cv:
            self._unbounded = True
            uploading = False
            try:
                if self._pending is not None:
                    self._drop_pending()
                while self._busy is not None and monotonic() < deadline:
                    self._cv.wait(max(0.0, deadline - monotonic()))
                if self._busy is not None:
                    return None
                if self.last_uploaded_step == info.step:
                    return UploadResult(info.step, info.nbytes, 0.0, self.last_durable_step == info.step)
                holder = self._snapshot_store()
                holder.hold(info.step)
                self._busy = info.step  # only once held: a failed hold must not leave the persister busy
                self._uploads_started += 1
                uploading = True
            finally:
                if not uploading:
                    self._unbounded = False
        try:
            return self._upload(info, timeline, world_size, deadline)
        finally:
            with self._cv:
                self._busy = None
                self._unbounded = False
                self._cv.notify_all()
            holder.release(info.step)
