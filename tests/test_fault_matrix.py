"""Faults at exact points of a ddp_ft run, with real processes and real signals (tests/FAULTS.md).

``ft_train.py --fault KIND:MODULE:QUALNAME[:N]`` makes a participant signal itself (SIGKILL,
SIGSTOP or SIGTERM) at the N-th call of one of lightning_ft's functions -- receiving a snapshot,
opening the next round, finishing -- so a fault lands inside that phase every time, not only
when the timing happens to allow it. Each test names its cell of the matrix.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

from proc_utils import REPO_ROOT, wait_for

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, in_order, ordered_start, release

pytestmark = [pytest.mark.multiprocess]

SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]
RECEIVE = "lightning_ft.checkpoint.memory.store:SnapshotStore.write_bytes"
OPEN_ROUND = "lightning_ft.runtime.session:Session.open_round"
FINISH = "lightning_ft.runtime.fit_loop:RendezvousFitLoop._pass_exit_barrier"
# a periodic snapshot's background copy runs (its helper thread) / is committed before the next
# optimizer step's update (the copy may still be running)
SAVE_COPY = "lightning_ft.checkpoint.memory.copying:BackgroundCopy._run"
SAVE_COMMIT = "lightning_ft.checkpoint.memory.store:SnapshotStore.commit_pending"


def four(processes, tmp_path, steps: int, faults: dict[str, str], *extra: str) -> Cluster:
    """2 actives (A, B) + 2 spares (C first in line, D second); ``faults``: name -> --fault spec."""
    cluster = Cluster(processes, tmp_path, "2:4")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("ABCD"):
        fault = ["--fault", faults[name]] if name in faults else []
        cluster.start_participant(name, ["--max-steps", str(steps), *SLOW, *extra, *fault, *hold],
                                  LIGHTNING_FT_INFRA_RANK=str(infra_rank))
        in_order(cluster, name, actives="AB")
    release(hold)
    cluster.wait_for_step(20, 60)
    assert sorted(cluster.active_names()) == ["A", "B"], cluster.logs()
    return cluster


def three(processes, tmp_path, args: list[str], fault_of_a: str) -> Cluster:
    """2 actives (A, B) + 1 spare (C); A signals itself as ``fault_of_a`` says."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("ABC"):
        fault = ["--fault", fault_of_a] if name == "A" else []
        cluster.start_participant(name, [*args, *fault, *hold], LIGHTNING_FT_INFRA_RANK=str(infra_rank))
        in_order(cluster, name, actives="AB")
    release(hold)
    return cluster


def wait_then_kill_frozen(cluster: Cluster, names: list[str], timeout: float, frozen: str) -> dict[str, int | None]:
    """Exit codes of ``names``; then the frozen participant is thawed and killed (never left behind)."""
    try:
        return cluster.wait(names, timeout)
    finally:
        thaw_and_kill(cluster, frozen)


def thaw_and_kill(cluster: Cluster, name: str) -> None:
    # SIGKILL ends a stopped process as it is; a SIGCONT first would let it run on for a moment
    # and finish what it froze in (its events then differ from run to run; seen in CI)
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(cluster.procs[name].pid, sig)
        except ProcessLookupError:
            pass


def faulted(cluster: Cluster, name: str) -> bool:
    return "FAULT " in cluster.procs[name].log()


# ------------------------------------------------------------------ snapshot transfer


@pytest.mark.timeout(120)
def test_kill9_of_the_spare_receiving_the_snapshot(processes, tmp_path):
    """kill -9 x snapshot transfer: the next spare takes the place and receives it."""
    cluster = four(processes, tmp_path, 200, {"C": f"kill:{RECEIVE}"})
    cluster.kill("A")
    codes = cluster.wait(["B", "C", "D"], 90)
    assert codes == {"B": 0, "C": -signal.SIGKILL, "D": 0}, cluster.logs()
    assert faulted(cluster, "C")
    assert "received snapshot" in cluster.procs["D"].log(), cluster.logs()
    assert cluster.result("D")["step"] == 200 and cluster.starts("D")[0]["step"] > 0, cluster.logs()


