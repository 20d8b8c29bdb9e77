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
* after a snapshot, each rank's shards are copied to a rank in another failure domain
  (:mod:`~lightning_ft.checkpoint.exchange.shard_replicas`, ``replication_factor`` copies), so
  losing one domain loses no shard of that step;
* a lost peer is recovered in-process: the module is rebuilt as ``fit()`` received it
  (:class:`~lightning_ft._lightning.module_template.ModuleTemplate`; the sharded one is bound
  to the dead mesh), the round re-forms with a hot spare in the lost rank's place, and every
  rank resumes from the newest step whose shards all exist (the lost rank's from a replica).

Model state and optimizer state go through torch's distributed state-dict API exactly as
``ModelParallelStrategy`` does (its methods are called here, not copied), so ``ModelCheckpoint``
writes the same distributed checkpoint directories.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies.model_parallel import _setup_device_mesh
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.nn import Module
from torch.optim import Optimizer

from lightning_ft._lightning.callbacks import first_callback_of_type
from lightning_ft._lightning.module_template import ModuleTemplate
from lightning_ft._lightning.names import FSDP_STRATEGY_DESCRIPTION, FSDP_STRATEGY_NAME
from lightning_ft.checkpoint.exchange.shard_replicas import ShardReplicator
from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
from lightning_ft.exit_codes import JobCannotGoOn
from lightning_ft.strategy.settings import StrategyConfigError
from lightning_ft.strategy.strategy import FaultTolerantDDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

_one_domain_warned = False  # said once per process


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
        #: the module's children as fit() received them (taken when the first round sets up)
        self._template: ModuleTemplate | None = None
        #: copies of each rank's snapshots on ranks in other failure domains (this round's)
        self._shard_replicas: ShardReplicator | None = None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The round's mesh: ``data_parallel`` over every rank, ``tensor_parallel`` of size 1."""
        if self._device_mesh is None:
            raise RuntimeError("fsdp_ft: the device mesh exists only once a round's process group formed")
        return self._device_mesh

    @property
    def cannot_reform(self) -> str | None:
        if self._template is None or self.lightning_module is None:
            return "the module's state at fit() start was not kept (the failure came before the first round set up)"
        return self._template.rebuild_problem(self.lightning_module)

    def rebuild_module(self) -> None:
        """Replace the sharded children, bound to the failed round's mesh, with fresh copies as
        ``fit()`` received them; ``configure_model`` shards them on the next round's mesh and the
        snapshot gives them their values."""
        assert self._template is not None and self.lightning_module is not None  # see cannot_reform
        self._template.rebuild(self.lightning_module, self.root_device)
        self._device_mesh = None
        self.model = self.lightning_module

    def setup_environment(self) -> None:
        assert self.lightning_module is not None
        if self._template is None:  # before configure_model shards anything in this process
            self._template = ModuleTemplate.capture(self.lightning_module)
        super().setup_environment()  # the round's process group (setup_distributed)
        # data_parallel spans the world, so torch gives it the default group: FSDP's collectives
        # run on the round's group, which a hang verdict breaks and a failure retires
        self._device_mesh = _setup_device_mesh(self.world_size, 1, self.world_size, self.root_device)
        self.lightning_module._device_mesh = self._device_mesh

    def setup(self, trainer: pl.Trainer) -> None:
        ModelParallelStrategy.setup(self, trainer)  # type: ignore[arg-type]  # no DDP wrapper: FSDP2 shards

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # as ModelParallelStrategy: optimizers of this setup only
        super().setup_optimizers(trainer)

    def on_train_start(self) -> None:
        checkpoint, runtime = first_callback_of_type(self.trainer, EmergencyCheckpoint), self.round
        resumed = checkpoint is not None and checkpoint.resumed_from is not None
        if runtime is not None and runtime.follows_a_failure and not resumed:
            # the module was rebuilt without values: only a snapshot whose shards all exist gives them
            raise JobCannotGoOn(
                "fsdp_ft: after the failure no step has every rank's shards (in memory on the participants' hosts "
                "or in the durable tier): a lost rank's shards went with its failure domain and no copy of them "
                "survived (replication_factor, persist_to); resuming would mix steps or start over")
        super().on_train_start()  # the round-start snapshot, among others
        self._shard_replicas = None
        if (checkpoint is None or runtime is None or runtime.result is None
                or not self.settings.replication_factor or self.world_size < 2):
            return
        round_id = runtime.round_id
        assert self.settings.domain_id is not None  # resolved by resolve_settings
        replicas = ShardReplicator(checkpoint.snapshots.open_store_for, self.global_rank, self.world_size,
                                   self.settings.domain_id, self.settings.replication_factor,
                                   lambda event, **f: self.event_log.emit(event, round=round_id, **f))
        global _one_domain_warned
        if not replicas.copies and not _one_domain_warned and self.global_rank == 0:
            _one_domain_warned = True
            log.warning("fsdp_ft: every rank is in one failure domain (%s), so no rank's shards are copied to "
                        "another; losing it loses the shards of every step (set LIGHTNING_FT_DOMAIN_ID per host, "
                        "or keep durable copies with persist_to)", self.settings.domain_id)
        self._shard_replicas = replicas if replicas.copies else None

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | Module | None = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # the snapshot of the scheduled step was committed before this update (the optimizer's
        # pre-hook): copy it now, every rank at the same step
        replicas, checkpoint = self._shard_replicas, self._checkpoint
        if replicas is not None and checkpoint is not None and checkpoint.scheduled(self.trainer.global_step):
            self._progress()
            replicas.copy(checkpoint.last_snapshot, checkpoint.store)
            self._progress()
        return output

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
