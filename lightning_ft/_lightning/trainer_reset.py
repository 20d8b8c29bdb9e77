"""Putting a Trainer back into the state ``fit()`` expects, after a run ended by a peer failure.

The strategy re-runs ``Trainer._fit_impl`` inside the same ``fit()`` call once the group has
been re-formed. What a failed run leaves behind, and why each piece is reset:

* the loops keep the old train/val ``CombinedLoader`` (``setup_data`` returns early when one
  exists), whose ``DistributedSampler`` still has the old world size and rank, plus
  mid-batch progress counters and restart flags. They are replaced by fresh loops with the
  same limits, as ``Trainer.__init__`` builds them; the resume from the snapshot then
  restores their progress exactly as in a freshly started process.
* ``trainer.state``/``should_stop`` are set as ``fit()`` sets them before its first run.
* the checkpoint connector may hold a half-consumed ``_loaded_checkpoint``: a fresh one.
* the model may still be wrapped in ``DistributedDataParallel`` bound to the broken group
  (the exception can come before Lightning's teardown unwrapped it): unwrapped here.
* Lightning's forward redirection patches ``module.forward`` on the instance and restores it
  only from inside the wrapper's forward. A peer failure inside DDP before that (its buffer
  sync) leaves the patch behind, and the next ``self(x)`` would call ``training_step``:
  the patch is removed here.

Lightning's own exception-path teardown (strategy, loop, logger connector, signal handlers)
is run by the caller before this, as ``_call_and_handle_interrupt`` would.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_ft._logging import StrategyLog

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})


def reset_trainer_for_rerun(trainer: pl.Trainer) -> None:
    """The Trainer as its call (fit, validate, test, predict) found it, for the stage's rerun in
    the next round: a fit gets fresh loops (the snapshot restores their progress); an evaluation
    keeps the fit loop's progress (its global step) and rebuilds its own loader for the new group."""
    if (trainer.state.fn or TrainerFn.FITTING) is TrainerFn.FITTING:
        _fresh_fit_loop(trainer)
    trainer._checkpoint_connector = _CheckpointConnector(trainer)

    strategy = trainer.strategy
    if isinstance(strategy.model, DistributedDataParallel):
        strategy.model = strategy.lightning_module
    _remove_leftover_forward_patch(strategy.lightning_module)

    # the stage runs again as the Trainer call started it
    stage = trainer.state.fn or TrainerFn.FITTING
    trainer.state.fn = stage
    trainer.state.status = TrainerStatus.RUNNING
    _STAGE_FLAGS[stage](trainer)
    trainer.should_stop = False


def _fresh_fit_loop(trainer: pl.Trainer) -> None:
    old_fit = trainer.fit_loop
    old_epoch = old_fit.epoch_loop
    if type(old_fit) is _FitLoop and type(old_epoch) is _TrainingEpochLoop \
            and type(old_epoch.val_loop) is _EvaluationLoop:
        fit_loop = _FitLoop(trainer, min_epochs=old_fit.min_epochs, max_epochs=old_fit.max_epochs)
        fit_loop.epoch_loop = _TrainingEpochLoop(trainer, min_steps=old_epoch.min_steps,
                                                 max_steps=old_epoch.max_steps)
        fit_loop.epoch_loop.val_loop.inference_mode = old_epoch.val_loop.inference_mode
        trainer.fit_loop = fit_loop
    else:
        # a user-supplied loop class: keep it, but drop the data it cached for the old group
        ft_log.warning("custom fit loop %s; only its cached data loaders are reset for the re-run",
                    type(old_fit).__name__)
        old_fit.teardown()
        old_fit._combined_loader = None
        old_epoch.val_loop._combined_loader = None


def _set_training(trainer: pl.Trainer) -> None:
    trainer.training = True


def _set_validating(trainer: pl.Trainer) -> None:
    trainer.validating = True


def _set_testing(trainer: pl.Trainer) -> None:
    trainer.testing = True


def _set_predicting(trainer: pl.Trainer) -> None:
    trainer.predicting = True


# what ``Trainer.fit/validate/test/predict`` set before their run (the stage flags)
_STAGE_FLAGS = {TrainerFn.FITTING: _set_training, TrainerFn.VALIDATING: _set_validating,
                TrainerFn.TESTING: _set_testing, TrainerFn.PREDICTING: _set_predicting}


def _remove_leftover_forward_patch(module: nn.Module | None) -> None:
    if module is None:
        return
    patched = vars(module).get("forward")
    # only Lightning's own patch (a closure named ``wrapped_forward``); a user's instance
    # attribute stays
    if patched is not None and getattr(patched, "__name__", "") == "wrapped_forward":
        del module.forward
        ft_log.info("removed Lightning's forward redirection left on the module by the failure")


def teardown_trainer(trainer: pl.Trainer) -> None:
    """Lightning's exception-path teardown (``Trainer._teardown``: strategy, loop, logger connector,
    signal handlers), as ``_call_and_handle_interrupt`` runs it after ``on_exception``; the
    stage is cleared as ``fit()`` leaves it."""
    try:
        trainer._teardown()
    finally:
        trainer.state.stage = None


def mark_finished(trainer: pl.Trainer) -> None:
    """The Trainer's state as ``fit()`` leaves it when this process ends fit() without training."""
    trainer.state.status = TrainerStatus.FINISHED
    trainer.state.stage = None
