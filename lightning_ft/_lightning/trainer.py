"""Small pieces of Lightning's private API the strategies use (device lines, meshes, backends)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.model_parallel import _setup_device_mesh
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.pytorch.trainer.setup import _log_device_info
from lightning.pytorch.utilities.exceptions import _TunerExitException


def log_device_info(trainer: Any) -> None:
    """Lightning's "GPU available ..." lines of ``Trainer.__init__`` (held back until rank 0 is known)."""
    if trainer is not None:
        _log_device_info(trainer)


def default_backend_for(device: Any) -> str:
    """The process-group backend Lightning picks for ``device`` (``nccl`` for CUDA, else ``gloo``)."""
    return _get_default_process_group_backend_for_device(device)


def data_parallel_mesh(world_size: int, device: Any) -> Any:
    """A device mesh as ``ModelParallelStrategy`` builds it: ``data_parallel`` over every rank,
    ``tensor_parallel`` of size 1 (it spans the world, so torch gives it the default group)."""
    return _setup_device_mesh(world_size, 1, world_size, device)


def give_module_its_mesh(module: Any, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns in ``configure_model``."""
    module._device_mesh = mesh


def is_fitting(trainer: Any) -> bool:
    """Whether the Trainer call under way is ``fit()`` (else ``validate``, ``test`` or ``predict``;
    no Trainer counts as fitting)."""
    stage = getattr(getattr(trainer, "state", None), "fn", None)
    return stage is None or stage.value == "fit"


#: where ``ckpt_path`` is among the arguments Lightning 2.6 passes its ``_<fn>_impl`` (and so our launcher)
_CKPT_PATH_POSITION = {"fit": 4, "validate": 2, "test": 2, "predict": 4}


def replace_checkpoint_path(trainer: Any, args: tuple, choose: Callable[[Any, bool], Any]) -> tuple:
    """The arguments of the Trainer call under way with its ``ckpt_path`` replaced by
    ``choose(ckpt_path, model_given)``; unchanged when the call has none."""
    stage = getattr(getattr(trainer, "state", None), "fn", None)
    position = _CKPT_PATH_POSITION.get(getattr(stage, "value", ""))
    if position is None or len(args) <= position:
        return args
    chosen = choose(args[position], args[0] is not None)
    return args if chosen is args[position] else (*args[:position], chosen, *args[position + 1:])


def is_tuner_exit(exc: BaseException) -> bool:
    """Whether ``exc`` is how Lightning's tuner (``lr_find``, ``scale_batch_size``) ends the trial
    ``fit()`` it runs: the stage completed; Lightning's own caller handles the exception."""
    return isinstance(exc, _TunerExitException)


def log_step_metrics(trainer: Any) -> None:
    """Hand the metrics of the step that just ended to the loggers, as Lightning does right after
    the ``on_train_batch_end`` hooks: for a callback that ends ``fit()`` from that hook (a stop
    at an agreed step), whose raise would skip it and lose the step's row."""
    connector = trainer._logger_connector
    connector.on_batch_end()
    connector.update_train_step_metrics()
