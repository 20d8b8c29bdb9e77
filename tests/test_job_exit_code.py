"""``lightning-ft report --exit-code``: the job's code from the run's outcome, not from the worst task."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_ft.report.text import main
from lightning_ft.report.timeline import job_exit_code, summarize

T0 = 1_700_000_000.0


def ev(dt: float, who: str, event: str, **fields):
    return {"t": T0 + dt, "mono": dt, "pid": 1, "who": who, "event": event, **fields}


START = [ev(0.0, "a", "join"), ev(0.0, "b", "join"), ev(0.0, "c", "join"),
         ev(1.0, "a", "round_complete", round=0, rank=0, world=2, standby=False),
         ev(1.0, "b", "round_complete", round=0, rank=1, world=2, standby=False),
         ev(1.0, "c", "round_complete", round=0, rank=None, world=2, standby=True)]
RECOVERED = START + [ev(5.0, "a", "failure_detected", round=0, step=42, error="peer gone"),
                     ev(5.5, "c", "snapshot_received", step=40),
                     ev(6.0, "a", "first_step_after_recovery", step=41, seconds_since_failure=1.0),
                     ev(9.0, "a", "finished", round=1, step=100), ev(9.0, "c", "finished", round=1, step=100)]


def code(events, launcher_code=137):
    return job_exit_code(summarize(events), launcher_code).code


def decision(dt, who, exit_code, step=31):
    return ev(dt, who, "termination_decision", step=step, action="save-then-exit", exit_code=exit_code)


def test_a_run_that_recovered_and_finished_is_0_whatever_the_launcher_said():
    outcome = job_exit_code(summarize(RECOVERED), 137)  # srun: the highest task code, a SIGKILLed task
    assert outcome.code == 0 and "finished at step 100" in outcome.reason


def test_no_restart_is_83():
    assert code(START + [ev(5.0, "a", "no_restart", reason="no hot spare left")], 1) == 83


def test_every_rank_saved_is_81_and_a_rank_killed_before_deciding_does_not_count():
    stopped = START + [decision(4.0, "rank0", 81), decision(4.0, "rank1", 81), ev(4.1, "c", "spare_exit")]
    assert code(stopped, 81) == 81
    assert code(stopped[:-2], 137) == 81  # rank 1 was SIGKILLed before its decision: rank 0's copy suffices


def test_an_unhealthy_node_is_82_even_when_its_peers_saved():
    events = START + [ev(4.0, "rank1", "unhealthy_exit", exit_code=82, reasons=["marker"]), decision(4.2, "rank0", 81)]
    outcome = job_exit_code(summarize(events), 82)
    assert outcome.code == 82 and "rank1" in outcome.reason


def test_a_rank_that_could_not_save_makes_it_its_code():
    assert code(START + [decision(4.0, "rank0", 81), decision(4.1, "rank1", 143)], 143) == 143
    assert code(START + [decision(4.0, "rank0", 138)], 138) == 138  # stopped by SIGUSR1, nothing saved


def test_stopped_without_any_decision_is_143():
    # e.g. graceful_termination=False: Lightning's own SIGTERM handling stops without saving
    assert code(START + [ev(4.0, "a", "stopped", round=0, reason="SystemExit")], 0) == 143


def test_incomplete_or_empty_runs_keep_the_launchers_code():
    assert code(START, 137) == 137  # killed before any exit event
    assert code(START + [ev(3.0, "rank0", "termination_signal", signal="SIGTERM", step=3)], 143) == 143
    assert code([], 9) == 9


def test_cli_prints_the_summary_and_exits_with_the_jobs_code(tmp_path, capsys):
    (tmp_path / "events-a-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in RECOVERED))
    assert main(["--exit-code", "--launcher-code", "137", "--summary-only", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FINISHED" in out and "job exit code 0: the run finished" in out
    assert main(["--exit-code", "--launcher-code", "137", "--json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["job_exit_code"] == 0
    # nothing to read: the launcher's code stands, and the report says so
    assert main(["--exit-code", "--launcher-code", "137", str(tmp_path / "missing")]) == 137
    assert "job exit code 137 (the launcher's)" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--exit-code", "--launcher-code", "1", str(empty)]) == 1


@pytest.mark.parametrize("argv", [["--exit-code"], ["--launcher-code", "3"], ["--exit-code", "--launcher-code", "256"]])
def test_cli_refuses_incomplete_options(tmp_path, argv, capsys):
    with pytest.raises(SystemExit) as raised:
        main([*argv, str(tmp_path)])
    assert raised.value.code == 2 and "launcher-code" in capsys.readouterr().err


def test_cli_through_lightning_ft_command(tmp_path):
    (tmp_path / "events-a-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in START))
    done = subprocess.run([sys.executable, "-m", "lightning_ft.cli", "report", "--exit-code", "--launcher-code",
                           "143", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and "job exit code 143" in done.stdout, done.stderr
