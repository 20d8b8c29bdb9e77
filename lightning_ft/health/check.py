"""Run several probes under one deadline; a hung probe can never block the caller."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_ft._clock import monotonic
from lightning_ft.health.probes import Probe, ProbeResult, default_probes
from lightning_ft.settings import Timeouts, load

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class HealthReport:
    """The composite verdict: healthy only if no probe said otherwise."""

    healthy: bool
    results: tuple[ProbeResult, ...]
    duration_s: float

    @property
    def reasons(self) -> list[str]:
        """Why the node is unhealthy (empty when healthy)."""
        return [f"{r.name}: {r.reason}" for r in self.results if r.healthy is False]

    def summary(self) -> str:
        if self.healthy:
            return f"healthy ({len(self.results)} probes, {self.duration_s * 1000:.1f} ms)"
        return f"UNHEALTHY ({'; '.join(self.reasons)}) after {self.duration_s * 1000:.1f} ms"

    def to_dict(self) -> dict:
        return {
            "healthy": self.healthy,
            "duration_s": self.duration_s,
            "probes": [
                {"name": r.name, "healthy": r.healthy, "reason": r.reason,
                 "duration_s": r.duration_s, "overran": r.overran}
                for r in self.results
            ],
        }


class NodeHealthCheck:
    """Runs probes concurrently (one daemon thread each) and returns by the deadline.

    Args:
        probes: the probes to run; ``None`` = :func:`default_probes` from the environment.
        timeout_s: deadline for the whole check, in seconds; ``None`` = the ``health_timeout``
            setting (``LIGHTNING_FT_HEALTH_TIMEOUT`` or 5 s).
        overrun_is_unhealthy: a probe that has not answered by the deadline (or was
            killed at it) makes the node unhealthy; with ``False`` it is reported and ignored.
        stop_at_first_unhealthy: return as soon as one probe says unhealthy, without
            waiting for the rest (they are reported as not awaited; commands are killed).
    """

    def __init__(self, probes: Sequence[Probe] | None = None, timeout_s: float | None = None,
                 overrun_is_unhealthy: bool = True, stop_at_first_unhealthy: bool = True) -> None:
        probes = default_probes() if probes is None else list(probes)
        if timeout_s is None:
            timeout_s = load(Timeouts, {}).health_timeout
        for probe in probes:
            if not callable(getattr(probe, "check", None)) or not isinstance(getattr(probe, "name", None), str):
                raise TypeError(f"NodeHealthCheck: `probes` must have a str `name` and a `check(deadline)` "
                                f"method; got {probe!r}")
        names = [p.name for p in probes]
        if len(set(names)) != len(names):
            raise ValueError(f"NodeHealthCheck: `probes` have duplicate names: {names}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"NodeHealthCheck: `timeout_s` must be > 0, got {timeout_s!r}")
        self.probes = probes
        self.timeout_s = float(timeout_s)
        self.overrun_is_unhealthy = bool(overrun_is_unhealthy)
        self.stop_at_first_unhealthy = bool(stop_at_first_unhealthy)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> NodeHealthCheck:
        """Default probes and timeout (the ``health_timeout`` setting) from ``env`` (default the process's)."""
        overrides.setdefault("timeout_s", load(Timeouts, {}, env=env).health_timeout)
        overrides.setdefault("probes", default_probes(env))
        return cls(**overrides)

    def run(self, deadline: float | None = None) -> HealthReport:
        """Run all probes; returns by ``deadline`` (monotonic) or after ``timeout_s``."""
        start = monotonic()
        deadline = start + self.timeout_s if deadline is None else min(deadline, start + self.timeout_s)
        answers: queue.SimpleQueue[tuple[int, ProbeResult]] = queue.SimpleQueue()
        for index, probe in enumerate(self.probes):
            threading.Thread(target=_run_probe, args=(probe, index, deadline, answers),
                             name=f"lightning-ft-probe-{probe.name}", daemon=True).start()

        results: dict[int, ProbeResult] = {}
        verdict_unhealthy = False
        while len(results) < len(self.probes):
            remaining = deadline - monotonic()
            if remaining <= 0 or (verdict_unhealthy and self.stop_at_first_unhealthy):
                break
            try:
                index, result = answers.get(timeout=remaining)
            except queue.Empty:
                break
            result = self._apply_overrun_policy(result)
            results[index] = result
            verdict_unhealthy = verdict_unhealthy or result.healthy is False

        now = monotonic()
        for index, probe in enumerate(self.probes):
            if index in results:
                continue
            cancel = getattr(probe, "cancel", None)
            if callable(cancel):
                try:
                    cancel()
                except Exception:  # cancelling is best effort
                    log.debug("cancelling probe %s failed", probe.name, exc_info=True)
            if verdict_unhealthy and self.stop_at_first_unhealthy and now < deadline:
                results[index] = ProbeResult(probe.name, None, "not awaited (verdict already unhealthy)",
                                             now - start)
            else:
                results[index] = self._apply_overrun_policy(ProbeResult(
                    probe.name, False, f"no answer within {self.timeout_s:g} s", now - start, overran=True))
        ordered = tuple(results[i] for i in range(len(self.probes)))
        healthy = not any(r.healthy is False for r in ordered)
        return HealthReport(healthy, ordered, monotonic() - start)

    def _apply_overrun_policy(self, result: ProbeResult) -> ProbeResult:
        if not result.overran:
            return result
        if self.overrun_is_unhealthy:
            return ProbeResult(result.name, False, result.reason, result.duration_s, overran=True)
        return ProbeResult(result.name, True, result.reason + " (overrun ignored: overrun_is_unhealthy=False)",
                           result.duration_s, overran=True)


def _run_probe(probe: Probe, index: int, deadline: float,
               answers: queue.SimpleQueue[tuple[int, ProbeResult]]) -> None:
    start = monotonic()
    try:
        result = probe.check(deadline)
        if not isinstance(result, ProbeResult):
            result = ProbeResult(probe.name, False, f"probe returned {type(result).__name__}, not ProbeResult",
                                 monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - a probe that crashes cannot vouch for the node
        result = ProbeResult(probe.name, False, f"probe raised {type(exc).__name__}: {exc}",
                             monotonic() - start)
    answers.put((index, result))
