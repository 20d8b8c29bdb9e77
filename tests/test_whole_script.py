"""A user's whole script under ``ddp_ft`` (issue 35): fit, test, a second fit with a fresh Trainer,
validate and predict are five stages of one job, over the same participants (2 actives + 1 hot
spare, ``tests/scripts/staged_user.py``). The actives run each stage; the spare stands by in each
and gets empty results; a node lost in a stage is replaced by the spare and the later stages run."""

from __future__ import annotations

import json
import sys

import pytest

from proc_utils import REPO_ROOT, wait_for

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, base_env

# one worker runs them all, so the uninterrupted script (a module fixture) runs once per suite
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("whole-script")]

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "staged_user.py")
NAMES = ("A", "B", "C")


def run_script(processes, tmp_path, *args: str, names: tuple[str, ...] = NAMES,
               nnodes: str = "2:3") -> tuple[Cluster, dict[str, int | None]]:
    """The script on ``names`` (2 actives + 1 spare by default) with a standalone store; returns
    their exit codes."""
    cluster = Cluster(processes, tmp_path, nnodes, run_id="staged")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    for name in names:
        env = base_env(LIGHTNING_FT_ENDPOINT=f"127.0.0.1:{cluster.port}", LIGHTNING_FT_RUN_ID=cluster.run_id,
                       LIGHTNING_FT_NNODES=cluster.nnodes, LIGHTNING_FT_DOMAIN_ID=f"host-{name}",
                       LIGHTNING_FT_SNAPSHOT_DIR=str(tmp_path / f"shm-{name}"),
                       LIGHTNING_FT_EVENTS_DIR=str(cluster.events))
        cluster.procs[name] = processes.python(name, [SCRIPT, "--out", str(cluster.out), *args], env=env)
    # every participant still running reached the second fit (the spare stands by there): its
    # first step may go
    def reached() -> bool:
        arrived = {path.name.removeprefix("second-fit-") for path in cluster.out.glob("second-fit-*")}
        return all(str(proc.pid) in arrived or proc.popen.poll() is not None for proc in cluster.procs.values())

    if not wait_for(reached, 120):
        return cluster, cluster.wait(list(names), 1)
    (cluster.out / "go").touch()
    return cluster, cluster.wait(list(names), 120)


def results(cluster: Cluster) -> dict[str, dict]:
    found = {}
    for name, proc in cluster.procs.items():
        path = cluster.out / f"result-{proc.pid}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The script without a fault: what every stage returns on the actives (the yardstick)."""
    from proc_utils import ProcessSet

    root = tmp_path_factory.mktemp("uninterrupted")
    processes = ProcessSet(log_dir=root)
    try:
        cluster, codes = run_script(processes, root, "--step-sleep", "0.02")
        yield cluster, codes, results(cluster)
    finally:
        processes.kill_all()


@pytest.mark.timeout(240)
def test_every_stage_runs_on_the_actives_and_an_unused_spare_stands_by_through_the_script(uninterrupted):
    cluster, codes, found = uninterrupted
    assert codes == {name: 0 for name in NAMES}, cluster.logs()
    actives = [r for r in found.values() if all(r["trained"])]
    spares = [r for r in found.values() if not any(r["trained"])]
    assert len(actives) == 2 and len(spares) == 1, found
    fit, test, fit2, validate, predict = actives[0]["returned"]
    assert fit is None and fit2 is None and test[0]["test_acc"] >= 0 and validate[0]["val_acc"] >= 0
    assert predict == {"predictions": 32}  # each active predicts its half of the data: 4 batches of 8
    assert actives[0]["returned"] == actives[1]["returned"] and actives[0]["weights"] == actives[1]["weights"]
    assert actives[0]["step"] == 32
    # the spare stood by in every stage: nothing ran there, its calls returned empty results
    assert spares[0]["returned"] == [None, [], None, [], []], spares[0]
    finished = [e for e in cluster.events_of("finished")]
    assert len(finished) == 2 * 5, finished  # each active finished each of the five stages


STAGES = ("fit", "test", "fit2", "validate", "predict")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", ["fit", "test", "fit2", "validate", "predict"])
def test_a_node_lost_in_any_stage_is_replaced_and_every_stage_returns_what_it_returns_without_a_fault(
        processes, tmp_path, uninterrupted, stage):
    """Rank 0 of a stage dies in it (a fit: at global step 4, an epoch's start, where the plain
    DataLoader resumes exactly; an evaluation: at its batch 2): the survivor and the spare re-form
    the group, a fit resumes at the step in flight, an evaluation runs again from its start (the
    spare first takes the module state of the actives: it stood by in the fits before), the later
    stages run on the new actives -- and every stage from the lost one on returns what the
    uninterrupted script's actives returned, with the same final weights on both."""
    index = STAGES.index(stage)
    kill_at = "4" if stage.startswith("fit") else "2"
    cluster, codes = run_script(processes, tmp_path, "--step-sleep", "0.02", "--kill-stage", str(index),
                                "--kill-step", kill_at)
    killed = [name for name, code in codes.items() if code == -9]
    assert len(killed) == 1 and all(code == 0 for name, code in codes.items() if name not in killed), cluster.logs()
    found = results(cluster)
    survivors = [r for name, r in found.items() if name not in killed]
    assert len(survivors) == 2, found
    _, _, reference = uninterrupted
    expected = next(r for r in reference.values() if all(r["trained"]))
    for result in survivors:
        assert result["weights"] == expected["weights"], (result, expected)
        assert result["returned"][index:] == expected["returned"][index:], (result, expected)
    decisions = [e for e in cluster.events_of("decision")]
    assert decisions and all(e["action"] == "recover" for e in decisions), cluster.logs()


@pytest.mark.timeout(180)
def test_a_bug_in_a_stage_raises_the_users_error_and_later_calls_say_the_job_ended(processes, tmp_path):
    """Every active raises the same ValueError in the first fit (a bug): each gets it -- catchable,
    as under ddp -- and the script that catches it and goes on gets a ``JobEndedError`` from each
    later call (the job failed: its other participants left), not an exit; the spare ends 83 (the
    job failed: do not requeue)."""
    cluster, codes = run_script(processes, tmp_path, "--bug-stage", "0")
    found = results(cluster)
    actives = [name for name, result in found.items() if result["returned"][0] == {"raised": "ValueError"}]
    assert len(actives) == 2, (found, cluster.logs())
    for name in actives:
        assert codes[name] == 0 and found[name]["returned"][1:] == [{"raised": "JobEndedError"}] * 4, found
    spare = next(name for name in NAMES if name not in actives)
    assert codes[spare] == 83, cluster.logs()


@pytest.mark.timeout(180)
def test_a_script_that_crashes_between_stages_does_not_tell_the_others_the_job_finished(processes, tmp_path):
    """2:2, no spare: rank 0 of the fit raises after fit() returned (uncaught: exit 1). Its exit
    closes the job as failed, so the other active -- waiting for its peer in the test stage --
    ends 83 saying so, instead of reading "finished" and returning empty results with exit 0."""
    cluster, codes = run_script(processes, tmp_path, "--crash-after-stage", "0", names=("A", "B"), nnodes="2:2")
    crashed = [name for name, code in codes.items() if code == 1]
    assert len(crashed) == 1, cluster.logs()
    other = next(name for name in codes if name not in crashed)
    assert codes[other] == 83, cluster.logs()
    assert "after its stage" in cluster.procs[other].log(), cluster.procs[other].log()
