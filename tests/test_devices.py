"""``Trainer(devices=N)`` under ``ddp_ft``: the node's first process starts the other N-1, each a
participant; a node's processes are active or stand by together, and a lost node (all of its
processes) is replaced by a spare node whole."""

from __future__ import annotations

import json
import signal

import pytest

from ft_cluster import Cluster
from proc_utils import wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def uninterrupted_weights(processes, root, args: list[str]) -> str:
    """The final weights of the same job run without a fault (2 nodes x 2 devices)."""
    reference = Cluster(processes, root, "2:2", run_id="devices-2-reference")
    reference.out.mkdir(parents=True)
    reference.start_store("reference-store")
    for name in ("RA", "RB"):
        reference.start_participant(name, args)
    assert reference.wait(["RA", "RB"], 150) == {"RA": 0, "RB": 0}, reference.logs()
    results = [json.loads(p.read_text()) for p in sorted(reference.out.glob("result-*.json"))]
    assert len(results) == 4 and len({json.dumps(r["weights"]) for r in results}) == 1, results
    return json.dumps(results[0]["weights"])


@pytest.mark.timeout(300)
def test_devices_2_a_lost_node_is_replaced_by_a_spare_node(processes, tmp_path):
    """...and the recovered job ends with the weights of the uninterrupted one (a resumable loader:
    its position is in every snapshot), not only with four processes that agree."""
    cluster = Cluster(processes, tmp_path / "recovered", "2:3", run_id="devices-2")
    args = ["--devices", "2", "--max-steps", "60", "--step-sleep", "0.05", "--snapshot-every", "10", "--loader-data"]
    # the spare node's two processes stand by before the node is lost: the job holds its first
    # step until they do (its second process is a fresh interpreter, ~8 s on a loaded machine: it
    # once arrived after the loss, joined the next round directly, and the record differed). No
    # hang detection while held: an idle rank reads its peers' heartbeats, and one starved 2 s by
    # the spare's start-up on a loaded machine was once judged frozen (the node's loss is seen by
    # the collective)
    hold = tmp_path / "hold-first-step"
    hold.touch()
    cluster.start(["A", "B"], [*args, "--hold-first-step-while", str(hold), "--ft-option", "hang_detection=false"])
    cluster.wait_for_log("A", "process group up", 90)
    cluster.start_participant("C", args)
    assert wait_for(lambda: cluster.procs["C"].log().count(" is standby") >= 2, 90), cluster.logs()
    hold.unlink()
    cluster.wait_for_step(25, 90, among=["A", "B"])
    cluster.procs["A"].signal_group(signal.SIGKILL)  # the node dies: its first process and the one it started
    codes = cluster.wait(["A", "B", "C"], 150)
    assert codes == {"A": -9, "B": 0, "C": 0}, cluster.logs()
    results = [json.loads(p.read_text()) for p in sorted(cluster.out.glob("result-*.json"))]
    # B's two processes and C's two finished the job together (A's two never wrote a result)
    assert len(results) == 4 and {r["step"] for r in results} == {60}, results
    assert all(r["trained"] for r in results) and sorted(r["rank"] for r in results) == [0, 1, 2, 3], results
    assert len({json.dumps(r["weights"]) for r in results}) == 1
    # equal to float rounding, not bit for bit: 4.9e-8 relative, the same with keep_ranks (a world
    # of 4 sums each gradient in an order that can differ once after the recovery -- suspected: the
    # re-wrapped DDP's first step reduces in its initial bucket layout, before it rebuilds them; a
    # world of 2, devices=1, sums two values and is exact). Reported as 0.21 in issue 46.
    expected = json.loads(uninterrupted_weights(processes, tmp_path / "reference", args))
    got = results[0]["weights"]
    distance = sum((a - b) ** 2 for a, b in zip(got, expected, strict=True)) ** 0.5
    assert distance <= 1e-6 * sum(b * b for b in expected) ** 0.5, (distance, got, expected)
    formed = [e for e in cluster.events_of("group_formed")]
    assert {e["world"] for e in formed} == {4}, formed  # 2 nodes x 2 devices in both rounds
    assert "started this node's processes 1" in cluster.procs["B"].log()
