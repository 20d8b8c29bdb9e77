"""The ``ddp_ft`` strategy's settings: one frozen, validated object, checked before anything starts.

Every setting is a field declared once (default, documentation, rule, environment variable)
in :class:`StrategySettings` or one of its groups; each is also a keyword argument of
``FaultTolerantDDPStrategy``. Where the launch comes from: explicit arguments, else
``LIGHTNING_FT_ENDPOINT`` / ``LIGHTNING_FT_RUN_ID`` / ``LIGHTNING_FT_NNODES``; under ``torchrun``
(``TORCHELASTIC_RUN_ID`` set) torchrun's agent owns the rendezvous and the rendezvous settings
must not be given. Every error names the setting.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_ft._logging import strategy_name
from lightning_ft.checkpoint.durable.settings import DurableSettings
from lightning_ft.checkpoint.settings import SnapshotSettings
from lightning_ft.events.log import EventSettings
from lightning_ft.rendezvous.settings import RendezvousConfigError, RendezvousOptions, RendezvousSettings
from lightning_ft.runtime.decisions import merge_setting, parse_nnodes
from lightning_ft.schema.signing import SecretError, read_secret
from lightning_ft.settings import SettingsError, Timeouts, describe, group, load, setting
from lightning_ft.settings.environment import (
    ENV_DOMAIN_ID,
    environ,
    resolve_domain_id,
    resolve_run_id,
    warn_unknown_variables,
)
from lightning_ft.settings.fields import (
    boolean,
    internal,
    number,
    optional_text,
    parse_flag,
    parse_number_or_off,
    parse_text,
    setting_values,
)
from lightning_ft.store.locator import REJOIN_PATIENCE, JobEndpoints, parse_endpoints

ENV_ENDPOINT = "LIGHTNING_FT_ENDPOINT"
ENV_RUN_ID = "LIGHTNING_FT_RUN_ID"
ENV_NNODES = "LIGHTNING_FT_NNODES"
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"

#: the launch settings: resolved by :func:`resolve_launch_config`, not by the settings loader
LAUNCH_ARGUMENTS = ("endpoint", "run_id", "min_nodes", "max_nodes")


class StrategyConfigError(SettingsError):
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
    #: where the job's store is (one endpoint or a list: :mod:`lightning_ft.store.locator`)
    endpoint: JobEndpoints | None = None
    min_nodes: int | None = None
    max_nodes: int | None = None

    @property
    def host(self) -> str | None:
        return None if self.endpoint is None else self.endpoint.host

    def per_device(self, devices: int) -> LaunchConfig:
        """``Trainer(devices=N)``: each of a node's N processes is a participant, so the job's
        participants number N times its nodes (``min_nodes``/``max_nodes`` count nodes)."""
        if self.min_nodes is None or self.max_nodes is None:
            return self
        return dataclasses.replace(self, min_nodes=self.min_nodes * devices, max_nodes=self.max_nodes * devices)

    @property
    def port(self) -> int | None:
        return None if self.endpoint is None else self.endpoint.port


_COUNT = number(integer=True, inclusive=True)
_SECONDS = number()


@dataclass(frozen=True)
class HangSettings:
    """When a step counts as hung (see :func:`~lightning_ft.runtime.decisions.hang_timeout`)."""

    hang_detection: bool = setting(True, "treat a step that runs longer than max(hang_timeout_floor, "
                                         "hang_safety_factor x slowest recent step) as a hang of the rank that "
                                         "did not progress (the first step of a round is exempt)", rule=boolean,
                                   advanced=True)
    hang_timeout_floor: float = setting(60.0, "the shortest hang timeout (seconds)", rule=_SECONDS)
    hang_safety_factor: float = setting(10.0, "the slowest recent step is multiplied by this", rule=_SECONDS,
                                        advanced=True)
    watchdog_interval: float = internal(0.2, "how often the round watchdog publishes progress and checks for a "
                                             "newer round or a hung step (seconds)")


@dataclass(frozen=True)
class StragglerSettings:
    """When a rank counts as a straggler (see :func:`~lightning_ft.stragglers.policy.judge`)."""

    straggler_factor: float | None = setting(2.0, "a rank whose own work per step (not waiting for its peers) "
                                                  "stays at least this many times its peers' median over a "
                                                  "window is a straggler: evicted when a hot spare can take its "
                                                  "place (exit 84), else warned about; never below 1.3; None: "
                                                  "off (ddp_ft only)",
                                             rule=number(minimum=1, inclusive=True, allow_none=True),
                                             env="LIGHTNING_FT_STRAGGLER_FACTOR", parse=parse_number_or_off)
    straggler_window: int = setting(25, "steps a straggler must stay slow in (and between two evictions)",
                                    rule=number(integer=True, minimum=2, inclusive=True), advanced=True)
    straggler_marker: str | None = setting(None, "a file an evicted straggler writes (its reason as content): "
                                                 "the health probe's marker file (lightning-ft health --marker, "
                                                 "LIGHTNING_FT_HEALTH_MARKERS) then reports this node unhealthy "
                                                 "until someone removes it", rule=optional_text,
                                           env="LIGHTNING_FT_STRAGGLER_MARKER", parse=parse_text, advanced=True)


@dataclass(frozen=True)
class StrategySettings:
    """Everything ``FaultTolerantDDPStrategy`` was configured with, validated."""

    launch: LaunchConfig
    #: the process group's timeout (as ``DDPStrategy(timeout=...)``)
    pg_timeout: datetime.timedelta | None = None
    domain_id: str | None = setting(None, "failure domain of this process; processes of one host share it "
                                          "(default: LIGHTNING_FT_DOMAIN_ID, else the host name)",
                                    rule=optional_text, env=ENV_DOMAIN_ID, parse=parse_text)
    is_store_host: bool | None = setting(None, "True: host the store at endpoint; False: only connect; None: "
                                               "host it when the port can be bound here",
                                         rule=lambda v: None if v in (None, True, False) else "True, False or None",
                                         env="LIGHTNING_FT_IS_STORE_HOST", parse=parse_flag, advanced=True)
    rejoin: bool = setting(False, "this process restarts a node of a running job (a scheduler's restart loop sets "
                                  "it): join that job as a spare, never host its store or start it; with no store "
                                  f"of the run answering at the job's endpoints within {REJOIN_PATIENCE:g} s, or "
                                  "its job ended before this process started, leave with 0",
                           rule=boolean, env="LIGHTNING_FT_REJOIN", parse=parse_flag, advanced=True)
    infra_rank: int | None = setting(None, "the scheduler's node index (default: from SLURM/JobSet variables)",
                                     rule=number(integer=True, inclusive=True, allow_none=True), advanced=True)
    events: EventSettings = group(EventSettings)
    graceful_termination: bool = setting(True, "add a GracefulTermination (default probes) when the Trainer has "
                                               "none, so SIGTERM takes the SIGTERM path (stop step, snapshot, exit "
                                               "81) instead of Lightning's handling, which exits 0 without saving",
                                         rule=boolean, advanced=True)
    replication_factor: int = setting(1, "copies of each snapshot wanted on other participants, on other domains "
                                         "when possible (hot spares receive encrypted copies through the store "
                                         "while fewer than factor + 1 participants/domains train; only with a job "
                                         "secret); 0 disables", rule=_COUNT)
    replica_max_bytes: int = setting(256 * 2**20, "snapshots larger than this are not replicated through the "
                                                  "store, and a hot spare refuses a replica that announces more",
                                     rule=_COUNT, advanced=True)
    max_failures_without_progress: int = setting(2, "failed rounds in a row without a completed training step "
                                                    "before giving up with NO_RESTART", rule=_COUNT, advanced=True)
    max_recoveries: int | None = setting(None, "optional cap on recoveries in one process",
                                         rule=number(integer=True, inclusive=True, allow_none=True), advanced=True)
    elastic_grow_interval: float = setting(30.0, "an elastic job takes in participants that arrived while it "
                                                 "trains at most once per this many seconds (a round must be "
                                                 "this old first; the job's first round takes them in at once)",
                                           rule=_SECONDS, advanced=True)
    random_streams: bool = setting(True, "each training batch starts from torch's, Python's and NumPy's "
                                         "generators seeded from (seed, rank, step, batch), so a recovery draws "
                                         "what the uninterrupted run drew (Dropout); a model with random layers "
                                         "then draws other numbers than under plain DDP; False: the generators "
                                         "run on as they are (recoveries of random models are not exact)",
                                   rule=boolean, advanced=True)
    keep_snapshots_when_finished: bool = setting(False, "keep the job's snapshots in memory (/dev/shm) after its "
                                                        "last stage completed; by default each participant that "
                                                        "saw the job finish removes its own", rule=boolean,
                                                 advanced=True)
    hang: HangSettings = group(HangSettings)
    stragglers: StragglerSettings = group(StragglerSettings)
    rendezvous: RendezvousOptions = group(RendezvousOptions, exclude=("health_check",))
    timeouts: Timeouts = group(Timeouts)
    #: the EmergencyCheckpoint the strategy adds when the Trainer has none (its run id is the strategy's)
    snapshot: SnapshotSettings = group(SnapshotSettings, prefix="snapshot_", exclude=("run_id", "durable"))
    #: that EmergencyCheckpoint's durable tier
    durable: DurableSettings = group(DurableSettings)
    #: the settings given as arguments, by keyword name
    given: frozenset[str] = frozenset()

    def snapshot_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the EmergencyCheckpoint the strategy adds."""
        return {**setting_values(self.snapshot, exclude=("run_id", "durable")), **setting_values(self.durable),
                "run_id": self.run_id}

    def snapshot_arguments_given(self) -> list[str]:
        """The snapshot_* and persist_* settings given as arguments (they configure the added
        EmergencyCheckpoint, so they contradict one of the user's own)."""
        defaults = {info.name: info.default for info in describe(StrategySettings)}
        values = {**setting_values(self.snapshot, "snapshot_"), **setting_values(self.durable)}
        return sorted(name for name in self.given if name in values and values[name] != defaults.get(name))

    @property
    def run_id(self) -> str:
        return self.launch.run_id

    @property
    def mode(self) -> LaunchMode:
        return self.launch.mode

    @property
    def snapshot_every_n_steps(self) -> int | None:
        return self.snapshot.every_n_steps

    @property
    def snapshot_every_n_seconds(self) -> float | None:
        return self.snapshot.every_n_seconds

    @property
    def snapshot_max_overhead(self) -> float | None:
        return self.snapshot.max_overhead

    @property
    def events_dir(self) -> str | None:
        return self.events.events_dir

    @property
    def segment(self) -> int:
        return self.rendezvous.segment

    def per_device(self, devices: int) -> StrategySettings:
        """``Trainer(devices=N)``: N participants per node (``LaunchConfig.per_device``), and -- unless
        ranks stay in place for sharded state -- a node's processes are active or stand by together,
        so that a spare node replaces a lost node whole (``segment`` counts participants)."""
        options = self.rendezvous
        if not options.keep_ranks:
            options = dataclasses.replace(options, segment=options.segment * devices)
        return dataclasses.replace(self, launch=self.launch.per_device(devices), rendezvous=options)

    def validate(self) -> None:
        if self.launch.mode is LaunchMode.RENDEZVOUS:
            self.rendezvous_settings()  # segment vs min_nodes and the like, named now rather than at fit()

    def rendezvous_settings(self) -> RendezvousSettings:
        """The barrier rendezvous settings (rendezvous mode only)."""
        launch = self.launch
        assert launch.min_nodes is not None and launch.max_nodes is not None  # a rendezvous launch has both
        try:
            return RendezvousSettings(launch.run_id, launch.min_nodes, launch.max_nodes, self.rendezvous, self.timeouts)
        except RendezvousConfigError as exc:
            raise StrategyConfigError(f"{exc}") from None


