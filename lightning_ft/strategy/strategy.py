"""``FaultTolerantDDPStrategy`` (``Trainer(strategy="ddp_ft")``): the strategy's Lightning surface.

The strategy is what Lightning talks to: its hooks and properties, and the process group of a
round. The rest lives in components it wires together:

* :mod:`.launcher` -- the fit/rendezvous/recovery loop around Lightning's ``_fit_impl``
  (how one process runs ``fit()``, joins rounds, waits as a hot spare, finishes);
* :mod:`.recovery` -- what happens when a round fails (classify, decide, tear down, reset);
* :mod:`.session` -- the session (store, rendezvous, event log) and the round runtime;
* :mod:`.process_group` -- building, breaking and retiring a round's gloo group;
* :mod:`.watchdog` / :mod:`.spare_monitor` -- the background threads;
* :mod:`lightning_ft.checkpoint` -- snapshots, their transfer to new ranks and replicas;
* :mod:`.settings` -- the one validated settings object.

Under ``torchrun --rdzv-backend=lightning_ft`` (or any torchrun) torchrun's agent does the
node-level rendezvous and restarts workers; the strategy then behaves like DDP plus the
snapshot exchange after the group forms.
"""

from __future__ import annotations

import datetime
import difflib
import inspect
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.setup import _log_device_info
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ft._lightning.callbacks import first_callback_of_type
from lightning_ft._lightning.history import (
    continue_history,
    mark_saved_configs,
    pin_versions,
    resolve_versions,
    set_aside_abandoned_checkpoints,
    versioned_loggers,
)
from lightning_ft._lightning.names import STRATEGY_DESCRIPTION, STRATEGY_NAME
from lightning_ft._lightning.slurm import install as install_slurm_compat
from lightning_ft._logging import ensure_log_output
from lightning_ft.checkpoint.exchange.replication import ReplicaPublisher, replica_cipher
from lightning_ft.checkpoint.lightning.auto_resume import model_fingerprint_before_setup
from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
from lightning_ft.deadlines import raw_store
from lightning_ft.events import EventLog, NullEventLog, open_event_log
from lightning_ft.events import names as ev
from lightning_ft.exit_codes import StragglerEvicted
from lightning_ft.process import plan_exit
from lightning_ft.schema.round import PROCESS_GROUP, encode_member, member_key
from lightning_ft.schema.run import decode_log_versions, encode_log_versions
from lightning_ft.schema.signing import SealedStore
from lightning_ft.settings import describe
from lightning_ft.settings.environment import local_rank, master_port, scheduler_node_index
from lightning_ft.settings.fields import setting_names
from lightning_ft.stragglers.watch import StragglerWatch
from lightning_ft.strategy.environment import NO_RANK, ElasticEnvironment, RoundEnvironment
from lightning_ft.strategy.launcher import ElasticLauncher, FaultTolerantLauncher
from lightning_ft.strategy.process_group import GroupTransport, init_round_group, open_sockets
from lightning_ft.strategy.run import RunState
from lightning_ft.strategy.session import RoundRuntime, Session
from lightning_ft.strategy.settings import (
    LAUNCH_ARGUMENTS,
    LaunchMode,
    StrategyConfigError,
    StrategySettings,
    resolve_settings,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import _StrategyRegistry

log = logging.getLogger(__name__)

#: what the strategy reads before Lightning configured its launcher
_NO_RUN = RunState()



class FaultTolerantDDPStrategy(DDPStrategy):
    """DDP over a barrier rendezvous with hot spares and in-process recovery.

    Launch one process per participant (``srun``, a JobSet pod, or plain ``python`` per
    node) with ``Trainer(strategy="ddp_ft", devices=1)`` -- or pass this object. ``min_nodes``
    participants train; up to ``max_nodes - min_nodes`` wait as hot spares. When a peer dies
    or hangs, the survivors and a spare re-form the group and resume from the newest
    in-memory snapshot inside the same ``fit()`` call.

    Args:
        endpoint: ``HOST:PORT`` of the rendezvous store (default ``$LIGHTNING_FT_ENDPOINT``);
            run ``lightning-ft store`` there, or let the first process bind it.
        run_id: names the job in the store and its snapshots (default ``$LIGHTNING_FT_RUN_ID``,
            else ``$TORCHELASTIC_RUN_ID``, else ``$SLURM_JOB_ID``).
        min_nodes, max_nodes: active participants, and actives plus spares (default
            ``$LIGHTNING_FT_NNODES`` as ``MIN:MAX``).
        timeout: process-group timeout (as ``DDPStrategy``).
        **kwargs: any setting of :class:`~lightning_ft.strategy.settings.StrategySettings` and its
            groups (each documented there, in ``docs/strategy.md`` and by ``help()`` of this
            class), e.g. ``replication_factor=2``, ``store_timeout=10``; the rest is passed to
            ``DistributedDataParallel`` (as ``DDPStrategy``). A name that is neither is an error
            naming the closest setting.
    """

    strategy_name = STRATEGY_NAME
    strategy_description = STRATEGY_DESCRIPTION
    #: each rank holds only its own shards of the state (FaultTolerantFSDPStrategy)
    shards_state = False

    @property
    def cannot_reform(self) -> str | None:
        """Why a failed round cannot re-form in-process (None: it can)."""
        return None

    def rebuild_module(self) -> None:
        """Replicated state needs no rebuild: the model's parameters survive a failed round."""

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
        given, ddp_kwargs = split_strategy_kwargs(kwargs)
        settings = resolve_settings(endpoint=endpoint, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes,
                                    timeout=timeout, **given)
        environment: ClusterEnvironment = (RoundEnvironment(socket.gethostname())
                                           if settings.mode is LaunchMode.RENDEZVOUS else ElasticEnvironment())
        super().__init__(cluster_environment=environment, timeout=timeout,
                         process_group_backend=process_group_backend, **ddp_kwargs)
        #: everything this strategy was configured with (frozen, validated)
        self.settings: StrategySettings = settings
        self.session: Session | None = None
        self._events: EventLog | NullEventLog | None = None
        self._replicas: ReplicaPublisher | None = None
        self._checkpoint: EmergencyCheckpoint | None = None
        self._printed_device_info = False
        if settings.mode is LaunchMode.RENDEZVOUS:
            # Before the rendezvous nobody knows who is rank 0, yet Lightning's rank-zero output
            # (the "GPU available" lines in Trainer.__init__, tips) would print on every process,
            # spares included. Only the scheduler's node 0 prints then. When the scheduler numbers
            # the nodes, node 0 has printed them, whoever becomes rank 0 (arrival order decides);
            # only without a numbering does rank 0 of the first round print the device lines.
            node_index = _scheduler_node_index(settings)
            early_rank = 0 if node_index == 0 else NO_RANK
            self._environment.assign(early_rank, 1)  # what set_world_ranks() reports until a round decides
            self.set_world_ranks()
            self._printed_device_info = node_index >= 0
        # Lightning never destroys a gloo group; and a ddp_ft process has told its peers and the
        # rendezvous everything before fit() returns, so its interpreter teardown may be quick
        plan_exit(destroy_process_group=True, quick_teardown=True)
        ensure_log_output()

    # ------------------------------------------------------------------ properties

    @property
    def run(self) -> RunState:
        """This process's run, owned by the launcher (empty until Lightning configured it)."""
        launcher = self._launcher
        return launcher.run if isinstance(launcher, (FaultTolerantLauncher, ElasticLauncher)) else _NO_RUN

    @property
    def trainer(self) -> Any:
        """The Trainer whose fit() this strategy runs."""
        return self.run.trainer

    @property
    def round(self) -> RoundRuntime | None:
        """The round this process trains in (None while it waits, and under torchrun before fit)."""
        return self.run.round

    @property
    def trained(self) -> bool:
        """True once this process trained in some round (False: it only ever was a hot spare)."""
        return self.run.trained

    @property
    def recoveries(self) -> int:
        """How many times this process recovered from a failed round."""
        return self.run.recoveries

    @property
    def launch_mode(self) -> LaunchMode:
        return self.settings.mode

    @property
    def run_id(self) -> str:
        return self.settings.run_id

    @property
    def event_log(self) -> EventLog | NullEventLog:
        """This process's event log in the run directory (a null log when none is configured).

        Callbacks that record events (``GracefulTermination``) write here, so every event of a
        ``ddp_ft`` process lands in ``events_dir`` whether it came from an argument or the
        environment.
        """
        if self._events is None:
            who = (self.session.participant.participant_id if self.session is not None else
                   f"{socket.gethostname()}:{os.getpid()}:{local_rank()}")
            self._events = open_event_log(who, self.settings.events_dir)
        return self._events

    @property
    def stop_store(self) -> Any:
        """The store the SIGTERM path agrees on a stop step through (``GracefulTermination``): a
        connection of the session's, which follows the store when it fails over; None before
        a session (then the process group's store)."""
        session = self.session
        # its calls are bounded by stop_store_timeout there anyway; a tight bound here also bounds
        # how long the exit waits for the stop watcher's call in flight
        return session.store.clone(self.settings.timeouts.stop_store_timeout) if session is not None else None

    def open_session(self) -> Session:
        """Reach the rendezvous store and join the run as a participant (once per process)."""
        if self.session is None:
            self.session = Session.open(self.settings, self._event_log_for)
        return self.session

    def _event_log_for(self, participant_id: str) -> EventLog | NullEventLog:
        if self._events is None or not self._events.enabled:
            self._events = open_event_log(participant_id, self.settings.events_dir)
        return self._events

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if self.settings.mode is LaunchMode.RENDEZVOUS or self.parallel_devices[0].type == "cpu":
            return self.parallel_devices[0]
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # DDPStrategy uses num_nodes * num_processes (the Trainer arguments); the round decides here
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ------------------------------------------------------------------ Lightning hooks

    def _configure_launcher(self) -> None:
        if self.settings.mode is LaunchMode.TORCHELASTIC:
            self._launcher = ElasticLauncher(self)
            return
        if self.parallel_devices is not None and len(self.parallel_devices) != 1:
            raise StrategyConfigError(
                f"ddp_ft: each process is one participant and trains on one device, but devices="
                f"{len(self.parallel_devices)} was given; pass devices=1 and start one process per device "
                "(srun --ntasks-per-node, one container per device, ...)")
        self._launcher = FaultTolerantLauncher(self)

    def set_world_ranks(self) -> None:
        # ranks come from the round (or torchrun), never from num_nodes/devices
        rank = self.cluster_environment.global_rank() if self.cluster_environment is not None else 0
        # a function attribute Lightning sets at import; its typed overloads do not declare it
        rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]

    def setup_distributed(self) -> None:
        if self.settings.mode is LaunchMode.TORCHELASTIC:
            before = open_sockets()
            super().setup_distributed()
            assert self.round is not None  # started by the ElasticLauncher
            self.round.transport = GroupTransport(before, open_sockets(), master_port())
            self._share_snapshots()
            return
        runtime, session = self.round, self.session
        if runtime is None or runtime.result is None or session is None:
            raise RuntimeError("ddp_ft: setup_distributed ran outside the strategy's launcher")
        result = runtime.result
        reset_seed()
        self._environment.assign(result.rank, result.world_size)
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        start = time.perf_counter()
        runtime.transport = init_round_group(
            self._process_group_backend, result.rank, result.world_size,
            store=dist.PrefixStore(f"{result.store_prefix}/{PROCESS_GROUP}", raw_store(session.store)),
            init_timeout=self.settings.timeouts.init_timeout, pg_timeout=self._timeout,
            store_port=getattr(session.store, "port", None))
        seconds = time.perf_counter() - start
        self.event_log.emit(ev.GROUP_FORMED, round=result.round, rank=result.rank, world=result.world_size,
                            seconds=round(seconds, 4))
        log.info("ddp_ft: round %d: process group up as rank %d of %d in %.3fs (%s)", result.round,
                 result.rank, result.world_size, seconds, self._process_group_backend)
        assert self.settings.domain_id is not None  # resolved by resolve_settings
        session.round_values(result).put(member_key(result.rank),
                                         encode_member(session.participant.participant_id, self.settings.domain_id))
        if result.rank == 0 and not self._printed_device_info:
            _log_device_info(self.trainer)  # held back until rank 0 was known (see __init__)
        self._printed_device_info = True
        resume_step = self._share_snapshots()
        self._keep_log_history(session, runtime, resume_step)
        runtime.start_watchdog(session, self.settings.hang, self.settings.timeouts, self._global_step,
                               stragglers=None if self.shards_state else self.settings.stragglers)

    @property
    def _environment(self) -> RoundEnvironment:
        assert isinstance(self.cluster_environment, RoundEnvironment)
        return self.cluster_environment

    def _global_step(self) -> int | None:
        return self.trainer.global_step if self.trainer is not None else None

    def _share_snapshots(self) -> int | None:
        """After the group formed: make the newest snapshot any rank holds available on every rank;
        returns its step (where training resumes), None without one."""
        checkpoint = first_callback_of_type(self.trainer, EmergencyCheckpoint)
        if checkpoint is None:
            return None
        round_id = self.round.round_id if self.round is not None else None
        exchange = checkpoint.snapshots.exchange_shards if self.shards_state else checkpoint.snapshots.exchange
        plan = exchange(self.global_rank, self.world_size,
                        lambda event, **f: self.event_log.emit(event, round=round_id, **f),
                        model=model_fingerprint_before_setup(self.lightning_module))
        if self.round is not None and self.round.follows_a_failure and not checkpoint.auto_resume:
            log.info("ddp_ft: turning on EmergencyCheckpoint auto-resume to continue after the failure")
            checkpoint.auto_resume = True
        return plan.step if plan is not None else None

    def _keep_log_history(self, session: Session, runtime: RoundRuntime, resume_step: int | None) -> None:
        """One log version per run on every participant; after a recovery, continue its history."""
        loggers = versioned_loggers(self.trainer)
        if loggers:
            key, values = session.keys.log_versions, session.rendezvous.values
            if self.global_rank == 0 and not values.has(key):
                values.put_if_absent(key, encode_log_versions(resolve_versions(loggers)))
            pin_versions(loggers, decode_log_versions(self._wait_for_value(values, key)))
        if not runtime.follows_a_failure:
            return
        if resume_step is not None:
            continue_history(self.trainer, resume_step, is_global_zero=self.global_rank == 0)
        mark_saved_configs(self.trainer, self)

    def leave_as_spare(self) -> None:
        """After fit() returns on a process that is not (or no longer) training: never act as rank 0."""
        if isinstance(self.cluster_environment, RoundEnvironment):
            self._environment.assign(NO_RANK, self._environment.world_size())
        self.set_world_ranks()

    # ------------------------------------------------------------------ progress
    # Strategy hooks, not a callback: Lightning dispatches every hook of a step to every
    # callback (profiler context, state key), which costs more than these few lines.

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.trainer
        runtime = self.round
        step = trainer.global_step
        if runtime is not None and (runtime.follows_a_failure or step > 0):
            self.event_log.emit(ev.RESTORED, round=runtime.round_id, step=step)
        self._checkpoint = first_callback_of_type(trainer, EmergencyCheckpoint)
        if runtime is not None and runtime.work is not None:
            runtime.work.begin()
        if self._checkpoint is not None and self.settings.mode is LaunchMode.RENDEZVOUS:
            resumed = self._checkpoint.resumed_from
            assert runtime is not None  # the launcher started the round
            if runtime.follows_a_failure and self.global_rank == 0 and resumed is not None:
                set_aside_abandoned_checkpoints(trainer, snapshot_created=resumed[1])
            self._snapshot_round_start(step)
        # rank 0 publishes copies for hot spares; decided once per round, not per step
        self._replicas = None
        # (copies of rank 0's snapshot: with sharded state, only rank 0's shards)
        if (self.settings.replication_factor and self._checkpoint is not None and self.global_rank == 0
                and not self.shards_state
                and self.settings.mode is LaunchMode.RENDEZVOUS and self.session is not None):
            signer = self.session.rendezvous.signer
            cipher = replica_cipher(signer, self.settings.replication_factor)  # None without a job secret
            if cipher is not None:
                self._replicas = ReplicaPublisher(self.session.store.clone, signer, cipher,
                                                  self.settings.replication_factor,
                                                  self.settings.replica_max_bytes, self.event_log.emit)

    def _wait_for_value(self, values: SealedStore, key: str) -> bytes:
        """An authentic value another rank writes, polled in short slices (bounded by init_timeout)."""
        deadline = time.monotonic() + self.settings.timeouts.init_timeout
        while (raw := values.get(key)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ddp_ft: no authentic value of {values.key(key)} within "
                                   f"init_timeout={self.settings.timeouts.init_timeout:g}s")
            time.sleep(0.01)
        return raw

    def _snapshot_round_start(self, step: int) -> None:
        # A round must always have a snapshot to fall back to: without one, a failure before the
        # first periodic snapshot would restart optimizer and step from scratch on top of weights
        # DDP broadcast from a survivor's trained model. With it, "from the start" is a restore too.
        checkpoint, runtime = self._checkpoint, self.round
        assert checkpoint is not None and runtime is not None  # see on_train_start
        store = checkpoint.store
        if store is None or not any(info.step == step for info in store.list()):
            checkpoint.save_now(self.trainer, reason=f"start of round {runtime.round_id}")

    def configure_ddp(self) -> None:
        super().configure_ddp()
        runtime = self.round
        if runtime is not None and runtime.work is not None and self.lightning_module is not None:
            runtime.work.watch_gradients(self.lightning_module)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        runtime = self.round
        if runtime is None:
            return
        runtime.step_started()
        watch = runtime.stragglers
        if watch is None:
            return
        if watch.evicted is not None:  # at a step boundary: the peers' live state is this step
            raise StragglerEvicted(f"evicted as a straggler at step {self.trainer.global_step}: {watch.evicted}")
        if self.global_rank == 0 and watch.scores:
            self._log_work(watch)

    def _log_work(self, watch: StragglerWatch) -> None:
        """Rank 0: every rank's own work and wait, and their straggler scores, to the Trainer's loggers."""
        summaries, scores = watch.summaries, watch.scores
        watch.scores = {}  # each judgement is logged once
        metrics = {"ft/straggler_score": max(scores.values())}
        for rank, summary in summaries.items():
            metrics[f"ft/busy_seconds/rank{rank}"] = summary.median
            metrics[f"ft/wait_seconds/rank{rank}"] = summary.wait
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=self.trainer.global_step)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | Module | None = None, **kwargs: Any) -> Any:
        runtime = self.round
        work = runtime.work if runtime is not None else None
        output = super().optimizer_step(optimizer, work.timed_closure(closure) if work is not None else closure,
                                        model, **kwargs)
        # forward, backward (with its all-reduce) and the update are done: the step completed
        if runtime is None:
            return output
        if work is not None:
            work.step_finished(self.trainer.global_step + 1)
        since_failure = runtime.step_finished()
        if since_failure is not None:
            # Lightning counts the optimizer step as completed only after this returns
            step = self.trainer.global_step + 1
            self.event_log.emit(ev.FIRST_STEP_AFTER_RECOVERY, round=runtime.round_id, step=step,
                                seconds_since_failure=round(since_failure, 4))
            log.info("ddp_ft: first step after recovery completed (step %d, %.3fs after the failure)",
                     step, since_failure)
        if self._replicas is not None and runtime.result is not None:
            assert self._checkpoint is not None  # replicas are published only with one
            result = runtime.result
            self._replicas.offer(self._checkpoint.last_snapshot, result.round, result.store_prefix,
                                 result.world_size)
        return output

    # Collectives and validation batches are progress too (see strategy/watchdog.py): a rank
    # that keeps entering and leaving them is not stuck, one that stays inside is waiting.

    def _progress(self) -> None:
        if self.round is not None:
            self.round.clock.touch()

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._progress()
        super().barrier(*args, **kwargs)
        self._progress()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._progress()
        result = super().broadcast(obj, src)
        self._progress()
        return result

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        self._progress()
        result = super().reduce(tensor, group=group, reduce_op=reduce_op)
        self._progress()
        return result

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        self._progress()
        result = super().all_gather(tensor, group=group, sync_grads=sync_grads)
        self._progress()
        return result

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._progress()
        return super().validation_step(*args, **kwargs)

    def stop_round_threads(self) -> None:
        """Stop the watchdog and wait (bounded) for a replica publication in flight."""
        if self.round is not None:
            self.round.stop_watchdog()
        if self._replicas is not None:
            self._replicas.stop()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)
            install_slurm_compat(cls)


