"""A SIGTERM to some actives while hot spares wait: the signalled hand their places over (exit 0),
the job goes on from the survivors' live state and no step is trained again (issue 38).

Real processes: a standalone ``lightning-ft store`` and ``tests/scripts/ft_train.py`` participants
(see ``tests/scripts/ft_cluster.py``); the spare is standby before training starts.
"""

from __future__ import annotations

import csv
import signal
import sys

import pytest

from lightning_ft.events.log import read_events
from lightning_ft.report.timeline import job_exit_code, summarize

from proc_utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, in_order, ordered_start, release

pytestmark = [pytest.mark.multiprocess]

SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]


def start_with_spares(cluster: Cluster, names: str, actives: str, args: list[str], **env_of: dict[str, str]) -> None:
    """``actives`` train, the other ``names`` are standby before the first step."""
    cluster.out.mkdir(parents=True, exist_ok=True)
    cluster.start_store()
    hold = ordered_start(cluster, actives)
    for name in names:
        cluster.start_participant(name, [*args, *hold], **env_of.get(name, {}))
        in_order(cluster, name, actives=actives)
    release(hold)


def assert_no_step_trained_twice(cluster: Cluster, name: str) -> list[int]:
    steps = [r["step"] for r in cluster.steps()[name]]
    assert steps == sorted(set(steps)), f"{name} trained a step again: {steps}"
    assert steps == list(range(steps[0], steps[-1] + 1)), f"{name} skipped a step: {steps}"
    return steps


