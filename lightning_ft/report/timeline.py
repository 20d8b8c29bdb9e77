"""``lightning-ft report RUN_DIR``: the recovery timeline and summary of a run's event logs.

The pure part, :func:`summarize` and :func:`format_report`, turns a list of events (as
:func:`lightning_ft.events.read_events` returns them) into a :class:`RunSummary` and text;
:func:`main` only reads the directory and prints. Exit status: 0 report printed, 2 bad
arguments, missing directory or no events. With ``--exit-code --launcher-code N`` the exit
status is instead the code the run's outcome implies for the whole job
(:func:`job_exit_code`), for a batch script to end with.

What the summary counts (event names are those the ``ddp_ft`` strategy emits):

* rounds: distinct ``round`` values of ``round_complete``;
* failures: ``failure_detected`` events, one incident per round (every survivor reports
  the same failure; they share the round that failed);
* per failure: the step training had reached, the step restored from (``restored``),
  steps redone (the difference), and the lost time, the sum of

  - detection and recovery: first detection to the first ``first_step_after_recovery`` (the
    event's own ``seconds_since_failure`` when the wall clocks of different hosts make the
    difference meaningless), plus, for a hang, how long the step had been stuck when it was
    detected (``stuck_seconds``);
  - redone work: the steps redone times the step time (``step_seconds`` of the failure, the
    median step of the failed round; else the median of every step time the run reported);

* goodput: 1 - lost time / training time, where training time runs from the first process
  group (``group_formed``; else the first completed round) to the end of the run (the last
  ``finished``, else the last event);
* hand-overs (:mod:`~lightning_ft.report.handovers`): signalled nodes that left for hot spares;
  the signal -> the first step after it counts as lost time;
* spares used: participants that were standby in one round and active in a later one;
* final status: ``no_restart``, else ``finished``, else ``stopped`` (the SIGTERM path:
  ``stopped``/``termination_decision``/``unhealthy_exit``), else ``incomplete`` (still
  running, or killed).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_ft.events import names as ev
from lightning_ft.exit_codes import ExitCode
from lightning_ft.report.handovers import HandOver, WorldChange, hand_overs, world_changes
from lightning_ft.report.launches import Relaunch, relaunches
from lightning_ft.report.work import RoundWork, straggler_lines, work_per_round

# fields every event has; the rest are the event's own "key fields"
_ENVELOPE = ("t", "mono", "pid", "who", "event")
MAX_VALUE_CHARS = 90  # long error texts would make the timeline unreadable
_STEP_FIELDS = ("step", "global_step")
SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp|c):\d+\]\s*")
_LOST_SECONDS_FIELDS = ("seconds_since_failure", "seconds", "lost_seconds")


@dataclass(frozen=True)
class TimelineEntry:
    """One event, with its time relative to the first event of the run."""

    seconds: float
    who: str  # display name (see display_names)
    participant_id: str  # the event's own "who"
    pid: int | None
    event: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class FailureSummary:
    round: int | None
    detected_at: float  # seconds since the start of the run
    detected_by: tuple[str, ...]
    error: str
    failure_step: int | None  # step training had reached when the failure was detected
    restored_step: int | None
    steps_redone: int | None
    #: detection (for a hang: when the step got stuck) -> first step after recovery
    recovery_seconds: float | None
    #: steps_redone x the step time (None: no step time known)
    redone_seconds: float | None
    #: recovery_seconds + redone_seconds (the recovery alone when the step time is unknown)
    lost_seconds: float | None
    recovered: bool
    #: a stage without training steps (validate, test, predict) failed and ran again from its start
    #: in the next round: recovered when it finished there; its redone work is what the failed
    #: round had done of it
    stage_rerun: bool = False


@dataclass(frozen=True)
class ParticipantSummary:
    who: str  # display name
    participant_id: str
    pids: tuple[int, ...]
    roles: tuple[str, ...]  # "active"/"standby" per round it completed, in order
    last_event: str
    last_seen: float


@dataclass(frozen=True)
class RunSummary:
    duration: float
    participants: tuple[ParticipantSummary, ...]
    rounds: int
    failures: tuple[FailureSummary, ...]
    spares_used: tuple[str, ...]
    spares_exited: tuple[str, ...]
    status: str  # "finished" | "no_restart" | "stopped" | "incomplete"
    status_detail: str
    final_step: int | None
    timeline: tuple[TimelineEntry, ...] = field(repr=False)
    #: first process group -> end of the run (None: no round trained)
    training_seconds: float | None = None
    #: the failures' lost time, summed
    lost_seconds: float = 0.0
    #: 1 - lost_seconds / training_seconds (None: no training time)
    goodput: float | None = None
    #: own work and wait per participant and round (``work`` events; stragglers)
    work: tuple[RoundWork, ...] = ()
    #: what the straggler policy found (``straggler`` events), one line each
    stragglers: tuple[str, ...] = ()
    #: launches after the first that took the run up again (their events in the same directory)
    relaunches: tuple[Relaunch, ...] = ()
    #: signalled nodes that handed their places over to hot spares (the job went on)
    hand_overs: tuple[HandOver, ...] = ()
    #: an elastic job's shrinks and grows
    world_changes: tuple[WorldChange, ...] = ()


# ---------------------------------------------------------------------- pure decisions

def _valid(events: Iterable[Any]) -> list[dict[str, Any]]:
    """Events that are dicts with an event name and a time, ordered by time (stable for equal times)."""
    good = [e for e in events
            if isinstance(e, dict) and isinstance(e.get("event"), str) and _number(e.get("t")) is not None]
    return sorted(good, key=lambda e: e["t"])


def _number(value: Any, default: Any = None) -> Any:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _int(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None


def _step_of(event: dict[str, Any]) -> int | None:
    for key in _STEP_FIELDS:
        if (step := _int(event.get(key))) is not None:
            return step
    return None


def display_names(events: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Participant id -> name to show: its ``domain`` (from ``join``) when domains tell participants
    apart (one process per node, as in the demo), else the id itself (``host:pid:local``)."""
    ids: list[str] = []
    domain_of: dict[str, set[str]] = {}
    for e in events:
        who = str(e.get("who", "?"))
        ids.append(who)
        if e.get("event") == ev.JOIN and isinstance(e.get("domain"), str) and e["domain"]:
            domain_of.setdefault(who, set()).add(e["domain"])
    ids = list(dict.fromkeys(ids))
    names = {who: next(iter(domain_of[who])) if len(domain_of.get(who, ())) == 1 else who for who in ids}
    if len(set(names.values())) != len(names):  # domains shared (several processes per host): keep ids
        return {who: who for who in ids}
    return names


