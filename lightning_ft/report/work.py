"""The part of ``lightning-ft report`` about stragglers: each participant's own work and wait
per step (its ``work`` events), who the others wait for, and what the straggler policy found
(``straggler`` events). Pure, like :mod:`lightning_ft.report.timeline`, which uses it and hands
it its timeline (``TimelineEntry``: ``who``, ``event``, ``fields``, ``seconds``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_ft.events import names as ev
from lightning_ft.stragglers.policy import NEVER_BELOW


@dataclass(frozen=True)
class RoundWork:
    """One participant's own work and wait per step (medians) over its last window of steps in a round."""

    who: str  # display name
    round: int | None
    busy_seconds: float
    wait_seconds: float


def work_per_round(timeline: Sequence[Any]) -> tuple[RoundWork, ...]:
    """Each participant's last ``work`` report of each round: its last window of steps there
    (a straggler shows where the round ended, not diluted by the steps before it slowed down)."""
    last: dict[tuple[str, int | None], RoundWork] = {}
    for e in timeline:
        busy, wait = _number(e.fields.get("busy_seconds")), _number(e.fields.get("wait_seconds"))
        if e.event == ev.WORK and busy is not None and wait is not None:
            number = _number(e.fields.get("round"))
            round_id = int(number) if number is not None else None
            last[(e.who, round_id)] = RoundWork(e.who, round_id, busy, wait)
    return tuple(last.values())


def straggler_lines(timeline: Sequence[Any]) -> tuple[str, ...]:
    return tuple(f"+{e.seconds:.2f}s rank {e.fields.get('rank')} at step {e.fields.get('step')}: "
                 f"{e.fields.get('action')} (score {e.fields.get('score')}) by {e.who}"
                 for e in timeline if e.event == ev.STRAGGLER)


def format_work(work: Sequence[RoundWork], stragglers: Sequence[str]) -> list[str]:
    """Own work and wait per step by round, who the others wait for, and the stragglers found."""
    if not work and not stragglers:
        return []
    lines = ["  work per step (median own work / wait for the peers, each participant's last window in the round)"]
    for round_id in dict.fromkeys(w.round for w in work):
        label = f"    round {'?' if round_id is None else round_id}"
        rows = [w for w in work if w.round == round_id]
        busiest = max(rows, key=lambda w: w.busy_seconds)
        lines += [f"{label}  {w.who:<14} busy {w.busy_seconds:.4f} s, wait {w.wait_seconds:.4f} s" for w in rows]
        others = [w.busy_seconds for w in rows if w is not busiest]
        if others and busiest.busy_seconds >= NEVER_BELOW * statistics.median(others):
            lines.append(f"{label}  the others wait for {busiest.who} "
                         f"({busiest.busy_seconds / statistics.median(others):.2f}x their own work)")
    lines += [f"  straggler     {line}" for line in stragglers]
    return lines


def _number(value: Any) -> float | None:
    """A JSON number of an event's field, or None (a malformed log line decides nothing)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