def _scheduler_node_index(settings: StrategySettings) -> int:
    if settings.infra_rank is not None:
        return settings.infra_rank
    try:
        return scheduler_node_index()
    except ValueError:  # a malformed variable is reported when the participant joins
        return -1


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
        hints = [f"{name!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
            name, sorted(names), n=1)) else "") for name in unknown]
        raise StrategyConfigError(f"ddp_ft: unknown argument(s) {', '.join(hints)}: neither a setting of ddp_ft "
                                  "(see docs/strategy.md) nor an argument of DistributedDataParallel")
    return given, rest


def _signature() -> inspect.Signature:
    """``__init__``'s signature with every setting as a keyword argument (for ``help()`` and tools)."""
    own = [p for p in inspect.signature(FaultTolerantDDPStrategy.__init__).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    settings = [inspect.Parameter(info.name, inspect.Parameter.KEYWORD_ONLY, default=info.default)
                for info in describe(StrategySettings)]
    return inspect.Signature([*own, *settings, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


# a function attribute inspect.signature reads (typeshed knows no __signature__ on functions)
FaultTolerantDDPStrategy.__init__.__signature__ = _signature()  # type: ignore[attr-defined]


def register_strategy() -> None:
    """Make ``Trainer(strategy="ddp_ft")`` resolve to :class:`FaultTolerantDDPStrategy` (idempotent)."""
    FaultTolerantDDPStrategy.register_strategies(StrategyRegistry)
