"""``FaultTolerantFSDPStrategy`` (``Trainer(strategy="fsdp_ft")``): Lightning's ``ModelParallelStrategy``
(FSDP2) holding the fault-tolerance runtime.

A LightningModule written for ``ModelParallelStrategy`` -- ``configure_model`` applies
``fully_shard`` over ``self.device_mesh["data_parallel"]`` -- runs unchanged; model and optimizer
state go through ``ModelParallelStrategy``'s own methods (torch's distributed state-dict API), so
``ModelCheckpoint`` writes the same distributed checkpoint directories. What fault tolerance does
differently for sharded state is :class:`~lightning_ft.runtime.layout.ShardedState`:

* ranks stay put (``keep_ranks``): a rank's shards exist only where that rank ran;
* each rank snapshots only its own shards, and after the group forms each rank receives its own
  shards of the newest step whose shards all exist (a relaunch in another order resumes too);
* after a scheduled snapshot, each rank's shards are copied to a rank in another failure domain
  (``replication_factor`` copies), so losing one domain loses no shard of that step;
* a lost peer is recovered in-process: the module is rebuilt as ``fit()`` received it, the round
  re-forms with a hot spare in the lost rank's place, and every rank resumes from the newest step
  whose shards all exist (the lost rank's from a copy).
"""

from __future__ import annotations

import datetime
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_ft._lightning.names import FSDP_STRATEGY_DESCRIPTION, FSDP_STRATEGY_NAME
from lightning_ft._lightning.trainer import data_parallel_mesh, give_module_its_mesh
from lightning_ft._logging import set_strategy_name
from lightning_ft.exit_codes import ExitCode
from lightning_ft.process import end_uncaught_configuration_errors
from lightning_ft.runtime.layout import ShardedState
from lightning_ft.runtime.settings import LAUNCH_ARGUMENTS, StrategyConfigError, StrategySettings, resolve_settings
from lightning_ft.settings.fields import SettingsError, setting_names
from lightning_ft.strategy.surface import (
    FaultTolerantSurface,
    cluster_environment_for,
    show_settings_in_signature,
    unknown_arguments,
)


class FaultTolerantFSDPStrategy(FaultTolerantSurface, ModelParallelStrategy):
    """FSDP2 sharded training (as Lightning's ``ModelParallelStrategy``, data parallel only) over the
    barrier rendezvous: stable ranks, sharded snapshots and their copies, in-process recovery.

    The LightningModule must shard itself in ``configure_model`` (``fully_shard`` over
    ``self.device_mesh["data_parallel"]``; ``tensor_parallel`` has size 1). Takes the arguments
    and settings of ``ddp_ft`` (not ``DistributedDataParallel``'s); ``keep_ranks`` is always on.
    """

    strategy_name = FSDP_STRATEGY_NAME
    strategy_description = FSDP_STRATEGY_DESCRIPTION

    def __init__(
        self,
        endpoint: str | None = None,
        run_id: str | None = None,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        *,
        timeout: datetime.timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        end_uncaught_configuration_errors((SettingsError,), int(ExitCode.NO_RESTART))
        set_strategy_name(self.strategy_name)  # the runtime's lines and errors name this strategy
        if kwargs.get("keep_ranks", True) is not True:
            raise StrategyConfigError("fsdp_ft: keep_ranks is always on (a rank's shards exist only where that rank "
                                      "ran); remove keep_ranks=False")
        names = setting_names(StrategySettings) | set(LAUNCH_ARGUMENTS)
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise StrategyConfigError(f"fsdp_ft: unknown argument(s) {unknown_arguments(unknown, names)}: fsdp_ft "
                                      "takes the settings of ddp_ft (docs/strategy.md), not DistributedDataParallel's")
        settings = resolve_settings(endpoint=endpoint, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes,
                                    timeout=timeout, **{**kwargs, "keep_ranks": True})
        # shards, not gathers: each rank saves its own part of a checkpoint (a distributed checkpoint)
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.cluster_environment = cluster_environment_for(settings)
        self._hold_runtime(settings, ShardedState())

    def setup_environment(self) -> None:
        assert self.lightning_module is not None and self.accelerator is not None
        self.ft.layout.capture(self.lightning_module)  # before configure_model shards anything
        self.accelerator.setup_device(self.root_device)
        self.setup_distributed()  # the round's process group
        # data_parallel spans the world, so torch gives it the default group: FSDP's collectives
        # run on the round's group, which a hang verdict breaks and a failure retires
        self._device_mesh = data_parallel_mesh(self.world_size, self.root_device)
        give_module_its_mesh(self.lightning_module, self._device_mesh)


show_settings_in_signature(FaultTolerantFSDPStrategy)