def build_timeline(events: Iterable[Any]) -> tuple[TimelineEntry, ...]:
    """Every event with relative time, who, pid, name and its own fields; malformed entries dropped."""
    valid = _valid(events)
    if not valid:
        return ()
    start = valid[0]["t"]
    names = display_names(valid)
    return tuple(
        TimelineEntry(seconds=e["t"] - start, who=names[str(e.get("who", "?"))], participant_id=str(e.get("who", "?")),
                      pid=_int(e.get("pid")), event=e["event"],
                      fields={k: v for k, v in e.items() if k not in _ENVELOPE})
        for e in valid)


def _group_failures(timeline: Sequence[TimelineEntry]) -> list[list[TimelineEntry]]:
    """``failure_detected`` entries grouped into incidents: same round, or (no round) no new round in between."""
    incidents: list[list[TimelineEntry]] = []
    open_incident: list[TimelineEntry] | None = None
    for entry in timeline:
        if entry.event == ev.ROUND_COMPLETE and open_incident is not None:
            round_ = _int(entry.fields.get("round"))
            opened = _int(open_incident[0].fields.get("round"))
            if round_ is None or opened is None or round_ > opened:
                open_incident = None
        elif entry.event == ev.FAILURE_DETECTED:
            round_ = _int(entry.fields.get("round"))
            opened = _int(open_incident[0].fields.get("round")) if open_incident is not None else None
            if open_incident is not None and (round_ is None or opened is None or round_ == opened):
                open_incident.append(entry)
            else:
                open_incident = [entry]
                incidents.append(open_incident)
    return incidents


def _first_after(timeline: Sequence[TimelineEntry], event: str, start: float, end: float) -> TimelineEntry | None:
    return next((e for e in timeline if e.event == event and start <= e.seconds < end), None)