@pytest.mark.timeout(120)
def test_sigstop_of_the_spare_receiving_the_snapshot(processes, tmp_path):
    """SIGSTOP x snapshot transfer: the frozen receiver's silent heartbeat fails the round."""
    cluster = four(processes, tmp_path, 200, {"C": f"stop:{RECEIVE}"}, "--hang-floor", "60")
    cluster.kill("A")
    codes = wait_then_kill_frozen(cluster, ["B", "D"], 90, "C")
    assert codes == {"B": 0, "D": 0}, cluster.logs()
    assert faulted(cluster, "C")
    assert "hang" in [e["detector"] for e in cluster.events_of("failure_detected")], cluster.logs()


@pytest.mark.timeout(120)
def test_sigterm_to_the_spare_receiving_the_snapshot(processes, tmp_path):
    """SIGTERM x snapshot transfer: that spare stops (nothing of its own to save), the next one
    receives the snapshot and the job goes on."""
    cluster = four(processes, tmp_path, 200, {"C": f"term:{RECEIVE}"})
    cluster.kill("A")
    codes = cluster.wait(["B", "C", "D"], 90)
    assert codes["C"] in (-signal.SIGTERM, 143, 81) and codes["B"] == codes["D"] == 0, cluster.logs()
    assert faulted(cluster, "C")
    assert cluster.result("D")["step"] == 200 and cluster.starts("D")[0]["step"] > 0, cluster.logs()


# ------------------------------------------------------------------ recovery


@pytest.mark.timeout(120)
def test_kill9_of_the_survivor_while_it_opens_the_next_round(processes, tmp_path):
    """kill -9 x recovery: both holders of the state are gone, the spares carry on (from step 0:
    no copy survived; the durable tier is what covers this)."""
    cluster = four(processes, tmp_path, 150, {"B": f"kill:{OPEN_ROUND}"})
    cluster.kill("A")
    codes = cluster.wait(["B", "C", "D"], 90)
    assert codes == {"B": -signal.SIGKILL, "C": 0, "D": 0}, cluster.logs()
    assert faulted(cluster, "B")
    assert cluster.result("C")["step"] == cluster.result("D")["step"] == 150


@pytest.mark.timeout(120)
def test_sigstop_of_the_survivor_while_it_opens_the_next_round(processes, tmp_path):
    cluster = four(processes, tmp_path, 150, {"B": f"stop:{OPEN_ROUND}"}, "--hang-floor", "60")
    cluster.kill("A")
    codes = wait_then_kill_frozen(cluster, ["C", "D"], 90, "B")
    assert codes == {"C": 0, "D": 0}, cluster.logs()
    assert faulted(cluster, "B")


@pytest.mark.timeout(120)
def test_sigterm_to_the_survivor_while_it_opens_the_next_round(processes, tmp_path):
    """SIGTERM x recovery: that node is stopped (by the signal: nothing of its own to save while
    it re-forms), a lost node for the others; the spares carry the job to its end."""
    cluster = four(processes, tmp_path, 150, {"B": f"term:{OPEN_ROUND}"})
    cluster.kill("A")
    codes = cluster.wait(["B", "C", "D"], 90)
    assert codes["B"] in (-signal.SIGTERM, 143) and codes["C"] == codes["D"] == 0, cluster.logs()
    assert faulted(cluster, "B")
    assert cluster.result("C")["step"] == cluster.result("D")["step"] == 150


# ------------------------------------------------------------------ snapshot save


