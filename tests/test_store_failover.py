"""The rendezvous store fails over to a surviving participant (issue 25): real processes, real
TCPStores, real signals."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from proc_utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, in_order, ordered_start, release

pytestmark = [pytest.mark.multiprocess]

SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]


def three(processes, tmp_path, args: list[str], standalone: bool = True) -> Cluster:
    """2 actives (A, B) + 1 spare (C), with a standalone store or (``standalone=False``) A hosting it."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    if standalone:
        cluster.start_store()
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("ABC"):
        cluster.start_participant(name, [*args, *hold], LIGHTNING_FT_INFRA_RANK=str(infra_rank))
        if name == "A" and not standalone:
            cluster.wait_for_log("A", "hosting the rendezvous store")
        in_order(cluster, name, actives="AB")
    release(hold)
    return cluster


@pytest.mark.timeout(150)
def test_store_hosting_participant_killed(processes, tmp_path):
    """The participant that hosts the store (the default launch) is SIGKILLed mid-training: the
    store fails over to a survivor, the spare takes the dead rank's place, the job finishes 0."""
    cluster = three(processes, tmp_path, ["--max-steps", "150", *SLOW], standalone=False)
    cluster.wait_for_step(50, 60)
    cluster.kill("A")
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert cluster.result("B")["step"] == 150
    for name in "BC":
        assert cluster.left_cleanly(name), cluster.procs[name].log()


@pytest.mark.timeout(150)
def test_standalone_store_killed_then_a_peer(processes, tmp_path):
    """`lightning-ft store` is SIGKILLed, then an active: the store fails over to a participant,
    and the peer's death after it recovers with the spare on the new store."""
    cluster = three(processes, tmp_path, ["--max-steps", "200", *SLOW])
    cluster.wait_for_step(40, 60)
    os.kill(cluster.stores["store"].pid, signal.SIGKILL)
    cluster.wait_for_step(90, 60)
    cluster.kill("A")
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert cluster.result("B")["step"] == 200
