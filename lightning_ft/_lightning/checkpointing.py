"""What the checkpoint callbacks need from Lightning's checkpoint connector and fit loop.

* :func:`dump_checkpoint` -- the full checkpoint of a Trainer, as ``ModelCheckpoint`` saves it;
* :func:`next_is_a_training_batch` -- whether the fit loop goes straight on to a training batch;
* :func:`requested_ckpt_path`, :func:`loaded_global_step`, :func:`restore_from` -- auto-resume's
  view of the checkpoint Lightning restored in ``fit()``, and replacing it;
* :func:`module_being_restored` -- the LightningModule a ``CheckpointIO`` load is for.

All of it is private Lightning API (``trainer._checkpoint_connector``, the epoch loop's
``_is_training_done`` and ``_should_check_val_fx``, ``fit_loop._data_fetcher``, the call path of
``Strategy.load_checkpoint``): when Lightning changes, this is the checkpoint code to look at.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

_CALLER_FRAMES = 8  # how far up the stack the restoring strategy is looked for


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The full checkpoint of ``trainer`` (weights, optimizer, loop and callback state), as
    ``ModelCheckpoint`` would save it; runs the ``on_save_checkpoint`` hooks. Sharded state
    comes as Lightning's strategy returns it (``DTensor`` values)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def holds_shards(trainer: pl.Trainer) -> bool:
    """Whether each rank's checkpoint holds only its own shards of the state: Lightning's
    ``ModelParallelStrategy`` (FSDP2, ``fsdp_ft`` included) saving a distributed checkpoint."""
    strategy = trainer.strategy
    return isinstance(strategy, ModelParallelStrategy) and bool(strategy._save_distributed_checkpoint)


def plain_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (itself when it is one already)."""
    return getattr(optimizer, "_optimizer", optimizer)


def restore_after_setup(trainer: pl.Trainer, checkpoint: dict[str, Any], ckpt_path: str,
                        used: Callable[[], None], passed_over: Callable[[Any], None]) -> None:
    """From ``on_fit_start`` of a strategy that restores after setup (``restore_checkpoint_after_setup``,
    e.g. ``ModelParallelStrategy``): when Lightning then loads the checkpoint of this ``fit()``
    without a user ``ckpt_path``, it gets ``checkpoint`` instead, as if ``ckpt_path`` had been
    passed, and ``used()`` runs (the model and optimizers are set up by then); Lightning's own
    code restores the rest once. With a user ``ckpt_path`` that one is loaded and
    ``passed_over(path)`` runs. One ``fit()`` only."""
    connector = trainer._checkpoint_connector
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        del connector.resume_start  # the instance attribute: back to the class's method
        if checkpoint_path:
            passed_over(checkpoint_path)
            original(checkpoint_path, weights_only=weights_only)
            return
        connector._ckpt_path = ckpt_path
        connector._loaded_checkpoint = checkpoint
        used()

    vars(connector)["resume_start"] = resume_start  # this connector's only, in place of its method


def drop_pending_restore(trainer: pl.Trainer) -> None:
    """Forget a :func:`restore_after_setup` of an earlier ``fit()`` that ended before Lightning
    loaded its checkpoint (it must not inject that snapshot into this one)."""
    vars(trainer._checkpoint_connector).pop("resume_start", None)


def next_is_a_training_batch(trainer: pl.Trainer) -> bool:
    """Whether, after this batch's end, the fit loop goes straight on to the next training batch:
    not the end of the epoch or of training, no stop requested, no validation due. Only then is
    a background copy safe from other callbacks' epoch, validation and end hooks, which may swap
    weights through ``.data`` (e.g. Lightning's ``WeightAveraging``), unseen by version counters."""
    try:
        epoch_loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
        assert fetcher is not None  # set for the whole of fit(), whose batch ends call this
        return not (trainer.should_stop or epoch_loop._is_training_done or epoch_loop._should_check_val_fx(fetcher))
    except Exception:  # noqa: BLE001 - another Lightning version or loop: copy synchronously
        return False


def requested_ckpt_path(trainer: pl.Trainer) -> Any:
    """The ``ckpt_path`` the user passed to this ``fit()`` (None: none)."""
    return trainer._checkpoint_connector._ckpt_path


def loaded_global_step(trainer: pl.Trainer) -> int | None:
    """The global step of the checkpoint Lightning restored for this ``fit()`` (None: none)."""
    connector = trainer._checkpoint_connector
    return connector._loaded_checkpoint.get("global_step") if connector._loaded_checkpoint else None


def restore_from(trainer: pl.Trainer, checkpoint: dict[str, Any], ckpt_path: str) -> None:
    """From ``on_fit_start``: restore ``checkpoint`` instead of what ``fit()`` restored, as if it
    had been passed as ``ckpt_path``.

    Lightning has already run its own restore for the ckpt_path the user passed
    (_restore_modules_and_callbacks runs before strategy.setup, which runs before on_fit_start)
    and will restore loops, optimizers, schedulers and precision state from
    `_checkpoint_connector._loaded_checkpoint` right after on_fit_start (restore_training_state).
    So we replace `_loaded_checkpoint` and re-run the module and callback restore; Lightning's
    own code does the rest, and resume_end logs "Restored all states from the checkpoint at
    <ckpt_path>".
    """
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    connector._ckpt_path = ckpt_path
    connector.restore_model()
    connector.restore_datamodule()
    connector.restore_callbacks()


def module_being_restored() -> torch.nn.Module | None:
    """The LightningModule a checkpoint is being loaded for, or None outside a Trainer's restore.

    Lightning calls ``CheckpointIO.load_checkpoint`` from ``Strategy.load_checkpoint`` without
    saying for which model; the strategy a frame or two up the stack knows it. Used only to
    refuse another model's snapshot with a clear message instead of a state_dict size mismatch.
    """
    frame: FrameType | None = sys._getframe(1).f_back
    for _ in range(_CALLER_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Strategy):
            return owner.lightning_module
        frame = frame.f_back
    return None
