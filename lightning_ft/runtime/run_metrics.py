"""The run's fault-tolerance figures in the Trainer's loggers: one point per round.

At the first completed step of every round, rank 0 logs (at that step)

* ``ft/world_size`` -- the round's world size;
* ``ft/recoveries`` -- rounds so far that replaced a failed one (in-process recoveries; a
  hand-over to a spare and an elastic grow re-form the group on purpose and are none);
* ``ft/lost_seconds`` -- their cost so far: for each, from the failure to the first step after
  it, as the slowest survivor measured it (a max over the round's ranks, taken only in a round
  that replaces another); a hand-over's pause counts too, a grow's does not -- as
  ``lightning-ft report`` counts them;
* ``ft/goodput`` -- ``1 - lost / elapsed`` since the run's first step.

Every rank takes the same small collectives at that step (the max above; a sum that tells every
rank rank 0's totals). Across launches: every rank keeps the totals with its snapshots
(``EmergencyCheckpoint.run_figures``); a relaunch that resumes from one -- the keys of its
incarnation new -- continues them, the relaunch's cost (from the snapshot's time to its first
step: the stop, the gap and the steps done again) counted as lost, as ``lightning-ft report``
counts a relaunch.

Not in a job of one participant (``max_nodes=1``: no peer, no recovery; its logs stay as
under ``ddp``). The totals live in the run's store (counters any later rank 0 continues), so a spare that
becomes rank 0 logs the run's figures, not its own. Lightning's loggers are rank-0-only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

#: every metric name here starts with it (the fidelity tests leave them out: no two runs share them)
PREFIX = "ft/"


class EarlierLaunch(NamedTuple):
    """What a relaunch continues: the totals kept with the snapshot it resumed from, and when that
    snapshot was taken (wall clock)."""

    totals: Mapping[str, float]
    snapshot_created: float


class RunFigures(NamedTuple):
    started: float
    world_size: int
    recoveries: int
    lost_seconds: float

    def metrics(self, now: float) -> dict[str, float]:
        """What the loggers get (see the module)."""
        elapsed = max(now - self.started, 1e-9)
        return {f"{PREFIX}world_size": float(self.world_size), f"{PREFIX}recoveries": float(self.recoveries),
                f"{PREFIX}lost_seconds": self.lost_seconds,
                f"{PREFIX}goodput": max(0.0, 1 - self.lost_seconds / elapsed) if self.lost_seconds else 1.0}

    def totals(self) -> dict[str, float]:
        """What a snapshot keeps for a relaunch (see :class:`EarlierLaunch`)."""
        return {"started": self.started, "recoveries": float(self.recoveries), "lost_seconds": self.lost_seconds}


def first_step_figures(trainer: Any, store: Any, key_prefix: str, world_size: int, rank: int,
                       after_failure: bool, since_failure: float | None, planned: str | None = None,
                       earlier: EarlierLaunch | None = None) -> RunFigures:
    """Every rank, at the first completed step of a round: the run's figures (rank 0 logs them;
    every rank keeps them with its snapshots). ``planned``: why a round that replaces another was
    opened on purpose (``hand_over``, ``grow``); ``earlier``: what the snapshot this launch resumed
    from kept (only the first round of a launch)."""
    device = trainer.strategy.root_device
    lost = 0.0
    if after_failure:
        mine = torch.tensor(since_failure or 0.0, dtype=torch.float64, device=device)
        lost = float(trainer.strategy.reduce(mine, reduce_op="max"))
        if planned == "grow":
            lost = 0.0
    totals = [0.0, 0.0, 0.0]
    if rank == 0:  # the totals live in the run's store; rank 0 adds this round's share
        recovered = 1 if after_failure and planned is None else 0
        now = time.time()
        first = repr(float(earlier.totals.get("started", now))) if earlier is not None else repr(now)
        held = store.compare_set(f"{key_prefix}/started", "", first).decode()
        # this launch's store had no figures yet (its first step): go on from the earlier launch's,
        # once -- a later stage resuming a snapshot of that launch must not add them again
        if earlier is not None and held == first and store.add(f"{key_prefix}/continued", 1) == 1:
            recovered += int(earlier.totals.get("recoveries", 0))
            lost += earlier.totals.get("lost_seconds", 0.0) + max(0.0, now - earlier.snapshot_created)
        recoveries = store.add(f"{key_prefix}/recoveries", recovered)
        lost_ms = store.add(f"{key_prefix}/lost_ms", round(lost * 1000))
        totals = [float(held or now), float(recoveries), lost_ms / 1000]
    # every rank learns rank 0's totals (the others add zeros): any rank's snapshot can carry them
    shared = trainer.strategy.reduce(torch.tensor(totals, dtype=torch.float64, device=device), reduce_op="sum")
    started, recoveries_total, lost_total = (float(x) for x in shared.tolist())
    return RunFigures(started, world_size, round(recoveries_total), lost_total)


def earlier_launch(checkpoint: Any) -> EarlierLaunch | None:
    """The run's totals as the snapshot this fit resumed from kept them (None: none kept, or no
    snapshot resumed from); ``checkpoint``: the fit's ``EmergencyCheckpoint`` (or None)."""
    if checkpoint is None or checkpoint.resumed_from is None or not checkpoint.restored_run_figures:
        return None
    return EarlierLaunch(checkpoint.restored_run_figures, checkpoint.resumed_from[1])


def log_figures(trainer: Any, figures: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(figures, step=step)
