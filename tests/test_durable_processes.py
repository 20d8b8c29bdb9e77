"""The durable tier end to end: ``strategy="ddp_ft"`` in real processes, settings from the
environment only (``LIGHTNING_FT_PERSIST_TO``), state surviving the loss of every node's memory.

(a) SIGTERM -> 81 with a durable flush; every shared-memory root wiped; relaunch resumes at the
    stop step and ends with the weights of an uninterrupted run; (b) kill -9 of every process,
    memory wiped: resume from the newest complete durable step; (c) a partial step (a shard
    without its marker, a torn upload) is never loaded; (d) = (a) against a local S3 server
    (moto) reached through s3fs exactly as a user's job would; (e) a hot spare steps in while
    uploads are in flight.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest

from proc_utils import REPO_ROOT, ProcessSet, wait_for

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster

pytestmark = [pytest.mark.multiprocess]

MAX_STEPS = 60
TRAIN = ["--resumable-data", "--snapshot-every", "5", "--step-sleep", "0.03", "--ft-by-name"]


@pytest.fixture
def launch(tmp_path):
    """``launch(name)``: a ProcessSet of its own per cluster (each has its own "store", "A", "B");
    every process of every set is killed (by pid) at teardown."""
    sets: list[ProcessSet] = []

    def make(name: str) -> ProcessSet:
        log_dir = tmp_path / f"logs-{name}"
        log_dir.mkdir()
        sets.append(ProcessSet(log_dir=log_dir))
        return sets[-1]

    try:
        yield make
    finally:
        for procs in sets:
            procs.kill_all()


@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory):
    """The weights of an uninterrupted run (same script and settings, no durable tier), once per module."""
    root = tmp_path_factory.mktemp("reference")
    procs = ProcessSet(log_dir=root)
    try:
        cluster = Cluster(procs, root, "2:2", run_id="reference")
        cluster.start(["A", "B"], ["--max-steps", str(MAX_STEPS), *TRAIN])
        results = finish(cluster, 90)
        assert results[0]["weights"] == pytest.approx(results[1]["weights"], rel=1e-6, abs=1e-7)
        yield results[0]["weights"]
    finally:
        procs.kill_all()


def durable_env(persist_to: str, **extra: str) -> dict[str, str]:
    return {"LIGHTNING_FT_PERSIST_TO": persist_to, "LIGHTNING_FT_PERSIST_EVERY_SECONDS": "0", **extra}


def wipe_memory(cluster: Cluster) -> None:
    """New nodes: every participant's shared-memory root is gone."""
    for root in cluster.root.glob("shm-*"):
        shutil.rmtree(root)


def relaunch(launch, root: Path, run_id: str, env: dict[str, str], max_steps: int = MAX_STEPS) -> Cluster:
    cluster = Cluster(launch(root.name), root, "2:2", run_id=run_id)
    cluster.start(["A", "B"], ["--max-steps", str(max_steps), *TRAIN], **env)
    return cluster


def finish(cluster: Cluster, timeout: float) -> list[dict]:
    codes = cluster.wait(["A", "B"], timeout)
    assert codes == {"A": 0, "B": 0}, cluster.logs()
    return [cluster.result(n) for n in "AB"]


def resumed_steps(cluster: Cluster) -> list[int]:
    return [cluster.starts(n)[0]["step"] for n in "AB"]


def wait_until(predicate, timeout: float) -> bool:
    return wait_for(predicate, timeout, interval=0.1)


def manifest_steps(directory: Path, run_id: str) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (directory / run_id / "manifests").glob("step-*.json"))


