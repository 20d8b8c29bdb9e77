"""``EmergencyCheckpoint``: periodic and on-demand in-memory snapshots, plus auto-resume."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from typing import Any, Callable, Iterable

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_ft._lightning.callback_dispatch import skip_unused_batch_hooks
from lightning_ft._validation import require_bool, require_number
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.durable.persister import DurablePersister
from lightning_ft.checkpoint.durable.settings import resolve_durable_settings
from lightning_ft.checkpoint.durable.tier import DurableTier, UploadResult
from lightning_ft.checkpoint.identity import state_dict_fingerprint
from lightning_ft.checkpoint.policy import parse_mem_url, snapshot_due
from lightning_ft.checkpoint.exchange.agreement import agree_across_tiers, bring_into_memory, gather_steps
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
from lightning_ft.checkpoint.tiers import (
    FIRST_CALIBRATION,
    Schedule,
    ScheduleProposal,
    agree_schedule,
    calibration_due,
    durable_copy_seconds,
    flush_fits,
    persist_due,
    persist_interval_steps,
    propose_schedule,
    snapshot_copies,
    space_shortfall,
)
from lightning_ft.events import NullEventLog, open_event_log
from lightning_ft.events import names as ev

log = logging.getLogger(__name__)

_EMA = 0.3  # weight of the newest step-time sample
_SKIPPED_SHOWN = 3  # skipped snapshots named in the auto-resume warning
_PEER_MARKERS_WAIT_S = 2.0  # SIGTERM flush: how long to look for the peers' markers of the stop step
_no_run_id_warned = False  # the "set a run id" warning is given once per process


def no_run_id_message(run_dir: str) -> str:
    """Why snapshots of a run without a run id are written but never resumed, and the fix."""
    return (f"EmergencyCheckpoint: no run id is set (run_id=, {', '.join(RUN_ID_ENV_VARS)}), so snapshots go to "
            f"{run_dir} but are never resumed: a run without a run id cannot tell its own snapshots from "
            f"another job's. Set a run id that stays the same when this job restarts (e.g. LIGHTNING_FT_RUN_ID) "
            f"to resume from them.")


def skipped_snapshots_message(rank: int, skipped: list[tuple[SnapshotInfo, str]], outcome: str) -> str:
    """The auto-resume warning for snapshots of another job or model: which, why, and what happens instead."""
    shown = "; ".join(f"step {info.step} ({info.path}): {why}" for info, why in skipped[:_SKIPPED_SHOWN])
    more = f" (and {len(skipped) - _SKIPPED_SHOWN} more)" if len(skipped) > _SKIPPED_SHOWN else ""
    return f"rank {rank}: auto-resume skipped snapshots of another job or model: {shown}{more}. {outcome}"


def _next_is_a_training_batch(trainer: pl.Trainer) -> bool:
    """Whether, after this batch's end, the fit loop goes straight on to the next training batch:
    not the end of the epoch or of training, no stop requested, no validation due. Only then is
    a background copy safe from other callbacks' epoch, validation and end hooks, which may swap
    weights through ``.data`` (e.g. Lightning's ``WeightAveraging``), unseen by version counters."""
    try:
        epoch_loop = trainer.fit_loop.epoch_loop
        return not (trainer.should_stop or epoch_loop._is_training_done
                    or epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except Exception:  # noqa: BLE001 - another Lightning version or loop: copy synchronously
        return False


def changed_only_by_optimizer_steps(optimizers: Iterable[torch.optim.Optimizer]) -> Callable[[torch.Tensor], bool]:
    """Whether a checkpoint tensor is (a view of) a parameter the optimizers update or one of
    their state tensors: between a batch's end and the next optimizer step only that step changes
    them. (A parameter no optimizer updates may be changed by anything, e.g. forward.)"""
    storages = set()
    for optimizer in optimizers:
        storages.update(parameter.untyped_storage().data_ptr()
                        for group in optimizer.param_groups for parameter in group["params"])
        for state in optimizer.state.values():
            storages.update(value.untyped_storage().data_ptr() for value in state.values()
                            if isinstance(value, torch.Tensor))
    storages.discard(0)  # empty tensors share the null pointer
    return lambda tensor: tensor.untyped_storage().data_ptr() in storages


class EmergencyCheckpoint(pl.Callback):
    """Snapshots the full Lightning checkpoint of each rank into host shared memory.

    * periodically at step boundaries (``every_n_steps`` and/or ``every_n_seconds``), so a
      ``kill -9`` loses at most that window;
    * on demand via ``save_now()`` (the SIGTERM path: synchronous, this rank only, no collectives);
    * on ``fit()``, with ``auto_resume``, restores the newest snapshot all ranks can read when it
      is newer than whatever ``ckpt_path`` the user passed (none, a path, ``"last"``).

    Args:
        every_n_steps: snapshot when ``global_step % every_n_steps == 0``.
        every_n_seconds: snapshot about every so many seconds: a power-of-two number of steps
            from the measured step time, agreed by all ranks (the smallest) at the calibration
            steps 8, 16, 32, ... after the start of training (one small collective each).
        max_overhead: without ``every_n_steps``/``every_n_seconds``: snapshot as often as keeps the
            measured save time within this share of training time (e.g. 0.005: 0.5 %), a
            power-of-two number of steps agreed by all ranks (the largest) at the calibration
            steps; the first snapshot is taken at the first calibration step (step 8 of a fit) to
            measure the save. None (default): no periodic snapshots without a schedule; the
            ``ddp_ft`` strategy's own ``EmergencyCheckpoint`` uses 0.005.
        keep_last: snapshots kept per rank (>= 1). With >= 2 the oldest file is overwritten in
            place by the next snapshot, which is ~3x faster than a fresh tmpfs file.
        root: snapshot root (default ``$LIGHTNING_FT_SNAPSHOT_DIR`` or ``/dev/shm/lightning_ft-<uid>``).
        run_id: scope (default LIGHTNING_FT_RUN_ID / TORCHELASTIC_RUN_ID / SLURM_JOB_ID). Without any,
            snapshots are written to ``<root>/default`` but never resumed (a warning says so once).
        auto_resume: on ``fit()``, restore the newest snapshot of this run id and this model (same
            parameter names and shapes); snapshots of another job or model are skipped with a
            warning that says which and why.
        preallocate: keep a spare snapshot file with its shared-memory pages allocated whenever
            the next save could not overwrite an old snapshot (before the first ``keep_last``
            snapshots exist). Costs one state-size of shared memory and a one-off allocation at
            a step boundary, and makes the first emergency save as fast as later ones.
        persist_to: the durable tier: a directory (local or shared filesystem) or an fsspec URL
            (``s3://bucket/prefix``, needs ``pip install 'lightning-ft[s3]'``); default
            ``$LIGHTNING_FT_PERSIST_TO``; None: memory only. Committed snapshots are copied there
            in the background (training never waits for an upload), a step counts only once
            every rank's copy is verified, and resume falls back to it when memory lacks the step.
            Needs a run id.
        persist_every_n_seconds: about how often a snapshot is copied durably (default
            ``$LIGHTNING_FT_PERSIST_EVERY_SECONDS``, else Daly's interval for the measured copy
            time and ``persist_mtbf_seconds``; 0: every snapshot). Converted to a power-of-two
            multiple of the snapshot interval in steps, agreed at the calibration steps with a
            budget or ``every_n_seconds`` schedule so all ranks copy the same steps (with
            ``every_n_steps`` each rank's own multiple).
        persist_mtbf_seconds: the job's mean time between failures assumed for that default
            (``$LIGHTNING_FT_MTBF_SECONDS``, else 4 h).
        persist_max_mib_per_second: upload bandwidth bound per rank (default
            ``$LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND`` or 512; <= 0: unbounded).
        persist_max_overhead: share of step time that steps overlapping a durable copy may lose
            against the others (default ``$LIGHTNING_FT_PERSIST_MAX_OVERHEAD`` or 0.02): the
            upload bound is paced from the measured step times, starting at 64 MiB/s and never
            above ``persist_max_mib_per_second``; 0: that bound, fixed.
        persist_keep_last: complete durable steps kept (default ``$LIGHTNING_FT_PERSIST_KEEP_LAST`` or 2).
        storage_options: fsspec options for ``persist_to`` (e.g. ``{"endpoint_url": ...}``; default
            ``$LIGHTNING_FT_PERSIST_STORAGE_OPTIONS`` as JSON). Credentials come from the usual places.
        background_copy: periodic snapshots copy the parameters and the optimizer state on a
            helper thread while the next batch's forward and backward run, and commit before the
            next optimizer step changes them (an optimizer step pre-hook); training blocks only
            for the rest (buffers, metadata) and for what is left of the copy at that step. The
            tensors' version counters are checked at the commit: a snapshot whose tensors were
            changed in place meanwhile (by something other than the optimizer) is abandoned
            with a warning and later snapshots are copied synchronously. Emergency (``save_now``)
            snapshots are always synchronous. False: every snapshot is copied synchronously.

    Supported strategies: single device and DDP (replicated state). Not a ``Checkpoint``
    subclass, so it works with ``enable_checkpointing=False``.
    """

    def __init__(self, every_n_steps: int | None = None, every_n_seconds: float | None = None,
                 keep_last: int = 2, root: str | None = None, run_id: str | None = None,
                 auto_resume: bool = True, preallocate: bool = True, persist_to: str | None = None,
                 persist_every_n_seconds: float | None = None, persist_max_mib_per_second: float | None = None,
                 persist_keep_last: int | None = None, storage_options: dict[str, Any] | None = None,
                 max_overhead: float | None = None, persist_mtbf_seconds: float | None = None,
                 background_copy: bool = True, persist_max_overhead: float | None = None) -> None:
        require_number("every_n_steps", every_n_steps, integer=True, allow_none=True)
        require_number("every_n_seconds", every_n_seconds, allow_none=True)
        require_number("max_overhead", max_overhead, allow_none=True)
        if every_n_seconds is not None:
            every_n_seconds = float(every_n_seconds)
        require_number("keep_last", keep_last, integer=True, minimum=1, inclusive=True)
        require_bool("auto_resume", auto_resume)
        require_bool("preallocate", preallocate)
        require_bool("background_copy", background_copy)
        self.background_copy = background_copy
        self._background_off: str | None = None  # why background copies stopped in this fit
        # (persist?, seconds blocked, of them dump_checkpoint's) of the save not yet committed
        self._pending: tuple[bool, float, float] | None = None
        self._step_hooks: list[Any] = []
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.max_overhead = max_overhead
        self.keep_last = keep_last
        self.root = resolve_root(root)
        ensure_writable_root(self.root)
        self.run_id = resolve_run_id(run_id)
        self._configured_run_id = configured_run_id(run_id)
        self.auto_resume = auto_resume
        self.preallocate = preallocate
        self._check_spare = True
        self._store: SnapshotStore | None = None
        self._trainer: pl.Trainer | None = None
        self._durations: deque[float] = deque(maxlen=5)
        self._last_saved_step: int | None = None
        self._last_snapshot: SnapshotInfo | None = None
        self._clock: tuple[float, int] | None = None  # (time, global_step) at the last step change
        self._upload_activity: tuple[bool, int] | None = None  # the persister's activity at that time
        self._seconds_per_step: float | None = None
        #: the schedule all ranks agreed on at the last calibration step (None: not yet in this fit)
        self.schedule: Schedule | None = None
        self._train_start_step = 0
        self._calibrated_step: int | None = None
        self._events: Any = NullEventLog()
        #: (step, wall-clock time it was taken) of the snapshot the last fit() resumed from
        self.resumed_from: tuple[int, float] | None = None
        #: the tier the last fit() resumed from ("memory", "durable") and why
        self.resumed_tier: tuple[str, str] | None = None
        self.durable_settings = resolve_durable_settings(persist_to, persist_every_n_seconds,
                                                         persist_max_mib_per_second, persist_keep_last, storage_options,
                                                         mtbf_seconds=persist_mtbf_seconds,
                                                         max_overhead=persist_max_overhead)
        self._durable: DurableTier | None = None
        if self.durable_settings is not None:
            if self._configured_run_id is None:
                log.warning("EmergencyCheckpoint: persist_to=%s is ignored: no run id is set (%s), so durable copies "
                            "could never be told apart from another job's", self.durable_settings.url,
                            ", ".join(RUN_ID_ENV_VARS))
            else:
                self._durable = DurableTier.from_settings(self.durable_settings, self._configured_run_id)
        self._persister: DurablePersister | None = None
        self._segment: str | None = None
        self._space_checked = False
        self._estimated_bytes: int | None = None
        # newer durable steps may be dropped as an abandoned timeline only when every rank could list them
        self._durable_listed_everywhere = False
        skip_unused_batch_hooks(self)

    # ------------------------------------------------------------------ public API
    @property
    def store(self) -> SnapshotStore | None:
        """This rank's store (created at ``setup``)."""
        return self._store

    @property
    def last_snapshot(self) -> SnapshotInfo | None:
        """The snapshot this callback wrote most recently."""
        return self._last_snapshot

    def save_now(self, trainer: pl.Trainer, reason: str) -> SnapshotInfo:
        """Synchronously snapshot this rank's full checkpoint at the current global step.

        No collectives and no barrier, so it is safe when peers are gone or stopping. Call at
        a step boundary (e.g. from a callback hook), not from inside a signal handler.
        """
        self.commit_pending()
        start = time.perf_counter()
        store = self._get_store(trainer)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        step = trainer.global_step
        info = store.save(checkpoint, step, reason=reason)
        seconds = time.perf_counter() - start
        self._durations.append(seconds)
        self._committed(info)
        log.debug("rank %d: %s snapshot at step %d committed in %.3f s (%.1f MiB)",
                  store.rank, reason, step, seconds, info.nbytes / 2**20)
        return info

    def commit_pending(self, where: str = "") -> SnapshotInfo | None:
        """Commit the periodic snapshot still copying in the background, if any (waits for the
        copy). A snapshot that cannot be committed is abandoned with a logged reason; the older
        snapshots stand. Called before the next optimizer step and by every other save."""
        store, pending = self._store, self._pending
        if store is None or pending is None:
            return None
        self._pending = None
        if store.pending_step is None:
            return None  # the store committed it itself (e.g. closed)
        persist, blocked, dumped = pending
        step = store.pending_step
        start = time.perf_counter()
        try:
            info = store.commit_pending()
        except fmt.SnapshotError as exc:
            self._background_off = str(exc)
            log.warning("rank %d: %s; snapshots of this fit are copied synchronously from now on", store.rank, exc)
            return None
        except Exception:
            log.exception("rank %d: periodic snapshot at step %s failed", store.rank, step)
            return None
        if info is None:
            return None
        waited = time.perf_counter() - start
        timing = store.last_timing
        # what a synchronous save_now of this state would take (the SIGTERM budget's estimate)
        self._durations.append(dumped + timing.work if timing is not None else blocked + waited)
        self._committed(info)
        log.debug("rank %d: periodic snapshot at step %d committed%s: training blocked %.3f s", store.rank, info.step,
                  f" ({where})" if where else "", blocked + waited)
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
        return self._durable

    @property
    def persister(self) -> DurablePersister | None:
        """This rank's background uploader (created at ``setup`` when a durable tier is set)."""
        return self._persister

    def flush_durable(self, info: SnapshotInfo, world_size: int, budget_left_s: float) -> tuple[str, str]:
        """Make ``info`` durable within ``budget_left_s`` when the measured upload rate says it fits
        (SIGTERM path, this rank only). Returns (the tier that now holds the state, why)."""
        persister = self._persister
        if persister is None or self._segment is None:
            return "memory", "no durable tier"
        fits, why = flush_fits(info.nbytes, persister.measured_unbounded_bytes_per_second, budget_left_s)
        if not fits:
            return "memory", why
        deadline = time.monotonic() + budget_left_s
        result: UploadResult | None = persister.flush(info, self._segment, world_size, deadline)
        if result is None:
            return "memory", f"durable copy of step {info.step} did not finish ({why})"
        # the peers flush the same stop step at the same time: their markers usually follow
        # within moments, and then this rank's record can say "durable" truthfully
        wait_until = min(deadline, time.monotonic() + _PEER_MARKERS_WAIT_S)
        complete = result.complete
        while not complete and time.monotonic() < wait_until:
            time.sleep(0.05)
            complete = persister.tier.publish_if_complete(info.step, self._segment)
        if complete:
            return "durable", f"step {info.step} complete in durable storage ({why})"
        return "memory+shard", (f"this rank's shard of step {info.step} is durable; the step is complete once "
                                f"every rank's shard is ({why})")

    def estimated_save_seconds(self) -> float | None:
        """Slowest of the last few ``save_now`` durations (conservative for budget decisions);
        None before the first snapshot."""
        return max(self._durations) if self._durations else None

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
        if self._durable is not None and self._persister is None:
            self._persister = DurablePersister(self._durable, lambda: self._get_store(trainer), store.rank,
                                               emit=lambda event, **fields: self._events.emit(event, **fields),
                                               pacer=self.durable_settings.pacer())
        if not self._replicated(trainer):
            log.warning("EmergencyCheckpoint supports single-device and DDP strategies; with %s each rank's "
                        "snapshot holds only what dump_checkpoint returns on that rank and auto-resume is off",
                        type(trainer.strategy).__name__)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resumed_from = None
        self.resumed_tier = None
        self._durable_listed_everywhere = False
        self._space_checked, self._estimated_bytes = False, None  # once per fit: the model may differ
        if self._durable is not None:
            # one token per stretch of training, the same on every rank: shards of one step written
            # by different stretches (the step trained again after a failure) never combine.
            # secrets, not random: seed_everything makes `random` repeat the token in every run
            self._segment = f"{gather_steps([secrets.randbits(62)])[0][0]:016x}"
        if self.auto_resume:
            self._auto_resume(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Snapshots past the step we (re)started from belong to an abandoned history; leaving
        # them would make the next restart jump onto it.
        self._get_store(trainer).discard_newer_than(trainer.global_step)
        if self._durable is not None and trainer.global_rank == 0 and self._durable_listed_everywhere:
            # Only after an agreement in which every rank listed the durable steps: a listing
            # that failed on one rank must never make rank 0 delete the job's durable progress.
            listed = self._durable.complete_steps()
            self._durable.drop_manifests([s for s in listed or [] if s > trainer.global_step])
        for optimizer in trainer.optimizers:
            if hasattr(getattr(optimizer, "_optimizer", optimizer), "consolidate_state_dict"):
                log.warning("sharded optimizer %s: dump_checkpoint runs a collective; save_now() is not "
                            "collective-free with it", type(optimizer).__name__)
        self._clock = (time.perf_counter(), trainer.global_step)
        self._upload_activity = self._persister.activity() if self._persister is not None else None
        self._check_spare = True
        self._background_off = None
        self._hook_optimizer_steps(trainer)
        # every rank of a (re)started fit calibrates at the same steps from here, survivors and
        # a spare alike; until the first calibration only every_n_steps applies
        self._train_start_step, self._calibrated_step, self.schedule = trainer.global_step, None, None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.commit_pending("batch end")  # no optimizer step since (gradient accumulation)
        step = trainer.global_step
        now = time.perf_counter()
        if self._clock is not None and step > self._clock[1]:
            sample = (now - self._clock[0]) / (step - self._clock[1])
            prev = self._seconds_per_step
            self._seconds_per_step = sample if prev is None else _EMA * sample + (1 - _EMA) * prev
            if self._persister is not None and self._upload_activity is not None:
                self._persister.observe_step(sample, self._upload_activity)
        if not self._space_checked and step >= 1:
            self._space_checked = True
            self._check_space(trainer)
        if self._calibrates() and step != self._calibrated_step and calibration_due(step, self._train_start_step):
            self._calibrated_step = step
            first = None
            if self._budget_schedule() and step - self._train_start_step == FIRST_CALIBRATION:
                first = self._periodic_save(trainer, step, persist=False)  # measures the save the budget needs
            self._calibrate(trainer, step)
            if first is not None:
                self._maybe_persist(trainer, first)
        interval = self.schedule.snapshot_interval if self.schedule is not None else None
        if snapshot_due(step, self._last_saved_step, self.every_n_steps, interval):
            if self.background_copy and self._background_off is None and _next_is_a_training_batch(trainer):
                self._start_background_save(trainer, step)
            else:
                self._periodic_save(trainer, step, persist=True)
        if self.preallocate and self._check_spare and step >= 1 and self._pending is None:
            self._ensure_spare(trainer)
        if self._clock is None or step != self._clock[1]:
            # measured after our own save so the snapshot time is not counted as step time
            # (the wait for a background copy at the next optimizer step is: training waited)
            self._clock = (time.perf_counter(), step)
            self._upload_activity = self._persister.activity() if self._persister is not None else None

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
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        if self._store is not None:
            self._store.discard_spare()  # committed snapshots stay; the spare is only for this process
            self._store.close()

    # ------------------------------------------------------------------ internals
    def _hook_optimizer_steps(self, trainer: pl.Trainer) -> None:
        """Commit a background snapshot before any optimizer step changes what it still copies
        (every optimizer step, automatic or manual optimization, runs torch's step pre-hooks)."""
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step)
                             for optimizer in trainer.optimizers]

    def _before_optimizer_step(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Torch's step pre-hook. With a closure (Lightning's automatic optimization: forward and
        backward run inside ``step``), commit once the closure returned, before the update; else now."""
        if self._pending is None:
            return None
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is None:
            self.commit_pending("optimizer step")
            return None

        def closure_then_commit() -> Any:
            loss = closure()
            self.commit_pending("optimizer step")
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_commit}
        return (closure_then_commit, *args[1:]), kwargs

    def _start_background_save(self, trainer: pl.Trainer, step: int) -> None:
        """The periodic snapshot of ``step``: parameters and optimizer state copied on a helper
        thread until :meth:`commit_pending` (the next optimizer step at the latest)."""
        start = time.perf_counter()
        store = self._get_store(trainer)
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            dumped = time.perf_counter() - start
            deferred = changed_only_by_optimizer_steps(trainer.optimizers)
            store.save_in_background(checkpoint, step, deferred, reason="periodic")
        except Exception:
            log.exception("rank %d: periodic snapshot at step %d failed", trainer.global_rank, step)
            return
        self._pending = (True, time.perf_counter() - start, dumped)
        self._last_saved_step = step  # not due again at this step; the commit makes it the last snapshot

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

    def _budget_schedule(self) -> bool:
        return bool(self.max_overhead) and self.every_n_steps is None and self.every_n_seconds is None

    def _calibrates(self) -> bool:
        """Whether ranks agree on a schedule at the calibration steps. Only settings of the code
        decide (every rank runs the same), never the environment: a rank that skipped the
        collective its peers entered would desynchronise the group. every_n_steps needs no
        agreement."""
        return self.every_n_seconds is not None or self._budget_schedule()

    def _persist_seconds(self, trainer: pl.Trainer) -> float | None:
        if self._persister is None or self.durable_settings is None:
            return None
        nbytes = self._snapshot_bytes(trainer)
        # before the first upload: the bound uploads run at now (the pacer's, when pacing)
        copy = durable_copy_seconds(nbytes, self._persister.measured_bytes_per_second,
                                    self._persister.tier.max_bytes_per_second)
        return self.durable_settings.interval_seconds(copy)

    def _calibrate(self, trainer: pl.Trainer, step: int) -> None:
        """Agree with every rank on the schedule (collective: every rank calls it at the same step)."""
        save_seconds = self.estimated_save_seconds()
        proposal = propose_schedule(seconds_per_step=self._seconds_per_step, save_seconds=save_seconds,
                                    every_n_steps=self.every_n_steps, every_n_seconds=self.every_n_seconds,
                                    max_overhead=self.max_overhead, persist_seconds=self._persist_seconds(trainer))
        rows = gather_steps(proposal.as_list())
        schedule = agree_schedule([ScheduleProposal(*row) for row in rows], self.every_n_steps)
        changed, self.schedule = schedule != self.schedule, schedule
        if not changed or trainer.global_rank != 0:
            return
        sps = self._seconds_per_step or 0.0
        fields = dict(step=step, snapshot_every_n_steps=schedule.snapshot_interval or self.every_n_steps,
                      persist_every_n_steps=schedule.persist_every, seconds_per_step=round(sps, 6),
                      save_seconds=None if save_seconds is None else round(save_seconds, 6))
        self._events.emit(ev.SNAPSHOT_SCHEDULE, **fields)
        every = fields["snapshot_every_n_steps"]
        share = f", a save {save_seconds:.3f} s = {100 * save_seconds / (every * sps):.2f} % of training time" \
            if every and sps and save_seconds else ""
        durable = f"; durable copies every {schedule.persist_every} steps" if schedule.persist_every else ""
        log.info("EmergencyCheckpoint: at step %d, snapshots every %s steps (%.2f s%s)%s", step, every,
                 (every or 0) * sps, share, durable)

    def _maybe_persist(self, trainer: pl.Trainer, info: SnapshotInfo) -> None:
        if self._persister is None or self._segment is None or self.durable_settings is None:
            return
        if self.schedule is not None:
            every = self.schedule.persist_every
        elif self._calibrates():
            every = None  # the first agreement is still to come
        else:
            # every_n_steps: this rank's own power-of-two multiple of it (ranks whose estimates
            # differ still share the larger interval's steps)
            every = persist_interval_steps(self._persist_seconds(trainer) or 0.0, self._seconds_per_step or 0.0,
                                           self.every_n_steps or 1)
        if persist_due(info.step, every):
            self._persister.offer(info, self._segment, trainer.world_size)

    def _get_store(self, trainer: pl.Trainer) -> SnapshotStore:
        rank = trainer.global_rank
        if self._store is None or self._store.rank != rank:
            if self._store is not None:
                self.commit_pending("a new store")
                self._store.close()
            self._store = SnapshotStore(self.root, self._configured_run_id, rank, self.keep_last)
        return self._store

    def _snapshot_bytes(self, trainer: pl.Trainer) -> int:
        """Size of this rank's snapshot file: the last one's, else estimated once (dump_checkpoint
        runs the on_save_checkpoint hooks, so the room check and the spare share one estimate)."""
        if self._last_snapshot is not None:
            return self._last_snapshot.nbytes
        if self._estimated_bytes is None:
            self._estimated_bytes = fmt.encode(trainer._checkpoint_connector.dump_checkpoint(weights_only=False),
                                               check_loadable=False).file_size
        return self._estimated_bytes

    def space_problem(self, trainer: pl.Trainer) -> str | None:
        """Why the snapshot root cannot hold this run's snapshots (None: it can), from free space
        (statvfs) vs the snapshot size x the copies one rank keeps x the ranks of this host."""
        store = self._get_store(trainer)
        nbytes = self._snapshot_bytes(trainer)
        stats = os.statvfs(store.root)
        free = stats.f_bavail * stats.f_frsize
        reusable = sum(info.nbytes for info in store.list())
        copies = snapshot_copies(self.keep_last, self.preallocate, self._persister is not None)
        ranks = max(1, int(getattr(trainer, "num_devices", 1) or 1))
        missing = space_shortfall(free, reusable, nbytes, copies, ranks)
        if not missing:
            return None
        return (f"snapshot root {store.root} has {free / 2**20:.1f} MiB free but rank {store.rank} needs "
                f"{nbytes / 2**20:.1f} MiB x {copies} snapshot files x {ranks} rank(s) on this host "
                f"({missing / 2**20:.1f} MiB missing); snapshots will fail. Fix: point {ENV_SNAPSHOT_DIR} "
                f"(or root=) to a local-disk directory with room, enlarge /dev/shm (containers default to "
                f"64 MiB: docker --shm-size, a Kubernetes memory emptyDir), or lower keep_last/preallocate")

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

    @staticmethod
    def _replicated(trainer: pl.Trainer) -> bool:
        strategy = trainer.strategy
        return isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) and not strategy.restore_checkpoint_after_setup

    def _auto_resume(self, trainer: pl.Trainer) -> None:
        # How: Lightning has already run its own restore for the ckpt_path the user passed
        # (_restore_modules_and_callbacks runs before strategy.setup, which runs before
        # on_fit_start) and will restore loops, optimizers, schedulers and precision state
        # from `_checkpoint_connector._loaded_checkpoint` right after on_fit_start
        # (restore_training_state). So we replace `_loaded_checkpoint` and re-run the module
        # and callback restore; Lightning's own code does the rest, and resume_end logs
        # "Restored all states from the checkpoint at mem://<step>".
        # Why not elsewhere: no callback hook runs before fit() resolves ckpt_path, so setting
        # trainer.ckpt_path from a hook is too late; in `setup` the user's choice is not yet
        # known (it is a local of Trainer._run) and pre-filling _loaded_checkpoint there would
        # rely on resume_start(None) happening to leave it untouched. Here we know what the
        # user's checkpoint contained and can keep it when it is newer. The process group is
        # up and every rank runs this hook, so the rank agreement (one all_gather) is safe.
        if not self._replicated(trainer):
            return
        connector = trainer._checkpoint_connector
        given = connector._ckpt_path
        if parse_mem_url(given) is not None:
            return  # already restored from a snapshot by MemoryCheckpointIO
        store = self._get_store(trainer)
        # Only this job's snapshots of this model: the run id, and the parameter names and shapes
        # of the module as it is now (after configure_model and the precision plugin's cast).
        expect = store.expected_identity(model=state_dict_fingerprint(trainer.lightning_module.state_dict()))
        if store.configured_run_id is None:
            local, skipped = [], []  # every rank still joins the agreement below
            log.info("rank %d: not resuming from snapshots: no run id is set", store.rank)
        else:
            scan = store.scan(include_peers=True, expect=expect)
            local, skipped = scan.readable, scan.foreign
        choice = agree_across_tiers(local, self._durable, store.rank)
        self._durable_listed_everywhere = choice.durable_listed_everywhere
        step = choice.step
        loaded_step = connector._loaded_checkpoint.get("global_step") if connector._loaded_checkpoint else None
        resumes = step is not None and (loaded_step is None or loaded_step < step)
        if skipped:
            outcome = (f"Resuming from this run's step {step} instead." if resumes else
                       f"Using ckpt_path={given} instead." if given else "Starting fresh.")
            log.warning(skipped_snapshots_message(store.rank, skipped, outcome))
        if step is None:
            log.info("rank %d: no snapshot of run %r to resume from%s", store.rank, store.run_id,
                     f"; using ckpt_path={given}" if given else "; starting fresh")
            return
        if not resumes:
            log.info("rank %d: keeping ckpt_path=%s (step %d); newest snapshot is step %d",
                     store.rank, given, loaded_step, step)
            return
        bring_into_memory(choice, self._durable, store)
        self.resumed_tier = (choice.tier, choice.reason)
        info = store.find(step, include_peers=True, expect=expect)
        if info is None:
            raise RuntimeError(f"rank {store.rank}: snapshot at step {step} vanished or broke after the ranks "
                               f"agreed on it (run {store.run_id!r}, {store.run_dir})")
        connector._loaded_checkpoint = store.load(info, expect=expect)
        self.resumed_from = (step, store.created(info))
        connector._ckpt_path = f"mem://{step}"
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()
        log.info("rank %d: auto-resume from snapshot step %d (rank %d's copy)%s", store.rank, step, info.rank,
                 f", newer than ckpt_path={given} (step {loaded_step})" if given else "")
