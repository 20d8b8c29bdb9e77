"""The run's fault-tolerance figures in the Trainer's loggers: one point per round.

At the first completed step of every round, rank 0 logs (at that step)

* ``ft/world_size`` -- the round's world size;
* ``ft/recoveries`` -- rounds so far that replaced a failed one (in-process recoveries);
* ``ft/lost_seconds`` -- their cost so far: for each, from the failure to the first step after
  it, as the slowest survivor measured it (a max over the round's ranks; the one collective,
  taken only in a round that follows a failure, where every rank takes it at the same step);
* ``ft/goodput`` -- ``1 - lost / elapsed`` since the run's first step.

Not in a job of one participant (``max_nodes=1``: no peer, no recovery; its logs stay as
under ``ddp``). The totals live in the run's store (counters any later rank 0 continues), so a spare that
becomes rank 0 logs the run's figures, not its own. Lightning's loggers are rank-0-only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

#: every metric name here starts with it (the fidelity tests leave them out: no two runs share them)
PREFIX = "ft/"


def first_step_figures(trainer: Any, store: Any, key_prefix: str, world_size: int, rank: int,
                       after_failure: bool, since_failure: float | None) -> dict[str, float] | None:
    """Every rank, at the first completed step of a round: the figures rank 0 logs (None elsewhere)."""
    lost = 0.0
    if after_failure:
        mine = torch.tensor(since_failure or 0.0, dtype=torch.float64, device=trainer.strategy.root_device)
        lost = float(trainer.strategy.reduce(mine, reduce_op="max"))
    if rank != 0:
        return None
    recoveries = store.add(f"{key_prefix}/recoveries", 1 if after_failure else 0)
    lost_ms = store.add(f"{key_prefix}/lost_ms", round(lost * 1000))
    now = time.time()
    started = float(store.compare_set(f"{key_prefix}/started", "", repr(now)).decode() or now)
    elapsed = max(now - started, 1e-9)
    return {f"{PREFIX}world_size": float(world_size), f"{PREFIX}recoveries": float(recoveries),
            f"{PREFIX}lost_seconds": lost_ms / 1000, f"{PREFIX}goodput": max(0.0, 1 - lost_ms / 1000 / elapsed)
            if lost_ms else 1.0}


def log_figures(trainer: Any, figures: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(figures, step=step)