@pytest.mark.timeout(180)
def test_sigterm_to_one_active_hands_over_to_the_spare_and_no_step_is_trained_again(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:3", run_id="hand-over")
    logs = tmp_path / "csv"
    start_with_spares(cluster, "ABC", "AB", ["--max-steps", "150", *SLOW, "--csv-logs", str(logs)])
    cluster.wait_for_step(20, 60)
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B", "C"], 90)
    assert codes == {"A": 0, "B": 0, "C": 0}, cluster.logs()
    assert "HANDED_OVER (0)" in cluster.procs["B"].log()
    left_at = max(r["step"] for r in cluster.steps()["B"])
    [verdict] = {tuple(e["leavers"]) for e in cluster.events_of("hand_over_verdict")}
    assert verdict == (cluster.steps()["B"][0]["rank"],), cluster.events_of("hand_over_verdict")
    assert len(cluster.events_of("handed_over")) == 1 and len(cluster.events_of("hand_over")) == 1
    # the survivor trained on without a step again; the spare started at the step B left after
    steps = assert_no_step_trained_twice(cluster, "A")
    assert steps[-1] == 150 and left_at in steps
    assert [s["step"] for s in cluster.starts("C")] == [left_at]
    assert assert_no_step_trained_twice(cluster, "C")[0] == left_at + 1
    restored = {e["step"] for e in cluster.events_of("restored") if e.get("round", 0) > 0}
    assert restored == {left_at}, restored
    assert cluster.result("A")["weights"] == cluster.result("C")["weights"]
    assert not cluster.events_of("failure_detected"), cluster.events_of("failure_detected")
    assert cluster.events_of("first_step_after_recovery")
    assert all(cluster.left_cleanly(n) for n in "ABC")
    # lightning-ft report: one hand-over, no failure, the job's code 0 (what a batch script ends with)
    summary = summarize(read_events(str(cluster.events)))
    [hand_over] = summary.hand_overs
    assert hand_over.steps_redone == 0 and hand_over.step == left_at and hand_over.seconds is not None
    assert summary.failures == () and summary.status == "finished"
    assert job_exit_code(summary, launcher_code=0).code == 0
    # the Trainer's logger agrees: a point per round, no recovery counted, the pause costed
    rows = [row for path in sorted(logs.rglob("metrics.csv")) for row in csv.DictReader(path.open(newline=""))
            if row.get("ft/recoveries")]
    assert [(float(r["ft/world_size"]), float(r["ft/recoveries"])) for r in rows] == [(2.0, 0.0), (2.0, 0.0)], rows
    assert float(rows[-1]["ft/lost_seconds"]) > 0 and 0 < float(rows[-1]["ft/goodput"]) < 1, rows


@pytest.mark.timeout(180)
def test_a_hand_over_verdict_a_store_client_forged_makes_no_healthy_node_leave(processes, tmp_path):
    """Issue 47, item 2 (no secret): a store client watching the keys wrote the termination's
    verdict first, ``leavers=[0, 1]``, during the settle after a SIGTERM to B alone; both actives
    -- the healthy one too -- left with exit 0 and the spare ended 83: the job was lost, no
    requeue. A verdict that has every active leave (or a rank leave that was neither signalled
    nor unhealthy) is refused: the whole job stops at the agreed step, saves, 81."""
    import time

    from ft_cluster import base_env

    cluster = Cluster(processes, tmp_path, "2:3", run_id="forged-hand-over")
    start_with_spares(cluster, "ABC", "AB", ["--max-steps", "300", *SLOW])
    forger = processes.start("forger", [sys.executable, str(REPO_ROOT / "tests" / "scripts" / "forge_hand_over.py"),
                                        "--endpoint", f"127.0.0.1:{cluster.port}", "--leavers", "0,1"],
                             env=base_env())
    deadline = time.monotonic() + 60
    while "watching" not in forger.log():
        assert forger.popen.poll() is None and time.monotonic() < deadline, forger.log()
        time.sleep(0.05)
    cluster.wait_for_step(20, 60)
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B", "C"], 90)
    assert "forged" in forger.log(), forger.log()  # the verdict was there before the ranks' own
    assert (codes["A"], codes["B"]) == (81, 81) and codes["C"] != 0, cluster.logs()
    assert "hand-over verdict is refused" in cluster.procs["A"].log(), cluster.logs()
    assert "\x1b" not in cluster.logs() and not cluster.events_of("handed_over")


@pytest.mark.timeout(180)
def test_an_unhealthy_signalled_node_leaves_at_once_and_the_spare_takes_its_place(processes, tmp_path):
    marker = tmp_path / "xid"
    marker.write_text("Xid 79: GPU has fallen off the bus")
    cluster = Cluster(processes, tmp_path, "2:3", run_id="unhealthy-hand-over")
    start_with_spares(cluster, "ABC", "AB", ["--max-steps", "120", *SLOW],
                      B={"LIGHTNING_FT_HEALTH_MARKERS": str(marker)})
    cluster.wait_for_step(20, 60)
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B", "C"], 90)
    assert codes == {"A": 0, "B": 82, "C": 0}, cluster.logs()
    assert "Xid 79" in cluster.procs["B"].log()
    assert cluster.result("A")["step"] == cluster.result("C")["step"] == 120
    assert cluster.result("A")["weights"] == cluster.result("C")["weights"]
    assert_no_step_trained_twice(cluster, "A")


@pytest.mark.timeout(180)
def test_after_a_hand_over_used_the_only_spare_a_second_signal_stops_the_job_with_81(processes, tmp_path):
    """B hands over to the spare C; later A is signalled too and no spare is left: A and C stop at one
    step with their snapshots (81, a requeue resumes there); B's 0 stands."""
    cluster = Cluster(processes, tmp_path, "2:3", run_id="hand-over-then-stop")
    start_with_spares(cluster, "ABC", "AB", ["--max-steps", "400", *SLOW])
    cluster.wait_for_step(20, 60)
    cluster.kill("B", signal.SIGTERM)
    assert cluster.wait(["B"], 60) == {"B": 0}, cluster.logs()
    cluster.wait_for_log("A", "first step after recovery completed")
    cluster.kill("A", signal.SIGTERM)
    codes = cluster.wait(["A", "C"], 60)
    assert codes == {"A": 81, "C": 81}, cluster.logs()
    verdicts = [e for e in cluster.events_of("hand_over_verdict") if not e["hands_over"]]
    assert verdicts and all("0 hot spare(s) are ready" in e["reason"] for e in verdicts), verdicts
    decisions = cluster.events_of("termination_decision")
    assert len({e["step"] for e in decisions}) == 1 and all(e["exit_code"] == 81 for e in decisions), decisions
    summary = summarize(read_events(str(cluster.events)))
    assert len(summary.hand_overs) == 1 and job_exit_code(summary, launcher_code=0).code == 81


@pytest.mark.timeout(180)
def test_ctrl_c_on_one_active_stops_the_whole_job_with_its_state_saved_never_a_hand_over(processes, tmp_path):
    """Issue 46, item 8: SIGINT (Ctrl-C) to B while a spare waits is no hand-over -- a user ends the
    job: A and B stop at one agreed step with their snapshots (81: a relaunch resumes there), the
    spare is not used; before, B ended 1 and A 143 "nothing saved"."""
    cluster = Cluster(processes, tmp_path, "2:3", run_id="ctrl-c")
    start_with_spares(cluster, "ABC", "AB", ["--max-steps", "400", *SLOW])
    cluster.wait_for_step(20, 60)
    cluster.kill("B", signal.SIGINT)
    codes = cluster.wait(["A", "B", "C"], 60)
    assert (codes["A"], codes["B"]) == (81, 81), cluster.logs()
    assert not [e for e in cluster.events_of("hand_over_verdict") if e["hands_over"]], cluster.logs()
    decisions = cluster.events_of("termination_decision")
    assert len({e["step"] for e in decisions}) == 1 and all(e["exit_code"] == 81 for e in decisions), decisions
    assert not cluster.steps()["C"], "the spare trained"
    summary = summarize(read_events(str(cluster.events)))
    assert summary.hand_overs == () and job_exit_code(summary, launcher_code=0).code == 81
