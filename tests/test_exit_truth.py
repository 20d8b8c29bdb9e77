"""Every way a ddp_ft process ends tells the scheduler the truth (issue 11, cases 1, 5, 6).

One test per row of the exit-code table (docs/sigterm.md) that the other process tests do not cover
already (they are named in the table): a stop before anything trained, the store lost with
and without a peer failure, a full /dev/shm on the spare that receives the snapshot, an
endpoint whose host does not resolve, and a participant that starts after its job ended.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from proc_utils import REPO_ROOT, wait_for

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, in_order, ordered_start, release

pytestmark = [pytest.mark.multiprocess]

SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]


def no_traceback(log: str) -> bool:
    return "Traceback" not in log and "frame #" not in log


def training_then_store_killed(processes, tmp_path, steps: int) -> Cluster:
    """2 actives + 1 spare at step 20 or later; then the store process is SIGKILLed."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    for name in "ABC":
        cluster.start_participant(name, ["--max-steps", str(steps), *SLOW])
    cluster.wait_for_step(20, 60)
    os.kill(store.pid, signal.SIGKILL)
    return cluster


@pytest.mark.timeout(180)
def test_sigterm_while_round_0_forms_stops_everyone_with_143(processes, tmp_path):
    """Nothing trained: a SIGTERM before the job could start is a stop (requeue), never a success."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    cluster.start_participant("A", ["--max-steps", "30"])
    # B exists (as srun's tasks do) but reaches the rendezvous only after A was stopped
    cluster.start_participant("B", ["--max-steps", "30", "--sleep-before-fit", "1000"])
    assert wait_for(lambda: "joins run" in cluster.procs["A"].log(), 60), cluster.logs()
    time.sleep(0.3)
    cluster.kill("A", signal.SIGTERM)
    assert cluster.wait(["A"], 30) == {"A": 143}, cluster.logs()
    cluster.procs["B"].signal(signal.SIGUSR1)
    assert cluster.wait(["B"], 30) == {"B": 143}, cluster.logs()
    assert not any(cluster.steps().values())
    assert "job stopped" in cluster.procs["B"].log()
    assert cluster.events_of("stopped") and not cluster.events_of("finished")


@pytest.mark.timeout(180)
def test_sigterm_while_the_rounds_process_group_forms_takes_the_sigterm_path(processes, tmp_path):
    """Issue 47, item 3: a SIGTERM that came while a round's process group formed (torch blocks
    there, up to the 60 s init timeout when a peer never comes) met the default action: the
    process died with -15, nothing saved, no 81. Held there, the SIGTERM path takes it once
    training starts: both stop at one agreed step, save and exit 81."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    cluster.start_participant("A", ["--max-steps", "300", "--step-sleep", "0.03",
                                    "--fault", "term:lightning_ft.runtime.runtime:init_round_group"])
    cluster.start_participant("B", ["--max-steps", "300", "--step-sleep", "0.03"])
    assert cluster.wait(["A", "B"], 120) == {"A": 81, "B": 81}, cluster.logs()
    assert "SIGTERM came while the round's process group formed" in cluster.procs["A"].log()
    stops = [re.search(r"reached the agreed stop step (\d+)", cluster.procs[n].log()) for n in "AB"]
    assert all(stops) and len({m.group(1) for m in stops}) == 1, cluster.logs()


@pytest.mark.timeout(180)
def test_store_lost_while_training_the_job_still_succeeds(processes, tmp_path):
    """The store is needed only to recover: training finishes; the spare leaves with 0, not 83."""
    cluster = training_then_store_killed(processes, tmp_path, steps=150)
    codes = cluster.wait(list("ABC"), 60)
    assert codes == {"A": 0, "B": 0, "C": 0}, cluster.logs()
    assert sorted(cluster.result(n)["step"] for n in "ABC") == [0, 150, 150]
    assert not cluster.events_of("no_restart")
    assert all(no_traceback(cluster.procs[n].log()) for n in "ABC"), cluster.logs()


