"""The ``ddp_ft`` strategy's settings: one frozen, validated object, checked before anything starts.

Where each value comes from: explicit constructor arguments, else ``LIGHTNING_FT_ENDPOINT`` /
``LIGHTNING_FT_RUN_ID`` / ``LIGHTNING_FT_NNODES`` / ``LIGHTNING_FT_DOMAIN_ID``; under ``torchrun``
(``TORCHELASTIC_RUN_ID`` set) torchrun's agent owns the rendezvous and the rendezvous
settings must not be given. Every error names the setting.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

from lightning_ft._validation import require, require_bool, require_number
from lightning_ft.checkpoint.tiers import DEFAULT_SNAPSHOT_OVERHEAD
from lightning_ft.rendezvous.settings import RendezvousConfigError, RendezvousSettings, RendezvousTimeouts
from lightning_ft.rendezvous.store import STORE_OP_TIMEOUT, Endpoint, parse_endpoint
from lightning_ft.schema.signing import SecretError, read_secret
from lightning_ft.strategy.decisions import merge_setting, parse_nnodes

ENV_ENDPOINT = "LIGHTNING_FT_ENDPOINT"
ENV_RUN_ID = "LIGHTNING_FT_RUN_ID"
ENV_NNODES = "LIGHTNING_FT_NNODES"
ENV_DOMAIN_ID = "LIGHTNING_FT_DOMAIN_ID"
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"

_PREFIX = "ddp_ft: "


class StrategyConfigError(ValueError):
    """A ``ddp_ft`` setting is missing, invalid or contradicts another; the message names it."""


class LaunchMode(enum.Enum):
    #: the strategy runs the barrier rendezvous itself (srun, JobSet, plain ``python``)
    RENDEZVOUS = "rendezvous"
    #: torchrun's elastic agent did the rendezvous and restarts workers
    TORCHELASTIC = "torchelastic"


@dataclass(frozen=True)
class LaunchConfig:
    """Who launched this process and where the rendezvous is."""

    mode: LaunchMode
    run_id: str
    endpoint: Endpoint | None = None
    min_nodes: int | None = None
    max_nodes: int | None = None

    @property
    def host(self) -> str | None:
        return None if self.endpoint is None else self.endpoint.host

    @property
    def port(self) -> int | None:
        return None if self.endpoint is None else self.endpoint.port


#: the rendezvous timing of a ddp_ft job (its defaults differ from torchrun's: a training
#: process, not an agent, waits, and a failure should be replaced promptly)
DEFAULT_RENDEZVOUS_TIMEOUTS = RendezvousTimeouts(join_timeout=600.0, rejoin_timeout=120.0, last_call_timeout=0.3,
                                                 previous_active_grace=3.0, heartbeat_interval=0.1)


@dataclass(frozen=True)
class StrategyTimeouts:
    """Every bounded wait of the strategy, in seconds: the rendezvous's, and three of its own."""

    rendezvous: RendezvousTimeouts = DEFAULT_RENDEZVOUS_TIMEOUTS
    #: bound on building the process group of a round (and on the teardown after a failure)
    init_timeout: float = 60.0
    #: bound on waiting for the other actives at the end
    exit_barrier_timeout: float = 60.0
    #: bound on reaching the rendezvous store
    connect_timeout: float = 60.0
    #: bound on any one store call once connected (a frozen store host never answers)
    store_timeout: float = STORE_OP_TIMEOUT


@dataclass(frozen=True)
class HangSettings:
    """When a step counts as hung (see :func:`~lightning_ft.strategy.decisions.hang_timeout`)."""

    enabled: bool = True
    floor: float = 60.0
    safety_factor: float = 10.0
    #: how often the round watchdog publishes progress and checks (seconds)
    watchdog_interval: float = 0.2


@dataclass(frozen=True)
class StrategySettings:
    """Everything ``FaultTolerantDDPStrategy`` was configured with, validated."""

    launch: LaunchConfig
    domain_id: str
    is_store_host: bool | None = None
    infra_rank: int | None = None
    segment: int = 1
    events_dir: str | None = None
    snapshot_every_n_steps: int | None = None
    snapshot_every_n_seconds: float | None = None
    snapshot_max_overhead: float | None = DEFAULT_SNAPSHOT_OVERHEAD
    graceful_termination: bool = True
    replication_factor: int = 1
    replica_max_bytes: int = 256 * 2**20
    max_failures_without_progress: int = 2
    max_recoveries: int | None = None
    #: the process group's timeout (as ``DDPStrategy(timeout=...)``)
    pg_timeout: datetime.timedelta | None = None
    hang: HangSettings = field(default_factory=HangSettings)
    timeouts: StrategyTimeouts = field(default_factory=StrategyTimeouts)

    @property
    def run_id(self) -> str:
        return self.launch.run_id

    @property
    def mode(self) -> LaunchMode:
        return self.launch.mode

    def rendezvous(self) -> RendezvousSettings:
        """The barrier rendezvous settings (rendezvous mode only)."""
        launch = self.launch
        try:
            return RendezvousSettings(run_id=launch.run_id, min_nodes=launch.min_nodes, max_nodes=launch.max_nodes,
                                      segment=self.segment, timeouts=self.timeouts.rendezvous)
        except RendezvousConfigError as exc:
            raise StrategyConfigError(f"{_PREFIX}{exc}") from None


