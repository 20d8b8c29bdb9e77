"""What ``ddp_ft`` and ``fsdp_ft`` share: Lightning's hooks, forwarded to the runtime they hold.

:class:`FaultTolerantSurface` is an abstract Lightning ``ParallelStrategy`` placed before the
Lightning strategy in each class's bases (``FaultTolerantDDPStrategy(FaultTolerantSurface,
DDPStrategy)``), so its hooks call the Lightning strategy's own through ``super()`` and add only
what fault tolerance needs: the launcher that runs ``fit()`` round by round, the round's
process group, progress for the watchdog, the step boundary and the optimizer step. Everything
behind them is the :class:`~lightning_ft.runtime.runtime.FaultToleranceRuntime` (``self.ft``).
"""

from __future__ import annotations

import difflib
import inspect
import socket
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.nn import Module
from torch.optim import Optimizer

from lightning_ft._lightning.launcher import RuntimeLauncher, script_can_run_again
from lightning_ft._lightning.slurm import install as install_slurm_compat
from lightning_ft._lightning.trainer import default_backend_for
from lightning_ft._logging import ensure_log_output
from lightning_ft.events import EventLog, NullEventLog
from lightning_ft.process import die_with_parent, plan_exit
from lightning_ft.runtime.layout import StateLayout
from lightning_ft.runtime.run import RunState
from lightning_ft.runtime.runtime import FaultToleranceRuntime
from lightning_ft.runtime.session import RoundRuntime, Session
from lightning_ft.runtime.settings import LaunchMode, StrategyConfigError, StrategySettings
from lightning_ft.settings import describe
from lightning_ft.settings.environment import (
    ENV_LOCAL_PARENT,
    environ,
    local_process_index,
    scheduler_node_index,
    tasks_per_node,
)
from lightning_ft.strategy.environment import ElasticEnvironment, RoundEnvironment
from lightning_ft.strategy.local_processes import start_local_processes

if TYPE_CHECKING:
    import lightning.pytorch as pl


def cluster_environment_for(settings: StrategySettings) -> ClusterEnvironment:
    """Ranks come from the round (rendezvous mode) or from torchrun's agent."""
    return RoundEnvironment(socket.gethostname()) if settings.mode is LaunchMode.RENDEZVOUS else ElasticEnvironment()


