"""``lightning-ft report``: the pure summary on synthetic events, and the CLI's exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_ft.report.text import format_report, main, summary_as_dict
from lightning_ft.report.timeline import summarize

T0 = 1_700_000_000.0
PIDS = {"node0": 100, "node1": 101, "node2": 102}


def ev(dt: float, who: str, event: str, **fields):
    return {"t": T0 + dt, "mono": dt, "pid": PIDS.get(who, 1), "who": who, "event": event, **fields}


def recovered_run() -> list[dict]:
    """2 actives + 1 spare; node1 dies at step 42, the spare steps in, resume from the step-40 snapshot."""
    return [
        ev(0.0, "node0", "join"), ev(0.1, "node1", "join"), ev(0.2, "node2", "join"),
        ev(1.0, "node0", "round_complete", round=0, rank=0, world=2, standby=False),
        ev(1.0, "node1", "round_complete", round=0, rank=1, world=2, standby=False),
        ev(1.0, "node2", "round_complete", round=0, rank=None, world=2, standby=True),
        ev(5.0, "node0", "failure_detected", round=0, error="Connection closed by peer", detector="collective",
           step=42, step_seconds=0.25),
        ev(5.1, "node2", "failure_detected", round=0, error="heartbeat lost", detector="watch", step=41),
        ev(5.2, "node0", "round_open", round=1),
        ev(5.5, "node0", "round_complete", round=1, rank=0, world=2, standby=False),
        ev(5.5, "node2", "round_complete", round=1, rank=1, world=2, standby=False),
        ev(5.6, "node0", "snapshot_sent", step=40, to="node2"),
        ev(5.7, "node2", "snapshot_received", step=40),
        ev(5.8, "node0", "restored", step=40),
        ev(5.8, "node2", "restored", step=40),
        ev(6.5, "node0", "first_step_after_recovery", step=41, seconds_since_failure=1.5),
        ev(6.5, "node2", "first_step_after_recovery", step=41, seconds_since_failure=1.4),
        ev(9.0, "node0", "finished", step=100),
        ev(9.0, "node2", "finished", step=100),
    ]


def test_recovered_run_summary():
    events = recovered_run()
    summary = summarize(list(reversed(events)))  # order of the input does not matter
    assert summary.rounds == 2
    assert summary.status == "finished" and summary.final_step == 100
    assert summary.spares_used == ("node2",)
    assert len(summary.failures) == 1  # two detectors, one incident
    failure = summary.failures[0]
    assert failure.round == 0 and failure.detected_by == ("node0", "node2")
    assert failure.failure_step == 42 and failure.restored_step == 40 and failure.steps_redone == 2
    # lost = detection and recovery (1.5 s) + the 2 redone steps at the failed round's 0.25 s per step
    assert failure.recovery_seconds == pytest.approx(1.5) and failure.redone_seconds == pytest.approx(0.5)
    assert failure.lost_seconds == pytest.approx(2.0)
    assert failure.recovered
    assert summary.duration == pytest.approx(9.0)
    # training from the first completed round (no group_formed here) at +1.0 s to the finish at +9.0 s
    assert summary.training_seconds == pytest.approx(8.0) and summary.goodput == pytest.approx(0.75)
    assert [e.event for e in summary.timeline] == [e["event"] for e in events]
    assert summary.timeline[0].seconds == 0.0


def test_report_text_has_timeline_and_summary():
    text = format_report(summarize(recovered_run()))
    assert "+5.00s  node0  failure_detected" in text
    assert "error=Connection closed by peer" in text
    assert "lost time 2.00 s = detection and recovery 1.50 s + redone work 0.50 s" in text
    assert "failure step 42, restored step 40, steps redone 2" in text
    assert "goodput       75.0 % (lost 2.00 s of 8.00 s of training)" in text
    assert "spares used   node2" in text
    assert "FINISHED" in text
    assert "node2          standby -> active" in text
    assert "node1          active; last: round_complete at +1.00s (no exit event: killed, or still running)" in text
    assert "node0          active x2; last: finished at +9.00s\n" in text


def test_a_stop_and_a_relaunch_sharing_the_events_directory_cost_their_gap():
    """SIGTERM stops both nodes at step 50 (81); 20 s later the relaunch (new pids) restores step 50
    and finishes: one relaunch, lost 20.5 s (gap to the restore, nothing redone), goodput below 100 %."""
    first = [ev(0.0, "node0", "join"), ev(0.1, "node1", "join"),
             ev(1.0, "node0", "round_complete", round=0, rank=0, world=2, standby=False),
             ev(1.0, "node1", "round_complete", round=0, rank=1, world=2, standby=False),
             ev(1.2, "node0", "group_formed", round=0), ev(30.0, "node0", "stop_agreed", step=50),
             ev(30.5, "node0", "termination_decision", step=50, exit_code=81),
             ev(30.5, "node1", "termination_decision", step=50, exit_code=81)]
    second = [{**e, "pid": e["pid"] + 1000} for e in [
        ev(50.0, "node0", "join"), ev(50.1, "node1", "join"),
        ev(50.8, "node0", "round_complete", round=0, rank=0, world=2, standby=False),
        ev(50.8, "node1", "round_complete", round=0, rank=1, world=2, standby=False),
        ev(51.0, "node0", "restored", step=50), ev(51.0, "node1", "restored", step=50),
        ev(80.0, "node0", "finished", step=100), ev(80.0, "node1", "finished", step=100)]]
    summary = summarize(first + second)
    [relaunch] = summary.relaunches
    assert (relaunch.stopped_step, relaunch.restored_step, relaunch.steps_redone) == (50, 50, 0)
    assert relaunch.lost_seconds == pytest.approx(20.5) and "exit 81" in relaunch.why
    assert summary.status == "finished" and "after 1 relaunch" in summary.status_detail
    assert summary.lost_seconds == pytest.approx(20.5) and summary.goodput < 0.8
    text = format_report(summary)
    assert "relaunches    1" in text and "resumed at +51.00s from step 50" in text
    # the first launch alone: no relaunch
    assert summarize(first).relaunches == ()


def test_malformed_entries_are_ignored_and_unknown_events_shown_as_is():
    events = recovered_run() + [
        "not a dict", {"t": T0 + 3, "who": "node0"}, {"event": "no_time"},
        ev(3.0, "node0", "custom_thing", detail="x" * 500, nested={"a": 1}),
    ]
    summary = summarize(events)
    assert summary.failures[0].steps_redone == 2
    line = next(line for line in format_report(summary).splitlines() if "custom_thing" in line)
    assert 'nested={"a": 1}' in line and "xxx... " in line and len(line) < 200
    assert "no_time" not in format_report(summary)


def test_no_restart_and_unrecovered_failure():
    events = recovered_run()[:8] + [
        ev(6.0, "node0", "no_restart", reason="no spare left and below min_nodes"),
    ]
    summary = summarize(events)
    assert summary.status == "no_restart" and "no spare left" in summary.status_detail
    assert not summary.failures[0].recovered and summary.failures[0].lost_seconds is None
    assert summary.failures[0].restored_step is None and summary.failures[0].steps_redone is None
    assert "not recovered" in format_report(summary)


def test_two_failures_in_different_rounds_are_separate():
    events = recovered_run()[:-2] + [
        ev(7.0, "node2", "failure_detected", round=1, error="peer gone", step=50),
        ev(7.5, "node2", "round_complete", round=2, rank=0, world=1, standby=False),
        ev(7.6, "node2", "restored", step=48),
        ev(8.6, "node2", "first_step_after_recovery", step=49),
        ev(9.5, "node2", "finished", step=100),
    ]
    summary = summarize(events)
    assert [f.round for f in summary.failures] == [0, 1]
    second = summary.failures[1]
    assert (second.failure_step, second.restored_step, second.steps_redone) == (50, 48, 2)
    # no step time in this incident's events: the run's median (0.25 s) prices its 2 redone steps
    assert second.lost_seconds == pytest.approx(1.6 + 0.5)
    assert summary.lost_seconds == pytest.approx(2.0 + 2.1)
    assert summary.failures[0].restored_step == 40  # not confused by the second recovery
    assert summary.rounds == 3


def test_incomplete_run_and_spare_exit():
    events = [ev(0, "node0", "join"), ev(1, "node2", "round_complete", round=0, standby=True),
              ev(2, "node2", "spare_exit", reason="run finished")]
    summary = summarize(events)
    assert summary.status == "incomplete" and summary.spares_exited == ("node2",) and summary.spares_used == ()
    json.dumps(summary_as_dict(summary))  # JSON-ready


def test_empty():
    summary = summarize([])
    assert summary.timeline == () and summary.failures == () and summary.status == "incomplete"


def _write_events(run_dir, events, torn: bool = False):
    by_file: dict[str, list[str]] = {}
    for e in events:
        by_file.setdefault(f"events-{e['who']}-{e['pid']}.jsonl", []).append(json.dumps(e))
    for name, lines in by_file.items():
        text = "\n".join(lines) + "\n"
        if torn and name.startswith("events-node1"):
            text += '{"t": 1700000009.5, "who": "node1", "ev'  # SIGKILL mid-write
        (run_dir / name).write_text(text)


def test_cli_reads_run_dir_with_torn_line(tmp_path, capsys):
    _write_events(tmp_path, recovered_run(), torn=True)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Timeline" in out and "steps redone 2" in out and "FINISHED" in out
    assert main([str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "finished" and data["failures"][0]["steps_redone"] == 2
    assert main([str(tmp_path), "--summary-only"]) == 0
    assert "Timeline" not in capsys.readouterr().out


def test_cli_exit_codes(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "no events" in capsys.readouterr().err
    (tmp_path / "events-x-1.jsonl").write_text('{"torn')
    assert main([str(tmp_path)]) == 2


def test_cli_through_lightning_ft_command(tmp_path):
    _write_events(tmp_path, recovered_run())
    ok = subprocess.run([sys.executable, "-m", "lightning_ft.cli", "report", str(tmp_path), "--summary-only"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "spares used   node2" in ok.stdout, ok.stderr
    missing = subprocess.run([sys.executable, "-m", "lightning_ft.cli", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not a directory" in missing.stderr
    usage = subprocess.run([sys.executable, "-m", "lightning_ft.cli", "report"],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_participants_named_by_domain_when_domains_are_unique():
    run = recovered_run()
    ids = {"node0": "host:100:0", "node1": "host:101:0", "node2": "host:102:0"}
    events = []
    for e in run:
        e = dict(e, who=ids[e["who"]])
        if e["event"] == "join":
            e["domain"] = {"host:100:0": "rack-a", "host:101:0": "rack-b", "host:102:0": "rack-c"}[e["who"]]
        events.append(e)
    events.append({"t": T0 + 4.9, "pid": 7, "who": "demo", "event": "sigkill", "target": "rack-b"})
    summary = summarize(events)
    assert summary.spares_used == ("rack-c",)
    assert [p.who for p in summary.participants] == ["rack-a", "rack-b", "rack-c"]  # "demo" did not join
    assert summary.participants[0].participant_id == "host:100:0"
    line = next(line for line in format_report(summary).splitlines() if "sigkill" in line)
    assert line.split()[1:3] == ["demo", "sigkill"] and "target=rack-b" in line
    # several processes per host share a domain: ids are shown instead
    shared = [dict(e, domain="same-host") if e["event"] == "join" else e for e in events]
    assert summarize(shared).spares_used == ("host:102:0",)


def test_error_text_is_shortened_for_the_timeline():
    events = recovered_run()
    events[6] = dict(events[6], error="RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                                      "pair.cc:537] Read error\n  Connection reset by peer")
    text = format_report(summarize(events))
    assert "error=RuntimeError: Read error Connection reset by peer" in text
    assert "pair.cc" not in text


def test_sigterm_path_is_reported_as_stopped():
    events = recovered_run()[:6] + [
        ev(4.0, "node0", "termination_signal", signal="SIGTERM", step=30),
        ev(4.1, "node0", "stop_agreed", step=30, stop_step=31, proposer=0, reason="SIGTERM"),
        ev(4.3, "node0", "termination_decision", step=31, action="save-then-exit", exit_code=81),
        ev(4.3, "node1", "termination_decision", step=31, action="save-then-exit", exit_code=81),
        ev(4.4, "node0", "stopped", round=0, reason="termination in progress"),
    ]
    summary = summarize(events)
    assert summary.status == "stopped" and summary.final_step == 31
    assert summary.status_detail == "stopped on purpose (SIGTERM path) after step 31, exit code 81"
    assert summary.failures == ()


def test_a_hang_counts_the_time_the_step_was_stuck_as_lost():
    events = [
        ev(0.0, "node0", "round_complete", round=0, rank=0, world=2, standby=False),
        ev(0.0, "node1", "round_complete", round=0, rank=1, world=2, standby=False),
        ev(70.0, "node0", "failure_detected", round=0, step=42, detector="hang", stalled=[1],
           error="step 43 ran 60.0s, longer than the hang timeout", stuck_seconds=60.0),
        ev(70.5, "node0", "restored", step=40),
        ev(71.0, "node0", "first_step_after_recovery", step=41, seconds_since_failure=1.0),
    ]
    failure = summarize(events).failures[0]
    assert failure.failure_step == 42 and failure.steps_redone == 2
    # no step time anywhere: the redone work is unknown and the lost time is the recovery alone
    assert failure.lost_seconds == pytest.approx(61.0) and failure.redone_seconds is None
    assert "redone work unknown (no step time)" in format_report(summarize(events))


def test_a_stopped_run_says_which_tier_holds_the_state():
    events = [ev(0, "node0", "join"),
              ev(1, "node0", "termination_decision", step=30, action="save_then_exit", exit_code=81, tier="durable"),
              ev(1, "node1", "termination_decision", step=30, action="save_then_exit", exit_code=81,
                 tier="memory+shard")]
    summary = summarize(events)
    assert summary.status == "stopped"
    assert "state held by: durable/memory+shard" in format_report(summary)


def test_work_per_rank_says_who_the_others_wait_for_and_which_straggler_was_found():
    events = [
        ev(0.0, "node0", "join"), ev(0.1, "node1", "join"),
        ev(1.0, "node0", "work", round=0, step=25, steps=25, busy_seconds=0.05, wait_seconds=0.001),
        ev(1.0, "node1", "work", round=0, step=25, steps=25, busy_seconds=0.05, wait_seconds=0.002),
        ev(9.0, "node0", "work", round=0, step=50, steps=25, busy_seconds=0.20, wait_seconds=0.001),
        ev(9.0, "node1", "work", round=0, step=50, steps=25, busy_seconds=0.05, wait_seconds=0.15),
        ev(9.5, "node0", "straggler", round=0, rank=0, step=50, action="warn", score=4.0, reason="slow"),
        ev(9.6, "node0", "work", round=0, step="bad", busy_seconds="x", wait_seconds=0.1),
    ]
    summary = summarize(events)
    assert [(w.who, w.busy_seconds, w.wait_seconds) for w in summary.work] == [("node0", 0.20, 0.001),
                                                                              ("node1", 0.05, 0.15)]
    text = format_report(summary)
    assert "the others wait for node0 (4.00x their own work)" in text
    assert "rank 0 at step 50: warn (score 4.0) by node0" in text
    assert "busy_seconds" not in text.split("Summary:")[0]  # work reports stay out of the timeline


def test_a_hand_over_is_reported_with_its_cost_and_the_job_exit_code_stays_0():
    """node1 signalled at +4.0 s, hands over after step 30 (exit 0); the spare node2 steps in and the
    job's first step after it comes at +4.8 s: 0.8 s lost, no step redone, no failure."""
    from lightning_ft.report.timeline import job_exit_code

    events = [
        ev(0.0, "node0", "join"), ev(0.1, "node1", "join"), ev(0.2, "node2", "join"),
        ev(1.0, "node0", "round_complete", round=0, rank=0, world=2, standby=False),
        ev(1.0, "node1", "round_complete", round=0, rank=1, world=2, standby=False),
        ev(1.0, "node2", "round_complete", round=0, rank=None, world=2, standby=True),
        ev(4.0, "node1", "termination_signal", signal="SIGTERM", step=29),
        ev(4.5, "node1", "hand_over_verdict", step=30, hands_over=True, leavers=[1], leaving=True, reason="r",
           seconds_since_signal=0.5),
        ev(4.5, "node0", "hand_over_verdict", step=30, hands_over=True, leavers=[1], leaving=False, reason="r",
           seconds_since_signal=0.4),
        ev(4.55, "node1", "handed_over", round=0, step=30, reason="r"),
        ev(4.55, "node0", "hand_over", round=0, step=30, reason="r"),
        ev(4.7, "node0", "round_complete", round=1, rank=0, world=2, standby=False),
        ev(4.7, "node2", "round_complete", round=1, rank=1, world=2, standby=False),
        ev(4.75, "node0", "restored", round=1, step=30),
        ev(4.75, "node2", "restored", round=1, step=30),
        ev(4.8, "node0", "first_step_after_recovery", round=1, step=31, seconds_since_failure=0.25),
        ev(9.0, "node0", "finished", step=100), ev(9.0, "node2", "finished", step=100),
    ]
    summary = summarize(events)
    [hand_over] = summary.hand_overs
    assert hand_over.left == ("node1",) and hand_over.step == 30 and hand_over.restored_step == 30
    assert hand_over.steps_redone == 0 and hand_over.seconds == pytest.approx(0.8)
    assert summary.failures == () and summary.status == "finished" and summary.spares_used == ("node2",)
    assert summary.lost_seconds == pytest.approx(0.8)
    text = format_report(summary)
    assert "hand-overs    1" in text and "node1 left after step 30 (exit 0)" in text and "steps redone 0" in text
    assert job_exit_code(summary, launcher_code=0).code == 0


