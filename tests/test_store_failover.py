"""The rendezvous store fails over to a surviving participant (issue 25): real processes, real
TCPStores, real signals."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from proc_utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, in_order, ordered_start, release

pytestmark = [pytest.mark.multiprocess]

SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]
OPEN_ROUND = "lightning_ft.runtime.session:Session.open_round"
PROPOSE = "lightning_ft.termination.coordination:StoreStopCoordinator.propose"


def three(processes, tmp_path, args: list[str], standalone: bool = True, **env: str) -> Cluster:
    """2 actives (A, B) + 1 spare (C), with a standalone store or (``standalone=False``) A hosting it."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    if standalone:
        cluster.start_store()
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("ABC"):
        cluster.start_participant(name, [*args, *hold], LIGHTNING_FT_INFRA_RANK=str(infra_rank), **env)
        if name == "A" and not standalone:
            cluster.wait_for_log("A", "hosting the rendezvous store")
        in_order(cluster, name, actives="AB")
    release(hold)
    return cluster


@pytest.mark.timeout(150)
@pytest.mark.parametrize("secret", ["no-secret", "job-secret"])
def test_store_hosting_participant_killed(processes, tmp_path, secret):
    """The participant that hosts the store (the default launch) is SIGKILLed mid-training: the
    store fails over to a survivor, the spare takes the dead rank's place, the job finishes 0.
    With a job secret every rebuilt value is sealed as before: none is refused."""
    env = {"LIGHTNING_FT_SECRET": "a-secret-for-this-test"} if secret == "job-secret" else {}
    cluster = three(processes, tmp_path, ["--max-steps", "150", *SLOW], standalone=False, **env)
    cluster.wait_for_step(50, 60)
    cluster.kill("A")
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert cluster.result("B")["step"] == 150
    for name in "BC":
        assert cluster.left_cleanly(name), cluster.procs[name].log()
        assert "ignored the value" not in cluster.procs[name].log(), cluster.procs[name].log()


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


@pytest.mark.timeout(180)
def test_frozen_store_host_then_its_return_never_makes_two_deciding_stores(processes, tmp_path):
    """SIGSTOP of the participant that hosts the store (a frozen peer and a frozen store at once):
    the others fail over (bounded by the store operation timeout of the watchdog), recover with
    the spare and finish. Thawed, the old host finds the others on the new store (its presence
    probes) instead of deciding alone on its own: it never trains a round of its own again."""
    cluster = three(processes, tmp_path, ["--max-steps", "400", *SLOW, "--hang-floor", "60"], standalone=False)
    cluster.wait_for_step(30, 60)
    cluster.kill("A", signal.SIGSTOP)
    try:
        cluster.wait_for_step(60, 90, among=["C"])
    finally:
        os.kill(cluster.procs["A"].pid, signal.SIGCONT)
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.result("B")["step"] == 400 and cluster.result("C")["step"] == 400
    assert cluster.wait(["A"], 60)["A"] is not None, cluster.logs()
    late = cluster.result("A")  # it never trained again: at most it left as a spare of the new store
    assert late is None or late["rank"] == -1, (late, cluster.logs())
    pid_of_a = cluster.procs["A"].pid
    active_rounds_of_a = [e["round"] for e in cluster.events_of("round_complete")
                          if e["pid"] == pid_of_a and not e["standby"]]
    assert active_rounds_of_a == [0], active_rounds_of_a


def two_with_a_store(processes, tmp_path, steps: int) -> Cluster:
    """2 actives (A, B), no spare, a standalone store."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    for name in "AB":
        cluster.start_participant(name, ["--max-steps", str(steps), *SLOW])
    return cluster


def committed_decisions(cluster: Cluster, tmp_path) -> dict[str, dict]:
    """Each rank's termination decision; an 81 only with a committed snapshot of its step."""
    decisions = {event["who"]: event for event in cluster.events_of("termination_decision")}
    for event in decisions.values():
        if event["exit_code"] == 81:
            assert list(tmp_path.glob(f"shm-*/**/step-{event['step']:012d}.snap")), event
    return decisions


@pytest.mark.timeout(150)
def test_sigterm_after_a_failover_agrees_a_stop_step_and_exits_81(processes, tmp_path):
    """The store is lost and taken over; then SIGTERM reaches both ranks: they agree on one stop
    step through the new store, snapshot it and exit 81."""
    cluster = two_with_a_store(processes, tmp_path, 100_000)
    cluster.wait_for_step(30, 60)
    os.kill(cluster.stores["store"].pid, signal.SIGKILL)
    cluster.wait_for_log("A", "failed over to", 30)
    cluster.wait_for_log("B", "failed over to", 30)
    cluster.wait_for_step(max(r[-1]["step"] for r in cluster.steps().values()) + 5, 30)  # training goes on
    cluster.kill("A", signal.SIGTERM)
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B"], 60)
    assert codes == {"A": 81, "B": 81}, cluster.logs()
    decisions = committed_decisions(cluster, tmp_path)
    assert len(decisions) == 2 and len({e["step"] for e in decisions.values()}) == 1, decisions
    assert all(e["reasons"] and "agreed" in e["reasons"][0] for e in decisions.values()), decisions


@pytest.mark.timeout(150)
def test_store_killed_during_the_sigterm_agreement_ends_truthfully(processes, tmp_path):
    """SIGTERM to both ranks; the store is SIGKILLed right when the first rank proposes the stop
    step (a fault injected there): each rank ends in bounded time with a truthful code -- 81
    only with a committed snapshot of the step it decided."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    fault = ["--fault", f"store-kill:{PROPOSE}"]
    for name in "AB":
        cluster.start_participant(name, ["--max-steps", "100000", *SLOW, *fault], FT_TEST_STORE_PID=str(store.pid))
    cluster.wait_for_step(30, 60)
    cluster.kill("A", signal.SIGTERM)
    time.sleep(0.05)
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B"], 60)
    assert set(codes.values()) <= {81, 143}, cluster.logs()
    committed_decisions(cluster, tmp_path)
    for name in "AB":
        assert "Traceback" not in cluster.procs[name].log(), cluster.procs[name].log()


@pytest.mark.timeout(150)
def test_store_killed_during_a_recovery_fails_over_and_the_recovery_goes_on(processes, tmp_path):
    """A peer dies; the store is SIGKILLed right when the survivor opens the next round (a fault
    injected there): the store fails over to the survivor or the spare, the recovery goes on on
    it and the job finishes 0."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("ABC"):
        fault = ["--fault", f"store-kill:{OPEN_ROUND}"] if name == "B" else []
        cluster.start_participant(name, ["--max-steps", "200", *SLOW, *fault, *hold],
                                  LIGHTNING_FT_INFRA_RANK=str(infra_rank), FT_TEST_STORE_PID=str(store.pid))
        in_order(cluster, name, actives="AB")
    release(hold)
    cluster.wait_for_step(40, 60)
    cluster.kill("A")
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert "FAULT store-kill" in cluster.procs["B"].log(), cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert cluster.result("B")["step"] == 200