def resolve_settings(env: Mapping[str, str] | None = None, *, timeout: Any = None,
                     **given: Any) -> StrategySettings:
    """Check every argument and combine arguments and environment; raise StrategyConfigError naming the setting.

    ``given``: the strategy's keyword arguments (the launch arguments and any setting);
    ``timeout``: DDP's process-group timeout.
    """
    env = environ() if env is None else env
    warn_unknown_variables(env)  # a misspelt variable is never silently ignored
    endpoint, run_id, min_nodes, max_nodes = (given.pop(name, None) for name in LAUNCH_ARGUMENTS)
    launch = resolve_launch_config(endpoint, run_id, min_nodes, max_nodes, env)
    try:
        read_secret(env)  # an unusable secret is a configuration error now, not a traceback at fit()
    except SecretError as exc:
        raise StrategyConfigError(f"{strategy_name()}: {exc}") from None
    if not (timeout is None or isinstance(timeout, datetime.timedelta)):
        raise StrategyConfigError(f"{strategy_name()}: timeout must be a datetime.timedelta, got {timeout!r}")
    settings = load(StrategySettings, {**given, "launch": launch, "pg_timeout": timeout}, env=env,
                    error=StrategyConfigError, prefix=f"{strategy_name()}: ")
    return dataclasses.replace(settings, domain_id=resolve_domain_id(settings.domain_id, env),
                               given=frozenset(given))


