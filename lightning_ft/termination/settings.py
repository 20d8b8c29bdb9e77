"""The SIGTERM path's settings (``GracefulTermination``): grace period, stop margin, save budget, records."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ft.settings import SettingsError, Timeouts, group, setting
from lightning_ft.settings.fields import boolean, number, optional_path, parse_text

#: the bounds of :class:`~lightning_ft.settings.Timeouts` the SIGTERM path uses
TERMINATION_TIMEOUTS = ("health_timeout", "stop_store_timeout", "exit_timeout", "announce_timeout",
                        "watcher_close_timeout")


@dataclass(frozen=True)
class TerminationSettings:
    """What ``GracefulTermination`` was configured with, validated."""

    grace_seconds: float | None = setting(
        None, "seconds between SIGTERM and SIGKILL; None: 30 (Kubernetes' terminationGracePeriodSeconds, SLURM's "
              "KillWait and torchrun's defaults), capped by torchrun's shutdown timeout when it is visible in the "
              "environment", rule=number(allow_none=True), env="LIGHTNING_FT_GRACE_SECONDS")
    margin_steps: int = setting(1, "optimizer steps between the first boundary after the signal and the agreed "
                                   "stop (>= 1 keeps the agreement exact; 1 stops soonest)",
                                rule=number(integer=True, minimum=1, inclusive=True), advanced=True)
    save_safety_factor: float = setting(1.5, "the measured snapshot cost is multiplied by this before it is "
                                             "compared with the time left",
                                        rule=number(minimum=1, inclusive=True), advanced=True)
    hand_over_settle_seconds: float = setting(
        0.5, "with hot spares ready, a termination waits this long after it began before deciding who hands over: "
             "the other signals of one preemption arrive meanwhile (a job whose every active is signalled stops)",
        rule=number(inclusive=True), advanced=True)
    exit_reserve_seconds: float = setting(1.0, "time kept back from the grace period for the exit itself",
                                          rule=number(inclusive=True), advanced=True)
    overrun_is_unhealthy: bool = setting(True, "a health probe that has not answered by the deadline counts as "
                                               "unhealthy (else it is reported and ignored)", rule=boolean,
                                         advanced=True)
    exit_record_dir: str | None = setting(
        None, "where to write rank-<R>.json with the decided exit code before exiting (for `lightning-ft "
              "exit-code`, since torchrun exits 1 whatever its workers did): a directory of this user that nobody "
              "else can write (created 0700); None: no records",
        rule=optional_path, env="LIGHTNING_FT_EXIT_RECORD_DIR", parse=parse_text)
    timeouts: Timeouts = group(Timeouts, only=TERMINATION_TIMEOUTS)


def check_reserve(settings: TerminationSettings, grace_seconds: float, grace_source: str) -> None:
    """The exit reserve must leave room in the grace period (SettingsError naming both)."""
    if not settings.exit_reserve_seconds < grace_seconds:
        raise SettingsError(f"exit_reserve_seconds must be smaller than the grace period ({grace_seconds:g} s from "
                            f"{grace_source}), got {settings.exit_reserve_seconds!r}")
