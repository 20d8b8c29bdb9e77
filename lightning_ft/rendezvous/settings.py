"""Rendezvous settings: the barrier's shape and timing, and torchrun's ``--rdzv-conf`` options."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_ft.rendezvous.liveness import LivenessThresholds
from lightning_ft.settings import Timeouts, group, load, setting
from lightning_ft.settings.fields import (
    RendezvousConfigError,
    boolean,
    number,
    optional_text,
    parse_flag,
    parse_int,
    parse_text,
)
from lightning_ft.settings.timeouts import RENDEZVOUS_TIMEOUTS

_POSITIVE_INT = number(integer=True)

#: the waiters of a round woken by the coordinator's tick stay near this many requests per second
WAKE_REQUESTS_PER_SECOND = 5000.0
#: store requests a waiter makes per wake (its checks plus the next wait)
REQUESTS_PER_WAKE = 5


@dataclass(frozen=True)
class RendezvousOptions:
    """The settings of a barrier rendezvous beyond its run id and node counts."""

    segment: int = setting(1, "active nodes come in whole groups of this many with the same domain_id "
                              "(1: no rule)", rule=_POSITIVE_INT, parse=parse_int, advanced=True)
    health_check: bool = setting(False, "run the node-health probes before joining a round (torchrun backend)",
                                 rule=boolean, parse=parse_flag)
    keep_ranks: bool = setting(False, "survivors of a failure keep their ranks and a newcomer (a hot spare) takes "
                                      "the lost rank's place, instead of closing ranks (sharded state: a rank's "
                                      "shard exists only where that rank ran); only with segment 1",
                               rule=boolean, parse=parse_flag, advanced=True)
    elastic: bool = setting(False, "every participant up to max_nodes trains (no hot spares): a node lost or "
                                   "signalled without a spare shrinks the job to at least min_nodes in-process, "
                                   "the global batch kept by gradient accumulation (that of max_nodes ranks)",
                            rule=boolean, parse=parse_flag, env="LIGHTNING_FT_ELASTIC")
    store_failover: bool = setting(True, "when the rendezvous store is lost (its host died, or lightning-ft "
                                         "store), a surviving participant takes it over (docs/strategy.md, "
                                         "Store fail-over); False: a lost store ends the job as before",
                                   rule=boolean, parse=parse_flag)


@dataclass(frozen=True)
class RendezvousSettings:
    """How a barrier rendezvous behaves.

    ``min_nodes`` participants train (the active count); up to ``max_nodes - min_nodes``
    more wait as hot spares.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    options: RendezvousOptions = group(RendezvousOptions)
    timeouts: Timeouts = group(Timeouts, only=RENDEZVOUS_TIMEOUTS)

    def __post_init__(self) -> None:
        validate_settings(self)

    @classmethod
    def of(cls, run_id: str, min_nodes: int, max_nodes: int, **settings: Any) -> RendezvousSettings:
        """Settings with the others given by their names (``segment=2``, ``last_call_timeout=...``)."""
        return load(cls, {**settings, "run_id": run_id, "min_nodes": min_nodes, "max_nodes": max_nodes},
                    error=RendezvousConfigError)

    @property
    def segment(self) -> int:
        return self.options.segment

    @property
    def health_check(self) -> bool:
        return self.options.health_check

    @property
    def keep_ranks(self) -> bool:
        return self.options.keep_ranks

    @property
    def elastic(self) -> bool:
        return self.options.elastic

    @property
    def active_count(self) -> int:
        """How many arrivals train: ``min_nodes`` (the rest are hot spares), every one up to
        ``max_nodes`` when elastic."""
        return self.max_nodes if self.options.elastic else self.min_nodes

    @property
    def store_failover(self) -> bool:
        return self.options.store_failover

    @property
    def liveness(self) -> LivenessThresholds:
        """Every threshold that judges a participant dead (see :mod:`.liveness`)."""
        return LivenessThresholds(self.timeouts.heartbeat_interval, self.max_nodes)

    @property
    def heartbeat_every(self) -> float:
        return self.liveness.heartbeat_every

    @property
    def dead_after(self) -> float:
        return self.liveness.dead_after

    @property
    def takeover_after(self) -> float:
        return self.liveness.takeover_after

    @property
    def poll_interval(self) -> float:
        """How often the coordinator of a round looks for new arrivals (one small request: the
        arrivals hint). A waiter does not poll: it waits on the store for the coordinator's tick."""
        return 0.01

    @property
    def tick_interval(self) -> float:
        """How often the coordinator of a round wakes its waiters when nothing happened (they check
        for a close, a newer round and the coordinator's lease then; completion wakes them at
        once). Each wake costs a waiter a few requests, so the interval grows with the job size to
        keep their sum near :data:`WAKE_REQUESTS_PER_SECOND` (50 ms floor)."""
        return max(0.05, self.max_nodes * REQUESTS_PER_WAKE / WAKE_REQUESTS_PER_SECOND)

    @property
    def reread_interval(self) -> float:
        """The shortest time between two full reads of a round's arrivals log by its coordinator
        (the log grows with the job: a read per new arrival would make a round's work O(N^2))."""
        return max(0.01, self.max_nodes * 0.00005)

    @property
    def standby_poll_interval(self) -> float:
        """How often a hot spare in standby looks for a new round: at most 20 times a second.

        Spares are few (``max_nodes - min_nodes``); each poll is three store reads. A new round
        waits for its last call anyway, so noticing it up to 50 ms later costs a recovery almost
        nothing.
        """
        return max(0.05, (self.max_nodes - self.min_nodes) * 3 / WAKE_REQUESTS_PER_SECOND)

    def with_timeouts(self, **changes: Any) -> RendezvousSettings:
        return dataclasses.replace(self, timeouts=dataclasses.replace(self.timeouts, **changes))