def resolve_launch_config(endpoint: str | None, run_id: str | None, min_nodes: int | None,
                          max_nodes: int | None, env: Mapping[str, str] | None = None) -> LaunchConfig:
    """Combine arguments and environment into one launch configuration, or raise StrategyConfigError."""
    env = environ() if env is None else env
    elastic_run_id = env.get(ENV_TORCHELASTIC_RUN_ID)
    if elastic_run_id:
        return _torchelastic_config(endpoint, run_id, min_nodes, max_nodes, env, elastic_run_id)
    try:
        endpoint_text = merge_setting("endpoint", endpoint, ENV_ENDPOINT, env.get(ENV_ENDPOINT))
        run_id_value, _ = resolve_run_id(run_id, env)
        nodes = _merge_nodes(min_nodes, max_nodes, env.get(ENV_NNODES))
    except ValueError as exc:
        raise StrategyConfigError(f"{strategy_name()}: {exc}") from None
    missing = []
    if endpoint_text is None:
        missing.append(f"endpoint= (or {ENV_ENDPOINT}=HOST:PORT)")
    if run_id_value is None:
        missing.append(f"run_id= (or {ENV_RUN_ID})")
    if nodes is None:
        missing.append(f"min_nodes=/max_nodes= (or {ENV_NNODES}=MIN:MAX)")
    if missing:
        raise StrategyConfigError(f"{strategy_name()}: missing setting(s): " + "; ".join(missing) +
                                  ". Or launch with torchrun --rdzv-backend=lightning_ft.")
    assert nodes is not None and run_id_value is not None
    try:
        parsed = parse_endpoints(str(endpoint_text))
    except RendezvousConfigError as exc:
        raise StrategyConfigError(f"{strategy_name()}: endpoint {endpoint_text!r}: {exc}") from None
    run_id_text = str(run_id_value)
    if not run_id_text or "/" in run_id_text:
        raise StrategyConfigError(f"{strategy_name()}: run_id must be a non-empty string without '/', "
                                  f"got {run_id_text!r}")
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


def _torchelastic_config(endpoint: str | None, run_id: str | None, min_nodes: int | None, max_nodes: int | None,
                         env: Mapping[str, str], elastic_run_id: str) -> LaunchConfig:
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
            f"{strategy_name()}: contradictory settings: this process was started by torchrun "
            f"({ENV_TORCHELASTIC_RUN_ID}={elastic_run_id!r}), whose agent does the rendezvous (--rdzv-endpoint, "
            "--nnodes), but "
            f"{', '.join(conflicts)} {'is' if len(conflicts) == 1 else 'are'} set too; remove "
            f"{'it' if len(conflicts) == 1 else 'them'}, or launch without torchrun")
    for name, value in (("run_id", run_id), (ENV_RUN_ID, env.get(ENV_RUN_ID))):
        if value not in (None, "") and value != elastic_run_id:
            raise StrategyConfigError(
                f"{strategy_name()}: contradictory settings: {name}={value!r} but torchrun's --rdzv-id is "
                f"{elastic_run_id!r}; drop {name} or make them equal")
    return LaunchConfig(LaunchMode.TORCHELASTIC, elastic_run_id)
