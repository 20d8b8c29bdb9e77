"""The strategy's view of training progress (a callback it adds to the Trainer it runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks.callback import Callback

if TYPE_CHECKING:
    from lightning_ft.strategy.strategy import FaultTolerantDDPStrategy


class FaultToleranceProbe(Callback):
    """Tells the ``ddp_ft`` strategy when training starts and when each step starts and ends.

    Stateless (nothing in checkpoints). Added last, so a step's end is seen after other
    callbacks' work at that boundary (for example a snapshot) is done.
    """

    def __init__(self, strategy: "FaultTolerantDDPStrategy") -> None:
        self._strategy = strategy

    def on_train_start(self, trainer, pl_module) -> None:
        self._strategy._on_train_start(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._strategy._on_batch_start()

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._strategy._on_batch_end(trainer)
