"""A run's launches in one events directory: a relaunch after a stop (a requeue, a manual restart)
writes its events next to the first launch's, and what it cost -- the stop, the gap, the steps
done again -- is lost time like a failure's.

Pure: it reads timeline entries (``seconds``, ``pid``, ``event``, ``fields``). A launch is a set
of processes whose lifetimes overlap (by participant id and pid -- pids repeat across hosts and
containers -- first to last event); the next launch starts with a process that began after every
process of the one before had logged its last event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_ft.events import names as ev


class Entry(Protocol):
    """A timeline entry as this module reads it."""

    @property
    def seconds(self) -> float: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def participant_id(self) -> str: ...

    @property
    def event(self) -> str: ...

    @property
    def fields(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Relaunch:
    """One launch ended and the next took the run up again."""

    stopped_at: float  # seconds since the run's start: the ended launch's last event
    stopped_step: int | None  # the step it had reached (its stop's step, else its last step seen)
    why: str  # how the launch ended, from its exit events
    resumed_at: float | None  # the next launch's restore (else its first round): training again
    restored_step: int | None  # None: it started over (no restore seen)
    steps_redone: int | None
    redone_seconds: float | None
    lost_seconds: float | None  # the gap from the stop to the restore, plus the steps done again


def launches(timeline: Sequence[Entry]) -> list[list[Entry]]:
    """The timeline cut into launches (in order); entries without a pid stay with the launch they
    fall into by time."""
    spans: dict[tuple[str, int], tuple[float, float]] = {}
    for entry in timeline:
        if entry.pid is not None:
            key = (entry.participant_id, entry.pid)
            first, last = spans.get(key, (entry.seconds, entry.seconds))
            spans[key] = (min(first, entry.seconds), max(last, entry.seconds))
    starts: list[float] = []
    end = None
    for first, last in sorted(spans.values()):
        if end is None or first > end:
            starts.append(first)
            end = last
        else:
            end = max(end, last)
    groups: list[list[Entry]] = [[] for _ in starts] or [[]]
    index = 0
    for entry in timeline:
        when = spans[(entry.participant_id, entry.pid)][0] if entry.pid is not None else entry.seconds
        while index + 1 < len(starts) and when >= starts[index + 1]:
            index += 1
        position = index
        while position > 0 and when < starts[position]:  # an earlier launch's late entry
            position -= 1
        groups[position].append(entry)
    return [group for group in groups if group]


def _why(launch: Sequence[Entry]) -> str:
    for entry in reversed(launch):
        if entry.event == ev.TERMINATION_DECISION:
            code = entry.fields.get("exit_code")
            return f"stopped (SIGTERM path{f', exit {code}' if code is not None else ''})"
        if entry.event in (ev.STOPPED, ev.NO_RESTART, ev.UNHEALTHY_EXIT):
            reason = str(entry.fields.get("reason") or "")
            return f"{entry.event}{': ' + reason if reason else ''}"
    return "ended without an exit event (killed?)"


def relaunches(timeline: Sequence[Entry], step_of: Callable[[dict[str, Any]], int | None],
               step_seconds: float | None) -> list[Relaunch]:
    """Each boundary between two launches, with what it cost (``step_seconds``: the price of a
    step done again; None: unknown)."""
    groups = launches(timeline)
    result = []
    for ended, started in zip(groups, groups[1:], strict=False):
        stops = [s for e in ended if e.event in (ev.TERMINATION_DECISION, ev.STOPPED, ev.NO_RESTART)
                 if (s := step_of(e.fields)) is not None]
        seen = [s for e in ended if (s := step_of(e.fields)) is not None]
        stopped_step = max(stops) if stops else (max(seen) if seen else None)
        stopped_at = max(e.seconds for e in ended)
        restored = next((e for e in started if e.event == ev.RESTORED), None)
        begun = restored or next((e for e in started if e.event in (ev.GROUP_FORMED, ev.ROUND_COMPLETE)), None)
        restored_step = step_of(restored.fields) if restored is not None else None
        redone = None
        if stopped_step is not None:
            redone = max(stopped_step - (restored_step or 0), 0)
        redone_seconds = redone * step_seconds if redone is not None and step_seconds is not None else None
        lost = None
        if begun is not None:
            lost = max(begun.seconds - stopped_at, 0.0) + (redone_seconds or 0.0)
        result.append(Relaunch(stopped_at, stopped_step, _why(ended), begun.seconds if begun else None,
                               restored_step, redone, redone_seconds, lost))
    return result