def test_a_spare_used_in_one_stage_and_not_needed_in_the_next_is_listed_once_as_used():
    """node2 stood by, took node1's place after a failure, and left 0 in the next stage (not
    needed): one spare used, none exited unused (issue 46 item 8: it was listed as both)."""
    events = [*recovered_run(), ev(30.0, "node2", "spare_exit", reason="not needed in stage 1")]
    summary = summarize(events)
    assert summary.spares_used == ("node2",) and summary.spares_exited == ()
    assert "spares exited unused" not in format_report(summary)


def test_a_node_an_elastic_job_grew_to_take_in_is_no_spare_used():
    """1:2, both launched together: node1 stood by in round 0 and joined when the job grew -- it
    replaced nobody, so no spare was used (issue 46 item 4: the report said one was)."""
    events = [
        ev(0.0, "node0", "join"), ev(0.1, "node1", "join"),
        ev(1.0, "node0", "round_complete", round=0, rank=0, world=1, standby=False),
        ev(1.0, "node1", "round_complete", round=0, rank=None, world=1, standby=True),
        ev(4.0, "node0", "grow", round=0, step=12, reason="1 participant arrived"),
        ev(4.5, "node0", "round_complete", round=1, rank=0, world=2, standby=False),
        ev(4.5, "node1", "round_complete", round=1, rank=1, world=2, standby=False),
        ev(9.0, "node0", "finished", step=40), ev(9.0, "node1", "finished", step=40),
    ]
    summary = summarize(events)
    assert summary.spares_used == () and summary.failures == ()
    assert [(c.kind, c.before, c.after) for c in summary.world_changes] == [("grow", 1, 2)]
    # a spare that takes a lost active's place in a grown job still counts
    later = [*events[:-2], ev(6.0, "node2", "join"),
             ev(6.1, "node2", "round_complete", round=1, rank=None, world=2, standby=True),
             ev(7.0, "node0", "failure_detected", round=1, step=30, error="peer lost", detector="collective"),
             ev(7.5, "node0", "round_complete", round=2, rank=0, world=2, standby=False),
             ev(7.5, "node2", "round_complete", round=2, rank=1, world=2, standby=False),
             ev(9.0, "node0", "finished", step=40)]
    assert summarize(later).spares_used == ("node2",)