@pytest.mark.timeout(180)
def test_sigterm_during_a_periodic_snapshot_save(processes, tmp_path):
    """SIGTERM x snapshot save (as its background copy is committed): the save completes, then A
    hands its place over to the waiting spare at the agreed step (exit 0); B and the spare train
    on from B's live state, no step again (every active signalled: ``strategy_multiprocess``'s
    ``test_sigterm_to_every_active_takes_the_graceful_termination_path``)."""
    cluster = three(processes, tmp_path, ["--max-steps", "150", *SLOW], f"term:{SAVE_COMMIT}:3")
    codes = cluster.wait(["A", "B", "C"], 90)
    assert codes == {"A": 0, "B": 0, "C": 0}, cluster.logs()
    assert faulted(cluster, "A")
    [handed] = cluster.events_of("handed_over")
    left_at = max(r["step"] for r in cluster.steps()["A"])
    assert handed["step"] == left_at and [s["step"] for s in cluster.starts("C")] == [left_at]
    assert cluster.result("B")["step"] == cluster.result("C")["step"] == 150
    assert not cluster.events_of("termination_decision")


@pytest.mark.timeout(180)
def test_full_shm_on_an_active_writer(processes, tmp_path, small_tmpfs):
    """Full /dev/shm x snapshot save: the periodic save fails with a warning, training goes on
    (its peer holds the same state), the job finishes."""
    tiny = small_tmpfs("tiny-shm", "40k")
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    for infra_rank, name in enumerate("AB"):
        extra = {"LIGHTNING_FT_SNAPSHOT_DIR": str(tiny)} if name == "A" else {}
        cluster.start_participant(name, ["--max-steps", "60", "--hidden", "256", *SLOW],
                                  LIGHTNING_FT_INFRA_RANK=str(infra_rank), **extra)
    codes = cluster.wait(["A", "B"], 75)
    assert codes == {"A": 0, "B": 0}, cluster.logs()
    assert "No space left on device" in cluster.procs["A"].log()
    assert cluster.result("A")["step"] == cluster.result("B")["step"] == 60


@pytest.mark.timeout(120)
def test_sigstop_during_a_periodic_snapshot_save(processes, tmp_path):
    """SIGSTOP x snapshot save (from its background copy thread, the next step under way): the
    frozen writer's silent heartbeat fails the round; the spare takes its place from the last
    committed snapshot."""
    cluster = three(processes, tmp_path, ["--max-steps", "150", *SLOW, "--hang-floor", "60",
                                          "--background-copy-min-bytes", "0"], f"stop:{SAVE_COPY}:3")
    codes = wait_then_kill_frozen(cluster, ["B", "C"], 90, "A")
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert faulted(cluster, "A")
    assert "hang" in [e["detector"] for e in cluster.events_of("failure_detected")], cluster.logs()
    assert cluster.starts("C")[0]["step"] >= 10


# ------------------------------------------------------------------ shutdown


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["kill", "stop", "term"])
def test_an_active_lost_after_fit_returned(processes, tmp_path, kind):
    """kill -9 / SIGSTOP / SIGTERM x shutdown: training is complete; the other active passes its
    bounded exit barrier and finishes 0, the spare leaves 0."""
    cluster = three(processes, tmp_path, ["--max-steps", "40", *SLOW, "--ft-option", "exit_barrier_timeout=5"],
                    f"{kind}:{FINISH}")
    codes = wait_then_kill_frozen(cluster, ["B", "C"], 75, "A")
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.left_cleanly("C"), cluster.procs["C"].log()  # the spare: no SIGABRT at interpreter exit
    assert faulted(cluster, "A")
    assert cluster.result("B")["step"] == 40


# ------------------------------------------------------------------ rendezvous


@pytest.mark.timeout(150)
def test_store_killed_before_the_first_round_formed(processes, tmp_path):
    """store kill x rendezvous: nothing trained and nothing can form: 83, promptly, said clearly."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    proc = cluster.start_participant("A", ["--max-steps", "20"])
    assert wait_for(lambda: "joins run" in proc.log(), 60), proc.log()
    os.kill(store.pid, signal.SIGKILL)
    assert cluster.wait(["A"], 40) == {"A": 83}, cluster.logs()
    assert "lost the rendezvous store" in proc.log() and "Traceback" not in proc.log()
