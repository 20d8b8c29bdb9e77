"""``Trainer(strategy="fsdp_ft")`` (issue 27, part 1): FSDP2 sharded state over the rendezvous,
in real processes (CPU/gloo) with a standalone store; each participant has its own node identity
and snapshot root, so no participant can read another's shards from disk."""

from __future__ import annotations

import os
import shutil
import signal
import sys

import pytest

from proc_utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, ordered_start, release

FSDP = ["--strategy", "fsdp_ft", "--resumable-data", "--step-sleep", "0.03", "--snapshot-every", "10"]


def test_configuration_errors_name_the_setting(monkeypatch):
    import lightning.pytorch as pl

    import lightning_ft
    from lightning_ft import FaultTolerantFSDPStrategy
    from lightning_ft.strategy import StrategyConfigError

    monkeypatch.setenv("LIGHTNING_FT_ENDPOINT", "127.0.0.1:29999")
    monkeypatch.setenv("LIGHTNING_FT_RUN_ID", "conf")
    monkeypatch.setenv("LIGHTNING_FT_NNODES", "2")
    with pytest.raises(StrategyConfigError, match="keep_ranks is always on"):
        FaultTolerantFSDPStrategy(keep_ranks=False)
    with pytest.raises(StrategyConfigError, match="not DistributedDataParallel's"):
        FaultTolerantFSDPStrategy(find_unused_parameters=True)
    assert FaultTolerantFSDPStrategy().settings.rendezvous.keep_ranks
    trainer = pl.Trainer(strategy="fsdp_ft", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is lightning_ft.FaultTolerantFSDPStrategy


def _cluster(processes, tmp_path, run_id: str, nnodes: str = "2:2") -> Cluster:
    return Cluster(processes, tmp_path, nnodes, run_id=run_id)


def _start(cluster: Cluster, order: dict[str, int], args: list[str], store: str = "store",
           node_of: dict[str, str] | None = None, env: dict[str, str] | None = None) -> None:
    """Participants with a fixed scheduler node index each (which decides their rank in a new run);
    ``node_of``: a participant that runs on another one's node (its identity and snapshot root)."""
    cluster.out.mkdir(parents=True, exist_ok=True)
    cluster.start_store(store)
    for name, index in order.items():
        node = (node_of or {}).get(name, name)
        cluster.start_participant(name, [*args, "--ft-option", f"infra_rank={index}"],
                                  LIGHTNING_FT_DOMAIN_ID=f"host-{node}",
                                  LIGHTNING_FT_SNAPSHOT_DIR=str(cluster.root / f"shm-{node}"), **(env or {}))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sigterm_then_a_relaunch_in_the_other_order_resumes_each_shard_exactly(processes, tmp_path):
    """SIGTERM -> every rank snapshots its shards of the agreed stop step, exit 81; the relaunch
    places the participants at each other's ranks, each receives its own shards from the other,
    and the run ends with the full weights of an uninterrupted run, bit for bit."""
    reference = _cluster(processes, tmp_path / "reference", "fsdp-reference")
    # the weights as a user's code after fit() gathers them (a collective): the group lives on
    _start(reference, {"R0": 0, "R1": 1}, [*FSDP, "--max-steps", "40", "--weights-after-fit"],
           store="reference-store")
    first = _cluster(processes, tmp_path / "job", "fsdp-job")
    _start(first, {"A": 0, "B": 1}, [*FSDP, "--max-steps", "40"])
    first.wait_for_step(15, 90, among=["A", "B"])
    first.kill("B", signal.SIGTERM)
    codes = first.wait(["A", "B"], 60)
    assert codes == {"A": 81, "B": 81}, first.logs()
    stop = max(r["step"] for r in first.steps()["A"])
    assert stop == max(r["step"] for r in first.steps()["B"])
    assert reference.wait(["R0", "R1"], 120) == {"R0": 0, "R1": 0}, reference.logs()

    again = _cluster(processes, tmp_path / "job", "fsdp-job")
    # a new store on a new port; new processes on the same nodes (snapshot roots), the same run id;
    # B's node is rank 0 now: it holds rank 1's shards, and A's node rank 0's
    _start(again, {"B2": 0, "A2": 1}, [*FSDP, "--max-steps", "40", "--weights-after-fit"], store="store2",
           node_of={"A2": "A", "B2": "B"})
    assert again.wait(["A2", "B2"], 120) == {"A2": 0, "B2": 0}, again.logs()
    for name in ("A2", "B2"):
        starts = again.starts(name)
        assert starts and starts[0]["step"] == stop, (name, starts, stop)
    received = again.events_of("snapshot_received")
    assert sorted(e["from_rank"] for e in received if e.get("step") == stop) == [0, 1], received
    weights = {name: again.result(name)["weights"] for name in ("A2", "B2")}
    expected = reference.result("R0")["weights"]
    assert weights["A2"] == weights["B2"] == expected


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sigterm_with_a_durable_tier_then_a_relaunch_on_other_nodes_resumes_from_it(processes, tmp_path):
    """Every rank's shards of the stop step are made durable before exit 81 (all-shards commit:
    the step's manifest); the requeue lands on two new nodes with empty memory, each of which
    downloads its own rank's shards and resumes at the stop step."""
    durable = {"LIGHTNING_FT_PERSIST_TO": str(tmp_path / "durable"), "LIGHTNING_FT_PERSIST_EVERY_SECONDS": "0"}
    first = _cluster(processes, tmp_path / "job", "fsdp-durable")
    _start(first, {"A": 0, "B": 1}, [*FSDP, "--max-steps", "40"], env=durable)
    first.wait_for_step(15, 90, among=["A", "B"])
    first.kill("A", signal.SIGTERM)
    assert first.wait(["A", "B"], 60) == {"A": 81, "B": 81}, first.logs()
    stop = max(r["step"] for r in first.steps()["A"])
    assert (tmp_path / "durable" / "fsdp-durable" / "manifests" / f"step-{stop:012d}.json").exists()

    again = _cluster(processes, tmp_path / "job", "fsdp-durable")
    _start(again, {"C": 0, "D": 1}, [*FSDP, "--max-steps", "40"], store="store2", env=durable)
    assert again.wait(["C", "D"], 120) == {"C": 0, "D": 0}, again.logs()
    for name in ("C", "D"):
        starts = again.starts(name)
        assert starts and starts[0]["step"] == stop, (name, starts, stop)
        assert f"resume step {stop} from the durable tier" in again.procs[name].log(), again.logs()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_killed_active_is_replaced_in_process_by_the_spare_on_its_node(processes, tmp_path):
    """Part 2 of issue 27: a SIGKILLed active's process is gone but its node's memory is not (the
    spare runs there): the survivor rebuilds its module, the spare takes the lost rank, both
    resume from the newest step whose shards all exist and finish (exit 0)."""
    cluster = _cluster(processes, tmp_path, "fsdp-lost", nnodes="2:3")
    _start(cluster, {"A": 0, "B": 1, "C": 2}, [*FSDP, "--max-steps", "60"], node_of={"C": "B"})
    cluster.wait_for_step(25, 90, among=["A", "B"])
    cluster.kill("B")
    codes = cluster.wait(["A", "C"], 90)
    assert codes == {"A": 0, "C": 0}, cluster.logs()
    _assert_resumed_together(cluster, ["A", "C"], newest_complete=20)



#: fsdp_ft's own schedule (the overhead budget, no --snapshot-every), its work-at-risk bound
#: lowered so that this short run takes a few periodic snapshots after the measured one at step 8
DEFAULT_SCHEDULE = ["--strategy", "fsdp_ft", "--resumable-data", "--step-sleep", "0.03", "--snapshot-every", "0",
                    "--ft-option", "snapshot_max_seconds_at_risk=0.5"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_killed_host_is_replaced_by_the_spare_with_its_shards_from_the_replica(processes, tmp_path):
    """Issue 27 part 3 and issue 36 item 1: three hosts, 2 actives + 1 spare, fsdp_ft's default
    schedule (the save budget, bounded by the work at risk, which its log line says). The
    round-start snapshot and every snapshot after it (the one step 8 measures included) are
    copied to the other active's host before the next one is taken. SIGKILL an active (its
    memory counts as lost: the spare runs on another host): the survivor sends the spare the
    lost rank's shards from its copy, both resume from the newest snapshot copied and finish
    (exit 0) with the full weights of an uninterrupted run, bit for bit (the recovery is a
    relaunch from that step)."""
    reference = _cluster(processes, tmp_path / "reference", "fsdp-reference")
    _start(reference, {"R0": 0, "R1": 1}, [*DEFAULT_SCHEDULE, "--max-steps", "60"], store="reference-store")
    cluster = _cluster(processes, tmp_path / "job", "fsdp-replica", nnodes="2:3")
    _start(cluster, {"A": 0, "B": 1, "C": 2}, [*DEFAULT_SCHEDULE, "--max-steps", "60"])
    victim = cluster.wait_for_step(25, 90, among=["A", "B", "C"])
    cluster.kill(victim)
    shutil.rmtree(cluster.root / f"shm-{victim}")  # the host is gone, its memory with it
    others = sorted(set(cluster.procs) - {victim})
    assert cluster.wait(others, 90) == dict.fromkeys(others, 0), cluster.logs()
    replicas = cluster.events_of("shard_replica")
    assert replicas and all(e["bytes"] > 0 for e in replicas), replicas
    survivor = next(name for name in others if cluster.steps()[name] and cluster.starts(name)[0]["step"] == 0)
    copied = [e["step"] for e in replicas if e["round"] == 0 and e["pid"] == cluster.procs[survivor].pid]
    assert copied[:2] == [0, 8], copied  # the round's start, then the save step 8 measures
    step = _assert_resumed_together(cluster, others, newest_complete=8, interval=None)
    assert step == max(copied), (step, copied, cluster.logs())
    schedule = [e for e in cluster.events_of("snapshot_schedule") if e["bounded_by_risk"]]
    assert schedule and "s of work at risk (max_seconds_at_risk=0.5)" in cluster.logs(), cluster.logs()
    assert reference.wait(["R0", "R1"], 120) == {"R0": 0, "R1": 0}, reference.logs()
    expected = reference.result("R0")["weights"]
    assert all(cluster.result(name)["weights"] == expected for name in others)
    # sharded state is never copied through the store: no warning that store copies need a secret
    assert "snapshot replicas for hot spares are off" not in cluster.logs()
    assert any(e.get("from_rank") is not None for e in cluster.events_of("snapshot_received")), cluster.logs()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sigterm_to_one_host_hands_its_shards_over_and_no_step_is_trained_again(processes, tmp_path):
    """Issue 38: three hosts, 2 actives + 1 spare, fsdp_ft's default schedule. SIGTERM to one
    active: at the agreed step every rank snapshots its shards and copies them to the other host
    (the signalled one too: it is alive and holds them), the signalled host leaves with exit 0,
    the survivor and the spare resume at that very step -- not at a scheduled snapshot -- the
    leaver's shards from their copy, and finish with the weights of an uninterrupted run."""
    reference = _cluster(processes, tmp_path / "reference", "fsdp-reference")
    _start(reference, {"R0": 0, "R1": 1}, [*DEFAULT_SCHEDULE, "--max-steps", "60"], store="reference-store")
    cluster = _cluster(processes, tmp_path / "job", "fsdp-hand-over", nnodes="2:3")
    cluster.out.mkdir(parents=True)
    hold = ordered_start(cluster, "AB")  # the spare is standby before the first step
    _start(cluster, {"A": 0, "B": 1}, [*DEFAULT_SCHEDULE, "--max-steps", "60", *hold])
    cluster.wait_for_log("B", "round 0 complete")
    cluster.start_participant("C", [*DEFAULT_SCHEDULE, "--max-steps", "60", "--ft-option", "infra_rank=2"])
    cluster.wait_for_log("C", "standby in round 0")
    release(hold)
    cluster.wait_for_step(25, 90, among=["A", "B"])
    cluster.kill("B", signal.SIGTERM)
    assert cluster.wait(["A", "B", "C"], 90) == {"A": 0, "B": 0, "C": 0}, cluster.logs()
    left_at = max(r["step"] for r in cluster.steps()["B"])
    assert "HANDED_OVER (0)" in cluster.procs["B"].log()
    copied = [e["step"] for e in cluster.events_of("shard_replica") if e["pid"] == cluster.procs["B"].pid]
    assert copied[-1] == left_at, (copied, left_at)  # the leaver's shards of the step it left at
    assert _assert_resumed_together(cluster, ["A", "C"], newest_complete=left_at, interval=None) == left_at
    assert reference.wait(["R0", "R1"], 120) == {"R0": 0, "R1": 0}, reference.logs()
    expected = reference.result("R0")["weights"]
    assert cluster.result("A")["weights"] == cluster.result("C")["weights"] == expected


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_host_lost_before_the_first_copy_starts_the_job_over_instead_of_ending_it(processes, tmp_path):
    """Issue 36 item 1: rank 1's host dies inside the round's first shard copy (no rank's shards
    exist anywhere else yet): the survivor and the spare start over from the state the fit started
    with (step 0) and finish -- the job is not ended for want of a copy."""
    cluster = _cluster(processes, tmp_path, "fsdp-first-copy", nnodes="2:3")
    fault = ["--fault", "kill:lightning_ft.checkpoint.exchange.shard_replicas:ShardReplicator.copy:1"]
    cluster.out.mkdir(parents=True, exist_ok=True)
    cluster.start_store("store")
    for name, index in {"A": 0, "B": 1, "C": 2}.items():
        if name == "C":  # the fault is B's: B must be active, whatever the machine's load (C arrived first once)
            for member in "AB":
                cluster.wait_for_log(member, "round 0 complete")
        cluster.start_participant(name, [*DEFAULT_SCHEDULE, "--max-steps", "30", "--ft-option", f"infra_rank={index}",
                                         *(fault if name == "B" else [])],
                                  LIGHTNING_FT_DOMAIN_ID=f"host-{name}",
                                  LIGHTNING_FT_SNAPSHOT_DIR=str(cluster.root / f"shm-{name}"))
    assert cluster.wait(["B"], 120) == {"B": -signal.SIGKILL}, cluster.logs()
    shutil.rmtree(cluster.root / "shm-B")
    assert cluster.wait(["A", "C"], 90) == {"A": 0, "C": 0}, cluster.logs()
    assert "starting over from the state the fit started with" in cluster.procs["A"].log(), cluster.logs()
    for name in ("A", "C"):
        assert [s["step"] for s in cluster.starts(name)][-1] == 0, (name, cluster.starts(name))
        assert max(r["step"] for r in cluster.steps()[name]) == 30


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_lost_shard_without_a_copy_ends_the_job_truthfully(processes, tmp_path):
    """Without copies (replication_factor=0) a lost host takes the only shards of its rank: no
    step has every rank's shards, so the job ends with 83 and says why -- never a model mixed
    from two steps, never a silent start from scratch."""
    cluster = _cluster(processes, tmp_path, "fsdp-noreplica", nnodes="2:3")
    _start(cluster, {"A": 0, "B": 1, "C": 2}, [*FSDP, "--max-steps", "400", "--replication-factor", "0"])
    victim = cluster.wait_for_step(12, 90, among=["A", "B", "C"])
    cluster.kill(victim)
    shutil.rmtree(cluster.root / f"shm-{victim}")
    others = sorted(set(cluster.procs) - {victim})
    assert cluster.wait(others, 60) == dict.fromkeys(others, 83), cluster.logs()
    reasons = [e["reason"] for e in cluster.events_of("no_restart")]
    assert reasons and all("no step has every rank's shards" in r for r in reasons), reasons



@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_frozen_active_is_replaced_by_the_spare_far_below_the_group_timeout(processes, tmp_path):
    """SIGSTOP an active: its connections stay open, so the survivor's FSDP collective would wait
    for the group timeout (120 s); the watchdog's hang verdict breaks the round's group (FSDP's
    data-parallel group is the default group), the survivor leaves its collective at once and
    the spare takes the frozen rank's place with its shards from the survivor's copy."""
    cluster = _cluster(processes, tmp_path, "fsdp-frozen", nnodes="2:3")
    _start(cluster, {"A": 0, "B": 1, "C": 2},
           [*FSDP, "--max-steps", "60", "--hang-floor", "3", "--pg-timeout", "120"])
    victim = cluster.wait_for_step(25, 90, among=["A", "B", "C"])
    os.kill(cluster.procs[victim].pid, signal.SIGSTOP)
    others = sorted(set(cluster.procs) - {victim})
    try:
        codes = cluster.wait(others, 60)
    finally:
        os.kill(cluster.procs[victim].pid, signal.SIGKILL)
    assert codes == dict.fromkeys(others, 0), cluster.logs()
    _assert_resumed_together(cluster, others, newest_complete=20)
    assert {e["detector"] for e in cluster.events_of("failure_detected")} == {"hang"}, cluster.logs()


def _assert_resumed_together(cluster: Cluster, names: list[str], newest_complete: int,
                             interval: int | None = 10) -> int:
    """The recovered round started every participant at one snapshot step (a multiple of the
    snapshot ``interval``, when one is fixed), at or after ``newest_complete``; returns it."""
    restarts = {name: [s["step"] for s in cluster.starts(name) if s["step"] > 0] for name in names}
    steps = {r[-1] for r in restarts.values() if r}
    assert len(steps) == 1 and all(restarts.values()), (restarts, cluster.logs())
    (step,) = steps
    assert step >= newest_complete and (interval is None or step % interval == 0), (restarts, cluster.logs())
    return step