@pytest.mark.timeout(180)
def test_store_lost_then_a_peer_fails_recovers_on_the_successor_store(processes, tmp_path):
    """Was: exit 83 ("lost the rendezvous store") -- and before that exit 1 with a raw
    DistNetworkError traceback. Now the store fails over to a participant (issue 25) and the
    peer's death after it recovers with the spare."""
    cluster = training_then_store_killed(processes, tmp_path, steps=300)
    victim = cluster.active_names()[-1]
    survivor = next(n for n in cluster.active_names() if n != victim)
    spare = next(n for n in "ABC" if n not in (victim, survivor))
    cluster.kill(victim)
    codes = cluster.wait([survivor, spare], 60)
    assert codes == {survivor: 0, spare: 0}, cluster.logs()
    log = cluster.procs[survivor].log()
    assert "failed over to" in log and "Traceback" not in log, log


@pytest.mark.timeout(120)
def test_full_shm_on_the_spare_that_receives_the_snapshot_is_a_node_fault(processes, tmp_path, small_tmpfs):
    """ENOSPC is the node's fault, not the user's bug: that spare leaves unhealthy (82) and the
    job goes on with the next spare."""
    tiny = small_tmpfs("tiny-shm", "40k")  # a snapshot of this model is ~60 kB
    cluster = Cluster(processes, tmp_path, "2:4")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    # roles by arrival whatever the load: A and B form round 0, then C queues as the first
    # spare, then D (a slow start of B once made C active and the test meaningless)
    hold = ordered_start(cluster, "AB")
    args = ["--max-steps", "400", "--hidden", "256", *SLOW, *hold]
    for infra_rank, name in enumerate("ABCD"):  # C is the first spare in line, D the second
        extra = {"LIGHTNING_FT_SNAPSHOT_DIR": str(tiny)} if name == "C" else {}
        cluster.start_participant(name, args, LIGHTNING_FT_INFRA_RANK=str(infra_rank), **extra)
        in_order(cluster, name, actives="AB")
    release(hold)
    cluster.wait_for_step(30, 60)
    assert sorted(cluster.active_names()) == ["A", "B"], cluster.logs()
    cluster.kill("A")
    codes = cluster.wait(["B", "C", "D"], 90)
    assert codes == {"B": 0, "C": 82, "D": 0}, cluster.logs()
    assert "No space left on device" in cluster.procs["C"].log()
    [fault] = cluster.events_of("node_fault")
    assert fault["errno"] == "ENOSPC"
    assert cluster.result("B")["step"] == cluster.result("D")["step"] == 400


@pytest.mark.timeout(150)
def test_unresolvable_endpoint_host_fails_within_connect_timeout(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "1:1")
    cluster.out.mkdir(parents=True)
    proc = cluster.start_participant("A", ["--max-steps", "5", "--ft-option", "connect_timeout=5"],
                                     LIGHTNING_FT_ENDPOINT="nohost.invalid:29400")
    assert cluster.wait(["A"], 45) == {"A": 83}, cluster.logs()
    log = proc.log()
    assert "cannot resolve the rendezvous host 'nohost.invalid' within 5s" in log, log
    assert no_traceback(log), log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["nnodes", "endpoint"])
def test_a_bad_configuration_ends_83_in_one_line(processes, tmp_path, bad):
    """Issue 46 item 8: a bad setting, raised while the Trainer builds the strategy, ended the
    script with a 20-30 line traceback through Lightning's constructors and exit code 1; docs/sigterm.md
    says 83. One line on stderr names what is wrong, and the code is 83."""
    cluster = Cluster(processes, tmp_path, "1:1")
    cluster.out.mkdir(parents=True)
    setting = {"nnodes": {"LIGHTNING_FT_NNODES": "3:2"}, "endpoint": {"LIGHTNING_FT_ENDPOINT": "127.0.0.1:99999"}}
    proc = cluster.start_participant("A", ["--max-steps", "5"], **setting[bad])
    assert cluster.wait(["A"], 45) == {"A": 83}, cluster.logs()
    log = proc.log()
    assert "lightning_ft: configuration error (83): ddp_ft: " in log and no_traceback(log), log


