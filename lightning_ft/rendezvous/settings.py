"""Rendezvous settings: defaults, validation and parsing of torchrun ``--rdzv-conf`` values."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


class RendezvousConfigError(ValueError):
    """A rendezvous setting is missing or invalid; the message names the setting."""


@dataclass(frozen=True)
class RendezvousSettings:
    """How a barrier rendezvous behaves.

    ``min_nodes`` participants train (the active count); up to ``max_nodes - min_nodes``
    more wait as hot spares. All durations are in seconds.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    #: after ``min_nodes`` arrived, wait this long for more before completing
    last_call_timeout: float = 0.5
    #: a participant that joined an open round gives up after this long
    join_timeout: float = 600.0
    #: survivors of the previous round keep their places for this long after a round opens
    previous_active_grace: float = 3.0
    #: active nodes come in whole groups of this many with the same ``domain_id`` (1 = no rule)
    segment: int = 1
    #: the store host waits at most this long for the others to acknowledge shutdown
    store_grace_timeout: float = 3.0
    #: a participant that took a slot but did not write it within this time is skipped
    unwritten_slot_timeout: float = 2.0
    #: participants bump a heartbeat this often; one silent for 4 beats is dead
    heartbeat_interval: float = 0.25
    #: run the node-health probes before joining a round (torchrun backend)
    health_check: bool = False

    def __post_init__(self) -> None:
        validate_settings(self)

    @property
    def dead_after(self) -> float:
        return 4 * self.heartbeat_interval

    @property
    def poll_interval(self) -> float:
        """How often one waiter polls the store.

        Scales with the job size so that the total polling load on the store stays near
        5,000 requests per second however many participants wait (10 ms floor, 0.5 s cap).
        """
        return min(0.5, max(0.01, self.max_nodes * 0.0002))

    def replace(self, **changes: Any) -> "RendezvousSettings":
        return dataclasses.replace(self, **changes)


_DURATIONS = (
    "last_call_timeout", "join_timeout", "previous_active_grace", "store_grace_timeout",
    "unwritten_slot_timeout", "heartbeat_interval",
)


def validate_settings(settings: RendezvousSettings) -> None:
    if not settings.run_id or not isinstance(settings.run_id, str):
        raise RendezvousConfigError("run_id must be a non-empty string (torchrun: --rdzv-id)")
    if "/" in settings.run_id:
        raise RendezvousConfigError(f"run_id must not contain '/': {settings.run_id!r}")
    for name in ("min_nodes", "max_nodes", "segment"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RendezvousConfigError(f"{name} must be a positive integer, got {value!r}")
    if settings.min_nodes > settings.max_nodes:
        raise RendezvousConfigError(
            f"min_nodes ({settings.min_nodes}) must not exceed max_nodes ({settings.max_nodes}); "
            "torchrun: --nnodes=MIN:MAX")
    if settings.min_nodes % settings.segment:
        raise RendezvousConfigError(
            f"min_nodes ({settings.min_nodes}) must be a multiple of segment ({settings.segment})")
    for name in _DURATIONS:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise RendezvousConfigError(f"{name} must be a positive number of seconds, got {value!r}")


# --rdzv-conf keys we accept, with the type each value is parsed to
_CONF_KEYS: dict[str, type] = {
    "last_call_timeout": float,
    "join_timeout": float,
    "previous_active_grace": float,
    "segment": int,
    "store_grace_timeout": float,
    "unwritten_slot_timeout": float,
    "heartbeat_interval": float,
    "health_check": bool,
}
# keys the torchrun handler reads itself (see lightning_ft.rendezvous.handler)
_HANDLER_KEYS = {"is_host", "connect_timeout", "domain_id", "infra_rank", "local_id"}


def _parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise RendezvousConfigError(f"{name} must be true or false, got {raw!r}")


def settings_from_config(run_id: str, min_nodes: int, max_nodes: int,
                         config: Mapping[str, Any]) -> RendezvousSettings:
    """Build settings from torchrun's values plus ``--rdzv-conf`` key=value pairs.

    Unknown keys are rejected with the list of known ones, so a typo does not pass silently.
    """
    values: dict[str, Any] = {}
    for key, raw in config.items():
        if key not in _CONF_KEYS:
            known = ", ".join(sorted(set(_CONF_KEYS) | _HANDLER_KEYS))
            raise RendezvousConfigError(f"unknown rendezvous option {key!r}; known options: {known}")
        kind = _CONF_KEYS[key]
        if kind is bool:
            values[key] = _parse_bool(key, raw)
            continue
        try:
            values[key] = kind(raw)
        except (TypeError, ValueError):
            raise RendezvousConfigError(
                f"{key} must be a {kind.__name__}, got {raw!r}") from None
    return RendezvousSettings(run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes, **values)