def _run_step_seconds(timeline: Sequence[TimelineEntry]) -> float | None:
    """Median of every step time the run's processes reported (the fallback price of a redone step)."""
    values = sorted(v for e in timeline if (v := _number(e.fields.get("step_seconds"))) is not None and v > 0)
    return values[len(values) // 2] if values else None


def _summarize_failure(incident: list[TimelineEntry], timeline: Sequence[TimelineEntry],
                       until: float) -> FailureSummary:
    detected_at = incident[0].seconds
    steps = [s for s in (_step_of(e.fields) for e in incident) if s is not None]
    failure_step = max(steps) if steps else None
    restored = _first_after(timeline, ev.RESTORED, detected_at, until)
    restored_step = _step_of(restored.fields) if restored else None
    first_step = _first_after(timeline, ev.FIRST_STEP_AFTER_RECOVERY, detected_at, until)
    lost = None
    if first_step is not None:
        lost = first_step.seconds - detected_at
        if lost <= 0:  # wall clocks of different hosts disagree: trust the event's own measure
            lost = next((float(v) for k in _LOST_SECONDS_FIELDS
                         if (v := _number(first_step.fields.get(k))) is not None), None)
        # a hang is detected only after the step was stuck for the hang timeout: that time is lost too
        stuck = [v for e in incident if (v := _number(e.fields.get("stuck_seconds"))) is not None]
        if lost is not None and stuck:
            lost += max(stuck)
    errors = [str(e.fields["error"]) for e in incident if e.fields.get("error")]
    redone_steps = (failure_step - restored_step) if failure_step is not None and restored_step is not None else None
    step_seconds = next((v for e in incident if (v := _number(e.fields.get("step_seconds"))) is not None and v > 0),
                        None) or _run_step_seconds(timeline)
    redone = max(redone_steps, 0) * step_seconds if redone_steps is not None and step_seconds is not None else None
    rerun = _stage_rerun(incident, timeline, until) if first_step is None else None
    if rerun is not None:
        lost, redone = rerun
        redone_steps = None
    return FailureSummary(
        round=_int(incident[0].fields.get("round")),
        detected_at=detected_at,
        detected_by=tuple(dict.fromkeys(e.who for e in incident)),
        error=errors[0] if errors else "",
        failure_step=failure_step,
        restored_step=restored_step,
        steps_redone=redone_steps,
        recovery_seconds=lost,
        redone_seconds=redone,
        lost_seconds=None if lost is None else lost + (redone or 0.0),
        recovered=first_step is not None or rerun is not None,
        stage_rerun=rerun is not None,
    )


def _stage_rerun(incident: list[TimelineEntry], timeline: Sequence[TimelineEntry],
                 until: float) -> tuple[float, float | None] | None:
    """(re-forming, redone) seconds of a failure in a stage without training steps that ran again and
    finished: from the detection to the next round's group, and what the failed round had done of
    the stage (its group -> the detection). None when no later round of it finished."""
    failed_round, detected_at = _int(incident[0].fields.get("round")), incident[0].seconds
    if failed_round is None:
        return None
    reformed = next((e for e in timeline if e.event == ev.GROUP_FORMED and detected_at <= e.seconds < until
                     and (_int(e.fields.get("round")) or -1) > failed_round), None)
    if reformed is None or not any(_finished(e) and reformed.seconds <= e.seconds < until for e in timeline):
        return None
    began = [e.seconds for e in timeline if e.event == ev.GROUP_FORMED and e.seconds <= detected_at
             and _int(e.fields.get("round")) == failed_round]
    return reformed.seconds - detected_at, (detected_at - max(began)) if began else None


def _training_seconds(timeline: Sequence[TimelineEntry]) -> float | None:
    start = next((e.seconds for e in timeline if e.event == ev.GROUP_FORMED), None)
    if start is None:
        start = next((e.seconds for e in timeline if e.event == ev.ROUND_COMPLETE), None)
    if start is None:
        return None
    finished = [e.seconds for e in timeline if _finished(e)]
    end = max(finished) if finished else timeline[-1].seconds
    return end - start if end > start else None


def _participants(timeline: Sequence[TimelineEntry]) -> tuple[ParticipantSummary, ...]:
    """Who joined the rendezvous (everyone who logged, when no one logged a ``join``: a partial log)."""
    joined = {e.who for e in timeline if e.event == ev.JOIN}
    order: dict[str, list[TimelineEntry]] = {}
    for entry in timeline:
        if entry.who in joined or not joined:
            order.setdefault(entry.who, []).append(entry)
    result = []
    for who, entries in order.items():
        roles = tuple("standby" if e.fields.get("standby") else "active"
                      for e in entries if e.event == ev.ROUND_COMPLETE)
        pids = tuple(dict.fromkeys(e.pid for e in entries if e.pid is not None))
        result.append(ParticipantSummary(who=who, participant_id=entries[0].participant_id, pids=pids, roles=roles,
                                         last_event=entries[-1].event, last_seen=entries[-1].seconds))
    return tuple(result)


def _spares_used(timeline: Sequence[TimelineEntry]) -> tuple[str, ...]:
    """Who stood by and later took an active's place after a failure or a hand-over -- not one that
    an elastic job grew to take in (it replaced nobody: a ``grow`` ended the round before, nothing
    failed in it). Launched together, an elastic job's nodes can start that way with no spare."""
    grown = {e.fields.get("round") for e in timeline if e.event == ev.GROW}
    replaced = {e.fields.get("round") for e in timeline
                if e.event in (ev.FAILURE_DETECTED, ev.HAND_OVER, ev.HANDED_OVER, ev.DECISION)}
    used: dict[str, None] = {}
    stood_by: set[str] = set()
    for entry in timeline:
        if entry.event != ev.ROUND_COMPLETE:
            continue
        if entry.fields.get("standby"):
            stood_by.add(entry.who)
            continue
        round_ = _int(entry.fields.get("round"))
        if entry.who in stood_by and entry.who not in used:
            before = None if round_ is None else round_ - 1
            if before not in grown or before in replaced:
                used[entry.who] = None
            stood_by.discard(entry.who)
    return tuple(used)


def _finished(entry: TimelineEntry) -> bool:
    """A stage completed: a participant's ``finished``, or a torchrun agent whose workers finished
    (its workers may log nothing of their own: not every torchrun script is a Lightning one)."""
    return entry.event == ev.FINISHED or (entry.event == ev.AGENT_EXIT and entry.fields.get("outcome") == "finished")


def _final_status(timeline: Sequence[TimelineEntry]) -> tuple[str, str, int | None]:
    no_restart = [e for e in timeline if e.event == ev.NO_RESTART]
    finished = [e for e in timeline if _finished(e)]
    steps = [s for s in (_step_of(e.fields) for e in finished) if s is not None]
    final_step = max(steps) if steps else None
    if no_restart:
        first = no_restart[0]
        reason = first.fields.get("reason") or first.fields.get("error") or ""
        return "no_restart", f"run stopped for good, reported by {first.who}" + (f": {reason}" if reason else ""), \
            final_step
    if finished:
        who = ", ".join(dict.fromkeys(e.who for e in finished))
        at = f" at step {final_step}" if final_step is not None else ""
        return "finished", f"finished{at} ({who})", final_step
    decisions = [e for e in timeline if e.event in (ev.TERMINATION_DECISION, ev.UNHEALTHY_EXIT)]
    stops = [e for e in timeline if e.event == ev.STOPPED]
    if decisions or stops:
        codes = sorted({str(e.fields["exit_code"]) for e in decisions if "exit_code" in e.fields})
        steps = [s for s in (_step_of(e.fields) for e in decisions) if s is not None]
        detail = "stopped on purpose (SIGTERM path)"
        if steps:
            detail += f" after step {max(steps)}"
        if codes:
            detail += f", exit code {'/'.join(codes)}"
        tiers = sorted({str(e.fields["tier"]) for e in decisions if e.fields.get("tier") not in (None, "none")})
        if tiers:
            # where the saved state is: "durable" on some rank means the step is complete there
            detail += f", state held by: {'/'.join(tiers)}"
        reason = next((str(e.fields["reason"]) for e in stops if e.fields.get("reason")), "")
        return "stopped", detail + (f": {reason}" if reason and not decisions else ""), max(steps) if steps else None
    return "incomplete", "no 'finished' event: the run is still going, or was killed", None


def summarize(events: Iterable[Any]) -> RunSummary:
    """Turn a run's events (any order; entries without an event name or time ignored) into its summary."""
    timeline = build_timeline(events)
    incidents = _group_failures(timeline)
    failures = []
    for index, incident in enumerate(incidents):
        until = incidents[index + 1][0].seconds if index + 1 < len(incidents) else float("inf")
        failures.append(_summarize_failure(incident, timeline, until))
    participants = _participants(timeline)
    spares_used = _spares_used(timeline)
    # a spare used in one stage that a later stage did not need is a spare used, not one unused
    spares_exited = tuple(who for who in dict.fromkeys(e.who for e in timeline if e.event == ev.SPARE_EXIT)
                          if who not in spares_used)
    rounds = {r for r in (_int(e.fields.get("round")) for e in timeline if e.event == ev.ROUND_COMPLETE)
              if r is not None}
    status, detail, final_step = _final_status(timeline)
    launched_again = tuple(relaunches(timeline, _step_of, _run_step_seconds(timeline)))
    if launched_again:
        detail += f" after {len(launched_again)} relaunch(es)"
    training = _training_seconds(timeline)
    handed = tuple(hand_overs(timeline, _step_of, lambda entry: entry.who))
    lost = sum(f.lost_seconds for f in failures if f.lost_seconds is not None) + \
        sum(r.lost_seconds for r in launched_again if r.lost_seconds is not None) + \
        sum(h.seconds for h in handed if h.seconds is not None)
    return RunSummary(
        duration=timeline[-1].seconds if timeline else 0.0,
        participants=participants,
        rounds=len(rounds),
        failures=tuple(failures),
        spares_used=spares_used,
        spares_exited=spares_exited,
        status=status,
        status_detail=detail,
        final_step=final_step,
        timeline=timeline,
        training_seconds=training,
        lost_seconds=lost,
        goodput=None if not training else max(0.0, 1.0 - lost / training),
        work=work_per_round(timeline),
        stragglers=straggler_lines(timeline),
        relaunches=launched_again,
        hand_overs=handed,
        world_changes=tuple(world_changes(timeline)),
    )


# ---------------------------------------------------------------------- the job's exit code

@dataclass(frozen=True)
class JobExitCode:
    """The code a job should end with, and why."""

    code: int
    reason: str


def job_exit_code(summary: RunSummary, launcher_code: int) -> JobExitCode:
    """The exit code the run's outcome implies for the whole job (e.g. a SLURM batch script).

    Why: launchers report their worst task. ``srun`` returns the highest task code, so a job
    whose hot spare replaced a SIGKILLed task (137) would end FAILED although training
    finished, and one unhealthy node among saved ones decides nothing by itself. The run's
    events say what finished and what was saved. In this order:

    * no events at all: ``launcher_code`` (the training never started or never logged);
    * status ``finished`` (a ``finished`` event and no ``no_restart``): 0;
    * status ``no_restart``: 83 -- do not requeue;
    * status ``stopped`` (the SIGTERM path):

      - a rank exited unhealthy (``unhealthy_exit``): 82 -- its healthy peers saved; requeue
        away from that node;
      - every ``termination_decision`` is 81: 81 -- stopped at the agreed step and saved.
        Ranks killed before they decided do not count against it: DDP ranks hold the same
        state, and on resume ddp_ft sends the newest snapshot to ranks that lack it;
      - another decision (e.g. 143: the save did not fit): the first such code;
      - no decision at all (stopped without ``GracefulTermination``): 143, nothing saved;

    * status ``incomplete`` (killed, or still running: no exit event decides): ``launcher_code``.
    """
    if not summary.timeline:
        return JobExitCode(launcher_code, "no events: the run never started or never logged; "
                                          "the launcher's code")
    if summary.status == "finished":
        return JobExitCode(int(ExitCode.SUCCESS), f"the run {summary.status_detail}")
    if summary.status == "no_restart":
        return JobExitCode(int(ExitCode.NO_RESTART), f"the run cannot go on ({summary.status_detail})")
    if summary.status == "stopped":
        unhealthy = [e for e in summary.timeline if e.event == ev.UNHEALTHY_EXIT]
        if unhealthy:
            who = ", ".join(dict.fromkeys(e.who for e in unhealthy))
            return JobExitCode(int(ExitCode.UNHEALTHY_NODE),
                               f"stopped; unhealthy node(s) ({who}) exited without saving, healthy peers saved")
        codes = [c for c in (_int(e.fields.get("exit_code")) for e in summary.timeline
                             if e.event == ev.TERMINATION_DECISION) if c is not None]
        if codes and all(c == ExitCode.PREEMPTED for c in codes):
            return JobExitCode(int(ExitCode.PREEMPTED), f"{summary.status_detail}; every rank that decided saved")
        if codes:
            code = next(c for c in codes if c != ExitCode.PREEMPTED)
            return JobExitCode(code, f"{summary.status_detail}; not every rank saved")
        return JobExitCode(128 + int(signal.SIGTERM),
                           f"{summary.status_detail}; no termination decision, nothing saved at the stop")
    return JobExitCode(launcher_code, f"{summary.status_detail}; the launcher's code")