@pytest.mark.timeout(180)
def test_a_participant_that_starts_after_its_job_finished_exits_0(processes, tmp_path):
    """A slow start (loaded machine): the run closed and its store is gone... almost; the store
    lingers so the latecomer learns the run is over instead of hosting a store of its own and
    waiting for peers that are gone."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    for name in "AB":
        cluster.start_participant(name, ["--max-steps", "20"])
    late = cluster.start_participant("C", ["--max-steps", "20", "--sleep-before-fit", "1000"])
    assert cluster.wait(["A", "B"], 60) == {"A": 0, "B": 0}, cluster.logs()
    late.signal(signal.SIGUSR1)
    assert cluster.wait(["C"], 30) == {"C": 0}, cluster.logs()
    assert cluster.left_cleanly("C"), late.log()
    result = cluster.result("C")
    assert not result["trained"], result
    assert "hosting the store" not in late.log()


@pytest.mark.timeout(150)
def test_a_frozen_store_and_a_frozen_peer_end_in_a_clear_decision_in_bounded_time(processes, tmp_path):
    """The store host and then a peer freeze (SIGSTOP): nobody can be blamed through the store,
    but the survivor does not wait for the process-group timeout (300 s here): its watchdog
    breaks the group once overdue (hang floor 5 s + a 5 s store bound), and the recovery gives
    up when the store does not answer within its bound (store_timeout, 8 s here; later calls
    fail at once) -- NO_RESTART, said clearly, about 20 s after the freeze."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    for name in "AB":
        cluster.start_participant(name, ["--max-steps", "5000", *SLOW, "--hang-floor", "5", "--pg-timeout", "300",
                                         "--ft-option", "store_timeout=8"])
    cluster.wait_for_step(20, 60)
    victim, survivor = cluster.active_names()
    os.kill(store.pid, signal.SIGSTOP)
    os.kill(cluster.procs[victim].pid, signal.SIGSTOP)
    try:
        codes = cluster.wait([survivor], 100)
    finally:
        for pid in (store.pid, cluster.procs[victim].pid):
            os.kill(pid, signal.SIGKILL)
    assert codes == {survivor: 83}, cluster.logs()
    log = cluster.procs[survivor].log()
    assert "does not answer" in log and "NO_RESTART (83)" in log, log


@pytest.mark.timeout(180)
def test_a_store_frozen_while_round_0_forms_ends_83_within_its_bounds(processes, tmp_path):
    """A waits in the rendezvous for B when the store host freezes; B starts after the freeze.
    A's next store call fails after ``store_timeout`` and B cannot reach the store within
    ``connect_timeout``: both end NO_RESTART (83) with a line that says so, no traceback."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    bounds = ["--ft-option", "store_timeout=4", "--ft-option", "connect_timeout=4"]
    cluster.start_participant("A", ["--max-steps", "30", *bounds])
    assert wait_for(lambda: "joins run" in cluster.procs["A"].log(), 60), cluster.logs()
    time.sleep(0.5)
    os.kill(store.pid, signal.SIGSTOP)
    try:
        cluster.start_participant("B", ["--max-steps", "30", *bounds])
        codes = cluster.wait(["A", "B"], 60)
    finally:
        os.kill(store.pid, signal.SIGKILL)
    assert codes == {"A": 83, "B": 83}, cluster.logs()
    assert not any(cluster.steps().values())
    for name in "AB":
        log = cluster.procs[name].log()
        assert "NO_RESTART (83)" in log and no_traceback(log), log


@pytest.mark.timeout(180)
def test_a_store_frozen_at_the_end_of_fit_still_ends_0(processes, tmp_path):
    """Both ranks trained every step; the store host freezes as the first of them reaches the
    exit barrier. The barrier and the rendezvous's close are bounded (``exit_barrier_timeout``,
    ``store_timeout``), and the truth is that the job finished: both exit 0."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    bounds = ["--ft-option", "store_timeout=3", "--ft-option", "exit_barrier_timeout=3"]
    freeze = ["--fault", "store-stop:lightning_ft.runtime.fit_loop:RendezvousFitLoop._pass_exit_barrier"]
    cluster.start_participant("A", ["--max-steps", "40", *bounds, *freeze], FT_TEST_STORE_PID=str(store.pid))
    cluster.start_participant("B", ["--max-steps", "40", *bounds])
    try:
        codes = cluster.wait(["A", "B"], 70)
    finally:
        os.kill(store.pid, signal.SIGKILL)
    assert "FAULT store-stop" in cluster.procs["A"].log(), cluster.logs()
    assert codes == {"A": 0, "B": 0}, cluster.logs()
    assert {max(r["step"] for r in records) for records in cluster.steps().values()} == {40}, cluster.logs()
