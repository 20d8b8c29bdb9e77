"""``FaultTolerantFSDPStrategy`` (``Trainer(strategy="fsdp_ft")``): sharded state (FSDP2).

A LightningModule written for Lightning's ``ModelParallelStrategy`` -- ``configure_model``
applies ``fully_shard`` over ``self.device_mesh["data_parallel"]`` -- runs unchanged; the
strategy is ``ddp_ft`` otherwise (barrier rendezvous, the SIGTERM path, snapshots, event log).
What differs, and why:

* ranks stay put (``keep_ranks``): a rank's shards exist only where that rank ran, so a
  re-formed round must not move them;
* each rank snapshots only its own shards (``DTensor`` local tensors and the sharded optimizer
  state; see :mod:`lightning_ft.checkpoint.sharded`), and after the group forms each rank
  receives its own shards of the newest step whose shards all exist
  (:func:`~lightning_ft.checkpoint.exchange.transfer.exchange_shards`): a relaunch that placed
  the participants in another order resumes as well;
* a lost peer ends the job (exit 83, said so): re-forming in-process needs the module rebuilt
  off the dead mesh and the lost rank's shards from a replica, neither built yet.

Model state and optimizer state go through torch's distributed state-dict API exactly as
``ModelParallelStrategy`` does (its methods are called here, not copied), so ``ModelCheckpoint``
writes the same distributed checkpoint directories.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies.model_parallel import _setup_device_mesh
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.optim import Optimizer

from lightning_ft._lightning.names import FSDP_STRATEGY_DESCRIPTION, FSDP_STRATEGY_NAME
from lightning_ft.strategy.settings import StrategyConfigError
from lightning_ft.strategy.strategy import FaultTolerantDDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

#: why a failed round ends the job instead of re-forming (see the module docstring)
NO_IN_PROCESS_RECOVERY = ("fsdp_ft cannot yet re-form a round of sharded state in-process (the module would stay "
                          "on the dead mesh and the lost rank's shards have no replica); each rank keeps its "
                          "snapshots, which a relaunch resumes from when every rank's shards of a step exist")


class FaultTolerantFSDPStrategy(FaultTolerantDDPStrategy):
    """FSDP2 sharded training (as Lightning's ``ModelParallelStrategy``, data parallel only) over
    ``ddp_ft``'s barrier rendezvous: stable ranks, sharded snapshots, the SIGTERM path.

    The LightningModule must shard itself in ``configure_model`` (``fully_shard`` over
    ``self.device_mesh["data_parallel"]``; ``tensor_parallel`` has size 1). Takes every
    argument and setting of :class:`FaultTolerantDDPStrategy` except ``DistributedDataParallel``'s;
    ``keep_ranks`` is always on.
    """

    strategy_name = FSDP_STRATEGY_NAME
    strategy_description = FSDP_STRATEGY_DESCRIPTION
    shards_state = True
    cannot_reform = NO_IN_PROCESS_RECOVERY

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("keep_ranks", True) is not True:
            raise StrategyConfigError("fsdp_ft: keep_ranks is always on (a rank's shards exist only where that rank "
                                      "ran); remove keep_ranks=False")
        kwargs["keep_ranks"] = True
        super().__init__(*args, **kwargs)
        if self._ddp_kwargs:
            raise StrategyConfigError(f"fsdp_ft: unknown argument(s) {sorted(self._ddp_kwargs)}: fsdp_ft takes the "
                                      "settings of ddp_ft (docs/strategy.md), not DistributedDataParallel's")
        self._save_distributed_checkpoint = True  # what ModelParallelStrategy's methods read: shards, not gathers
        self._device_mesh: DeviceMesh | None = None
        launch = self.settings.launch
        if launch.max_nodes is not None and launch.min_nodes is not None and launch.max_nodes > launch.min_nodes:
            log.warning("fsdp_ft: hot spares wait but are not used yet: a lost peer ends the job (exit 83); "
                        "SIGTERM still saves every rank's shards and a relaunch resumes from them")

    @property
    def device_mesh(self) -> DeviceMesh:
        """The round's mesh: ``data_parallel`` over every rank, ``tensor_parallel`` of size 1."""
        if self._device_mesh is None:
            raise RuntimeError("fsdp_ft: the device mesh exists only once a round's process group formed")
        return self._device_mesh

    def setup_environment(self) -> None:
        super().setup_environment()  # the round's process group (setup_distributed)
        self._device_mesh = _setup_device_mesh(self.world_size, 1, self.world_size, self.root_device)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def setup(self, trainer: pl.Trainer) -> None:
        ModelParallelStrategy.setup(self, trainer)  # type: ignore[arg-type]  # no DDP wrapper: FSDP2 shards

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # as ModelParallelStrategy: optimizers of this setup only
        super().setup_optimizers(trainer)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the state goes into the sharded parameters

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # restored through torch's distributed state-dict API (load_checkpoint)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with ModelParallelStrategy.tensor_init_context(self, empty_init):  # type: ignore[arg-type]
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return ModelParallelStrategy.lightning_module_state_dict(self)  # type: ignore[arg-type]

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return ModelParallelStrategy.optimizer_state(self, optimizer)  # type: ignore[arg-type]

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint (or a snapshot's restore_shards) loads straight into the shards

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # as load_model_state_dict

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        ModelParallelStrategy.save_checkpoint(self, checkpoint, filepath, storage_options)  # type: ignore[arg-type]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return ModelParallelStrategy.load_checkpoint(self, checkpoint_path, weights_only)  # type: ignore[arg-type]


# every setting as a keyword argument for help() and tools, as FaultTolerantDDPStrategy's
FaultTolerantFSDPStrategy.__init__.__signature__ = (  # type: ignore[attr-defined]
    FaultTolerantDDPStrategy.__init__.__signature__)  # type: ignore[attr-defined]
