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

from typing import Any

import lightning.pytorch as pl


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
