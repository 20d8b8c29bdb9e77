"""Auto-resume of ``EmergencyCheckpoint``: on ``fit()``, the newest snapshot every rank can get
(memory or durable) replaces an older checkpoint the user passed, or none."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_ft._lightning.checkpointing import (
    holds_shards,
    loaded_global_step,
    requested_ckpt_path,
    restore_after_setup,
    restore_from,
)
from lightning_ft.checkpoint.durable.tier import DurableTier
from lightning_ft.checkpoint.exchange.agreement import resume_from_newest_intact
from lightning_ft.checkpoint.identity import ExpectedIdentity, state_dict_fingerprint
from lightning_ft.checkpoint.lightning.state import restore_shards
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import parse_mem_url
from lightning_ft.checkpoint.tiers import every_copy_damaged

log = logging.getLogger(__name__)

_SKIPPED_SHOWN = 3  # skipped snapshots named in the auto-resume warning


def skipped_snapshots_message(rank: int, skipped: list[tuple[SnapshotInfo, str]], outcome: str) -> str:
    """The auto-resume warning for snapshots of another job or model: which, why, and what happens instead."""
    shown = "; ".join(f"step {info.step} ({info.path}): {why}" for info, why in skipped[:_SKIPPED_SHOWN])
    more = f" (and {len(skipped) - _SKIPPED_SHOWN} more)" if len(skipped) > _SKIPPED_SHOWN else ""
    return f"rank {rank}: auto-resume skipped snapshots of another job or model: {shown}{more}. {outcome}"


def replicated(trainer: pl.Trainer) -> bool:
    """Whether every rank's checkpoint holds the whole state (single device, DDP), so a rank may
    resume from any rank's snapshot."""
    strategy = trainer.strategy
    return isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) and not strategy.restore_checkpoint_after_setup


def model_fingerprint_before_setup(module: pl.LightningModule | None) -> str | None:
    """The model fingerprint of ``module`` before ``fit()`` sets it up (where the snapshot exchange
    and a waiting hot spare need it), or None when it is not known yet: a module that builds
    layers in ``configure_model`` has them only later, and there only the run id is checked
    (the model still is at the resume)."""
    if module is None or is_overridden("configure_model", module, pl.LightningModule):
        return None
    return state_dict_fingerprint(module.state_dict())