def test_a_test_stage_killed_and_run_again_is_a_recovery_that_cost_the_rerun():
    """test() (stage 1, no training steps) loses node1 at +12 s; node0 and the spare node2 re-form
    at +13 s and run the whole stage again, which finishes: recovered, lost 1 s of re-forming + the
    2 s of the stage the failed round had done (issue 46 item 8: "not recovered, goodput 100 %")."""
    events = [
        ev(0.0, "node0", "join"), ev(0.1, "node1", "join"), ev(0.2, "node2", "join"),
        ev(1.0, "node0", "round_complete", round=0, rank=0, world=2, standby=False),
        ev(1.0, "node1", "round_complete", round=0, rank=1, world=2, standby=False),
        ev(1.0, "node2", "round_complete", round=0, rank=None, world=2, standby=True),
        ev(1.1, "node0", "group_formed", round=0), ev(1.1, "node1", "group_formed", round=0),
        ev(9.0, "node0", "finished", round=0, step=50), ev(9.0, "node1", "finished", round=0, step=50),
        ev(10.0, "node0", "round_complete", round=1, rank=0, world=2, standby=False),
        ev(10.0, "node1", "round_complete", round=1, rank=1, world=2, standby=False),
        ev(10.0, "node0", "group_formed", round=1), ev(10.0, "node1", "group_formed", round=1),
        ev(12.0, "node0", "failure_detected", round=1, step=50, error="peer lost", detector="collective"),
        ev(12.1, "node0", "decision", round=1, kind="peer_lost", action="recover"),
        ev(12.8, "node0", "round_complete", round=2, rank=0, world=2, standby=False),
        ev(12.8, "node2", "round_complete", round=2, rank=1, world=2, standby=False),
        ev(13.0, "node0", "group_formed", round=2), ev(13.0, "node2", "group_formed", round=2),
        ev(16.0, "node0", "finished", round=2, step=50), ev(16.0, "node2", "finished", round=2, step=50),
    ]
    summary = summarize(events)
    [failure] = summary.failures
    assert failure.recovered and failure.stage_rerun and failure.steps_redone is None
    assert failure.recovery_seconds == pytest.approx(1.0) and failure.redone_seconds == pytest.approx(2.0)
    assert summary.lost_seconds == pytest.approx(3.0) and summary.goodput < 1.0
    assert summary.spares_used == ("node2",)
    text = format_report(summary)
    assert "ran again from its start and finished" in text and "not recovered" not in text


