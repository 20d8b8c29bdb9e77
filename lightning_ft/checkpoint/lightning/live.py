"""Live-state snapshots of ``EmergencyCheckpoint``: after a failure in optimizer step ``s+1``, the
state of step ``s`` is still there -- the live parameters and optimizer state (no update ran) plus
what :class:`~lightning_ft._lightning.live_state.BoundaryRecorder` captured at the end of step ``s``.

A recovery (or an exit under torchrun, whose agent restarts the workers) snapshots that state
instead of going back to the last periodic snapshot, so a peer's death costs at most the step in
flight. Whether the live tensors are still step ``s``'s is checked, not assumed: an optimizer
step that ran since the capture (its post-hook fires) makes the live state unusable, and the
newest snapshot is used instead (said in the log and the ``live_state`` event).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

from lightning_ft._lightning.live_state import BoundaryRecorder
from lightning_ft.checkpoint.hparams import with_plain_hyperparameters

log = logging.getLogger(__name__)


class LiveState:
    """The step-boundary capture of one run of ``fit`` and whether it still matches the live tensors."""

    def __init__(self) -> None:
        self._recorder: BoundaryRecorder | None = None
        self._hooks: list[Any] = []
        self._stepped = False
        self._boundary_step: int | None = None

    def start(self, trainer: pl.Trainer) -> None:
        """At ``on_train_start``: the restored state is the first boundary; watch the optimizer steps."""
        self.stop()
        self._recorder = BoundaryRecorder(trainer)
        self._hooks = [optimizer.register_step_post_hook(self._after_optimizer_step)
                       for optimizer in trainer.optimizers]
        self._record(trainer)

    def _after_optimizer_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self._stepped = True  # the live tensors are past the captured boundary from here on

    def _record(self, trainer: pl.Trainer) -> None:
        assert self._recorder is not None
        self._recorder.record(trainer)
        self._boundary_step = trainer.global_step
        self._stepped = False

    def at_batch_end(self, trainer: pl.Trainer) -> None:
        """At ``on_train_batch_end``: an optimizer step completed since the last capture (not inside
        an accumulation window) makes this a boundary: capture it."""
        if self._recorder is not None and trainer.global_step != self._boundary_step:
            self._record(trainer)

    def problem(self, trainer: pl.Trainer) -> str | None:
        """Why the live state is not the last boundary's (None: it is)."""
        if self._recorder is None or self._recorder.boundary is None:
            return "no optimizer-step boundary captured in this run of fit()"
        if self._stepped or trainer.global_step != self._boundary_step:
            return (f"an optimizer step ran after the boundary of step {self._boundary_step} (the failure came "
                    f"after the update, at step {trainer.global_step})")
        return None

    @property
    def step(self) -> int | None:
        """The step of the last captured boundary."""
        return self._boundary_step

    def checkpoint(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Lightning's checkpoint of the boundary's step (call only when :meth:`problem` is None)."""
        assert self._recorder is not None
        return with_plain_hyperparameters(self._recorder.checkpoint_at_boundary(trainer))

    def stop(self) -> None:
        """At ``teardown``: no more captures; the optimizer hooks go."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
