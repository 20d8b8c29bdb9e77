"""The snapshot settings of ``EmergencyCheckpoint`` (and, behind the ``snapshot_`` prefix, of the
``EmergencyCheckpoint`` the ``ddp_ft`` strategy adds): schedule, where, how many, resume, durable tier."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ft.checkpoint.durable.settings import DurableSettings
from lightning_ft.checkpoint.memory.roots import RootSettings
from lightning_ft.checkpoint.tiers import DEFAULT_SNAPSHOT_OVERHEAD
from lightning_ft.settings import group, setting
from lightning_ft.settings.fields import boolean, number, optional_text, parse_text


@dataclass(frozen=True)
class SnapshotSettings:
    """What ``EmergencyCheckpoint`` was configured with, validated."""

    every_n_steps: int | None = setting(None, "snapshot when global_step % every_n_steps == 0",
                                        rule=number(integer=True, allow_none=True))
    every_n_seconds: float | None = setting(
        None, "snapshot about every so many seconds: a power-of-two number of steps from the measured step time, "
              "agreed by all ranks (the smallest) at the calibration steps 8, 16, 32, ... (one small collective "
              "each)", rule=number(allow_none=True))
    max_overhead: float | None = setting(
        DEFAULT_SNAPSHOT_OVERHEAD, "without every_n_steps/every_n_seconds: snapshot as often as keeps the measured "
                                   "save time within this share of training time (0.005: 0.5 %), a power-of-two "
                                   "number of steps agreed by all ranks at the calibration steps, the first at "
                                   "step 8; None: no periodic snapshots without a schedule (a warning says so)",
        rule=number(allow_none=True))
    max_seconds_at_risk: float | None = setting(
        60.0, "sharded state (fsdp_ft) only, where a lost rank's work since its last snapshot cannot be recovered "
               "from the survivors: the max_overhead schedule snapshots at least this often (seconds of training, a "
               "power-of-two number of steps; wins over the save budget); None: the budget alone",
        rule=number(allow_none=True), advanced=True)
    keep_last: int = setting(2, "snapshots kept per rank (>= 1); with >= 2 the oldest file is overwritten in place "
                                "by the next snapshot, ~3x faster than a fresh tmpfs file",
                             rule=number(integer=True, minimum=1, inclusive=True), advanced=True)
    run_id: str | None = setting(None, "scope (default: LIGHTNING_FT_RUN_ID, TORCHELASTIC_RUN_ID, SLURM_JOB_ID); "
                                       "without any, snapshots go to <root>/default and are never resumed",
                                 rule=optional_text, parse=parse_text)
    auto_resume: bool = setting(True, "on fit(), restore the newest snapshot of this run id and this model when it "
                                      "is newer than the ckpt_path given; snapshots of another job or model are "
                                      "skipped with a warning that says which and why", rule=boolean, advanced=True)
    preallocate: bool = setting(True, "keep a spare snapshot file with its pages allocated whenever the next save "
                                      "could not overwrite an old one (one state-size of shared memory; makes "
                                      "the first emergency save as fast as later ones)", rule=boolean, advanced=True)
    background_copy: bool = setting(True, "periodic snapshots copy parameters and optimizer state on a helper "
                                          "thread during the next forward and backward and commit before the next "
                                          "optimizer step; False: every snapshot is copied synchronously",
                                    rule=boolean, advanced=True)
    live_state: bool = setting(True, "after a failure inside an optimizer step (a peer's death fails its gradient "
                                     "all-reduce), snapshot the last step boundary from the live state, so the "
                                     "recovery resumes there instead of at the last periodic snapshot; False: the "
                                     "newest snapshot", rule=boolean, advanced=True)
    location: RootSettings = group(RootSettings)
    durable: DurableSettings = group(DurableSettings)

    @property
    def root(self) -> str | None:
        return self.location.root
