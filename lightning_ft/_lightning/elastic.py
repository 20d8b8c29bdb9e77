"""Elastic jobs (``elastic=True``): Lightning's batch counters follow the per-rank gradient accumulation.

When the world size changes, the runtime changes ``trainer.accumulate_grad_batches`` so that the
global batch stays that of ``max_nodes`` ranks. Lightning decides where an optimizer step ends from
the epoch's batch count (``batch_progress.current.ready % accumulate_grad_batches``) and the
``batch_idx`` it derives from it; restored from a snapshot counted in another accumulation, those
counts would put the step boundaries in the wrong places. :class:`ElasticBatches` saves the
accumulation with every snapshot and, after a resume in another one, rescales the counts to the
steps of the epoch so far times the new accumulation.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ft._logging import StrategyLog

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})

#: layers that normalise a training batch with that batch's own statistics (public torch classes)
BATCH_STATISTICS_LAYERS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
                           torch.nn.LazyBatchNorm1d, torch.nn.LazyBatchNorm2d, torch.nn.LazyBatchNorm3d)


class ElasticBatches(pl.Callback):
    """Saved with every snapshot: the accumulation the batch counters were counted in (see the module)."""

    def __init__(self) -> None:
        self.accumulation: int | None = None
        self._restored: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"accumulation": self.accumulation}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        value = state_dict.get("accumulation")
        self._restored = value if type(value) is int and value > 0 else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        warn_of_batch_statistics(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning restored the loops, before the epoch loop resets on restart
        now, before = int(trainer.accumulate_grad_batches), self._restored
        self.accumulation, self._restored = now, None
        if before is not None and before != now:
            rescale_epoch_batches(trainer, before, now)


def rescale_epoch_batches(trainer: pl.Trainer, before: int, now: int) -> None:
    """The epoch's batch counts, counted with ``before`` micro-batches per optimizer step, as ``now``
    would have counted the same optimizer steps (what was in flight keeps its offset)."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    steps = current.ready // before
    ready = steps * now
    for name in ("started", "processed", "completed"):
        setattr(current, name, max(0, ready - (current.ready - getattr(current, name))))
    current.ready = ready


_warned_about: set[int] = set()


def batch_statistics_layers(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s layers that normalise with a batch's statistics (BatchNorm)."""
    return [name or type(layer).__name__ for name, layer in module.named_modules()
            if isinstance(layer, BATCH_STATISTICS_LAYERS)]


def warn_of_batch_statistics(module: torch.nn.Module) -> bool:
    """Say once per model, naming its BatchNorm layers, what an elastic job does not keep equal for
    them; True when it warned. Why: a smaller world keeps the global batch by accumulating more
    micro-batches per rank, but a micro-batch then holds other samples than a rank of the full
    world's batch did, so the batch statistics -- and so the gradients and weights -- differ from
    the uninterrupted run (0.41 relative after 2 -> 1 -> 2, measured), and the running statistics
    are updated once per micro-batch."""
    names = batch_statistics_layers(module)
    if not names or id(module) in _warned_about:
        return False
    _warned_about.add(id(module))
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    ft_log.warning("elastic: %s normalise%s with each batch's statistics (BatchNorm): while the world is "
                "smaller than its maximum, a rank's micro-batches hold other samples than the full world's ranks "
                "did, so these layers -- and the weights -- train differently from the uninterrupted run (parameter-"
                "free layers and GroupNorm/LayerNorm train the same math to float tolerance). For equal results use "
                "GroupNorm or LayerNorm, or a fixed world size (no elastic)", shown, "s" if len(names) == 1 else "")
    return True
