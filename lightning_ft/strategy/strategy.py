"""``FaultTolerantDDPStrategy`` (``Trainer(strategy="ddp_ft")``): DDP whose group survives a lost node.

How one process runs ``fit()`` (rendezvous mode):

1. ``fit()`` calls the strategy's launcher, which joins the barrier rendezvous. A hot spare
   blocks there until a failure needs it, and returns from ``fit()`` (exit 0) when the job
   finishes or the rendezvous is closed for good.
2. An active participant runs Lightning's ``_fit_impl``. ``setup_distributed`` builds the
   gloo group from the round (``PrefixStore(f"{round prefix}/pg", store)``), makes the newest
   snapshot any rank holds available on every rank (a spare receives it over the new group)
   and starts the round watchdog. ``EmergencyCheckpoint``'s auto-resume then restores it.
3. A peer dies: the survivors' collective fails (gloo raises in ~20-40 ms; a frozen peer is
   caught by the hang detector, which breaks the group). The launcher classifies the error,
   runs Lightning's exception-path teardown, destroys the group, resets the Trainer
   (:mod:`~lightning_ft.strategy.trainer_reset`), opens the next round and goes back to 1 --
   inside the same ``fit()`` call, without relaunching anything.
4. Success: the actives pass torch's elastic exit barrier for the round, close the
   rendezvous for good (spares leave), acknowledge, and destroy the group.

Under ``torchrun --rdzv-backend=lightning_ft`` (or any torchrun) torchrun's agent does the
node-level rendezvous and restarts workers; the strategy then behaves like DDP plus the
snapshot exchange of step 2.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from lightning_ft._logging import ensure_log_output
from lightning_ft.exit_codes import ExitCode
from lightning_ft.strategy import timeline as ev
from lightning_ft.strategy.config import (
    ENV_DOMAIN_ID,
    LaunchConfig,
    LaunchMode,
    StrategyConfigError,
    check_positive,
    resolve_launch_config,
)
from lightning_ft.strategy.decisions import (
    JOB_FAILED_REASON,
    JOB_FINISHED_REASON,
    JOB_STOPPED_REASON,
    EndAction,
    FailureFacts,
    FailureKind,
    RecoveryAction,
    classify_failure,
    decide_on_rendezvous_end,
    decide_recovery,
    looks_like_collective_error,
    looks_like_peer_gone,
    replica_needed,
)
from lightning_ft.strategy.transport import GroupTransport, exchange_snapshots, open_sockets
from lightning_ft.strategy.watchdog import (
    REPLICA_BLOB_KEY,
    REPLICA_META_KEY,
    RoundWatchdog,
    SpareMonitor,
    StepClock,
    encode_member,
    failed_key,
    member_key,
)

log = logging.getLogger(__name__)

STRATEGY_NAME = "ddp_ft"
_SEP = "\x1f"


class NoRestartError(SystemExit):
    """The job cannot go on (no hot spare left, a peer's own error, repeated failures).

    A ``SystemExit`` whose code is ``ExitCode.NO_RESTART`` (83), so an uncaught one ends the
    process with that status: "unrecoverable, do not requeue".
    """

    def __init__(self, message: str) -> None:
        super().__init__(int(ExitCode.NO_RESTART))
        self.message = message

    def __str__(self) -> str:
        return f"exit {int(ExitCode.NO_RESTART)} (NO_RESTART): {self.message}"


class _SpareTerminated(BaseException):
    """SIGTERM arrived while this process waited in the rendezvous."""


# ---------------------------------------------------------------------------- environments


class _RoundEnvironment(ClusterEnvironment):
    """Rank and world size come from the current rendezvous round; Lightning's setters are no-ops."""

    def __init__(self, address: str) -> None:
        super().__init__()
        self._address = address
        self._rank = 0
        self._world_size = 1

    @property
    def creates_processes_externally(self) -> bool:
        return True  # one process per participant, started by srun/JobSet/...: never Lightning's popen

    @property
    def main_address(self) -> str:
        return self._address

    @property
    def main_port(self) -> int:
        return 0  # the group rendezvous through the store, not MASTER_ADDR/MASTER_PORT

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return max(self._rank, 0)

    def assign(self, rank: int, world_size: int) -> None:
        self._rank, self._world_size = rank, world_size


class _ElasticEnvironment(TorchElasticEnvironment):
    """torchrun's environment without the ``devices * num_nodes == WORLD_SIZE`` check: with
    hot spares the active world size is torchrun's to decide, not the Trainer arguments'."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        pass


# ---------------------------------------------------------------------------- launchers


class _FaultTolerantLauncher(_Launcher):
    """Runs ``fit`` in this process inside the rendezvous/recovery loop."""

    def __init__(self, strategy: "FaultTolerantDDPStrategy") -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        return self._strategy._launch(function, args, kwargs, trainer)

    def kill(self, signum) -> None:
        pass  # no child processes


class _ElasticLauncher(_Launcher):
    """Under torchrun: run ``fit`` once; destroy the group at the end (Lightning never does for gloo)."""

    def __init__(self, strategy: "FaultTolerantDDPStrategy") -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        strategy = self._strategy
        strategy._trainer = trainer
        if strategy._timeline is None:
            who = f"{socket.gethostname()}:{os.getpid()}:{os.environ.get('LOCAL_RANK', '0')}"
            strategy._timeline = ev.Timeline(who, strategy._events_dir)
        strategy._attach_callbacks(trainer)
        strategy.trained = True  # torchrun starts workers only on active nodes
        try:
            output = function(*args, **kwargs)
        except BaseException as exc:
            if looks_like_collective_error(_exception_chain(exc)):
                # torchrun restarts this worker; Lightning's teardown must not wait on the broken group
                log.warning("ddp_ft: collective failed (%s: %s); torchrun restarts the workers",
                            type(exc).__name__, _first_line(exc))
                strategy._break_group()
            raise
        _destroy_group()  # Lightning never destroys a gloo group (1 exit in ~15 aborts otherwise)
        # the run's outcome for `lightning-ft report --exit-code` (rendezvous mode: _finish_success)
        strategy._emit(ev.FINISHED, cycle=strategy._cycle(), rank=strategy.global_rank,
                       step=trainer.global_step if trainer is not None else None)
        return output

    def kill(self, signum) -> None:
        pass


@dataclass
class _Session:
    """Per-process rendezvous state (kept across rounds and across fit() calls)."""

    store: Any
    rendezvous: Any
    participant: Any
    keys: Any
    hosting_store: bool


# ---------------------------------------------------------------------------- the strategy


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
        run_id: names the job in the store and its snapshots (default ``$LIGHTNING_FT_RUN_ID``).
        min_nodes, max_nodes: active participants, and actives plus spares (default
            ``$LIGHTNING_FT_NNODES`` as ``MIN:MAX``).
        is_store_host: ``True``: host the store at ``endpoint``; ``False``: only connect;
            ``None``: host it when the port can be bound here.
        domain_id: failure domain of this process (default ``$LIGHTNING_FT_DOMAIN_ID`` or the
            host name); processes of one host share it.
        infra_rank: the scheduler's node index (default from SLURM/JobSet variables).
        segment: actives come in whole groups of this many participants of one domain.
        events_dir: run directory of the event log (default ``$LIGHTNING_FT_EVENTS_DIR``).
        snapshot_every_n_steps, snapshot_every_n_seconds: schedule of the
            ``EmergencyCheckpoint`` the strategy adds when the Trainer has none.
        graceful_termination: add a ``GracefulTermination`` (default probes) when the Trainer
            has none, so SIGTERM takes the SIGTERM path (stop step, snapshot, exit 81)
            instead of Lightning's handling, which exits 0 without saving.
        replication_factor: copies of each snapshot wanted on other participants, on other
            domains when possible (hot spares receive copies through the store while fewer
            than ``factor + 1`` participants/domains train). 0 disables.
        replica_max_bytes: snapshots larger than this are not replicated through the store.
        watchdog_interval: how often the round watchdog publishes progress and checks for a
            newer round or a hung step (seconds).
        hang_detection: treat a step that runs longer than
            ``max(hang_timeout_floor, hang_safety_factor * slowest recent step)`` as a hang
            of the rank that did not progress (the first step of a round is exempt).
        heartbeat_interval, last_call_timeout, previous_active_grace: rendezvous timing;
            a participant silent for 4 heartbeats is dead.
        join_timeout: the first round must complete within this (seconds).
        rejoin_timeout: later rounds (after a failure) must complete within this.
        init_timeout: bound on building the process group of a round.
        exit_barrier_timeout: bound on waiting for the other actives at the end.
        connect_timeout: bound on reaching the rendezvous store.
        max_failures_without_progress: failed rounds in a row without a completed training
            step before giving up with NO_RESTART.
        max_recoveries: optional cap on recoveries in one process.
        timeout: process-group timeout (as ``DDPStrategy``).
        **kwargs: passed to ``DistributedDataParallel`` (as ``DDPStrategy``).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        endpoint: str | None = None,
        run_id: str | None = None,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        *,
        is_store_host: bool | None = None,
        domain_id: str | None = None,
        infra_rank: int | None = None,
        segment: int = 1,
        events_dir: str | os.PathLike | None = None,
        snapshot_every_n_steps: int | None = None,
        snapshot_every_n_seconds: float | None = 30.0,
        graceful_termination: bool = True,
        replication_factor: int = 1,
        replica_max_bytes: int = 256 * 2**20,
        hang_detection: bool = True,
        watchdog_interval: float = 0.2,
        hang_timeout_floor: float = 60.0,
        hang_safety_factor: float = 10.0,
        heartbeat_interval: float = 0.1,
        last_call_timeout: float = 0.3,
        previous_active_grace: float = 3.0,
        join_timeout: float = 600.0,
        rejoin_timeout: float = 120.0,
        init_timeout: float = 60.0,
        exit_barrier_timeout: float = 60.0,
        connect_timeout: float = 60.0,
        max_failures_without_progress: int = 2,
        max_recoveries: int | None = None,
        timeout: datetime.timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        config = resolve_launch_config(endpoint, run_id, min_nodes, max_nodes)
        for name, value in (("watchdog_interval", watchdog_interval), ("hang_timeout_floor", hang_timeout_floor), ("hang_safety_factor", hang_safety_factor),
                            ("heartbeat_interval", heartbeat_interval), ("last_call_timeout", last_call_timeout),
                            ("previous_active_grace", previous_active_grace), ("join_timeout", join_timeout),
                            ("rejoin_timeout", rejoin_timeout), ("init_timeout", init_timeout),
                            ("exit_barrier_timeout", exit_barrier_timeout), ("connect_timeout", connect_timeout)):
            check_positive(name, value)
        check_positive("segment", segment, integer=True)
        check_positive("replication_factor", replication_factor, integer=True, allow_zero=True)
        check_positive("replica_max_bytes", replica_max_bytes, integer=True, allow_zero=True)
        check_positive("max_failures_without_progress", max_failures_without_progress, integer=True,
                       allow_zero=True)
        check_positive("max_recoveries", max_recoveries, integer=True, allow_none=True, allow_zero=True)
        check_positive("snapshot_every_n_steps", snapshot_every_n_steps, integer=True, allow_none=True)
        check_positive("snapshot_every_n_seconds", snapshot_every_n_seconds, allow_none=True)
        if not isinstance(hang_detection, bool):
            raise StrategyConfigError(f"ddp_ft: hang_detection must be True or False, got {hang_detection!r}")
        if is_store_host not in (None, True, False):
            raise StrategyConfigError(f"ddp_ft: is_store_host must be True, False or None, got {is_store_host!r}")
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise StrategyConfigError(f"ddp_ft: timeout must be a datetime.timedelta, got {timeout!r}")
        domain = domain_id or os.environ.get(ENV_DOMAIN_ID) or socket.gethostname()
        self._config: LaunchConfig = config
        self._rdzv_settings = None
        if config.mode is LaunchMode.RENDEZVOUS:
            from lightning_ft.rendezvous.settings import RendezvousConfigError, RendezvousSettings

            try:
                self._rdzv_settings = RendezvousSettings(
                    run_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                    last_call_timeout=float(last_call_timeout), join_timeout=float(join_timeout),
                    previous_active_grace=float(previous_active_grace), segment=segment,
                    heartbeat_interval=float(heartbeat_interval))
            except RendezvousConfigError as exc:
                raise StrategyConfigError(f"ddp_ft: {exc}") from None
            environment: ClusterEnvironment = _RoundEnvironment(socket.gethostname())
        else:
            environment = _ElasticEnvironment()
        super().__init__(cluster_environment=environment, timeout=timeout,
                         process_group_backend=process_group_backend, **kwargs)
        self._is_store_host = is_store_host
        self._domain_id = str(domain)
        self._infra_rank = infra_rank
        self._events_dir = None if events_dir is None else os.fspath(events_dir)
        self._snapshot_every_n_steps = snapshot_every_n_steps
        self._snapshot_every_n_seconds = snapshot_every_n_seconds
        if not isinstance(graceful_termination, bool):
            raise StrategyConfigError(f"ddp_ft: graceful_termination must be a bool, got {graceful_termination!r}")
        self._graceful_termination = graceful_termination
        self.replication_factor = replication_factor
        self.replica_max_bytes = replica_max_bytes
        self.hang_detection = hang_detection
        self.watchdog_interval = float(watchdog_interval)
        self.hang_timeout_floor = float(hang_timeout_floor)
        self.hang_safety_factor = float(hang_safety_factor)
        self.rejoin_timeout = float(rejoin_timeout)
        self.init_timeout = float(init_timeout)
        self.exit_barrier_timeout = float(exit_barrier_timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_failures_without_progress = max_failures_without_progress
        self.max_recoveries = max_recoveries

        self._session: _Session | None = None
        self._timeline: ev.Timeline | None = None
        self._trainer = None
        self._round = None  # RoundResult of the round being trained
        self._was_active = False
        self._transport: GroupTransport | None = None
        self._watchdog: RoundWatchdog | None = None
        self._spare_monitor: SpareMonitor | None = None
        self._step_clock = StepClock()
        self._failure_at: float | None = None  # time.monotonic() of the last failure detection
        self._awaiting_first_step = False
        self._progress_in_round = False
        self._callbacks_attached = False
        self._replica_thread: threading.Thread | None = None
        self._replica_pending: Any = None
        self._replica_lock = threading.Lock()
        self._replica_published_step: int | None = None
        self._replica_store: Any = None
        self._replica_prefix: str | None = None
        self._domains_cache: tuple[int, list[str]] | None = None
        self._finished = False
        self._checkpoint: Any = None
        self._replicate_here = False
        _register_atexit_destroy()
        self.recoveries = 0
        #: True once this process trained in some round (False: it only ever was a hot spare)
        self.trained = False
        ensure_log_output()

    # ------------------------------------------------------------------ Lightning hooks

    @property
    def launch_mode(self) -> LaunchMode:
        return self._config.mode

    @property
    def run_id(self) -> str:
        return self._config.run_id

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if self._config.mode is LaunchMode.RENDEZVOUS or self.parallel_devices[0].type == "cpu":
            return self.parallel_devices[0]
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # DDPStrategy uses num_nodes * num_processes (the Trainer arguments); the round decides here
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        if self._config.mode is LaunchMode.TORCHELASTIC:
            self._launcher = _ElasticLauncher(self)
            return
        if self.parallel_devices is not None and len(self.parallel_devices) != 1:
            raise StrategyConfigError(
                f"ddp_ft: each process is one participant and trains on one device, but devices="
                f"{len(self.parallel_devices)} was given; pass devices=1 and start one process per device "
                "(srun --ntasks-per-node, one container per device, ...)")
        self._launcher = _FaultTolerantLauncher(self)

    def set_world_ranks(self) -> None:
        # ranks come from the round (or torchrun), never from num_nodes/devices
        rank = self.cluster_environment.global_rank() if self.cluster_environment is not None else 0
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = utils_rank_zero_only.rank = rank

    def setup_distributed(self) -> None:
        if self._config.mode is LaunchMode.TORCHELASTIC:
            before = open_sockets()
            super().setup_distributed()
            master_port = int(os.environ.get("MASTER_PORT", "0") or 0) or None
            self._transport = GroupTransport(before, open_sockets(), master_port)
            self._after_group_formed(cycle=self._cycle())
            return
        result = self._round
        if result is None:
            raise RuntimeError("ddp_ft: setup_distributed ran outside the strategy's launcher")
        reset_seed()
        self._environment.assign(result.rank, result.world_size)
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        _destroy_group()  # a stale group from an earlier round or fit()
        session = self._session
        start = time.perf_counter()
        before = open_sockets()
        timeout = datetime.timedelta(seconds=self.init_timeout)
        if self._timeout is not None:
            timeout = min(timeout, self._timeout)
        dist.init_process_group(self._process_group_backend, rank=result.rank, world_size=result.world_size,
                                store=dist.PrefixStore(f"{result.store_prefix}/pg", session.store),
                                timeout=timeout)
        if self._timeout is not None and self._timeout != timeout:
            dist.distributed_c10d._set_pg_timeout(self._timeout)
        store_port = getattr(session.store, "port", None)
        self._transport = GroupTransport(before, open_sockets(), store_port)
        seconds = time.perf_counter() - start
        self._emit(ev.GROUP_FORMED, cycle=result.cycle_id, rank=result.rank, world=result.world_size,
                   seconds=round(seconds, 4))
        log.info("ddp_ft: round %d: process group up as rank %d of %d in %.3fs (%s)", result.cycle_id,
                 result.rank, result.world_size, seconds, self._process_group_backend)
        round_store = dist.PrefixStore(result.store_prefix, session.store)
        round_store.set(member_key(result.rank), encode_member(session.participant.participant_id, self._domain_id))
        self._after_group_formed(cycle=result.cycle_id)
        self._start_watchdog(result)

    @property
    def _environment(self) -> _RoundEnvironment:
        assert isinstance(self.cluster_environment, _RoundEnvironment)
        return self.cluster_environment

    def _after_group_formed(self, cycle: int) -> None:
        checkpoint = _find_emergency_checkpoint(self._trainer)
        if checkpoint is None:
            return
        from lightning_ft.checkpoint.store import SnapshotStore

        store = SnapshotStore(checkpoint.root, checkpoint.run_id, self.global_rank, checkpoint.keep_last)
        try:
            exchange_snapshots(store, self.global_rank, self.world_size,
                               lambda event, **f: self._emit(event, cycle=cycle, **f))
        finally:
            store.close()
        if self._failure_at is not None and not getattr(checkpoint, "auto_resume", True):
            log.info("ddp_ft: turning on EmergencyCheckpoint auto-resume to continue after the failure")
            checkpoint.auto_resume = True

    def _break_group(self) -> None:
        """Fail every pending collective of the current group, and retire the group.

        The group object is kept alive (``_BROKEN_GROUPS``), not destroyed. Why: when the
        last reference to a ``ProcessGroupGloo`` goes -- normally when Lightning's teardown
        unwraps ``DistributedDataParallel`` and drops its reducer -- its destructor joins the
        gloo worker threads while holding the GIL, and a worker thread still finishing a
        failed all-reduce needs the GIL to free it: a deadlock (seen under torchrun, gdb:
        ``~ProcessGroupGloo`` -> ``thread::join`` vs ``~AsyncAllreduceWork`` -> ``take_gil``).
        Kept alive, it is destroyed at interpreter exit, long after its threads went idle.
        """
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()
        try:
            if dist.is_available() and dist.is_initialized():
                _BROKEN_GROUPS.append(dist.distributed_c10d._get_default_group())
        except (RuntimeError, ValueError):
            pass
        _destroy_group()

    def teardown(self) -> None:
        super().teardown()

    # ------------------------------------------------------------------ progress
    # Strategy hooks, not a callback: Lightning dispatches every hook of a step to every
    # callback (profiler context, state key), which costs more than these few lines.

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._trainer
        self._step_clock = StepClock()
        if self._watchdog is not None:
            self._watchdog.clock = self._step_clock
        step = trainer.global_step
        if self._failure_at is not None or step > 0:
            self._emit(ev.RESTORED, cycle=self._cycle(), step=step)
        self._awaiting_first_step = self._failure_at is not None
        self._checkpoint = _find_emergency_checkpoint(trainer)
        # rank 0 publishes copies for hot spares; decided once per run, not per step
        self._replicate_here = bool(self.replication_factor and self._checkpoint is not None
                                    and self._config.mode is LaunchMode.RENDEZVOUS and self.global_rank == 0)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._step_clock.started(time.monotonic())

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # forward, backward (with its all-reduce) and the update are done: the step completed
        self._step_clock.finished(time.monotonic())
        self._progress_in_round = True
        if self._awaiting_first_step:
            self._awaiting_first_step = False
            # Lightning counts the optimizer step as completed only after this returns
            step = self._trainer.global_step + 1
            since = time.monotonic() - self._failure_at if self._failure_at is not None else None
            self._emit(ev.FIRST_STEP_AFTER_RECOVERY, cycle=self._cycle(), step=step,
                       seconds_since_failure=None if since is None else round(since, 4))
            log.info("ddp_ft: first step after recovery completed (step %d, %.3fs after the failure)",
                     step, since or 0.0)
        if self._replicate_here:
            self._maybe_publish_replica()
        return output

    def _cycle(self) -> int | None:
        if self._config.mode is LaunchMode.TORCHELASTIC:
            return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)  # torchrun's worker-group restarts
        return None if self._round is None else self._round.cycle_id

    # ------------------------------------------------------------------ the launcher's loop

    def _launch(self, function: Callable, args: tuple, kwargs: dict, trainer) -> Any:
        stage = getattr(getattr(trainer, "state", None), "fn", None)
        if stage is not None and stage.value != "fit":
            raise StrategyConfigError(
                f"ddp_ft: trainer.{stage.value}() is not supported; ddp_ft runs fit() only (its process group "
                "and rendezvous end with fit). Evaluate with another Trainer, e.g. Trainer(devices=1) on the "
                "fitted model or a checkpoint, or strategy='ddp' under torchrun")
        if self._finished:
            raise StrategyConfigError(
                f"ddp_ft: run {self.run_id!r} already ended in this process; a FaultTolerantDDPStrategy "
                "runs one fit() per run_id (use a new run_id, and a new Trainer, for another fit)")
        self._trainer = trainer
        session = self._ensure_session()
        self._attach_callbacks(trainer)
        failures_without_progress = 0
        while True:
            result = self._join_round(session)
            if result is None:
                self._finished = True
                return None  # a spare that was not needed (or the job ended): leave fit() cleanly
            self._round = result
            self._was_active = self.trained = True
            self._progress_in_round = False
            try:
                output = function(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - every exception is classified below
                failures_without_progress = 1 if self._progress_in_round else failures_without_progress + 1
                self._handle_failure(exc, trainer, failures_without_progress)
                continue  # recovered: re-form the group and run fit again
            self._finished = True
            self._finish_success(result, trainer)
            return output

    def _ensure_session(self) -> _Session:
        if self._session is not None:
            return self._session
        from lightning_ft.rendezvous.barrier import BarrierRendezvous
        from lightning_ft.rendezvous.handler import connect_store
        from lightning_ft.rendezvous.keys import StoreKeys
        from lightning_ft.rendezvous.participant import local_participant

        config = self._config
        try:
            store, hosting = connect_store(config.host, config.port, self._is_store_host, self.connect_timeout)
        except RendezvousError as exc:
            self._no_restart(f"cannot reach the rendezvous store: {exc}", cause=exc)
        participant = local_participant(domain_id=self._domain_id, infra_rank=self._infra_rank)
        rendezvous = BarrierRendezvous(store, self._rdzv_settings, participant, is_store_host=hosting,
                                       heartbeat_store_factory=store.clone)
        self._session = _Session(store, rendezvous, participant, StoreKeys(config.run_id), hosting)
        self._timeline = ev.Timeline(participant.participant_id, self._events_dir)
        self._emit(ev.JOIN, participant=participant.participant_id, domain=self._domain_id,
                   endpoint=config.endpoint, run_id=config.run_id, min_nodes=config.min_nodes,
                   max_nodes=config.max_nodes, store_host=hosting)
        log.info("ddp_ft: participant %s (domain %s) joins run %s at %s (nodes %d:%d)%s",
                 participant.participant_id, self._domain_id, config.run_id, config.endpoint, config.min_nodes,
                 config.max_nodes, "; hosting the store" if hosting else "")
        return self._session

    def _attach_callbacks(self, trainer) -> None:
        if self._callbacks_attached or trainer is None:
            return
        self._callbacks_attached = True
        if _find_emergency_checkpoint(trainer) is None:
            from lightning_ft.checkpoint.callback import EmergencyCheckpoint

            trainer.callbacks.append(EmergencyCheckpoint(every_n_steps=self._snapshot_every_n_steps,
                                                         every_n_seconds=self._snapshot_every_n_seconds,
                                                         run_id=self._config.run_id))
            log.info("ddp_ft: added EmergencyCheckpoint(every_n_steps=%s, every_n_seconds=%s) for recovery",
                     self._snapshot_every_n_steps, self._snapshot_every_n_seconds)
        if self._graceful_termination and not _graceful_terminations(trainer):
            from lightning_ft.termination.callback import GracefulTermination

            trainer.callbacks.append(GracefulTermination())
            log.info("ddp_ft: added GracefulTermination() for the SIGTERM path")

    def _join_round(self, session: _Session):
        """Block until active in a round; ``None`` when this process should leave fit() cleanly."""
        rendezvous = session.rendezvous
        if self._was_active:
            # rounds after a failure must form promptly; the first may wait for slow launches
            rendezvous.settings = rendezvous.settings.replace(join_timeout=self.rejoin_timeout)
        previous_handler = _install_sigterm_raiser()
        monitor = self._start_spare_monitor(session)
        try:
            while True:
                result = rendezvous.join_round()
                self._emit(ev.ROUND_COMPLETE, cycle=result.cycle_id, rank=result.rank, world=result.world_size,
                           standby=not result.is_active)
                if result.is_active:
                    return result
                rendezvous.wait_while_standby(result.cycle_id)
        except RendezvousGracefulExitError as exc:
            return self._rendezvous_ended(str(exc), timed_out=False)
        except RendezvousClosedError as exc:
            return self._rendezvous_ended(str(exc), timed_out=False)
        except RendezvousTimeoutError as exc:
            return self._rendezvous_ended(str(exc), timed_out=True)
        except _SpareTerminated:
            rendezvous.withdraw("SIGTERM while waiting in the rendezvous")
            rendezvous.shutdown(job_finished=False)
            self._emit(ev.SPARE_EXIT, reason="SIGTERM while waiting in the rendezvous")
            if self._was_active:
                raise SystemExit(128 + signal.SIGTERM) from None
            log.info("ddp_ft: SIGTERM while waiting as a hot spare; leaving fit()")
            self._become_spare_exit()
            return None
        except (RuntimeError, OSError) as exc:  # the store itself (DistStoreError is a RuntimeError)
            self._no_restart(f"lost the rendezvous store at {self._config.endpoint}: {type(exc).__name__}: {exc}",
                             cause=exc)
        except RendezvousError as exc:  # extra participant, unhealthy
            from lightning_ft.rendezvous.barrier import ParticipantExcludedError

            if isinstance(exc, ParticipantExcludedError) and not self._was_active:
                log.error("ddp_ft: %s", exc)
                self._emit(ev.SPARE_EXIT, reason=str(exc))
                self._become_spare_exit()
                return None
            self._no_restart(f"rendezvous failed: {exc}", cause=exc)
        finally:
            _restore_sigterm(previous_handler)  # first: a SIGTERM from here on is the caller's to handle
            if monitor is not None:
                monitor.stop()

    def _rendezvous_ended(self, reason: str, timed_out: bool):
        rendezvous = self._session.rendezvous
        closed = None
        if not timed_out:
            try:
                closed = rendezvous.closed_reason()
            except (RuntimeError, OSError):
                closed = None
        action = decide_on_rendezvous_end(self._was_active, closed or reason, timed_out)
        if action is EndAction.RETURN:
            rendezvous.shutdown(job_finished=False)
            self._emit(ev.SPARE_EXIT, reason=closed or reason)
            log.info("ddp_ft: leaving fit() (%s): %s", "job over" if self._was_active else "hot spare not needed",
                     closed or reason)
            self._become_spare_exit()
            return None
        if closed is not None and not closed.startswith(JOB_FAILED_REASON) and "min_nodes" in closed:
            message = f"no hot spare left to replace the lost participant(s): {closed}"
        else:
            message = f"the job cannot go on: {closed or reason}"
        self._no_restart(message)

    def _become_spare_exit(self) -> None:
        # after fit() returns on a process that is not (or no longer) training, it must not act as rank 0
        if isinstance(self.cluster_environment, _RoundEnvironment):
            self._environment.assign(-1, self._environment.world_size())
        self.set_world_ranks()
        if self._trainer is not None:
            from lightning.pytorch.trainer.states import TrainerStatus

            self._trainer.state.status = TrainerStatus.FINISHED
            self._trainer.state.stage = None
        _destroy_group()

    def _start_spare_monitor(self, session: _Session) -> SpareMonitor | None:
        checkpoint = _find_emergency_checkpoint(self._trainer)

        def save_replica(blob: bytes) -> int | None:
            if checkpoint is None:
                return None
            from lightning_ft.checkpoint.store import SnapshotStore

            with SnapshotStore(checkpoint.root, checkpoint.run_id, 0, checkpoint.keep_last) as store:
                return store.write_bytes(blob).step

        monitor = SpareMonitor(
            rdzv_store=session.store.clone(), keys=session.keys, participant_id=session.participant.participant_id,
            domain_id=self._domain_id, replication_factor=self.replication_factor,
            dead_after=session.rendezvous.settings.dead_after, save_replica=save_replica,
            on_replica=lambda step, nbytes: self._emit(ev.REPLICA_RECEIVED, step=step, bytes=nbytes),
            open_round=lambda cycle, reason: self._open_round(session, cycle, reason))
        monitor.start()
        return monitor

    def _open_round(self, session: _Session, failed_cycle: int, reason: str) -> int:
        new = session.rendezvous.open_next_round(failed_cycle, reason)
        self._emit(ev.ROUND_OPEN, cycle=new, after=failed_cycle, reason=reason)
        return new

    # ------------------------------------------------------------------ failure handling

    def _handle_failure(self, exc: BaseException, trainer, failures_without_progress: int) -> None:
        """Recover in place (return), or raise what ends fit()."""
        now = time.monotonic()
        result = self._round
        session = self._session
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()
        facts = self._failure_facts(exc, watchdog)
        kind = classify_failure(facts)
        detector = watchdog.triggered[0] if watchdog is not None and watchdog.triggered else "collective"
        step = trainer.global_step if trainer is not None else None
        if kind in (FailureKind.STOP, FailureKind.LOCAL_ERROR):
            self._end_on_exception(kind, exc, result)
            raise exc  # Lightning runs on_exception hooks and its teardown, as for any error
        self._failure_at = now
        error_text = f"{type(exc).__name__}: {_first_line(exc)}"
        if detector != "hang":  # the hang detector reported it already, when it fired
            self._emit(ev.FAILURE_DETECTED, cycle=result.cycle_id, step=step, error=error_text, detector=detector,
                       stalled=[])
        log.warning("ddp_ft: round %d failed at step %s (%s, detected by %s): %s", result.cycle_id, step, kind.value,
                    detector, error_text)
        self._break_group()  # nothing may wait on the broken group from here on (see _break_group)
        # callbacks learn about the interruption as Lightning would tell them (GracefulTermination
        # decides here whether a peer's failure is part of a termination in progress)
        _call_on_exception(trainer, exc)
        if _termination_in_progress(trainer):
            self._close(f"{JOB_STOPPED_REASON}: a termination is in progress (SIGTERM path)")
            self._emit(ev.STOPPED, cycle=result.cycle_id, reason="termination in progress during a peer failure")
            self._stop_threads()
            session.rendezvous.shutdown(job_finished=False)
            _destroy_group()
            raise exc
        decision = decide_recovery(kind, failures_without_progress, self.max_failures_without_progress,
                                   self.recoveries, self.max_recoveries)
        self._emit(ev.DECISION, cycle=result.cycle_id, kind=kind.value, action=decision.action.value,
                   reason=decision.reason)
        if decision.action is not RecoveryAction.RECOVER:
            peer = f" ({facts.peer_error})" if facts.peer_error else ""
            self._teardown_after_failure(trainer)
            self._no_restart(f"{decision.reason}{peer}", cause=exc, close=True)
        self._teardown_after_failure(trainer)
        from lightning_ft.strategy.trainer_reset import reset_trainer_for_rerun

        reset_trainer_for_rerun(trainer)
        self.recoveries += 1
        self._open_round(session, result.cycle_id, f"{kind.value} in round {result.cycle_id}: {error_text}")

    def _failure_facts(self, exc: BaseException, watchdog: RoundWatchdog | None) -> FailureFacts:
        chain = _exception_chain(exc)
        hang = watchdog is not None and watchdog.triggered is not None and watchdog.triggered[0] == "hang"
        transport_broken = self._transport is not None and self._transport.aborted
        peer_error = newer = None
        result, session = self._round, self._session
        try:
            round_store = dist.PrefixStore(result.store_prefix, session.store)
            for rank in range(result.world_size):
                if rank != result.rank and round_store.check([failed_key(rank)]):
                    peer_error = f"rank {rank}: {round_store.get(failed_key(rank)).decode()}"
                    break
            closed = session.rendezvous.closed_reason()
            if peer_error is None and closed is not None and closed.startswith(JOB_FAILED_REASON):
                peer_error = closed
            newer = session.rendezvous.current_cycle() > result.cycle_id
        except (RuntimeError, OSError) as store_error:
            log.warning("ddp_ft: cannot read the rendezvous store while classifying a failure: %s", store_error)
        return FailureFacts(
            exception_type=type(exc).__name__,
            is_collective_error=looks_like_collective_error(chain) or transport_broken,
            is_stop=isinstance(exc, (SystemExit, KeyboardInterrupt)),
            peer_error=peer_error, newer_round=bool(newer), hang_detected=hang,
            peer_gone=looks_like_peer_gone(chain) and not transport_broken)

    def _end_on_exception(self, kind: FailureKind, exc: BaseException, result) -> None:
        """Tell the others this job is over (spares leave, peers do not mistake it for a lost node)."""
        cycle = result.cycle_id if result is not None else None
        text = f"{type(exc).__name__}: {_first_line(exc)}"
        try:
            if kind is FailureKind.LOCAL_ERROR and result is not None:
                dist.PrefixStore(result.store_prefix, self._session.store).set(failed_key(result.rank), text)
                reason = f"{JOB_FAILED_REASON}: rank {result.rank} raised {text}"
                self._emit(ev.DECISION, cycle=cycle, kind=kind.value, action="raise", reason=reason)
            else:
                reason = f"{JOB_STOPPED_REASON}: {text}"
                self._emit(ev.STOPPED, cycle=cycle, reason=reason)
            self._close(reason)
        except (RuntimeError, OSError) as store_error:
            log.warning("ddp_ft: could not tell the rendezvous that the job ended: %s", store_error)
        self._stop_threads()
        self._session.rendezvous.shutdown(job_finished=False)
        log.info("ddp_ft: %s; not recovering (%s)", text, kind.value)

    def _teardown_after_failure(self, trainer) -> None:
        # what Lightning's _call_and_handle_interrupt does after on_exception, minus re-raising;
        # bounded: a teardown stuck on the broken group would leave this process alive but useless
        guard = _Deadline(self.init_timeout, "teardown after a failure")
        try:
            trainer._teardown()
        except Exception as exc:  # noqa: BLE001 - a broken group may make parts of teardown fail
            log.warning("ddp_ft: teardown after the failure raised %s: %s", type(exc).__name__, exc)
        finally:
            guard.cancel()
        trainer.state.stage = None
        self._break_group()

    def _close(self, reason: str) -> None:
        if self._session is not None:
            try:
                self._session.rendezvous.close_for_good(reason)
            except (RuntimeError, OSError) as exc:
                log.warning("ddp_ft: could not close the rendezvous: %s", exc)

    def _no_restart(self, message: str, cause: BaseException | None = None, close: bool = False) -> None:
        if close:
            self._close(f"{JOB_FAILED_REASON}: {message}")
        self._emit(ev.NO_RESTART, cycle=self._cycle(), reason=message)
        log.error("ddp_ft: giving up with exit code %d (NO_RESTART): %s", int(ExitCode.NO_RESTART), message)
        print(f"lightning_ft: NO_RESTART ({int(ExitCode.NO_RESTART)}): {message}", file=sys.stderr, flush=True)
        self._stop_threads()
        if self._session is not None:
            self._session.rendezvous.shutdown(job_finished=False)
        _destroy_group()
        error = NoRestartError(message)
        if cause is not None:
            raise error from cause
        raise error

    # ------------------------------------------------------------------ success

    def _finish_success(self, result, trainer) -> None:
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
        from torch.distributed.elastic.utils import store as store_util

        self._stop_threads()
        session = self._session
        start = time.monotonic()
        round_store = dist.PrefixStore(result.store_prefix, session.store)
        try:
            # torch's elastic exit barrier, same keys and semantics as the agent's: spares
            # watching keys.exit_barrier(cycle) see that this round's actives finished
            store_util.barrier(round_store, result.world_size, key_prefix=_TERMINAL_STATE_SYNC_ID,
                               barrier_timeout=self.exit_barrier_timeout)
        except Exception as exc:  # noqa: BLE001 - our work is done; a peer lost at the very end is no reason to fail
            log.warning("ddp_ft: exit barrier of round %d did not complete within %.0fs (%s); finishing anyway",
                        result.cycle_id, self.exit_barrier_timeout, exc)
        step = trainer.global_step if trainer is not None else None
        self._emit(ev.FINISHED, cycle=result.cycle_id, rank=result.rank, step=step,
                   seconds=round(time.monotonic() - start, 4))
        session.rendezvous.shutdown(job_finished=True,
                                    reason=f"{JOB_FINISHED_REASON}: round {result.cycle_id} completed fit()")
        _destroy_group()
        log.info("ddp_ft: fit() finished in round %d as rank %d at step %s", result.cycle_id, result.rank, step)

    def _stop_threads(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()
        thread = self._replica_thread
        if thread is not None:
            thread.join(timeout=5.0)

    # ------------------------------------------------------------------ watchdog

    def _start_watchdog(self, result) -> None:
        session = self._session
        clone = session.store.clone()
        keys = session.keys

        def on_trigger(detector: str, reason: str, stalled: tuple[int, ...]) -> None:
            if detector == "hang":
                # the trainer's step, not the clock's (it restarts with every round); and how long
                # the step had been stuck, which the report counts as lost time
                trainer, began = self._trainer, self._step_clock.in_flight_since
                self._emit(ev.FAILURE_DETECTED, cycle=result.cycle_id,
                           step=trainer.global_step if trainer is not None else None, error=reason,
                           detector="hang", stalled=list(stalled),
                           stuck_seconds=None if began is None else round(time.monotonic() - began, 3))
            opened = int(clone.compare_set(keys.cycle, str(result.cycle_id), str(result.cycle_id + 1)))
            if detector == "hang" and opened == result.cycle_id + 1:
                self._emit(ev.ROUND_OPEN, cycle=result.cycle_id + 1, after=result.cycle_id, reason=reason)

        transport = self._transport
        self._watchdog = RoundWatchdog(
            round_store=dist.PrefixStore(result.store_prefix, clone), rdzv_store=clone, cycle_key=keys.cycle,
            heartbeat_key=keys.heartbeat, cycle=result.cycle_id, rank=result.rank, world_size=result.world_size,
            clock=self._step_clock, hang_detection=self.hang_detection, hang_floor=self.hang_timeout_floor,
            hang_factor=self.hang_safety_factor, dead_after=session.rendezvous.settings.dead_after,
            on_trigger=on_trigger, break_group=transport.abort if transport is not None else (lambda: 0),
            poll_interval=self.watchdog_interval)
        self._watchdog.start()

    # ------------------------------------------------------------------ replication

    def _maybe_publish_replica(self) -> None:
        info = getattr(self._checkpoint, "last_snapshot", None)
        if info is None or info.step == self._replica_published_step:
            return
        self._replica_published_step = info.step
        domains = self._round_domains()
        if not replica_needed(domains, self.replication_factor):
            return
        if info.nbytes > self.replica_max_bytes:
            log.warning("ddp_ft: snapshot of step %d (%d bytes) exceeds replica_max_bytes=%d; not replicated",
                        info.step, info.nbytes, self.replica_max_bytes)
            return
        with self._replica_lock:
            self._replica_pending = (info, domains, self._round)
            if self._replica_thread is None:  # the publisher clears it under this lock when it leaves
                self._replica_thread = threading.Thread(target=self._publish_replicas, daemon=True,
                                                        name="lightning_ft-replica")
                self._replica_thread.start()

    def _round_domains(self) -> list[str]:
        result, session = self._round, self._session
        cached = self._domains_cache
        if cached is not None and cached[0] == result.cycle_id:
            return cached[1]
        round_store = dist.PrefixStore(result.store_prefix, session.store)
        domains = []
        for rank in range(result.world_size):
            raw = round_store.get(member_key(rank)).decode()
            domains.append(raw.partition(_SEP)[2])
        self._domains_cache = (result.cycle_id, domains)
        return domains

    def _publish_replicas(self) -> None:
        if self._replica_store is None:  # one connection for all publications: new ones can be slow
            try:
                self._replica_store = self._session.store.clone()
            except (RuntimeError, OSError) as exc:
                log.warning("ddp_ft: cannot connect to publish a replica: %s", exc)
                with self._replica_lock:
                    self._replica_thread = None
                return
        store = self._replica_store
        while True:
            with self._replica_lock:
                pending, self._replica_pending = self._replica_pending, None
                if pending is None:
                    self._replica_thread = None
                    return
            info, domains, result = pending
            try:
                blob = _read_snapshot_file(info.path)
            except Exception as exc:  # noqa: BLE001 - recycled by a newer snapshot while we read: skip it
                log.debug("ddp_ft: replica of step %d skipped: %s", info.step, exc)
                continue
            prefix = result.store_prefix
            if self._replica_prefix is not None and self._replica_prefix != prefix:
                try:
                    store.delete_key(f"{self._replica_prefix}/{REPLICA_BLOB_KEY}")
                except (RuntimeError, OSError):
                    pass
            self._replica_prefix = prefix
            try:
                store.set(f"{prefix}/{REPLICA_BLOB_KEY}", blob)
                store.set(f"{prefix}/{REPLICA_META_KEY}", f"{info.step}{_SEP}{','.join(domains)}")
            except (RuntimeError, OSError) as exc:  # the store went away: the main thread will see it too
                log.warning("ddp_ft: replica of step %d not published: %s", info.step, exc)
                continue
            self._emit(ev.REPLICA_PUBLISHED, cycle=result.cycle_id, step=info.step, bytes=len(blob))

    # ------------------------------------------------------------------ misc

    def _emit(self, event: str, **fields: Any) -> None:
        if self._timeline is not None:
            self._timeline.emit(event, **fields)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(STRATEGY_NAME, cls, description=cls.__doc__.splitlines()[0])


def register_strategy() -> None:
    """Make ``Trainer(strategy="ddp_ft")`` resolve to :class:`FaultTolerantDDPStrategy` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    FaultTolerantDDPStrategy.register_strategies(StrategyRegistry)


# ---------------------------------------------------------------------------- helpers


class _Deadline:
    """Ends the process (exit 1) if ``cancel()`` is not called within ``seconds``."""

    def __init__(self, seconds: float, what: str) -> None:
        self._done = threading.Event()
        self._what = what
        self._seconds = seconds
        threading.Thread(target=self._run, name="lightning_ft-deadline", daemon=True).start()

    def _run(self) -> None:
        if not self._done.wait(self._seconds):
            log.error("ddp_ft: %s did not finish within %.0fs; exiting (exit 1) so the others see this "
                      "participant gone", self._what, self._seconds)
            from lightning_ft.termination.exit import exit_now

            exit_now(1)

    def cancel(self) -> None:
        self._done.set()


_atexit_registered = False
#: process groups broken by a failure, kept until interpreter exit (see _break_group)
_BROKEN_GROUPS: list = []


def _register_atexit_destroy() -> None:
    global _atexit_registered
    if not _atexit_registered:
        import atexit

        atexit.register(_destroy_group)
        _atexit_registered = True


def _destroy_group() -> None:
    """Destroy the default group if there is one (Lightning never does for gloo, and gloo's
    threads alive at interpreter exit abort about 1 run in 15)."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may refuse; nothing else to do
        log.debug("destroy_process_group: %s", exc)


def _read_snapshot_file(path: str) -> bytes:
    from lightning_ft.checkpoint import snapshot_format as fmt

    with open(path, "rb") as f:
        blob = f.read()
    fmt.verify(blob, len(blob))  # a file recycled for a newer snapshot while we read fails here
    return blob


def _find_emergency_checkpoint(trainer) -> Any | None:
    if trainer is None:
        return None
    for callback in trainer.callbacks:
        if all(hasattr(callback, name) for name in ("save_now", "root", "run_id", "keep_last")):
            return callback
    return None


def _call_on_exception(trainer, exc: BaseException) -> None:
    for callback in list(trainer.callbacks):
        try:
            callback.on_exception(trainer, trainer.lightning_module, exc)
        except Exception as hook_error:  # noqa: BLE001 - one callback must not stop the recovery
            log.warning("ddp_ft: %s.on_exception raised %s: %s", type(callback).__name__,
                        type(hook_error).__name__, hook_error)


def _termination_in_progress(trainer) -> bool:
    # a termination decided the exit (possibly already torn down its callback), or one is running
    exit_module = sys.modules.get("lightning_ft.termination.exit")
    if exit_module is not None and exit_module.planned_exit_code() is not None:
        return True
    return any(cb.termination_in_progress for cb in _graceful_terminations(trainer))


def _graceful_terminations(trainer) -> list[Any]:
    # by what they offer, as _find_emergency_checkpoint: no import of the termination package here
    return [cb for cb in trainer.callbacks if hasattr(cb, "termination_in_progress")]


def _exception_chain(exc: BaseException) -> list[tuple[str, str]]:
    chain, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(chain) < 10:
        seen.add(id(current))
        chain.append((type(current).__name__, str(current)))
        current = current.__cause__ or current.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:300]


def _install_sigterm_raiser():
    if threading.current_thread() is not threading.main_thread():
        return None

    def raise_in_main(signum, frame):
        raise _SpareTerminated()

    try:
        return signal.signal(signal.SIGTERM, raise_in_main)
    except (ValueError, OSError):
        return None


def _restore_sigterm(previous) -> None:
    if previous is None:
        return
    try:
        signal.signal(signal.SIGTERM, previous)
    except (ValueError, OSError, TypeError):
        pass


# Importing this module loads lightning.pytorch.strategies; when that was the first import of
# it, lightning_ft's import hook ran while this module was half-initialized and could not
# register. Registering here covers every import order (it is idempotent).
register_strategy()
