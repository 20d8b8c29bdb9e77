"""``lightning-ft report RUN_DIR``: the run's timeline and summary as text or JSON, and the job's
exit code (``--exit-code``). What is printed is computed by :mod:`.timeline` (pure)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_ft._text import printable
from lightning_ft.events import names as ev
from lightning_ft.events.log import read_events_counted
from lightning_ft.report.handovers import hand_over_lines, world_change_lines
from lightning_ft.report.timeline import MAX_VALUE_CHARS, SOURCE_LOCATION, RunSummary, job_exit_code, summarize
from lightning_ft.report.work import format_work

# ---------------------------------------------------------------------- text

def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = SOURCE_LOCATION.sub("", text)  # "[/__w/pytorch/.../pair.cc:537] " says nothing to a reader
    text = " ".join(text.split())  # tracebacks and multi-line errors on one line
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 3] + "..."


def _fmt_fields(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in fields.items())


def _fmt_seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f} s"


def _fmt_opt(value: Any) -> str:
    return "?" if value is None else str(value)


def format_timeline(summary: RunSummary) -> list[str]:
    # the periodic work reports would drown the timeline; the summary gives their medians
    entries = tuple(e for e in summary.timeline if e.event != ev.WORK)
    if not entries:
        return []
    multi_pid = {p.who for p in summary.participants if len(p.pids) > 1}
    names = [f"{e.who}[{e.pid}]" if e.who in multi_pid else e.who for e in entries]
    who_width = max(len(n) for n in names)
    event_width = max(len(e.event) for e in entries)
    return [f"  {e.seconds:+8.2f}s  {name:<{who_width}}  {e.event:<{event_width}}  {_fmt_fields(e.fields)}".rstrip()
            for e, name in zip(entries, names, strict=True)]


def format_summary(summary: RunSummary) -> list[str]:
    lines = [f"  duration      {summary.duration:.2f} s (first to last event)",
             f"  participants  {len(summary.participants)}"]
    for p in summary.participants:
        roles = " -> ".join(_compress(p.roles)) or "no round completed"
        end = "" if p.last_event in ev.EXIT_EVENTS else " (no exit event: killed, or still running)"
        lines.append(f"    {p.who:<14} {roles}; last: {p.last_event} at +{p.last_seen:.2f}s{end}")
    lines.append(f"  rounds        {summary.rounds}")
    lines.append(f"  failures      {len(summary.failures)}")
    for n, f in enumerate(summary.failures, 1):
        in_round = f" in round {f.round}" if f.round is not None else ""
        lines.append(f"    #{n}{in_round} at +{f.detected_at:.2f}s, detected by {', '.join(f.detected_by)}"
                     + (f": {_short(f.error)}" if f.error else ""))
        if f.recovered:
            unknown = "redone work unknown" + ("" if f.stage_rerun else " (no step time)")
            redone = unknown if f.redone_seconds is None else f"redone work {_fmt_seconds(f.redone_seconds)}"
            lines.append(f"       lost time {_fmt_seconds(f.lost_seconds)} = detection and recovery "
                         f"{_fmt_seconds(f.recovery_seconds)} + {redone}")
            if f.stage_rerun:
                lines.append("       the interrupted stage ran again from its start and finished")
            else:
                lines.append(f"       failure step {_fmt_opt(f.failure_step)}, restored step "
                             f"{_fmt_opt(f.restored_step)}, steps redone {_fmt_opt(f.steps_redone)}")
        else:
            lines.append("       not recovered (no first step after recovery, no stage finished after it)")
    if summary.relaunches:
        lines.append(f"  relaunches    {len(summary.relaunches)}")
    for n, r in enumerate(summary.relaunches, 1):
        resumed = "never resumed" if r.resumed_at is None else (
            f"resumed at +{r.resumed_at:.2f}s from step {r.restored_step}" if r.restored_step is not None
            else f"started over at +{r.resumed_at:.2f}s")
        lines.append(f"    #{n} {_short(r.why)} at +{r.stopped_at:.2f}s, step {_fmt_opt(r.stopped_step)}; {resumed}")
        lines.append(f"       lost time {_fmt_seconds(r.lost_seconds)} (the gap, and {_fmt_opt(r.steps_redone)} "
                     f"step(s) done again)")
    lines += hand_over_lines(summary.hand_overs)
    lines += world_change_lines(summary.world_changes)
    if summary.goodput is not None:
        lines.append(f"  goodput       {100 * summary.goodput:.1f} % (lost {summary.lost_seconds:.2f} s of "
                     f"{summary.training_seconds:.2f} s of training)")
    lines.append(f"  spares used   {', '.join(summary.spares_used) or 'none'}")
    if summary.spares_exited:
        lines.append(f"  spares exited unused  {', '.join(summary.spares_exited)}")
    lines += format_work(summary.work, summary.stragglers)
    lines.append(f"  final status  {summary.status.upper()}: {summary.status_detail}")
    return lines


def _compress(roles: Sequence[str]) -> list[str]:
    """["standby", "standby", "active"] -> ["standby x2", "active"]"""
    out: list[tuple[str, int]] = []
    for role in roles:
        if out and out[-1][0] == role:
            out[-1] = (role, out[-1][1] + 1)
        else:
            out.append((role, 1))
    return [role if count == 1 else f"{role} x{count}" for role, count in out]


def format_report(summary: RunSummary, timeline: bool = True) -> str:
    lines: list[str] = []
    if timeline:
        lines += ["Timeline (seconds since the first event):", *format_timeline(summary), ""]
    lines += ["Summary:", *format_summary(summary)]
    return "\n".join(lines)


def summary_as_dict(summary: RunSummary) -> dict[str, Any]:
    """JSON-ready summary (without the timeline)."""
    data = asdict(summary)
    data.pop("timeline")
    return data


# ---------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-ft report",
                                     description="Print the recovery timeline and summary of a run directory "
                                                 "(the events-*.jsonl files written under LIGHTNING_FT_EVENTS_DIR).")
    parser.add_argument("run_dir", help="directory holding events-*.jsonl")
    parser.add_argument("--summary-only", action="store_true", help="skip the timeline")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--exit-code", action="store_true",
                        help="exit with the code the run's outcome implies for the whole job: 0 finished, 81 "
                             "stopped and saved, 82 an unhealthy node, 83 cannot go on, 143 stopped unsaved, "
                             "else the launcher's code (needs --launcher-code)")
    parser.add_argument("--launcher-code", type=int, metavar="N",
                        help="the launcher's own exit status (e.g. srun's), used when the events decide nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.exit_code and args.launcher_code is None:
        parser.error("--exit-code needs --launcher-code N (the launcher's exit status, used when the events "
                     "decide nothing)")
    if args.launcher_code is not None and not args.exit_code:
        parser.error("--launcher-code goes with --exit-code")
    if args.launcher_code is not None and not 0 <= args.launcher_code <= 255:
        parser.error(f"--launcher-code must be an exit status 0..255, got {args.launcher_code}")

    def no_report(problem: str) -> int:
        problem = printable(problem)
        if not args.exit_code:
            print(f"lightning-ft report: {problem}", file=sys.stderr)
            return 2
        # nothing says what happened: the job keeps the launcher's code
        print(f"lightning-ft report: {problem}; job exit code {args.launcher_code} (the launcher's)", file=sys.stderr)
        return args.launcher_code

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        return no_report(f"{run_dir} is not a directory")
    try:
        events, skipped = read_events_counted(run_dir)
    except OSError as exc:
        return no_report(f"cannot read events in {run_dir}: {exc}")
    if skipped:
        print(printable(f"lightning-ft report: skipped {skipped} line(s) in {run_dir} that are not events (torn by "
                        "a kill mid-write, or not written by lightning_ft)"), file=sys.stderr)
    summary = summarize(events)
    if not summary.timeline:
        return no_report(f"no events in {run_dir} (expected events-*.jsonl files; set LIGHTNING_FT_EVENTS_DIR "
                         "for the training processes)")
    outcome = job_exit_code(summary, args.launcher_code) if args.exit_code else None
    if args.json:
        data = summary_as_dict(summary)
        if outcome is not None:
            data["job_exit_code"], data["job_exit_reason"] = outcome.code, outcome.reason
        print(json.dumps(data, indent=2))
    else:
        print(printable(format_report(summary, timeline=not args.summary_only)))
        if outcome is not None:
            print(printable(f"  job exit code {outcome.code}: {outcome.reason}"))
    return 0 if outcome is None else outcome.code


if __name__ == "__main__":
    sys.exit(main())