_OWN_DURATIONS = ("init_timeout", "exit_barrier_timeout", "connect_timeout", "store_timeout")


def resolve_settings(*, endpoint: str | None, run_id: str | None, min_nodes: int | None, max_nodes: int | None,
                     domain_id: str | None, is_store_host: bool | None, infra_rank: int | None, segment: int,
                     events_dir: Any, snapshot_every_n_steps: int | None, snapshot_every_n_seconds: float | None,
                     snapshot_max_overhead: float | None,
                     graceful_termination: bool, replication_factor: int, replica_max_bytes: int,
                     hang_detection: bool, hang_timeout_floor: float, hang_safety_factor: float,
                     watchdog_interval: float, max_failures_without_progress: int, max_recoveries: int | None,
                     timeout: datetime.timedelta | None, env: Mapping[str, str] | None = None,
                     **durations: float) -> StrategySettings:
    """Check every argument and combine arguments and environment; raise StrategyConfigError naming the setting."""
    env = os.environ if env is None else env
    launch = resolve_launch_config(endpoint, run_id, min_nodes, max_nodes, env)
    try:
        read_secret(env)  # an unusable secret is a configuration error now, not a traceback at fit()
    except SecretError as exc:
        raise StrategyConfigError(f"{_PREFIX}{exc}") from None
    for name, value in (("watchdog_interval", watchdog_interval), ("hang_timeout_floor", hang_timeout_floor),
                        ("hang_safety_factor", hang_safety_factor), *durations.items()):
        _number(name, value)
    _number("segment", segment, integer=True)
    for name, value in (("replication_factor", replication_factor), ("replica_max_bytes", replica_max_bytes),
                        ("max_failures_without_progress", max_failures_without_progress)):
        _number(name, value, integer=True, inclusive=True)
    _number("max_recoveries", max_recoveries, integer=True, inclusive=True, allow_none=True)
    _number("snapshot_every_n_steps", snapshot_every_n_steps, integer=True, allow_none=True)
    _number("snapshot_every_n_seconds", snapshot_every_n_seconds, allow_none=True)
    _number("snapshot_max_overhead", snapshot_max_overhead, allow_none=True)
    for name, value in (("hang_detection", hang_detection), ("graceful_termination", graceful_termination)):
        require_bool(name, value, error=StrategyConfigError, prefix=_PREFIX)
    require(is_store_host in (None, True, False), "is_store_host", "True, False or None", is_store_host,
            error=StrategyConfigError, prefix=_PREFIX)
    require(timeout is None or isinstance(timeout, datetime.timedelta), "timeout", "a datetime.timedelta", timeout,
            error=StrategyConfigError, prefix=_PREFIX)
    settings = StrategySettings(
        launch=launch, domain_id=str(domain_id or env.get(ENV_DOMAIN_ID) or socket.gethostname()),
        is_store_host=is_store_host, infra_rank=infra_rank, segment=segment,
        events_dir=None if events_dir is None else os.fspath(events_dir),
        snapshot_every_n_steps=snapshot_every_n_steps, snapshot_every_n_seconds=snapshot_every_n_seconds,
        snapshot_max_overhead=snapshot_max_overhead,
        graceful_termination=graceful_termination, replication_factor=replication_factor,
        replica_max_bytes=replica_max_bytes, max_failures_without_progress=max_failures_without_progress,
        max_recoveries=max_recoveries, pg_timeout=timeout,
        hang=HangSettings(hang_detection, float(hang_timeout_floor), float(hang_safety_factor),
                          float(watchdog_interval)),
        timeouts=_timeouts(durations))
    if launch.mode is LaunchMode.RENDEZVOUS:
        settings.rendezvous()  # segment vs min_nodes and the like, named now rather than at fit()
    return settings


def _timeouts(durations: Mapping[str, float]) -> StrategyTimeouts:
    own = {name: float(value) for name, value in durations.items() if name in _OWN_DURATIONS}
    rendezvous = {name: float(value) for name, value in durations.items() if name not in _OWN_DURATIONS}
    try:
        return StrategyTimeouts(dataclasses.replace(DEFAULT_RENDEZVOUS_TIMEOUTS, **rendezvous), **own)
    except RendezvousConfigError as exc:
        raise StrategyConfigError(f"{_PREFIX}{exc}") from None