class FaultTolerantSurface(ParallelStrategy):
    """The hooks both fault-tolerant strategies add to their Lightning strategy (module docstring)."""

    #: the fault-tolerance runtime this strategy holds (set by :meth:`_hold_runtime`)
    ft: FaultToleranceRuntime
    #: declared by the Lightning strategies this surface is combined with
    strategy_name: str
    _process_group_backend: str | None

    def _hold_runtime(self, settings: StrategySettings, layout: StateLayout) -> None:
        """Build the runtime; call at the end of the subclass's ``__init__``."""
        self.ft = FaultToleranceRuntime(settings, layout, self)
        parent = environ().get(ENV_LOCAL_PARENT, "")
        if local_process_index() > 0 and parent.isdecimal():
            die_with_parent(int(parent))  # one of a node's devices=N processes: it shares the node's fate
        if settings.mode is LaunchMode.RENDEZVOUS:
            self.ft.note_early_rank(_scheduler_node_index(settings))
        # Lightning never destroys a gloo group; and a process of ours has told its peers and the
        # rendezvous everything before fit() returns, so its interpreter teardown may be quick
        plan_exit(destroy_process_group=True, quick_teardown=True)
        ensure_log_output()

    # ------------------------------------------------------------------ what the runtime knows

    @property
    def settings(self) -> StrategySettings:
        """Everything this strategy was configured with (frozen, validated)."""
        return self.ft.settings

    @property
    def session(self) -> Session | None:
        """This process's rendezvous session (None before fit(), and under torchrun)."""
        return self.ft.session

    @property
    def run(self) -> RunState:
        """This process's run (empty until fit())."""
        return self.ft.run

    @property
    def trainer(self) -> Any:
        """The Trainer whose fit() this strategy runs."""
        return self.ft.run.trainer

    @property
    def round(self) -> RoundRuntime | None:
        """The round this process trains in (None while it waits, and under torchrun before fit)."""
        return self.ft.round

    @property
    def trained(self) -> bool:
        """True once this process trained in some round (False: it only ever was a hot spare)."""
        return self.ft.run.trained

    @property
    def recoveries(self) -> int:
        """How many times this process recovered from a failed round."""
        return self.ft.run.recoveries

    @property
    def launch_mode(self) -> LaunchMode:
        return self.ft.settings.mode

    @property
    def run_id(self) -> str:
        return self.ft.settings.run_id

    @property
    def event_log(self) -> EventLog | NullEventLog:
        """This process's event log (callbacks that record events write here)."""
        return self.ft.event_log

    @property
    def stop_store(self) -> Any:
        """The store the SIGTERM path agrees on a stop step through (see the runtime)."""
        return self.ft.stop_store

    @property
    def hand_over_seat(self) -> Any:
        """What the SIGTERM path hands a signalled node's place over through (see the runtime)."""
        return self.ft.hand_over_seat

    # ------------------------------------------------------------------ what the runtime asks

    def assign_rank(self, rank: int, world_size: int) -> None:
        environment = self.cluster_environment
        if isinstance(environment, RoundEnvironment):
            environment.assign(rank, world_size)
        self.set_world_ranks()

    def group_backend(self) -> str:
        if self._process_group_backend is None:
            self._process_group_backend = default_backend_for(self.root_device)
        return self._process_group_backend

    # ------------------------------------------------------------------ Lightning hooks

    def _configure_launcher(self) -> None:
        devices = len(self.parallel_devices) if self.parallel_devices is not None else 1
        start_local = None
        if self.launch_mode is LaunchMode.RENDEZVOUS and devices > 1 and tasks_per_node() > 1:
            raise StrategyConfigError(
                f"{self.strategy_name}: each process is one participant, and srun already starts "
                f"{tasks_per_node()} tasks per node; with devices={devices} each would start {devices - 1} more. "
                f"Pass devices=1 (one task per device), or srun one task per node with devices={devices}")
        if self.launch_mode is LaunchMode.RENDEZVOUS and devices > 1 and local_process_index() == 0 \
                and not script_can_run_again():
            raise StrategyConfigError(
                f"{self.strategy_name}: devices={devices} starts this script again for each further device, but "
                "it runs from python -c, a notebook or an interactive session; run it as a file, or pass devices=1 "
                "and start one process per device")
        if self.launch_mode is LaunchMode.RENDEZVOUS and devices > 1:
            # Trainer(devices=N): the node's first process starts the other N-1, each a participant
            self.ft.train_on_devices(devices)
            if local_process_index() == 0:
                start_local = partial(start_local_processes, devices)
        nodes = getattr(self, "num_nodes", 1)
        if self.launch_mode is LaunchMode.RENDEZVOUS and nodes != 1:
            raise StrategyConfigError(
                f"{self.strategy_name}: Trainer(num_nodes={nodes}) is not how this job's size is set: the rendezvous "
                "forms it from the participants that join (min_nodes/max_nodes, LIGHTNING_FT_NNODES=MIN:MAX); "
                "leave num_nodes at 1")
        self._launcher = RuntimeLauncher(self.ft.loop, before_first_launch=start_local)

    def set_world_ranks(self) -> None:
        # ranks come from the round (or torchrun), never from num_nodes/devices
        rank = self.cluster_environment.global_rank() if self.cluster_environment is not None else 0
        # a function attribute Lightning sets at import (its typed overloads do not declare it)
        vars(rank_zero_only)["rank"] = vars(utils_rank_zero_only)["rank"] = rank

    def setup_distributed(self) -> None:
        """The round's process group (rendezvous mode) or torchrun's, then the snapshot exchange
        and the watchdog (see the runtime)."""
        reset_seed()
        self.set_world_ranks()
        self.ft.setup_distributed()

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's setup (device, wrapping), after a rank that stood by in a fit received the
        module state of the ranks that trained (see the runtime)."""
        self.ft.align_stage_state()
        super().setup(trainer)

    def on_train_start(self) -> None:
        super().on_train_start()
        self.ft.on_train_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.ft.on_train_batch_start(batch_idx)

    def post_backward(self, closure_loss: Any) -> None:
        super().post_backward(closure_loss)
        self.ft.after_backward()

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | Module | None = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, self.ft.timed_closure(closure), model, **kwargs)
        self.ft.after_optimizer_step()
        return output

    # Collectives and validation batches are progress too (see runtime/watchdog.py): a rank
    # that keeps entering and leaving them is not stuck, one that stays inside is waiting.

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.ft.progress()
        super().barrier(*args, **kwargs)
        self.ft.progress()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.ft.progress()
        result = super().broadcast(obj, src)
        self.ft.progress()
        return result

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        self.ft.progress()
        result = super().reduce(tensor, group=group, reduce_op=reduce_op)
        self.ft.progress()
        return result

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        self.ft.progress()
        result = super().all_gather(tensor, group=group, sync_grads=sync_grads)
        self.ft.progress()
        return result

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.ft.progress()
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.ft.progress()
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self.ft.progress()
        return super().predict_step(*args, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        name = getattr(cls, "strategy_name", None)
        if name is not None and name not in strategy_registry:
            strategy_registry.register(name, cls, description=getattr(cls, "strategy_description", ""))
            install_slurm_compat(cls)


def unknown_arguments(unknown: list[str], names: set[str]) -> str:
    """``'nme' (did you mean 'name'?), ...`` for the names that are no setting."""
    return ", ".join(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
        name, sorted(names), n=1)) else "") for name in unknown)


def strategy_signature(init: Any) -> inspect.Signature:
    """``init``'s signature with every setting as a keyword argument (for ``help()`` and tools)."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    settings = [inspect.Parameter(info.name, inspect.Parameter.KEYWORD_ONLY, default=info.default)
                for info in describe(StrategySettings)]
    return inspect.Signature([*own, *settings, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def show_settings_in_signature(strategy: type) -> None:
    """Every setting as a keyword argument of ``strategy.__init__`` for ``help()`` and tools
    (a function attribute ``inspect.signature`` reads)."""
    init = vars(strategy)["__init__"]
    vars(init)["__signature__"] = strategy_signature(init)


def _scheduler_node_index(settings: StrategySettings) -> int:
    if local_process_index() > 0:
        return -1  # a node's later devices=N process: never rank 0 before the rendezvous says so
    if settings.infra_rank is not None:
        return settings.infra_rank
    if settings.launch.max_nodes == 1:
        return 0  # the job's only participant is its rank 0 (as under ddp, before fit() too)
    try:
        return scheduler_node_index()
    except ValueError:  # a malformed variable is reported when the participant joins
        return -1
