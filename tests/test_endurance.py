"""Faults after faults (issue 45): a job keeps its identity, its spares and its state while nodes
die and replacements arrive -- real processes, real stores, real signals."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from proc_utils import REPO_ROOT, wait_for

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from chaos_job import FAULTS, ChaosJob, job_args

from ft_cluster import Cluster, free_port, in_order, ordered_start, release

pytestmark = [pytest.mark.multiprocess]

SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]


def start_a_hosting_the_store(cluster: Cluster, args: list[str], names: str = "ABC",
                              faults: dict[str, str] | None = None, **env: str) -> None:
    """A (hosting the store: the default launch) and B active, the others (C, ...) hot spares
    (``faults``: name -> ``--fault`` spec); returns once the job trained step 40."""
    cluster.out.mkdir(parents=True)
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate(names):
        fault = ["--fault", faults[name]] if faults and name in faults else []
        cluster.start_participant(name, [*args, *fault, *hold], LIGHTNING_FT_INFRA_RANK=str(infra_rank), **env)
        if name == "A":
            cluster.wait_for_log("A", "hosting the rendezvous store")
        in_order(cluster, name, actives="AB")
    release(hold)
    cluster.wait_for_step(40, 60)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("secret", ["no-secret", "job-secret"])
def test_a_replacement_after_the_store_hosts_death_joins_the_running_job(processes, tmp_path, secret):
    """A hosts the store (the default launch) and is SIGKILLed; the store fails over to a
    participant. A replacement D, started as the scheduler would (the job's own launch settings),
    joins the running job as a spare -- never a second job of the same run id from step 0 -- and
    takes B's place when B dies later."""
    env = {"LIGHTNING_FT_SECRET": "a-secret-for-this-test"} if secret == "job-secret" else {}
    cluster = Cluster(processes, tmp_path, "2:3")
    args = ["--max-steps", "400", *SLOW]
    start_a_hosting_the_store(cluster, args, **env)
    cluster.kill("A")
    cluster.wait_for_log("B", "failed over to", 60)
    cluster.start_participant("D", args, LIGHTNING_FT_INFRA_RANK="3", **env)
    cluster.wait_for_log("D", "standby", 60)
    cluster.wait_for_step(120, 60, among=["C"])
    cluster.kill("B")
    codes = cluster.wait(["C", "D"], 120)
    assert codes == {"C": 0, "D": 0}, cluster.logs()
    assert cluster.result("C")["step"] == 400 and cluster.result("D")["step"] == 400, cluster.logs()
    assert "starting fresh" not in cluster.procs["D"].log(), cluster.logs()
    first_steps = {name: records[0]["step"] for name, records in cluster.steps().items() if records}
    # the spares took over where the job was: nobody trained the first steps again
    assert first_steps["A"] == first_steps["B"] == 1 and first_steps["C"] > 40 and first_steps["D"] > 40, first_steps


@pytest.mark.timeout(180)
def test_with_the_first_endpoint_unreachable_the_store_moves_to_a_listed_one_and_newcomers_find_it(
        processes, tmp_path):
    """The job is launched with two endpoints (``LIGHTNING_FT_ENDPOINT=first,second``). A, hosting
    the store at the first, freezes (SIGSTOP: its port still accepts connections and never
    answers, as an unreachable host's would time out): the successor cannot take the first
    endpoint and serves at the second, which the job listed. A replacement D, started with the
    same settings, finds the store there and joins -- it does not host a second store. D arrives
    while the job re-forms, beside the spare C: the rebuilt store had lost round 0's list of actives
    (only its coordinator, A, had written it), and the round used to complete with the two spares
    alone, the survivor B arriving 11 ms late -- the job then trained from step 0 again. B keeps
    its place now (its rank answer names it), and no step is trained again."""
    cluster = Cluster(processes, tmp_path, "2:3")
    second = free_port()
    endpoints = f"127.0.0.1:{cluster.port},127.0.0.1:{second}"
    args = ["--max-steps", "400", *SLOW, "--hang-floor", "60"]
    start_a_hosting_the_store(cluster, args, LIGHTNING_FT_ENDPOINT=endpoints)
    cluster.kill("A", signal.SIGSTOP)
    try:
        cluster.wait_for_log("B", f"failed over to 127.0.0.1:{second}", 60)
        cluster.start_participant("D", args, LIGHTNING_FT_INFRA_RANK="3", LIGHTNING_FT_ENDPOINT=endpoints)
        cluster.wait_for_log("D", "standby", 60)
    finally:
        cluster.kill("A")
    assert "joining it there" in cluster.procs["D"].log() and "hosting" not in cluster.procs["D"].log()
    codes = cluster.wait(["B", "C", "D"], 120)
    assert codes == {"B": 0, "C": 0, "D": 0}, cluster.logs()
    steps = cluster.steps()
    trained_after_the_freeze = [r["step"] for name in "CD" for r in steps[name]]
    assert not trained_after_the_freeze or min(trained_after_the_freeze) > 40, cluster.logs()
    # the survivor kept its place and trained on to the end: no step twice, none skipped
    assert [r["step"] for r in steps["B"]] == list(range(1, 401)), cluster.logs()


@pytest.mark.timeout(180)
def test_a_replacement_joins_the_live_store_not_the_stale_one_a_thawed_store_host_still_serves(
        processes, tmp_path):
    """A hosts the store at the job's one endpoint and freezes: the successor cannot take the
    endpoint (A still holds it) and serves at the next port (the job's places). A thaws: its stale
    store answers at the endpoint again. A replacement D joins the store of the highest fail-over
    epoch -- the live one -- as a spare (A, thawed, follows the others there as a spare too); B
    dies, a spare takes its place, and the job finishes."""
    cluster = Cluster(processes, tmp_path, "2:4")
    args = ["--max-steps", "400", *SLOW, "--hang-floor", "60"]
    start_a_hosting_the_store(cluster, args)
    cluster.kill("A", signal.SIGSTOP)
    try:
        cluster.wait_for_log("B", f"failed over to 127.0.0.1:{cluster.port + 1}", 60)
        cluster.wait_for_step(60, 60, among=["C"])  # the spare took A's place
    finally:
        os.kill(cluster.procs["A"].pid, signal.SIGCONT)
    cluster.start_participant("D", args, LIGHTNING_FT_INFRA_RANK="3")
    cluster.wait_for_log("D", "standby", 60)
    assert f"serves at 127.0.0.1:{cluster.port + 1} (epoch 1" in cluster.procs["D"].log(), cluster.logs()
    cluster.wait_for_step(120, 60, among=["C"])
    cluster.kill("B")
    codes = cluster.wait(["A", "C", "D"], 120)
    assert codes == {"A": 0, "C": 0, "D": 0}, cluster.logs()
    finished = [name for name in "ACD" if (cluster.result(name) or {}).get("step") == 400
                and cluster.result(name)["rank"] >= 0]
    assert len(finished) == 2 and "C" in finished, (finished, cluster.logs())


@pytest.mark.timeout(180)
def test_a_hand_over_does_not_count_a_spare_that_just_died(processes, tmp_path):
    """The only spare is SIGKILLed, then an active is SIGTERMed at once: the spare is still an
    arrival of the round and not yet judged lost, but its heartbeat no longer rises. The verdict
    counts spares by heartbeat: no hand-over, the whole job stops with 81 at one step (it used to
    hand over to the dead spare: the signalled node left 0 and the survivor waited 120 s for it)."""
    from lightning_ft.events.log import read_events
    from lightning_ft.report.timeline import job_exit_code, summarize

    cluster = Cluster(processes, tmp_path, "2:3", run_id="dead-spare")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    hold = ordered_start(cluster, "AB")
    for name in "ABC":
        cluster.start_participant(name, ["--max-steps", "2000", *SLOW, *hold])
        in_order(cluster, name, actives="AB")
    release(hold)
    cluster.wait_for_step(20, 60)
    cluster.kill("C")
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B"], 90)
    assert codes == {"A": 81, "B": 81}, cluster.logs()
    verdicts = cluster.events_of("hand_over_verdict")
    assert verdicts and not any(v["hands_over"] for v in verdicts), verdicts
    summary = summarize(read_events(str(cluster.events)))
    assert job_exit_code(summary, launcher_code=81).code == 81


@pytest.mark.timeout(180)
def test_both_actives_lost_at_once_with_the_store_the_spares_go_on_from_their_replica(processes, tmp_path):
    """A (hosting the store) and B are SIGKILLed as one event; C and D, hot spares holding the
    replica of the newest snapshot (a job secret), are all that is left. The successor store opens
    without an active -- every active is proven gone (their presence ports refuse), so no partition
    can hold a second store -- and the spares train on from their replica to the end. It used to
    refuse ("no participant that was active reached the successor"), and both spares left 0: the
    job was lost, and the scheduler was told nothing was wrong."""
    env = {"LIGHTNING_FT_SECRET": "a-secret-for-this-test"}
    cluster = Cluster(processes, tmp_path, "2:4")
    # two copies wanted besides the actives' own: with 2 actives, the spares hold one each
    args = ["--max-steps", "300", *SLOW, "--replication-factor", "2"]
    start_a_hosting_the_store(cluster, args, names="ABCD", **env)
    cluster.wait_for_step(60, 60)
    assert wait_for(lambda: all(any((tmp_path / f"shm-{n}").rglob("*.snap")) for n in "CD"), 60), cluster.logs()
    cluster.kill_together(["A", "B"])
    lost_at = max(r["step"] for name in "AB" for r in cluster.steps()[name])
    codes = cluster.wait(["C", "D"], 120)
    assert codes == {"C": 0, "D": 0}, cluster.logs()
    assert cluster.result("C")["step"] == 300 and cluster.result("D")["step"] == 300, cluster.logs()
    resumed = min(r["step"] for name in "CD" for r in cluster.starts(name))
    # from the replica: a snapshot step at most 10 before the loss, never step 0
    assert lost_at - 10 <= resumed <= lost_at, (resumed, lost_at, cluster.logs())


@pytest.mark.timeout(180)
def test_the_store_host_lost_while_a_hand_over_settles_stops_the_job_with_its_state_saved(processes, tmp_path):
    """B is SIGTERMed with two spares ready; A -- the other active, hosting the store -- is SIGKILLed
    as it starts settling the hand-over verdict. The store fails over; the verdict counts A as gone
    (its heartbeat stood still and its process is proven gone), so B does not leave with the only
    live copy of the state: every active is signalled or gone, the whole job stops at the agreed
    step, B saves it and exits 81, and the rerun resumes from that step. (B used to hand over to
    the spares, which had nothing to take over from: they trained the run again from step 0, and
    every process said 0.)"""
    cluster = Cluster(processes, tmp_path, "2:4")
    args = ["--max-steps", "300", *SLOW]
    start_a_hosting_the_store(cluster, args, names="ABCD",
                              faults={"A": "kill:lightning_ft.termination.handover:HandOverAgreement.verdict"})
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B", "C", "D"], 120)
    assert codes["A"] == -signal.SIGKILL and codes["B"] == 81, cluster.logs()
    assert codes["C"] == codes["D"] == 143 or codes["C"] == codes["D"] == 0, cluster.logs()
    verdicts = cluster.events_of("hand_over_verdict")
    assert verdicts and not any(v["hands_over"] for v in verdicts), verdicts
    steps = cluster.steps()
    assert not steps["C"] and not steps["D"], cluster.logs()  # nobody trained the run again
    saved = [e["step"] for e in cluster.events_of("termination_decision") if e.get("exit_code") == 81]
    assert saved and saved[0] >= 40, cluster.events_of("termination_decision")


@pytest.mark.timeout(180)
def test_a_restarted_node_rejoins_as_a_spare_and_one_restarted_after_the_end_leaves_0(processes, tmp_path):
    """What a scheduler's restart loop does (examples/slurm/ddp_ft.sbatch): B, an active of a job
    with no spare left, is SIGKILLed; B2 -- B restarted on its node with ``LIGHTNING_FT_REJOIN=1``
    -- joins the running job and takes B's place from A's live state (no step trained again).
    After the job ended, a node restarted the same way finds no store of its run: it leaves 0 at
    once, saying so, and never hosts a store or starts the run again."""
    cluster = Cluster(processes, tmp_path, "2:2")
    args = ["--max-steps", "300", *SLOW]
    start_a_hosting_the_store(cluster, args, names="AB")
    cluster.kill("B")
    cluster.start_participant("B2", args, LIGHTNING_FT_INFRA_RANK="1", LIGHTNING_FT_REJOIN="1",
                              LIGHTNING_FT_DOMAIN_ID="host-B", LIGHTNING_FT_SNAPSHOT_DIR=str(tmp_path / "shm-B"))
    codes = cluster.wait(["A", "B2"], 120)
    assert codes == {"A": 0, "B2": 0}, cluster.logs()
    assert "rejoining the running job" in cluster.procs["B2"].log(), cluster.logs()
    steps = cluster.steps()
    assert [r["step"] for r in steps["A"]] == list(range(1, 301)), cluster.logs()
    assert cluster.result("A")["weights"] == cluster.result("B2")["weights"], cluster.logs()
    assert steps["B2"][0]["step"] > 40, cluster.logs()
    cluster.start_participant("B3", args, LIGHTNING_FT_INFRA_RANK="1", LIGHTNING_FT_REJOIN="1")
    assert cluster.wait(["B3"], 60) == {"B3": 0}, cluster.logs()
    log = cluster.procs["B3"].log()
    assert "there is no running job to rejoin" in log and "hosting" not in log and not steps.get("B3"), log


RECOVERIES = int(os.environ.get("FT_TEST_RECOVERIES", "100"))


@pytest.mark.timeout(600)
def test_a_hundred_recoveries_leave_the_survivors_threads_fds_memory_and_shm_bounded(processes, tmp_path):
    """A, hosting the store, survives 100 recoveries: its peer is SIGKILLed as soon as it trains,
    and a new node (started as a scheduler's restart loop would) takes its place each time. What A
    holds at each round's start -- threads, file descriptors, RSS, process groups retired after a
    failure, snapshot files -- stays bounded: the last round's equals the tenth's."""
    cluster = Cluster(processes, tmp_path, "2:2")
    args = ["--max-steps", "1000000", "--step-sleep", "0.01", "--snapshot-every", "5"]
    start_a_hosting_the_store(cluster, args, names="AB")
    victim = "B"
    for i in range(RECOVERIES):
        cluster.kill(victim)
        victim = f"B{i}"
        cluster.start_participant(victim, args, LIGHTNING_FT_INFRA_RANK="1", LIGHTNING_FT_REJOIN="1")
        assert wait_for(lambda name=victim: cluster.steps()[name], 60), cluster.logs()
    starts = cluster.starts("A")
    assert len(starts) == RECOVERIES + 1, cluster.logs()
    tenth, last = starts[10], starts[-1]
    print({k: (tenth[k], last[k]) for k in ("threads", "fds", "rss", "retired_groups", "shm_files")})
    # at most one failure's retired group is kept (its threads and descriptors: the slack), however
    # fast the failures come; without releasing them, 40 recoveries added 90 threads and 120 fds
    assert max(s["retired_groups"] for s in starts) <= 1, starts
    assert last["threads"] <= tenth["threads"] + 4, (tenth, last)
    assert last["fds"] <= tenth["fds"] + 8, (tenth, last)
    assert last["shm_files"] <= tenth["shm_files"] + 2, (tenth, last)
    assert last["rss"] <= tenth["rss"] + 64 * 2**20, (tenth, last)


#: the short chaos run: a fault every FAULT_EVERY steps (about 10 s), each once the job is whole
#: again; the last stretch leaves room for faults that came late (a freeze's recovery takes longer)
FAULT_EVERY = 250
CHAOS_STEPS = FAULT_EVERY * len(FAULTS) + 400
#: codes a participant of the chaos job may end with: finished or not needed (0), handed over (0),
#: killed (-9: the test's SIGKILL), a thawed node that was replaced (0 as "not needed")
CHAOS_CODES = {0, -signal.SIGKILL}


@pytest.mark.timeout(420)
def test_a_job_under_every_kind_of_fault_in_turn_ends_as_the_uninterrupted_run(processes, tmp_path):
    """The short version of ``benchmarks/bench_chaos.py`` (issue 45): 2 actives + 2 hot spares, a
    job secret, a durable tier, the default launch (the first participant hosts the store). Every
    FAULT_EVERY steps, once the job is whole again (two actives training, two spares standing by),
    the next fault of the cycle hits it -- SIGKILL an active, SIGTERM an active, SIGSTOP an active
    (thawed 12 s later, as the issue has it), SIGKILL a spare, SIGKILL the store's host, SIGKILL both actives at once --
    and every ended process is replaced 1-2 s later by a fresh one with the same launch settings.
    The job finishes once, never splits into a second job from step 0, leaves nothing running, and
    its weights equal the uninterrupted run's (a 2-rank job of the same steps and data)."""
    reference = Cluster(processes, tmp_path / "reference", "2:2", run_id="chaos-reference")
    reference.start(["R0", "R1"], job_args(CHAOS_STEPS, 0.0))
    job = ChaosJob(processes, tmp_path / "chaos", "chaos-test", job_args(CHAOS_STEPS, 0.03), replace_after=(1.0, 2.0))
    job.start(4)
    since = job.first_step_at(120)
    deadline = time.monotonic() + 300
    timeline = tmp_path / "timeline.jsonl"  # what happened when, to read after a failure
    for number, kind in enumerate(FAULTS, start=1):
        while not (job.whole() and job.newest_step() >= number * FAULT_EVERY):
            assert time.monotonic() < deadline and not job.finished(), (job.timeline, job.cluster.logs())
            job.tend()
            time.sleep(0.05)
        assert job.inject(kind, freeze=12.0)["victims"], (kind, job.timeline)
        timeline.write_text("\n".join(json.dumps(line) for line in job.timeline))
    while not job.finished():
        assert time.monotonic() < deadline, (job.timeline, job.cluster.logs())
        job.tend()
        time.sleep(0.05)
    codes = job.cluster.wait(list(job.cluster.procs), 60)
    summary = job.summary(since)
    assert summary["fresh_starts"] == 0, (summary, job.cluster.logs())
    assert set(codes.values()) <= CHAOS_CODES, (codes, job.timeline, job.cluster.logs())
    assert reference.wait(["R0", "R1"], 120) == {"R0": 0, "R1": 0}, reference.logs()
    assert summary["weights"] == [json.dumps(reference.result("R0")["weights"])], (summary, job.cluster.logs())