HOSTILE_LINES = [
    b'{"t": 1700000003.0, "who": "x", "event": "\xff\xfe not utf-8"}\n',
    b"[" * 100_000 + b"]" * 100_000 + b"\n",
    b'{"t": 1700000003.0, "who": "x", "event": "join", "pid": ' + b"7" * 5_000 + b"}\n",
    b'{"t": NaN, "who": "x", "event": "join"}\n',
    b'{"t": "soon", "who": "x", "event": "join"}\n',
    b'{"t": 1700000003.0, "who": "x", "event": ["join"]}\n',
    b'"just a string"\n',
]


@pytest.mark.parametrize("exit_code", [False, True])
def test_hostile_lines_are_skipped_and_counted_and_control_sequences_never_reach_the_terminal(tmp_path, exit_code):
    """Issue 47, item 4: invalid UTF-8, 100,000 nested brackets or a 5,000-digit number crashed the
    report with exit 1 -- also ``--exit-code``, which the SLURM scripts take the job's exit code
    from -- and ESC/OSC/C1 sequences in event fields reached the terminal raw."""
    run = recovered_run()
    run[4]["error"] = "\x1b]0;owned\x07\x1b[2J\u009b31m\u202egnp.exe"  # OSC title, clear screen, C1 CSI, bidi
    _write_events(tmp_path, run)
    with open(tmp_path / "events-planted-1.jsonl", "wb") as planted:
        planted.writelines(HOSTILE_LINES)
    argv = [sys.executable, "-m", "lightning_ft.cli", "report", str(tmp_path)]
    if exit_code:
        argv += ["--exit-code", "--launcher-code", "1"]
    done = subprocess.run(argv, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")  # finished: the job's code is 0
    out, err = done.stdout.decode(), done.stderr.decode()
    assert f"skipped {len(HOSTILE_LINES)} line(s)" in err and "Traceback" not in err, err
    assert "FINISHED" in out
    assert not any(c in out + err for c in ("\x1b", "\x07", "\u009b", "\u202e")), out
    assert "\\x1b]0;owned\\x07" in out  # shown, escaped


def test_the_events_directory_must_be_private_or_nothing_is_written_there(tmp_path, caplog):
    """A directory another user could write is where they would plant the events the job's exit
    code is read from: the log is not written there (one warning), as snapshot directories."""
    from lightning_ft.events.log import NullEventLog, open_event_log

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert isinstance(open_event_log("p", shared), NullEventLog)
    assert "writable by its group and other users" in caplog.text
    made = tmp_path / "new" / "events"
    log = open_event_log("p", made)
    log.emit("join")
    assert (made.stat().st_mode & 0o777) == 0o700 and list(made.glob("events-p-*.jsonl"))
