"""``Trainer(devices=N)`` under ``ddp_ft``: the node's first process starts the other N-1, each a
participant; a node's processes are active or stand by together, and a lost node (all of its
processes) is replaced by a spare node whole."""

from __future__ import annotations

import json
import signal

import pytest

from ft_cluster import Cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_devices_2_a_lost_node_is_replaced_by_a_spare_node(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:3", run_id="devices-2")
    args = ["--devices", "2", "--max-steps", "60", "--step-sleep", "0.05", "--snapshot-every", "10"]
    cluster.start(["A", "B"], args)
    cluster.wait_for_step(5, 90, among=["A", "B"])
    cluster.start_participant("C", args)
    cluster.wait_for_log("C", "started this node's processes 1")
    cluster.wait_for_step(25, 90, among=["A", "B"])
    cluster.procs["A"].signal_group(signal.SIGKILL)  # the node dies: its first process and the one it started
    codes = cluster.wait(["A", "B", "C"], 150)
    assert codes == {"A": -9, "B": 0, "C": 0}, cluster.logs()
    results = [json.loads(p.read_text()) for p in sorted(cluster.out.glob("result-*.json"))]
    # B's two processes and C's two finished the job together (A's two never wrote a result)
    assert len(results) == 4 and {r["step"] for r in results} == {60}, results
    assert all(r["trained"] for r in results) and sorted(r["rank"] for r in results) == [0, 1, 2, 3], results
    assert len({json.dumps(r["weights"]) for r in results}) == 1
    formed = [e for e in cluster.events_of("group_formed")]
    assert {e["world"] for e in formed} == {4}, formed  # 2 nodes x 2 devices in both rounds
    assert "started this node's processes 1" in cluster.procs["B"].log()
