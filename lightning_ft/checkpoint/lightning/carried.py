"""Small figures of the run that travel with every checkpoint a callback is in.

The strategy keeps its running totals of the run (``lightning_ft.runtime.run_metrics``: when the
run started, its recoveries and lost time) with each snapshot, so that a relaunch that resumes from
one goes on with them. They ride in the checkpoint dictionary under one top-level key, written and
read by the callback's ``on_save_checkpoint`` / ``on_load_checkpoint`` hooks -- not its
``state_dict``, which would make a Trainer with two such callbacks refuse to save.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

#: the checkpoint dictionary's key (Lightning ignores keys it does not know)
RUN_FIGURES_KEY = "lightning_ft_run_figures"


class CarriesRunFigures(pl.Callback):
    """Keeps :attr:`run_figures` with every checkpoint; :attr:`restored_run_figures` is what the
    last restore found (None: none)."""

    #: set by the strategy; opaque here (numbers by name)
    run_figures: dict[str, float] | None = None
    restored_run_figures: dict[str, float] | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
                           ) -> None:
        if self.run_figures:
            checkpoint[RUN_FIGURES_KEY] = dict(self.run_figures)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
                           ) -> None:
        figures = checkpoint.get(RUN_FIGURES_KEY)
        self.restored_run_figures = {str(k): float(v) for k, v in figures.items() if type(v) in (int, float)} \
            if isinstance(figures, dict) else None
