"""``FaultTolerantDDPStrategy`` (``Trainer(strategy="ddp_ft")``): Lightning's ``DDPStrategy`` holding
the fault-tolerance runtime.

Everything fault tolerance does lives in :mod:`lightning_ft.runtime` (one
:class:`~lightning_ft.runtime.runtime.FaultToleranceRuntime` per process, with replicated state:
:class:`~lightning_ft.runtime.layout.ReplicatedState`); the hooks it shares with ``fsdp_ft`` are
:class:`~lightning_ft.strategy.surface.FaultTolerantSurface`'s. This class adds what is DDP's
own: its constructor arguments, the device, the sampler and the gradient hooks of the straggler
meter.

Under ``torchrun --rdzv-backend=lightning_ft`` (or any torchrun) torchrun's agent does the
node-level rendezvous and restarts workers; the strategy then behaves like DDP plus the
snapshot exchange after the group forms.
"""

from __future__ import annotations

import datetime
import inspect
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_ft._lightning.names import STRATEGY_DESCRIPTION, STRATEGY_NAME
from lightning_ft._logging import set_strategy_name
from lightning_ft.exit_codes import ExitCode
from lightning_ft.process import end_uncaught_configuration_errors
from lightning_ft.runtime.layout import ReplicatedState
from lightning_ft.runtime.settings import (
    LAUNCH_ARGUMENTS,
    StrategyConfigError,
    StrategySettings,
    resolve_settings,
)
from lightning_ft.settings.fields import SettingsError, setting_names
from lightning_ft.strategy.surface import (
    FaultTolerantSurface,
    cluster_environment_for,
    show_settings_in_signature,
    unknown_arguments,
)


class FaultTolerantDDPStrategy(FaultTolerantSurface, DDPStrategy):
    """DDP over a barrier rendezvous with hot spares and in-process recovery.

    Launch one process per participant (``srun``, a JobSet pod, or plain ``python`` per
    node) with ``Trainer(strategy="ddp_ft", devices=1)`` -- or pass this object. ``min_nodes``
    participants train; up to ``max_nodes - min_nodes`` wait as hot spares. When a peer dies
    or hangs, the survivors and a spare re-form the group and resume from the survivors' live
    state (or the newest in-memory snapshot) inside the same ``fit()`` call.

    Args:
        endpoint: ``HOST:PORT`` of the rendezvous store (default ``$LIGHTNING_FT_ENDPOINT``);
            run ``lightning-ft store`` there, or let the first process bind it. A list
            ``HOST:PORT,HOST:PORT`` names where the store may move when its host is lost.
        run_id: names the job in the store and its snapshots (default ``$LIGHTNING_FT_RUN_ID``,
            else ``$TORCHELASTIC_RUN_ID``, else ``$SLURM_JOB_ID``).
        min_nodes, max_nodes: active participants, and actives plus spares (default
            ``$LIGHTNING_FT_NNODES`` as ``MIN:MAX``).
        timeout: process-group timeout (as ``DDPStrategy``).
        **kwargs: any setting of :class:`~lightning_ft.runtime.settings.StrategySettings` and its
            groups (each documented there, in ``docs/strategy.md`` and by ``help()`` of this
            class), e.g. ``replication_factor=2``, ``store_timeout=10``; the rest is passed to
            ``DistributedDataParallel`` (as ``DDPStrategy``). A name that is neither is an error
            naming the closest setting.
    """

    strategy_name = STRATEGY_NAME
    strategy_description = STRATEGY_DESCRIPTION

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
        given, ddp_kwargs = split_strategy_kwargs(kwargs)
        settings = resolve_settings(endpoint=endpoint, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes,
                                    timeout=timeout, **given)
        super().__init__(cluster_environment=cluster_environment_for(settings), timeout=timeout,
                         process_group_backend=process_group_backend, **ddp_kwargs)
        self._hold_runtime(settings, ReplicatedState())

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if self.parallel_devices[0].type == "cpu":
            return self.parallel_devices[0]
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # DDPStrategy uses num_nodes * num_processes (the Trainer arguments); the round decides here
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def configure_ddp(self) -> None:
        super().configure_ddp()
        self.ft.watch_gradients(self.lightning_module)


def split_strategy_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The strategy's keyword arguments -> (settings, ``DistributedDataParallel`` arguments).

    A name that is neither a setting nor an argument of ``DistributedDataParallel`` is an error
    naming the closest setting (a misspelt setting would otherwise reach DDP's constructor).
    """
    names = setting_names(StrategySettings) | set(LAUNCH_ARGUMENTS)
    given = {key: value for key, value in kwargs.items() if key in names}
    rest = {key: value for key, value in kwargs.items() if key not in names}
    ddp_names = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
    unknown = sorted(set(rest) - ddp_names)
    if unknown:
        raise StrategyConfigError(f"ddp_ft: unknown argument(s) {unknown_arguments(unknown, names)}: neither a "
                                  "setting of ddp_ft (see docs/strategy.md) nor an argument of DistributedDataParallel")
    return given, rest


show_settings_in_signature(FaultTolerantDDPStrategy)


def register_strategy() -> None:
    """Make ``Trainer(strategy="ddp_ft")`` resolve to :class:`FaultTolerantDDPStrategy` (idempotent)."""
    FaultTolerantDDPStrategy.register_strategies(StrategyRegistry)
