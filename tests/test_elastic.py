"""Elastic world size (issue 38, part 2): ``LIGHTNING_FT_ELASTIC=1`` with ``NNODES=MIN:MAX`` -- every
participant up to MAX trains; a node lost without a spare shrinks the job in-process from the live
state, the global batch kept by gradient accumulation and the data re-sharded by sample position,
so the training math is that of the uninterrupted run.

Real processes: a standalone ``lightning-ft store`` and ``tests/scripts/ft_train.py`` participants
with ``lightning_ft.data.resumable_loader`` (``--loader-data``).
"""

from __future__ import annotations

import csv
import signal
import sys

import pytest

from lightning_ft.events.log import read_events
from lightning_ft.report.text import format_report
from lightning_ft.report.timeline import job_exit_code, summarize

from proc_utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster

pytestmark = [pytest.mark.multiprocess]

#: 256 samples in batches of 8: 16 optimizer steps an epoch at 2 ranks (and at 1 rank accumulating 2)
ARGS = ["--loader-data", "--step-sleep", "0.03", "--snapshot-every", "10", "--max-steps", "60"]


def start_reference(processes, tmp_path, args: list[str]) -> Cluster:
    """The uninterrupted run to compare with: 2 ranks, not elastic, the same data order."""
    reference = Cluster(processes, tmp_path / "reference", "2:2", run_id="elastic-reference")
    reference.out.mkdir(parents=True)
    reference.start_store("reference-store")
    for name in ("R0", "R1"):
        reference.start_participant(name, args)
    return reference


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["lost", "signalled"])
def test_an_elastic_job_shrinks_when_a_node_is_lost_or_signalled_and_keeps_the_math(processes, tmp_path, how):
    """1:2 elastic, no spare: B is SIGKILLed (A recovers from its live state) or SIGTERMed (B hands its
    place over: exit 0); A goes on alone, accumulating 2 micro-batches per step over the rest of the
    epoch re-sharded by position, and ends with the weights of an uninterrupted 2-rank run."""
    reference = start_reference(processes, tmp_path, ARGS)
    cluster = Cluster(processes, tmp_path / "job", "1:2", run_id="elastic")
    # both must train in round 0: the job's start window (60 s here, whatever the machine's load)
    # holds it until both arrived (max)
    cluster.start(["A", "B"], [*ARGS, "--ft-option", "elastic_start_window=60"], LIGHTNING_FT_ELASTIC="1")
    cluster.wait_for_step(20, 90, among=["A", "B"])
    sig = signal.SIGKILL if how == "lost" else signal.SIGTERM
    cluster.kill("B", sig)
    codes = cluster.wait(["A", "B"], 90)
    assert codes == {"A": 0, "B": -9 if sig == signal.SIGKILL else 0}, cluster.logs()
    assert reference.wait(["R0", "R1"], 120) == {"R0": 0, "R1": 0}, reference.logs()
    pid = cluster.procs["A"].pid
    worlds = [(e["round"], e["world"]) for e in cluster.events_of("round_complete") if e["pid"] == pid]
    assert worlds == [(0, 2), (1, 1)], worlds
    assert "1 rank(s) train; each accumulates 2 micro-batches" in cluster.procs["A"].log()
    assert cluster.result("A")["step"] == 60
    expected = reference.result("R0")["weights"]
    assert cluster.result("A")["weights"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.timeout(240)
def test_an_elastic_job_that_shrank_grows_back_when_a_node_arrives_and_keeps_the_math(processes, tmp_path):
    """1:2 elastic: B is lost, A trains alone (accumulating 2); a new participant C arrives and A's
    round takes it in at a step boundary (at most once per ``elastic_grow_interval``, 1 s here):
    2 -> 1 -> 2 ranks, and the weights of an uninterrupted 2-rank run (float tolerance)."""
    args = [*ARGS[:-1], "160"]
    reference = start_reference(processes, tmp_path, args)
    cluster = Cluster(processes, tmp_path / "job", "1:2", run_id="elastic-grow")
    logs = tmp_path / "logs"
    options = ["--ft-option", "last_call_timeout=60", "--ft-option", "elastic_grow_interval=1", "--csv-logs", str(logs)]
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    for name in ("A", "B"):
        # A slows down after the loss, so that C arrives while it still trains
        cluster.start_participant(name, [*args, *options], LIGHTNING_FT_ELASTIC="1", FT_TRAIN_SLOW="25:4")
    cluster.wait_for_step(20, 90, among=["A", "B"])
    cluster.kill("B")
    cluster.wait_for_log("A", "first step after recovery completed")
    cluster.start_participant("C", [*args, *options], LIGHTNING_FT_ELASTIC="1")
    assert cluster.wait(["A", "C"], 150) == {"A": 0, "C": 0}, cluster.logs()
    assert reference.wait(["R0", "R1"], 120) == {"R0": 0, "R1": 0}, reference.logs()
    pid = cluster.procs["A"].pid
    worlds = [(e["round"], e["world"]) for e in cluster.events_of("round_complete") if e["pid"] == pid]
    assert worlds == [(0, 2), (1, 1), (2, 2)], worlds
    assert "elastic: 1 participant(s) arrived while 1 train" in cluster.procs["A"].log()
    assert len(cluster.events_of("grow")) == 1
    # lightning-ft report: the shrink and the grow, each with what it cost; the job's code 0
    summary = summarize(read_events(str(cluster.events)))
    assert [(c.round, c.kind, c.before, c.after) for c in summary.world_changes] == \
        [(1, "shrink", 2, 1), (2, "grow", 1, 2)], summary.world_changes
    assert all(c.seconds is not None and c.seconds > 0 for c in summary.world_changes), summary.world_changes
    assert "round 2: grow 1 -> 2 ranks" in format_report(summary)
    assert job_exit_code(summary, launcher_code=0).code == 0
    # the Trainer's logger: the world size at the first step of every round (it changes only with a round)
    with open(logs / "lightning_logs" / "version_0" / "metrics.csv", newline="") as f:
        points = [float(row["ft/world_size"]) for row in csv.DictReader(f) if row.get("ft/world_size")]
    assert points == [2.0, 1.0, 2.0], points
    assert cluster.result("A")["step"] == cluster.result("C")["step"] == 160
    assert cluster.result("A")["weights"] == cluster.result("C")["weights"]
    expected = reference.result("R0")["weights"]
    assert cluster.result("A")["weights"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.timeout(180)
def test_a_node_that_missed_the_start_window_is_taken_in_at_once_not_after_the_grow_interval(processes, tmp_path):
    """Issue 46, item 4: 1:2 elastic, A started alone (a 1 s start window), B once A trains: the
    job's first round takes B in at the next steps -- no 30 s ``elastic_grow_interval`` (default)
    -- and the report names it a grow, not a spare used."""
    cluster = Cluster(processes, tmp_path, "1:2", run_id="elastic-young")
    args = [*ARGS[:-1], "400", "--ft-option", "elastic_start_window=1"]
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    cluster.start_participant("A", args, LIGHTNING_FT_ELASTIC="1")
    cluster.wait_for_step(10, 90, among=["A"])
    cluster.start_participant("B", args, LIGHTNING_FT_ELASTIC="1")
    assert cluster.wait(["A", "B"], 150) == {"A": 0, "B": 0}, cluster.logs()
    pid = cluster.procs["A"].pid
    worlds = [(e["round"], e["world"]) for e in cluster.events_of("round_complete") if e["pid"] == pid]
    assert worlds == [(0, 1), (1, 2)], worlds
    assert cluster.result("A")["step"] == cluster.result("B")["step"] == 400
    assert cluster.result("A")["weights"] == cluster.result("B")["weights"]
    summary = summarize(read_events(str(cluster.events)))
    assert summary.spares_used == () and [c.kind for c in summary.world_changes] == ["grow"], summary