class AutoResume:
    """Where the last ``fit()`` resumed from, and the resume itself (:meth:`run`, at ``on_fit_start``)."""

    def __init__(self) -> None:
        #: (step, wall-clock time it was taken) of the snapshot the last fit() resumed from
        self.resumed_from: tuple[int, float] | None = None
        #: the tier the last fit() resumed from ("memory", "durable") and why
        self.resumed_tier: tuple[str, str] | None = None
        # newer durable steps may be dropped as an abandoned timeline only when every rank could list them
        self.durable_listed_everywhere = False

    def reset(self) -> None:
        """A new ``fit()`` begins: nothing resumed yet."""
        self.resumed_from = None
        self.resumed_tier = None
        self.durable_listed_everywhere = False

    def run(self, trainer: pl.Trainer, store: SnapshotStore, durable: DurableTier | None) -> None:
        """Resume from the newest snapshot of this run and model every rank can get, when it is
        newer than what ``fit()`` restored (collective: every rank calls it in ``on_fit_start``).

        How: :func:`~lightning_ft._lightning.checkpointing.restore_from` replaces the checkpoint
        Lightning restored; Lightning's own code restores the rest right after on_fit_start.
        """
        # Why not elsewhere: no callback hook runs before fit() resolves ckpt_path, so setting
        # trainer.ckpt_path from a hook is too late; in `setup` the user's choice is not yet
        # known (it is a local of Trainer._run) and pre-filling _loaded_checkpoint there would
        # rely on resume_start(None) happening to leave it untouched. Here we know what the
        # user's checkpoint contained and can keep it when it is newer. The process group is
        # up and every rank runs this hook, so the rank agreement (one all_gather) is safe.
        sharded = holds_shards(trainer)
        if not (replicated(trainer) or sharded):
            return
        # sharded: each rank resumes from its own shards only (another rank's copy is another shard;
        # the shard exchange after the group formed brought each rank its own), in memory or durable
        peers = not sharded
        given = requested_ckpt_path(trainer)
        if parse_mem_url(given) is not None:
            return  # already restored from a snapshot by MemoryCheckpointIO
        # Only this job's snapshots of this model: the run id, and the parameter names and shapes
        # of the module as it is now (after configure_model and the precision plugin's cast).
        expect = store.expected_identity(model=state_dict_fingerprint(trainer.lightning_module.state_dict()))
        if store.configured_run_id is None:
            local, skipped = [], []  # every rank still joins the agreement below
            log.info("rank %d: not resuming from snapshots: no run id is set", store.rank)
        else:
            scan = store.scan(include_peers=peers, expect=expect)
            local, skipped = scan.readable, scan.foreign
        loaded_step = loaded_global_step(trainer)
        # downloads the agreed step only when it is newer than what ckpt_path restored
        choice = resume_from_newest_intact(local, durable, store, store.rank, expect, newer_than=loaded_step)
        self.durable_listed_everywhere = choice.durable_listed_everywhere
        step = choice.step
        if step is None and choice.damaged and durable is not None and not given:  # never silently from step 0
            raise RuntimeError(f"rank {store.rank}: {every_copy_damaged(choice.damaged, durable.target.url)}")
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
        self.resumed_tier = (choice.tier, choice.reason)
        self._resume(trainer, store, step, peers, expect, given, loaded_step)

    def _resume(self, trainer: pl.Trainer, store: SnapshotStore, step: int, peers: bool, expect: ExpectedIdentity,
                given: Any, loaded_step: int | None) -> None:
        """Load the agreed step (now in memory) and restore it as Lightning would a ``ckpt_path``."""
        info = store.find(step, include_peers=peers, expect=expect)
        if info is None:
            raise RuntimeError(f"rank {store.rank}: snapshot at step {step} vanished or broke after the ranks "
                               f"agreed on it (run {store.run_id!r}, {store.run_dir})")
        checkpoint = store.load(info, expect=expect)
        if not peers:  # sharded: only this rank's own shards
            self._restore_sharded_after_setup(trainer, store, info, checkpoint, step)
            return
        self.resumed_from = (step, store.created(info))
        restore_from(trainer, checkpoint, f"mem://{step}")
        log.info("rank %d: auto-resume from snapshot step %d (rank %d's copy)%s", store.rank, step, info.rank,
                 f", newer than ckpt_path={given} (step {loaded_step})" if given else "")

    def _restore_sharded_after_setup(self, trainer: pl.Trainer, store: SnapshotStore, info: SnapshotInfo,
                                     checkpoint: dict, step: int) -> None:
        # A strategy that holds shards restores after on_fit_start (restore_checkpoint_after_setup):
        # the snapshot goes in where Lightning then loads the checkpoint, unless the user passed
        # ckpt_path -- whose step cannot be compared before it is loaded, so it wins (logged).
        def used() -> None:
            restore_shards(trainer, checkpoint, f"snapshot step {step} of rank {store.rank}")
            self.resumed_from = (step, store.created(info))
            log.info("rank %d: auto-resume from this rank's shards of snapshot step %d", store.rank, step)

        def passed_over(ckpt_path: Any) -> None:
            self.resumed_tier = None
            log.warning("rank %d: restoring ckpt_path=%s as given, not snapshot step %d: with sharded state their "
                        "steps cannot be compared before loading (remove ckpt_path to resume from the snapshots)",
                        store.rank, ckpt_path, step)

        restore_after_setup(trainer, checkpoint, f"mem://{step}", used, passed_over)