def sigterm_then_resume_on_new_nodes(launch, tmp_path: Path, persist_to: str, env: dict[str, str],
                                     expected: list[float]) -> None:
    run_id = "durable-a"
    records = tmp_path / "exit-records"
    first = relaunch(launch, tmp_path / "first", run_id,
                     durable_env(persist_to, LIGHTNING_FT_EXIT_RECORD_DIR=str(records), **env), max_steps=400)
    first.wait_for_step(22, 60)
    first.kill("B", signal.SIGTERM)
    assert first.wait(["A", "B"], 40) == {"A": 81, "B": 81}, first.logs()
    stop = max(r["step"] for r in first.steps()["A"])
    decisions = first.events_of("termination_decision")
    # whoever wrote the last marker saw the step complete; the other may have seen only its shard
    assert "durable" in {d["tier"] for d in decisions} <= {"durable", "memory+shard"}, decisions
    exit_records = [json.loads(p.read_text()) for p in sorted(records.glob("rank-*.json"))]
    assert [r["exit_code"] for r in exit_records] == [81, 81]
    assert all(any(reason.startswith("tier ") for reason in r["reasons"]) for r in exit_records), exit_records
    assert stop in manifest_steps(Path(persist_to), run_id) if "://" not in persist_to else True
    wipe_memory(first)

    second = relaunch(launch, tmp_path / "second", run_id, durable_env(persist_to, **env))
    results = finish(second, 60)
    assert resumed_steps(second) == [stop, stop], second.logs()
    assert "from the durable tier" in second.procs["A"].log(), second.logs()
    for result in results:
        assert result["step"] == MAX_STEPS
        assert result["weights"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.timeout(150)
def test_a_sigterm_flush_survives_the_loss_of_every_nodes_memory(launch, tmp_path, reference_weights):
    sigterm_then_resume_on_new_nodes(launch, tmp_path, str(tmp_path / "durable"), {}, reference_weights)


@pytest.mark.timeout(150)
def test_a_sigterm_flush_to_s3_survives_the_loss_of_every_nodes_memory(launch, tmp_path, s3_server,
                                                                       reference_weights):
    # reached as a user's job reaches S3: an s3:// URL, endpoint and credentials from the environment
    sigterm_then_resume_on_new_nodes(launch, tmp_path, f"s3://lightning-ft-test/{tmp_path.name}", s3_server,
                                     reference_weights)


@pytest.mark.timeout(150)
def test_after_kill_9_of_every_process_resume_from_the_newest_complete_durable_step(launch, tmp_path):
    # A state of ~2 MiB uploaded at 4 MiB/s per rank while snapshots come every ~0.2 s: uploads
    # are superseded and usually in flight when the kill comes (not asserted: timing); a step is
    # complete only where both ranks' markers made it, and only those may be loaded.
    run_id, durable = "durable-b", tmp_path / "durable"
    env = durable_env(str(durable), LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND="4")
    big = ["--hidden", "8192"]
    first = Cluster(launch("first"), tmp_path / "first", "2:2", run_id=run_id)
    first.start(["A", "B"], ["--max-steps", "400", *TRAIN, *big], **env)
    assert wait_until(lambda: manifest_steps(durable, run_id), 60), first.logs()
    first.wait_for_step(max(manifest_steps(durable, run_id)) + 10, 60)
    first.kill_together(["A", "B"])
    assert first.wait(["A", "B"], 20) == {"A": -9, "B": -9}
    newest = max(manifest_steps(durable, run_id))
    wipe_memory(first)

    # (c) a partial newer step: rank 0's shard and marker only, plus a torn upload of rank 1
    partial_step = newest + 1000
    complete_dir = next((durable / run_id / "steps" / f"step-{newest:012d}").iterdir())
    partial_dir = durable / run_id / "steps" / f"step-{partial_step:012d}" / complete_dir.name
    partial_dir.mkdir(parents=True)
    shutil.copy(complete_dir / "rank0.snap", partial_dir / "rank0.snap")
    marker = json.loads((complete_dir / "rank0.done.json").read_text())
    (partial_dir / "rank0.done.json").write_text(json.dumps({**marker, "step": partial_step}))
    (partial_dir / ".tmp-rank1.snap-4242-deadbeef").write_bytes(b"torn")

    # The second run ends at a fixed step, not one after the kill's (which timing picks): its
    # characterization record keeps the step it finished at.
    final_step = 80
    assert newest < final_step, f"the first run was killed after step {final_step}: {newest}"
    second = Cluster(launch("second"), tmp_path / "second", "2:2", run_id=run_id)
    second.start(["A", "B"], ["--max-steps", str(final_step), *TRAIN, *big],
                 **durable_env(str(durable), LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND="0"))
    results = finish(second, 90)
    assert resumed_steps(second) == [newest, newest], second.logs()
    assert all(r["step"] == final_step for r in results)
    assert "from the durable tier" in second.procs["A"].log(), second.logs()
    assert partial_step not in manifest_steps(durable, run_id)


@pytest.mark.timeout(150)
def test_with_callbacks_given_no_arguments_a_short_run_still_leaves_a_durable_step(launch, tmp_path):
    """Protected by default: EmergencyCheckpoint() and GracefulTermination() with no arguments and
    only LIGHTNING_FT_PERSIST_TO set (no interval: Daly's, minutes here). The first periodic
    snapshot (step 8, the cost schedule's first) is copied durably at once, so kill -9 of every
    process and new nodes resume from a durable step, not from step 0."""
    run_id, durable = "durable-f", tmp_path / "durable"
    env = {"LIGHTNING_FT_PERSIST_TO": str(durable)}
    args = ["--resumable-data", "--step-sleep", "0.03", "--ft-by-name", "--explicit-callbacks"]
    first = Cluster(launch("first"), tmp_path / "first", "2:2", run_id=run_id)
    first.start(["A", "B"], ["--max-steps", "400", *args], **env)
    assert wait_until(lambda: manifest_steps(durable, run_id), 60), first.logs()
    newest = max(manifest_steps(durable, run_id))
    assert newest == 8, manifest_steps(durable, run_id)
    first.wait_for_step(30, 60)
    first.kill_together(["A", "B"])
    assert first.wait(["A", "B"], 20) == {"A": -9, "B": -9}
    newest = max(manifest_steps(durable, run_id))
    wipe_memory(first)
    second = Cluster(launch("second"), tmp_path / "second", "2:2", run_id=run_id)
    second.start(["A", "B"], ["--max-steps", str(newest + 5), *args], **env)
    results = finish(second, 90)
    assert resumed_steps(second) == [newest, newest] and newest > 0, second.logs()
    assert all(r["step"] == newest + 5 for r in results)
    assert "from the durable tier" in second.procs["A"].log(), second.logs()


@pytest.mark.timeout(120)
def test_a_hot_spare_steps_in_while_uploads_are_in_flight(launch, tmp_path):
    # ~2 MiB of state at 4 MiB/s per rank: when an active is killed, uploads of the old round are
    # usually still running; the spare steps in (in-process recovery), training goes on, and
    # durable steps keep completing in the new round with the new world.
    run_id, durable = "durable-e", tmp_path / "durable"
    cluster = Cluster(launch("spare"), tmp_path / "spare", "2:3", run_id=run_id)
    cluster.start(["A", "B", "C"], ["--max-steps", "80", *TRAIN, "--hidden", "8192"],
                  **durable_env(str(durable), LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND="4"))
    cluster.wait_for_step(30, 60)
    actives = cluster.active_names()
    spare = next(n for n in "ABC" if n not in actives)
    cluster.kill(actives[1], signal.SIGKILL)
    survivors = [actives[0], spare]
    assert cluster.wait(survivors, 90) == {n: 0 for n in survivors}, cluster.logs()
    results = [cluster.result(n) for n in survivors]
    assert all(r["trained"] and r["step"] == 80 for r in results), results
    assert results[0]["weights"] == pytest.approx(results[1]["weights"], rel=1e-6, abs=1e-7)
    newest = max(manifest_steps(durable, run_id))
    assert newest > 30  # completed after the recovery
    manifest = json.loads((durable / run_id / "manifests" / f"step-{newest:012d}.json").read_text())
    assert manifest["world_size"] == 2 and [s["rank"] for s in manifest["shards"]] == [0, 1]


@pytest.mark.timeout(240)
def test_a_finished_run_is_not_trained_again_by_nodes_started_after_it(launch, tmp_path):
    """bench_chaos.py: nodes started in a job's last seconds found no store (its host had left),
    opened a new one and trained the last 100 steps again from the durable tier. The finish is
    recorded in the durable tier now: nodes started later leave 0 without training; a relaunch
    that asks for more steps trains on from the newest durable step."""
    persist_to = str(tmp_path / "durable")
    first = relaunch(launch, tmp_path / "first", "finished-run", durable_env(persist_to))
    finish(first, 120)
    assert (tmp_path / "durable" / "finished-run").exists()
    finished = list((tmp_path / "durable").rglob("finished.json"))
    assert len(finished) == 1, list((tmp_path / "durable").rglob("*"))

    late = relaunch(launch, tmp_path / "late", "finished-run", durable_env(persist_to))
    assert late.wait(["A", "B"], 120) == {"A": 0, "B": 0}, late.logs()
    assert all("is not needed" in late.procs[n].log() for n in "AB"), late.logs()
    assert not any(late.steps().values()), late.logs()  # not one step trained again

    more = relaunch(launch, tmp_path / "more", "finished-run", durable_env(persist_to), max_steps=MAX_STEPS + 20)
    results = finish(more, 120)
    assert [r["step"] for r in results] == [MAX_STEPS + 20] * 2, more.logs()
    assert min(resumed_steps(more)) >= MAX_STEPS - 5, more.logs()
