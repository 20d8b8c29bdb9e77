"""Hand-overs in a run's events: a SIGTERM reached some actives, they left (exit 0) and hot spares took
their places from the survivors' live state (see ``lightning_ft.termination.handover``).

Pure: it reads timeline entries (``seconds``, ``who``, ``event``, ``fields``). One hand-over per
round whose leavers logged ``handed_over``; its cost runs from the signal (the leaver's
``hand_over_verdict`` less its ``seconds_since_signal``) to the first step of the job after it
(``first_step_after_recovery``), plus the steps trained again (none, unless something failed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_ft.events import names as ev
from lightning_ft.report.launches import Entry


@dataclass(frozen=True)
class HandOver:
    """One hand-over: who left, at which step, and what it cost."""

    round: int | None
    signalled_at: float  # seconds since the run's start
    left: tuple[str, ...]  # display names of the leavers
    step: int | None  # the step they left after
    restored_step: int | None  # where the job resumed (the next round's ``restored``)
    steps_redone: int | None
    #: the signal -> the first step of the job after the hand-over (None: not seen)
    seconds: float | None


def hand_overs(timeline: Sequence[Entry], step_of: Callable[[dict[str, Any]], int | None],
               who: Callable[[Any], str]) -> list[HandOver]:
    """Every hand-over of the run, in order."""
    by_round: dict[int | None, list[Entry]] = {}
    for entry in timeline:
        if entry.event == ev.HANDED_OVER:
            round_ = entry.fields.get("round")
            by_round.setdefault(round_ if isinstance(round_, int) else None, []).append(entry)
    result = []
    for round_, leavers in by_round.items():
        left_at = leavers[0].seconds
        names = {entry.participant_id for entry in leavers}
        verdicts = [e for e in timeline if e.event == ev.HAND_OVER_VERDICT and e.participant_id in names
                    and e.seconds <= left_at and isinstance(e.fields.get("seconds_since_signal"), (int, float))]
        signalled_at = min((e.seconds - float(e.fields["seconds_since_signal"]) for e in verdicts), default=left_at)
        step = step_of(leavers[0].fields)
        # the next round's first step (not a later one: a job that never trained again, then was
        # relaunched, would count the gap twice); hosts' clocks differ: a cost <= 0 is unknown
        first = next((e for e in timeline if e.event == ev.FIRST_STEP_AFTER_RECOVERY and e.seconds > left_at
                      and e.fields.get("round") == (round_ or 0) + 1), None)
        restored = next((e for e in timeline if e.event == ev.RESTORED and e.seconds > left_at
                         and isinstance(e.fields.get("round"), int) and e.fields["round"] > (round_ or 0)), None)
        restored_step = step_of(restored.fields) if restored is not None else None
        result.append(HandOver(
            round=round_, signalled_at=signalled_at, left=tuple(dict.fromkeys(who(e) for e in leavers)), step=step,
            restored_step=restored_step,
            steps_redone=step - restored_step if step is not None and restored_step is not None else None,
            seconds=first.seconds - signalled_at if first is not None and first.seconds > signalled_at else None))
    return result


def hand_over_lines(items: Sequence[HandOver]) -> list[str]:
    """The report's lines for the hand-overs (none when there were none)."""
    if not items:
        return []
    lines = [f"  hand-overs    {len(items)}"]
    for n, item in enumerate(items, 1):
        in_round = f" in round {item.round}" if item.round is not None else ""
        cost = "the job did not train again after it" if item.seconds is None else \
            f"signal -> first step of the job after it {item.seconds:.2f} s"
        redone = "" if item.steps_redone is None else f", steps redone {item.steps_redone}"
        lines.append(f"    #{n}{in_round} at +{item.signalled_at:.2f}s: {', '.join(item.left)} left after step "
                     f"{item.step if item.step is not None else '-'} (exit 0), spares took their places; "
                     f"{cost}{redone}")
    return lines


@dataclass(frozen=True)
class WorldChange:
    """An elastic job's world size changed between two rounds (a shrink or a grow)."""

    round: int  # the round that formed with the new size
    before: int
    after: int
    #: the event that began the change (a grow, a hand-over, a failure) -> the first step after it
    seconds: float | None

    @property
    def kind(self) -> str:
        return "grow" if self.after > self.before else "shrink"


def world_changes(timeline: Sequence[Entry]) -> list[WorldChange]:
    """Every change of the actives' world size from one completed round to the next, in order."""
    worlds: dict[int, tuple[int, float]] = {}
    for entry in timeline:
        round_, world = entry.fields.get("round"), entry.fields.get("world")
        if entry.event == ev.ROUND_COMPLETE and not entry.fields.get("standby") and isinstance(round_, int) \
                and isinstance(world, int):
            worlds.setdefault(round_, (world, entry.seconds))
    changes = []
    ordered = sorted(worlds.items())
    starts = (ev.GROW, ev.HAND_OVER, ev.FAILURE_DETECTED)
    for (_, (before, _)), (round_, (after, formed_at)) in zip(ordered, ordered[1:], strict=False):
        if before == after:
            continue
        began = [e.seconds for e in timeline if e.event in starts and e.fields.get("round") == round_ - 1]
        first = next((e for e in timeline if e.event == ev.FIRST_STEP_AFTER_RECOVERY and e.seconds >= formed_at
                      and e.fields.get("round") == round_), None)
        seconds = first.seconds - min(began) if first is not None and began else None
        changes.append(WorldChange(round_, before, after, seconds))
    return changes


def world_change_lines(items: Sequence[WorldChange]) -> list[str]:
    """The report's lines for an elastic job's shrinks and grows (none when the world never changed)."""
    if not items:
        return []
    lines = [f"  world size    {len(items)} change(s)"]
    for item in items:
        cost = "" if item.seconds is None else f"; its cause -> first step after it {item.seconds:.2f} s"
        lines.append(f"    round {item.round}: {item.kind} {item.before} -> {item.after} ranks{cost}")
    return lines