def validate_settings(settings: RendezvousSettings) -> None:
    if not settings.run_id or not isinstance(settings.run_id, str):
        raise RendezvousConfigError("run_id must be a non-empty string (torchrun: --rdzv-id)")
    if "/" in settings.run_id:
        raise RendezvousConfigError(f"run_id must not contain '/': {settings.run_id!r}")
    for name in ("min_nodes", "max_nodes", "segment"):
        value = getattr(settings, name)
        if _POSITIVE_INT(value) is not None:
            raise RendezvousConfigError(f"{name} must be a positive integer, got {value!r}")
    if settings.min_nodes > settings.max_nodes:
        raise RendezvousConfigError(
            f"min_nodes ({settings.min_nodes}) must not exceed max_nodes ({settings.max_nodes}); "
            "torchrun: --nnodes=MIN:MAX")
    if settings.min_nodes % settings.segment:
        raise RendezvousConfigError(
            f"min_nodes ({settings.min_nodes}) must be a multiple of segment ({settings.segment})")
    if not isinstance(settings.options, RendezvousOptions):
        raise RendezvousConfigError(f"options must be RendezvousOptions, got {settings.options!r}")
    if settings.options.keep_ranks and settings.options.elastic:
        raise RendezvousConfigError("elastic needs replicated state (ddp_ft): with keep_ranks (fsdp_ft) a rank's "
                                    "shards exist only where it ran, so the world cannot shrink or grow")
    if settings.options.keep_ranks and settings.segment != 1:
        raise RendezvousConfigError(f"keep_ranks needs segment 1 (got segment {settings.segment}): a newcomer "
                                    "takes one lost rank's place, not a whole group's")
    if not isinstance(settings.timeouts, Timeouts):
        raise RendezvousConfigError(f"timeouts must be Timeouts, got {settings.timeouts!r}")


@dataclass(frozen=True)
class HandlerOptions:
    """``--rdzv-conf`` options the torchrun handler reads itself (the rest are :class:`RendezvousSettings`)."""

    is_host: bool | None = setting(None, "True: host the store at the endpoint; False: only connect; unset: host "
                                         "it when the port can be bound here", rule=lambda v: None if v in (
                                             None, True, False) else "true, false or unset", parse=parse_flag)
    domain_id: str | None = setting(None, "failure domain of this node (default: LIGHTNING_FT_DOMAIN_ID, else the "
                                          "host name)", rule=optional_text, parse=parse_text)
    infra_rank: int | None = setting(None, "the scheduler's node index (default: from SLURM/JobSet variables)",
                                     rule=number(integer=True, inclusive=True, allow_none=True), parse=parse_int)
    local_id: int = setting(0, "tells apart participants of one process (benchmarks)",
                            rule=number(integer=True, inclusive=True), parse=parse_int, advanced=True)


@dataclass(frozen=True)
class TorchrunConfig:
    """Everything ``--rdzv-conf`` may say: the handler's options and the rendezvous settings."""

    handler: HandlerOptions = group(HandlerOptions)
    rendezvous: RendezvousOptions = group(RendezvousOptions)
    timeouts: Timeouts = group(Timeouts, only=RENDEZVOUS_TIMEOUTS)


#: keys torchrun adds to ``--rdzv-conf`` on its own (``timeout`` is the join timeout)
TORCHRUN_KEYS = ("timeout", "rank", "read_timeout")


def torchrun_config(run_id: str, min_nodes: int, max_nodes: int,
                    config: Mapping[str, Any]) -> tuple[HandlerOptions, RendezvousSettings]:
    """The handler's options and the rendezvous settings from torchrun's values plus ``--rdzv-conf``
    key=value pairs. Unknown keys are rejected, naming the closest known one, so a typo does not
    pass silently."""
    values = dict(config)
    for key in TORCHRUN_KEYS:
        value = values.pop(key, None)
        if key == "timeout" and value is not None and "join_timeout" not in values:
            values["join_timeout"] = value
    parsed = load(TorchrunConfig, values, strings=True, error=RendezvousConfigError, prefix="--rdzv-conf: ")
    try:
        return parsed.handler, RendezvousSettings(run_id, min_nodes, max_nodes, parsed.rendezvous, parsed.timeouts)
    except RendezvousConfigError as exc:
        raise RendezvousConfigError(f"--rdzv-conf: {exc}") from None


def settings_from_config(run_id: str, min_nodes: int, max_nodes: int,
                         config: Mapping[str, Any]) -> RendezvousSettings:
    """The rendezvous settings of :func:`torchrun_config`."""
    return torchrun_config(run_id, min_nodes, max_nodes, config)[1]