def _number(name: str, value: Any, **rule: Any) -> None:
    require_number(name, value, error=StrategyConfigError, prefix=_PREFIX, **rule)


def resolve_launch_config(endpoint: str | None, run_id: str | None, min_nodes: int | None,
                          max_nodes: int | None, env: Mapping[str, str] | None = None) -> LaunchConfig:
    """Combine arguments and environment into one launch configuration, or raise StrategyConfigError."""
    env = os.environ if env is None else env
    elastic_run_id = env.get(ENV_TORCHELASTIC_RUN_ID)
    if elastic_run_id:
        return _torchelastic_config(endpoint, run_id, min_nodes, max_nodes, env, elastic_run_id)
    try:
        endpoint_text = merge_setting("endpoint", endpoint, ENV_ENDPOINT, env.get(ENV_ENDPOINT))
        run_id_value = merge_setting("run_id", run_id, ENV_RUN_ID, env.get(ENV_RUN_ID))
        nodes = _merge_nodes(min_nodes, max_nodes, env.get(ENV_NNODES))
    except ValueError as exc:
        raise StrategyConfigError(f"{_PREFIX}{exc}") from None
    missing = []
    if endpoint_text is None:
        missing.append(f"endpoint= (or {ENV_ENDPOINT}=HOST:PORT)")
    if run_id_value is None:
        missing.append(f"run_id= (or {ENV_RUN_ID})")
    if nodes is None:
        missing.append(f"min_nodes=/max_nodes= (or {ENV_NNODES}=MIN:MAX)")
    if missing:
        raise StrategyConfigError(f"{_PREFIX}missing setting(s): " + "; ".join(missing) +
                                  ". Or launch with torchrun --rdzv-backend=lightning_ft.")
    try:
        parsed = parse_endpoint(str(endpoint_text))
    except RendezvousConfigError as exc:
        raise StrategyConfigError(f"{_PREFIX}endpoint {endpoint_text!r}: {exc}") from None
    run_id_text = str(run_id_value)
    if not run_id_text or "/" in run_id_text:
        raise StrategyConfigError(f"{_PREFIX}run_id must be a non-empty string without '/', got {run_id_text!r}")
    return LaunchConfig(LaunchMode.RENDEZVOUS, run_id_text, parsed, nodes[0], nodes[1])


def _merge_nodes(min_nodes: int | None, max_nodes: int | None, env_nnodes: str | None) -> tuple[int, int] | None:
    for name, value in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_nodes is not None and min_nodes is None:
        raise ValueError("max_nodes is set but min_nodes is not; pass both (or LIGHTNING_FT_NNODES=MIN:MAX)")
    explicit = None
    if min_nodes is not None:
        explicit = (min_nodes, min_nodes if max_nodes is None else max_nodes)
        if explicit[1] < explicit[0]:
            raise ValueError(f"min_nodes={min_nodes} must not exceed max_nodes={max_nodes}")
    from_env = parse_nnodes(env_nnodes, ENV_NNODES) if env_nnodes not in (None, "") else None
    if explicit is not None and from_env is not None and explicit != from_env:
        raise ValueError(f"contradictory settings: min_nodes/max_nodes={explicit[0]}:{explicit[1]} but "
                         f"{ENV_NNODES}={env_nnodes!r}; set one of them")
    return explicit or from_env


def _torchelastic_config(endpoint, run_id, min_nodes, max_nodes, env, elastic_run_id) -> LaunchConfig:
    conflicts = []
    if endpoint is not None:
        conflicts.append("endpoint=")
    if env.get(ENV_ENDPOINT):
        conflicts.append(ENV_ENDPOINT)
    if min_nodes is not None or max_nodes is not None:
        conflicts.append("min_nodes=/max_nodes=")
    if env.get(ENV_NNODES):
        conflicts.append(ENV_NNODES)
    if conflicts:
        raise StrategyConfigError(
            f"{_PREFIX}contradictory settings: this process was started by torchrun ({ENV_TORCHELASTIC_RUN_ID}="
            f"{elastic_run_id!r}), whose agent does the rendezvous (--rdzv-endpoint, --nnodes), but "
            f"{', '.join(conflicts)} {'is' if len(conflicts) == 1 else 'are'} set too; remove "
            f"{'it' if len(conflicts) == 1 else 'them'}, or launch without torchrun")
    for name, value in (("run_id", run_id), (ENV_RUN_ID, env.get(ENV_RUN_ID))):
        if value not in (None, "") and value != elastic_run_id:
            raise StrategyConfigError(
                f"{_PREFIX}contradictory settings: {name}={value!r} but torchrun's --rdzv-id is "
                f"{elastic_run_id!r}; drop {name} or make them equal")
    return LaunchConfig(LaunchMode.TORCHELASTIC, elastic_run_id)
