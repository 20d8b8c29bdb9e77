"""A Trainer's state as a snapshot holds it, and back: sharded state as each rank's own shards.

* :func:`dump_state` -- the full checkpoint of a Trainer as ``ModelCheckpoint`` would save it,
  with ``DTensor`` values (FSDP2) as this rank's own shards
  (:func:`~lightning_ft.checkpoint.sharded.dtensors_to_shards`);
* :func:`estimate_state_bytes` -- about how large that snapshot will be, without running a hook;
* :func:`restore_shards` -- this rank's saved shards into the live parameters and optimizers.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ft._lightning.checkpointing import dump_checkpoint, holds_shards, plain_optimizer
from lightning_ft.checkpoint.hparams import with_plain_hyperparameters
from lightning_ft.checkpoint.sharded import (
    ShardLayoutError,
    copy_into_shards,
    dtensors_to_shards,
    is_shard_record,
    optimizer_shards_to_dtensors,
)


def dump_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The full checkpoint of ``trainer``, as a ``ModelCheckpoint`` save makes it (the same hooks
    run: the callbacks' ``state_dict`` and ``on_save_checkpoint``, the module's and datamodule's
    ``on_save_checkpoint``). Sharded state comes as this rank's own shards (no walk of the
    checkpoint for replicated state), hyperparameters as plain data (:mod:`lightning_ft.checkpoint.hparams`)."""
    checkpoint = with_plain_hyperparameters(dump_checkpoint(trainer))
    return dtensors_to_shards(checkpoint) if holds_shards(trainer) else checkpoint


#: what a snapshot holds beyond the tensors counted by :func:`estimate_state_bytes` (loops,
#: callbacks, hyperparameters, the file's own records): a share of them, and at least this much
_BEYOND_TENSORS = (0.05, 1 << 20)


def estimate_state_bytes(trainer: pl.Trainer) -> int:
    """About how large :func:`dump_state`'s snapshot of ``trainer`` will be, without making it: the
    module's parameters and buffers and the optimizers' state tensors (this rank's shards of
    sharded ones), plus a margin. Runs no hook -- a snapshot runs the user's checkpoint hooks,
    and a size check must not add calls of them that Lightning would not make."""
    tensors: list[torch.Tensor] = []
    module = trainer.lightning_module
    if module is not None:
        tensors += [*module.parameters(), *module.buffers()]
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: its local shard
        total += local.numel() * local.element_size()
    share, floor = _BEYOND_TENSORS
    return total + max(int(total * share), floor)


def restore_shards(trainer: pl.Trainer, checkpoint: dict[str, Any], where: str) -> None:
    """After a restore on a strategy that holds shards: copy this rank's saved shards into the
    live parameters and load the optimizers' sharded state (the strategy's own
    ``load_model_state_dict`` and optimizer restore do nothing: they expect a distributed
    checkpoint directory). Raises :class:`~lightning_ft.checkpoint.sharded.ShardLayoutError` when
    the snapshot was taken at another world size or by another rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    model = trainer.strategy.model
    assert model is not None  # set up by now (restore_checkpoint_after_setup)
    live = model.state_dict()
    saved = checkpoint.get("state_dict", {})
    copied = set(copy_into_shards(live, saved, where))
    # names differ e.g. for a torch.compile'd module ("_orig_mod."): never resume half a model
    unmatched = sorted(key for key, value in {**saved, **live}.items()
                       if key not in copied and (isinstance(value, torch.Tensor) or is_shard_record(value)))
    if unmatched:
        raise ShardLayoutError(f"{where}: {len(unmatched)} tensor(s) of the model and the snapshot do not match "
                               f"by name, e.g. {unmatched[:5]}")
    # each parameter's optimizer state lives on the mesh that parameter is sharded over
    meshes = {name: value.device_mesh for name, value in live.items() if hasattr(value, "device_mesh")}
    options = StateDictOptions(full_state_dict=False, cpu_offload=True)
    for optimizer, state in zip(trainer.optimizers, checkpoint.get("optimizer_states", []), strict=False):
        set_optimizer_state_dict(model, plain_optimizer(optimizer), optimizer_shards_to_dtensors(state, meshes, where),
                                 options=options)
