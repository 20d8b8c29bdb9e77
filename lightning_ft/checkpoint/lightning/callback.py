"""``EmergencyCheckpoint``: periodic and on-demand in-memory snapshots, plus auto-resume.

The callback holds the settings, the hooks and the public API; its parts are collaborators:
the snapshot schedule (:mod:`.calibration`), auto-resume (:mod:`.auto_resume`), the durable
copies (:mod:`.durable_copies`) and the background copies with their optimizer step pre-hooks
(:mod:`.background`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import lightning.pytorch as pl

from lightning_ft._lightning.callback_dispatch import skip_unused_batch_hooks
from lightning_ft._lightning.checkpointing import (
    drop_pending_restore,
    holds_shards,
    next_is_a_training_batch,
)
from lightning_ft.checkpoint.durable.persister import DurablePersister
from lightning_ft.checkpoint.durable.tier import DurableTier
from lightning_ft.checkpoint.lightning.auto_resume import AutoResume, replicated
from lightning_ft.checkpoint.lightning.background import BackgroundSnapshots
from lightning_ft.checkpoint.lightning.calibration import ScheduleCalibration
from lightning_ft.checkpoint.lightning.carried import CarriesRunFigures
from lightning_ft.checkpoint.lightning.durable_copies import DurableCopies
from lightning_ft.checkpoint.lightning.live import LiveState
from lightning_ft.checkpoint.lightning.state import dump_state, estimate_state_bytes
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.roots import (
    ENV_SNAPSHOT_DIR,
    RUN_ID_ENV_VARS,
    configured_run_id,
    ensure_writable_root,
    resolve_root,
    resolve_run_id,
)
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import snapshot_due
from lightning_ft.checkpoint.service import SnapshotService
from lightning_ft.checkpoint.settings import SnapshotSettings
from lightning_ft.checkpoint.tiers import (
    Schedule,
    first_durable_copy_due,
    persist_due,
    protection_gaps,
    snapshot_copies,
    space_shortfall,
)
from lightning_ft.events import NullEventLog, open_event_log
from lightning_ft.events import names as ev
from lightning_ft.settings import load

log = logging.getLogger(__name__)

_no_run_id_warned = False  # the "set a run id" warning is given once per process
_unprotected_warned = False  # the "progress unprotected" warning too


def no_run_id_message(run_dir: str) -> str:
    """Why snapshots of a run without a run id are written but never resumed, and the fix."""
    return (f"EmergencyCheckpoint: no run id is set (run_id=, {', '.join(RUN_ID_ENV_VARS)}), so snapshots go to "
            f"{run_dir} but are never resumed: a run without a run id cannot tell its own snapshots from "
            f"another job's. Set a run id that stays the same when this job restarts (e.g. LIGHTNING_FT_RUN_ID) "
            f"to resume from them.")


def room_problem(store: SnapshotStore, nbytes: int, copies: int, ranks: int) -> str | None:
    """Why ``store``'s root cannot hold ``copies`` snapshot files of ``nbytes`` for each of ``ranks``
    ranks (its own files are reusable); None when it can."""
    stats = os.statvfs(store.root)
    free = stats.f_bavail * stats.f_frsize
    reusable = sum(info.nbytes for info in store.list())
    missing = space_shortfall(free, reusable, nbytes, copies, ranks)
    if not missing:
        return None
    return (f"snapshot root {store.root} has {free / 2**20:.1f} MiB free but rank {store.rank} needs "
            f"{nbytes / 2**20:.1f} MiB x {copies} snapshot files x {ranks} rank(s) on this host "
            f"({missing / 2**20:.1f} MiB missing); snapshots will fail. Fix: point {ENV_SNAPSHOT_DIR} "
            f"(or root=) to a local-disk directory with room, enlarge /dev/shm (containers default to "
            f"64 MiB: docker --shm-size, a Kubernetes memory emptyDir), or lower keep_last/preallocate")


class EmergencyCheckpoint(CarriesRunFigures):
    """Snapshots the full Lightning checkpoint of each rank into host shared memory.

    * periodically at step boundaries (``every_n_steps`` and/or ``every_n_seconds``), so a
      ``kill -9`` loses at most that window;
    * on demand via ``save_now()`` (the SIGTERM path: synchronous, this rank only, no collectives);
    * on ``fit()``, with ``auto_resume``, restores the newest snapshot all ranks can read when it
      is newer than whatever ``ckpt_path`` the user passed (none, a path, ``"last"``).

    Args:
        every_n_steps: snapshot when ``global_step % every_n_steps == 0``.
        every_n_seconds: snapshot about every so many seconds (see ``SnapshotSettings``).
        **settings: any setting of :class:`~lightning_ft.checkpoint.settings.SnapshotSettings`
            (``max_overhead``, ``keep_last``, ``root``, ``run_id``, ``auto_resume``,
            ``preallocate``, ``background_copy``) and of the durable tier,
            :class:`~lightning_ft.checkpoint.durable.settings.DurableSettings` (``persist_to``,
            ``persist_every_n_seconds``, ``persist_mtbf_seconds``, ``persist_max_mib_per_second``,
            ``persist_max_overhead``, ``persist_keep_last``, ``storage_options``), each documented
            there and in ``docs/snapshots.md``; a setting with an environment variable takes it
            when not given.

    Supported strategies: single device and DDP (replicated state). Not a ``Checkpoint``
    subclass, so it works with ``enable_checkpointing=False``.
    """

    def __init__(self, every_n_steps: int | None = None, every_n_seconds: float | None = None,
                 **settings: Any) -> None:
        #: everything this callback was configured with (frozen, validated)
        self.settings: SnapshotSettings = load(
            SnapshotSettings, {"every_n_steps": every_n_steps, "every_n_seconds": every_n_seconds, **settings},
            error=ValueError, prefix="EmergencyCheckpoint: ")
        config = self.settings
        self.background_copy = config.background_copy
        self.every_n_steps = config.every_n_steps
        self.every_n_seconds = None if config.every_n_seconds is None else float(config.every_n_seconds)
        self.max_overhead = config.max_overhead
        self.keep_last = config.keep_last
        self.root = resolve_root(config.root)
        ensure_writable_root(self.root)
        self.run_id = resolve_run_id(config.run_id)
        self._configured_run_id = configured_run_id(config.run_id)
        self.auto_resume = config.auto_resume
        self.preallocate = config.preallocate
        self._store: SnapshotStore | None = None
        self._trainer: pl.Trainer | None = None
        self._events: Any = NullEventLog()
        self._last_saved_step: int | None = None
        self._last_snapshot: SnapshotInfo | None = None
        self._check_spare = True
        self._space_checked = False
        self._estimated_bytes: int | None = None
        self._calibration = ScheduleCalibration(self.every_n_steps, self.every_n_seconds, self.max_overhead,
                                                config.max_seconds_at_risk)
        self._background = BackgroundSnapshots()
        self._resume = AutoResume()
        self._live = LiveState()
        self.durable_settings = config.durable if config.durable.persist_to else None
        self._durable = DurableCopies(self.durable_settings, self._configured_run_id)
        skip_unused_batch_hooks(self)

    # ------------------------------------------------------------------ public API
    def adopt_run_id(self, run_id: str) -> None:
        """Take the strategy's run id when this callback was given none of its own (the strategy's
        may come from an argument the environment does not show); one given that differs is an
        error naming both. Call before ``setup``."""
        if self.settings.run_id is not None:
            if configured_run_id(self.settings.run_id) != configured_run_id(run_id):
                raise ValueError(f"EmergencyCheckpoint: run_id={self.settings.run_id!r} but the strategy's run id is "
                                 f"{run_id!r}; drop one or make them equal")
            return
        self._take_run_id(run_id)

    @property
    def store(self) -> SnapshotStore | None:
        """This rank's store (created at ``setup``)."""
        return self._store

    def keep_under(self, run_id: str) -> None:
        """Keep this ``fit()``'s snapshots under ``run_id`` (each later ``fit()`` of a job has a run id
        of its own: a recovery in one never restores another). Call before ``setup``."""
        self._drop_store("a new run id")
        self._take_run_id(run_id)
        self._last_snapshot = None

    @property
    def snapshots(self) -> SnapshotService:
        """This callback's snapshots as the code around training uses them (the strategy's
        transfer to new ranks, a hot spare's replicas): see :class:`SnapshotService`."""
        return SnapshotService(self.root, self.run_id, self.keep_last)

    @property
    def last_snapshot(self) -> SnapshotInfo | None:
        """The snapshot this callback wrote most recently."""
        return self._last_snapshot

    @property
    def schedule(self) -> Schedule | None:
        """The schedule all ranks agreed on at the last calibration step (None: not yet in this fit)."""
        return self._calibration.schedule

    @property
    def resumed_from(self) -> tuple[int, float] | None:
        """(step, wall-clock time it was taken) of the snapshot the last fit() resumed from."""
        return self._resume.resumed_from

    @property
    def resumed_tier(self) -> tuple[str, str] | None:
        """The tier the last fit() resumed from ("memory", "durable") and why."""
        return self._resume.resumed_tier

    def save_now(self, trainer: pl.Trainer, reason: str) -> SnapshotInfo:
        """Synchronously snapshot this rank's full checkpoint at the current global step.

        No collectives and no barrier, so it is safe when peers are gone or stopping. Call at
        a step boundary (e.g. from a callback hook), not from inside a signal handler.
        """
        self.commit_pending()
        start = time.perf_counter()
        store = self._get_store(trainer)
        checkpoint = dump_state(trainer)
        step = trainer.global_step
        info = store.save(checkpoint, step, reason=reason)
        seconds = time.perf_counter() - start
        self._calibration.record_save(seconds)
        self._committed(info)
        log.debug("rank %d: %s snapshot at step %d committed in %.3f s (%.1f MiB)",
                  store.rank, reason, step, seconds, info.nbytes / 2**20)
        return info

    def snapshot_step(self, step: int) -> bool:
        """Whether every rank took (or tried) a snapshot at ``step``: a periodic one of the agreed
        schedule, or the save the overhead budget's first calibration measures (the same answer on
        every rank, whether or not this rank's save succeeded)."""
        return (snapshot_due(step, None, self.every_n_steps, self._calibration.snapshot_interval)
                or self._calibration.first_needs_a_save(step))

    def save_live_state(self, trainer: pl.Trainer, reason: str) -> SnapshotInfo | None:
        """After a failure inside the next optimizer step (a peer's death fails its gradient
        all-reduce before any update): snapshot the last optimizer-step boundary from the live
        parameters and optimizer state plus what was captured there (see :mod:`.live`), so a
        recovery -- or the workers torchrun restarts -- resume at that step. None when the live
        state cannot be shown to be that boundary's (an update ran since); the newest snapshot
        then stands. Synchronous, this rank only, no collectives. Emits ``live_state``."""
        self.commit_pending("live state")
        problem = self._live.problem(trainer) if self.settings.live_state else "live_state=False"
        step = self._live.step
        if problem is None and self._last_snapshot is not None and self._last_snapshot.step == step:
            # the boundary's snapshot exists already (a periodic one): nothing to add
            self._events.emit(ev.LIVE_STATE, step=step, saved=True, reason="the snapshot of this step exists",
                              seconds=0.0)
            return self._last_snapshot
        if problem is not None:
            log.warning("rank %d: not resuming from the live state (%s); the newest snapshot stands",
                        trainer.global_rank, problem)
            self._events.emit(ev.LIVE_STATE, step=step, saved=False, reason=problem, seconds=None)
            return None
        assert step is not None  # problem() is None only when a boundary was recorded
        start = time.perf_counter()
        try:
            info = self._get_store(trainer).save(self._live.checkpoint(trainer), step, reason=reason)
        except Exception as exc:  # the newest snapshot stands; said why
            log.exception("rank %d: live-state snapshot of step %s failed; the newest snapshot stands",
                          trainer.global_rank, step)
            self._events.emit(ev.LIVE_STATE, step=step, saved=False, reason=f"{type(exc).__name__}: {exc}"[:300],
                              seconds=None)
            return None
        seconds = time.perf_counter() - start
        self._committed(info)
        log.info("rank %d: live state of step %d snapshotted in %.3f s (%s)", trainer.global_rank, step, seconds,
                 reason)
        self._events.emit(ev.LIVE_STATE, step=step, saved=True, reason=reason, seconds=round(seconds, 4),
                          bytes=info.nbytes)
        return info

    def commit_pending(self, where: str = "") -> SnapshotInfo | None:
        """Commit the periodic snapshot still copying in the background, if any (waits for the
        copy). A snapshot that cannot be committed is abandoned with a logged reason; the older
        snapshots stand. Called before the next optimizer step and by every other save."""
        committed = self._background.commit(self._store, where)
        if committed is None:
            return None
        info, persist, save_seconds = committed
        self._calibration.record_save(save_seconds)
        self._committed(info)
        if persist and self._trainer is not None:
            self._maybe_persist(self._trainer, info)
        return info

    def _committed(self, info: SnapshotInfo) -> None:
        self._check_spare = True
        self._last_saved_step = info.step
        self._last_snapshot = info

    @property
    def durable(self) -> DurableTier | None:
        """The durable tier (None: memory only)."""
        return self._durable.tier

    @property
    def persister(self) -> DurablePersister | None:
        """This rank's background uploader (created at ``setup`` when a durable tier is set)."""
        return self._durable.persister

    def flush_durable(self, info: SnapshotInfo, world_size: int, budget_left_s: float) -> tuple[str, str]:
        """Make ``info`` durable within ``budget_left_s`` when the measured upload rate says it fits
        (SIGTERM path, this rank only). Returns (the tier that now holds the state, why)."""
        return self._durable.flush(info, world_size, budget_left_s)

    def estimated_save_seconds(self) -> float | None:
        """Slowest of the last few ``save_now`` durations (conservative for budget decisions);
        None before the first snapshot."""
        return self._calibration.estimated_save_seconds()

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        store = self._get_store(trainer)
        global _no_run_id_warned
        if store.configured_run_id is None and not _no_run_id_warned:
            _no_run_id_warned = True
            log.warning(no_run_id_message(store.run_dir))
        self._events = getattr(trainer.strategy, "event_log", None) or open_event_log(f"rank{store.rank}")
        # every rank uploads its own snapshot and a step is durable once all ranks' are: sharded
        # state is made durable by the same all-shards commit as replicated state
        self._durable.start(lambda: self._get_store(trainer), store.rank,
                            emit=lambda event, **fields: self._events.emit(event, **fields))
        if not (holds_shards(trainer) or replicated(trainer)):
            log.warning("EmergencyCheckpoint supports single-device, DDP and ModelParallelStrategy; with %s each "
                        "rank's snapshot holds only what dump_checkpoint returns on that rank and auto-resume is off",
                        type(trainer.strategy).__name__)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drop_pending_restore(trainer)
        self._warn_if_unprotected(trainer)
        self._resume.reset()
        self._space_checked, self._estimated_bytes = False, None  # once per fit: the model may differ
        self._durable.new_timeline()
        if self.auto_resume:
            self._resume.run(trainer, self._get_store(trainer), self._durable.tier)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Snapshots past the step we (re)started from belong to an abandoned history; leaving
        # them would make the next restart jump onto it.
        self._get_store(trainer).discard_newer_than(trainer.global_step)
        self._durable.drop_abandoned(trainer.global_step, trainer.global_rank, self._resume.durable_listed_everywhere)
        for optimizer in trainer.optimizers:
            if hasattr(getattr(optimizer, "_optimizer", optimizer), "consolidate_state_dict"):
                log.warning("sharded optimizer %s: dump_checkpoint runs a collective; save_now() is not "
                            "collective-free with it", type(optimizer).__name__)
        self._calibration.start(trainer.global_step)
        if replicated(trainer):
            self._live.start(trainer)
        self._durable.mark_step_start()
        self._check_spare = True
        self._background.off = None
        self._background.hook_optimizer_steps(trainer.optimizers, self.commit_pending)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.commit_pending("batch end")  # no optimizer step since (gradient accumulation)
        self._live.at_batch_end(trainer)
        step = trainer.global_step
        sample = self._calibration.step_time(step)
        if sample is not None:
            self._durable.observe_step(sample)
        if not self._space_checked and step >= 1:
            self._space_checked = True
            self._check_space(trainer)
        if self._calibration.due(step):
            first = None
            if self._calibration.first_needs_a_save(step):
                first = self._periodic_save(trainer, step, persist=False)  # measures the save the budget needs
            self._calibration.calibrate(step, trainer.global_rank, self._persist_seconds(trainer), self._events.emit,
                                        sharded=holds_shards(trainer))
            if first is not None:
                self._maybe_persist(trainer, first)
        if snapshot_due(step, self._last_saved_step, self.every_n_steps, self._calibration.snapshot_interval):
            if self.background_copy and self._background.off is None and next_is_a_training_batch(trainer):
                if self._background.start(trainer, self._get_store(trainer), step):
                    self._last_saved_step = step  # not due again at this step; the commit makes it the last snapshot
            else:
                self._periodic_save(trainer, step, persist=True)
        if self.preallocate and self._check_spare and step >= 1 and not self._background.pending:
            self._ensure_spare(trainer)
        if self._calibration.restart_clock(step):
            self._durable.mark_step_start()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.commit_pending("validation")  # e.g. weight averaging swaps parameters in for it

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.commit_pending("end of training")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # a peer's failure in the next backward leaves parameters and optimizer state as they
        # were at the snapshot's step (no optimizer step ran), so the snapshot is still whole
        self.commit_pending("exception")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.commit_pending("teardown")
        self._background.remove_hooks()
        self._live.stop()
        if self._store is not None:
            self._store.discard_spare()  # committed snapshots stay; the spare is only for this process
            self._store.close()

    # ------------------------------------------------------------------ internals
    def _warn_if_unprotected(self, trainer: pl.Trainer) -> None:
        """Say once per process, in one line, what leaves this run's progress unprotected."""
        global _unprotected_warned
        periodic = bool(self.every_n_steps or self.every_n_seconds or self.max_overhead)
        gaps = protection_gaps(periodic=periodic, persist_to=self.settings.durable.persist_to,
                               auto_resume=self.auto_resume)
        if gaps and not _unprotected_warned:
            _unprotected_warned = True
            log.warning("rank %d: EmergencyCheckpoint leaves progress unprotected: %s", trainer.global_rank,
                        "; ".join(gaps))

    def _periodic_save(self, trainer: pl.Trainer, step: int, persist: bool) -> SnapshotInfo | None:
        try:
            info = self.save_now(trainer, reason="periodic")
            if persist:
                self._maybe_persist(trainer, info)
            return info
        except Exception:
            # A failed periodic snapshot (e.g. shm full) must not kill training; the next
            # one may succeed and the error is visible in the log.
            log.exception("rank %d: periodic snapshot at step %d failed", trainer.global_rank, step)
            return None

    def _persist_seconds(self, trainer: pl.Trainer) -> float | None:
        return self._durable.persist_seconds(lambda: self._snapshot_bytes(trainer))

    def _maybe_persist(self, trainer: pl.Trainer, info: SnapshotInfo) -> None:
        if not self._durable.offering:
            return
        every = self._calibration.persist_every(lambda: self._persist_seconds(trainer))
        if first_durable_copy_due(self._durable.offered_in_timeline) or persist_due(info.step, every):
            self._durable.offer(info, trainer.world_size)

    def _get_store(self, trainer: pl.Trainer) -> SnapshotStore:
        rank = trainer.global_rank
        if self._store is None or self._store.rank != rank:
            self._drop_store("a new store")
            self._store = SnapshotStore(self.root, self._configured_run_id, rank, self.keep_last)
        return self._store

    def _take_run_id(self, run_id: str) -> None:
        self.run_id = resolve_run_id(run_id)
        self._configured_run_id = configured_run_id(run_id)
        self._durable = DurableCopies(self.durable_settings, self._configured_run_id)

    def _drop_store(self, why: str) -> None:
        if self._store is not None:
            self.commit_pending(why)
            self._store.close()
            self._store = None

    def _snapshot_bytes(self, trainer: pl.Trainer) -> int:
        """Size of this rank's snapshot file: the last one's, else estimated once from the tensors
        (no hook runs: see ``estimate_state_bytes``; the room check and the spare share it)."""
        if self._last_snapshot is not None:
            return self._last_snapshot.nbytes
        if self._estimated_bytes is None:
            self._estimated_bytes = estimate_state_bytes(trainer)
        return self._estimated_bytes

    def space_problem(self, trainer: pl.Trainer) -> str | None:
        """Why the snapshot root cannot hold this run's snapshots (None: it can), from free space
        (statvfs) vs the snapshot size x the copies one rank keeps x the ranks of this host."""
        copies = snapshot_copies(self.keep_last, self.preallocate, self._durable.persister is not None)
        ranks = max(1, int(getattr(trainer, "num_devices", 1) or 1))
        return room_problem(self._get_store(trainer), self._snapshot_bytes(trainer), copies, ranks)

    def _check_space(self, trainer: pl.Trainer) -> None:
        # before the first save: a full tmpfs otherwise shows up as a failed snapshot at the
        # worst moment (SIGTERM)
        try:
            problem = self.space_problem(trainer)
        except OSError as exc:
            log.warning("rank %d: could not check the snapshot root's free space: %s", trainer.global_rank, exc)
            return
        if problem is not None:
            log.error("rank %d: %s", trainer.global_rank, problem)

    def _ensure_spare(self, trainer: pl.Trainer) -> None:
        # Runs at step >= 1 so the optimizer state exists and the size estimate is right.
        self._check_spare = False
        store = self._get_store(trainer)
        if not store.spare_needed():
            return
        nbytes = self._snapshot_bytes(trainer)
        try:
            store.preallocate(nbytes)
        except OSError as exc:
            log.warning("rank %d: could not preallocate a %.1f MiB spare snapshot file (%s); the next "
                        "snapshot writes a fresh file", store.rank, nbytes / 2**20, exc)
