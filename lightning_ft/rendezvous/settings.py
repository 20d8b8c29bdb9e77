"""Rendezvous settings: defaults, validation and parsing of torchrun ``--rdzv-conf`` values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from lightning_ft._validation import check_number, parse_bool, require


class RendezvousConfigError(ValueError):
    """A rendezvous setting is missing or invalid; the message names the setting."""


@dataclass(frozen=True)
class RendezvousTimeouts:
    """Every duration of the barrier rendezvous, in seconds (the ``--rdzv-conf`` key names)."""

    #: a participant that joined an open round gives up after this long
    join_timeout: float = 600.0
    #: the same for rounds after this participant trained in one (a failure must be
    #: replaced promptly; the first round may wait for slow launches); None = join_timeout
    rejoin_timeout: float | None = None
    #: after ``min_nodes`` arrived, wait this long for more before completing
    last_call_timeout: float = 0.5
    #: survivors of the previous round keep their places for this long after a round opens
    previous_active_grace: float = 3.0
    #: the store host waits at most this long for the others to acknowledge shutdown
    store_grace_timeout: float = 3.0
    #: a participant that took a slot but did not write it within this time is skipped
    unwritten_slot_timeout: float = 2.0
    #: participants bump a heartbeat this often; one silent for 4 beats is dead
    heartbeat_interval: float = 0.25

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.name == "rejoin_timeout" and value is None:
                continue
            require(check_number(value), item.name, "a positive number of seconds", value,
                    error=RendezvousConfigError)

    @property
    def dead_after(self) -> float:
        """Seconds of heartbeat silence after which a participant counts as dead."""
        return 4 * self.heartbeat_interval

    def join_timeout_for(self, was_active: bool) -> float:
        if was_active and self.rejoin_timeout is not None:
            return self.rejoin_timeout
        return self.join_timeout


DURATION_KEYS = tuple(f.name for f in dataclasses.fields(RendezvousTimeouts))


@dataclass(frozen=True)
class RendezvousSettings:
    """How a barrier rendezvous behaves.

    ``min_nodes`` participants train (the active count); up to ``max_nodes - min_nodes``
    more wait as hot spares.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    #: active nodes come in whole groups of this many with the same ``domain_id`` (1 = no rule)
    segment: int = 1
    #: run the node-health probes before joining a round (torchrun backend)
    health_check: bool = False
    timeouts: RendezvousTimeouts = field(default_factory=RendezvousTimeouts)

    def __post_init__(self) -> None:
        validate_settings(self)

    @classmethod
    def of(cls, run_id: str, min_nodes: int, max_nodes: int, *, segment: int = 1, health_check: bool = False,
           **durations: Any) -> "RendezvousSettings":
        """Settings with durations given by their ``--rdzv-conf`` names (``last_call_timeout=...``)."""
        unknown = sorted(set(durations) - set(DURATION_KEYS))
        if unknown:
            raise RendezvousConfigError(f"unknown rendezvous duration(s) {unknown}; known: {', '.join(DURATION_KEYS)}")
        return cls(run_id, min_nodes, max_nodes, segment, health_check, RendezvousTimeouts(**durations))

    @property
    def dead_after(self) -> float:
        return self.timeouts.dead_after

    @property
    def poll_interval(self) -> float:
        """How often one waiter polls the store.

        Scales with the job size so that the total polling load on the store stays near
        5,000 requests per second however many participants wait (10 ms floor, 0.5 s cap).
        """
        return min(0.5, max(0.01, self.max_nodes * 0.0002))

    def with_timeouts(self, **changes: Any) -> "RendezvousSettings":
        return dataclasses.replace(self, timeouts=dataclasses.replace(self.timeouts, **changes))


def validate_settings(settings: RendezvousSettings) -> None:
    if not settings.run_id or not isinstance(settings.run_id, str):
        raise RendezvousConfigError("run_id must be a non-empty string (torchrun: --rdzv-id)")
    if "/" in settings.run_id:
        raise RendezvousConfigError(f"run_id must not contain '/': {settings.run_id!r}")
    for name in ("min_nodes", "max_nodes", "segment"):
        value = getattr(settings, name)
        require(check_number(value, integer=True), name, "a positive integer", value, error=RendezvousConfigError)
    if settings.min_nodes > settings.max_nodes:
        raise RendezvousConfigError(
            f"min_nodes ({settings.min_nodes}) must not exceed max_nodes ({settings.max_nodes}); "
            "torchrun: --nnodes=MIN:MAX")
    if settings.min_nodes % settings.segment:
        raise RendezvousConfigError(
            f"min_nodes ({settings.min_nodes}) must be a multiple of segment ({settings.segment})")
    if not isinstance(settings.timeouts, RendezvousTimeouts):
        raise RendezvousConfigError(f"timeouts must be a RendezvousTimeouts, got {settings.timeouts!r}")


# --rdzv-conf keys we accept, with the type each value is parsed to (rejoin_timeout is the
# strategy's; torchrun's agent restarts workers, it does not re-join in-process)
_CONF_KEYS: dict[str, type] = {
    **{name: float for name in DURATION_KEYS if name != "rejoin_timeout"},
    "segment": int,
    "health_check": bool,
}
# keys the torchrun handler reads itself (see lightning_ft.rendezvous.handler)
HANDLER_KEYS = ("is_host", "connect_timeout", "domain_id", "infra_rank", "local_id")


def settings_from_config(run_id: str, min_nodes: int, max_nodes: int,
                         config: Mapping[str, Any]) -> RendezvousSettings:
    """Build settings from torchrun's values plus ``--rdzv-conf`` key=value pairs.

    Unknown keys are rejected with the list of known ones, so a typo does not pass silently.
    """
    values: dict[str, Any] = {}
    for key, raw in config.items():
        if key not in _CONF_KEYS:
            known = ", ".join(sorted(set(_CONF_KEYS) | set(HANDLER_KEYS)))
            raise RendezvousConfigError(f"unknown rendezvous option {key!r}; known options: {known}")
        kind = _CONF_KEYS[key]
        if kind is bool:
            values[key] = parse_bool(key, raw, error=RendezvousConfigError)
            continue
        try:
            values[key] = kind(raw)
        except (TypeError, ValueError):
            raise RendezvousConfigError(f"{key} must be a {kind.__name__}, got {raw!r}") from None
    segment = values.pop("segment", 1)
    health_check = values.pop("health_check", False)
    return RendezvousSettings.of(run_id, min_nodes, max_nodes, segment=segment, health_check=health_check, **values)
