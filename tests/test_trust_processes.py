"""Trust boundaries with real processes (issue 10, cases 1 and 2).

An attacker process that reaches the job's store and knows its run id, but not its secret,
forges control-plane values while the job trains; a second job reuses a run id on a store
that outlives jobs; a participant starts after its job ended. Cases 3 and 4 (snapshots of
another job, planted files and foreign directories) are in ``test_checkpoint_store.py`` and
``test_checkpoint_trainer.py``.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from proc_utils import REPO_ROOT, wait_for, write_secret

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, base_env

pytestmark = [pytest.mark.multiprocess]

FORGE = str(REPO_ROOT / "tests" / "scripts" / "forge_store.py")
BUMP = str(REPO_ROOT / "tests" / "scripts" / "bump_counters.py")
SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) with a socket listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A = LISTEN
                    found.append(address)
    return found


def start_forger(processes, cluster: Cluster, marker: Path, *extra: str):
    return processes.start("forger", [sys.executable, FORGE, "--endpoint", f"127.0.0.1:{cluster.port}",
                                      "--run-id", cluster.run_id, "--marker", str(marker),
                                      "--seconds", "120", *extra], env=base_env())


def kill_an_active_after(cluster: Cluster, step: int) -> tuple[str, list[str]]:
    cluster.wait_for_step(step, 60)
    victim = cluster.active_names()[-1]
    cluster.kill(victim)
    return victim, [n for n in cluster.procs if n != victim]


@pytest.mark.timeout(120)
def test_forged_values_from_a_client_without_the_secret_change_nothing(processes, tmp_path):
    """Case 1 (and the stray ``set`` of case 2): forged "closed", failure notices, a deadlock
    verdict, a fake participant and a snapshot replica that would run a command are all
    ignored; a real failure is still recovered from and the job trains to the end."""
    secret = {"LIGHTNING_FT_SECRET_FILE": write_secret(tmp_path)}
    marker = tmp_path / "attacker-ran-code"
    cluster = Cluster(processes, tmp_path, "2:3", run_id="trusted")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store(**secret)
    assert listening_addresses(cluster.port) == ["0100007F"], "the store listens beyond the address it was given"
    for name in "ABC":
        cluster.start_participant(name, ["--max-steps", "100", *SLOW], **secret)
    forger = start_forger(processes, cluster, marker)

    victim, survivors = kill_an_active_after(cluster, 35)
    codes = cluster.wait(survivors, 80)
    assert codes == {n: 0 for n in survivors}, cluster.logs()
    assert "forging" in forger.log() and "Traceback" not in forger.log(), forger.log()
    assert not marker.exists(), "a forged snapshot ran code"
    for name in survivors:
        result = cluster.result(name)
        assert result["trained"] and result["step"] == 100, (name, result)
    assert cluster.events_of("restored"), cluster.logs()
    assert not cluster.events_of("replica_received"), "a forged replica was kept"
    assert [e["detector"] for e in cluster.events_of("failure_detected")] == ["collective"], cluster.logs()
    everything = cluster.logs() + store.log()
    assert "ignored the value of store key" in everything
    assert "forged" not in "".join(str(e) for e in cluster.events_of("run_closed"))


@pytest.mark.timeout(150)
def test_a_job_whose_counters_are_bumped_trains_to_the_end(processes, tmp_path):
    """Issue 24, finding 1: counters are hints, sealed records are truth. Before any node
    arrives the attacker bumps the arrivals of rounds 0-5 by 10 (all three nodes exited 0 with
    0 steps as "extra"), the lost count by 1000 (the coordinator closed the run TOO_FEW_NODES
    under the job's own seal at the first failure: exit 83) and the incarnation; then it adds
    to every integer key it lists, as keys appear. The job trains to the end anyway, through
    the loss of an active that the spare replaces, and nobody exits with a made-up reason."""
    secret = {"LIGHTNING_FT_SECRET_FILE": write_secret(tmp_path)}
    cluster = Cluster(processes, tmp_path, "2:3", run_id="bumped")
    cluster.out.mkdir(parents=True)
    cluster.start_store(**secret)
    bumper = processes.start("bumper", [sys.executable, BUMP, "--endpoint", f"127.0.0.1:{cluster.port}",
                                        "--run-id", cluster.run_id, "--seconds", "120"],
                             # the attacker is a plain torch client, not ours: its own C++ warnings
                             # (the server drops it on every add to a sealed value) are not a user's log
                             env=base_env(TORCH_CPP_LOG_LEVEL="ERROR"))
    assert wait_for(lambda: "bumping" in bumper.log(), 30), bumper.log()
    for name in "ABC":
        cluster.start_participant(name, ["--max-steps", "100", *SLOW], **secret)

    victim, survivors = kill_an_active_after(cluster, 35)
    codes = cluster.wait(survivors, 90)
    assert codes == {n: 0 for n in survivors}, cluster.logs()
    for name in survivors:
        result = cluster.result(name)
        assert result["trained"] and result["step"] == 100, (name, result)
    assert "Traceback" not in bumper.log(), bumper.log()
    assert cluster.events_of("restored"), cluster.logs()
    closes = "".join(str(e) for e in cluster.events_of("run_closed"))
    assert "too_few_nodes" not in closes and "extra" not in cluster.logs(), cluster.logs()


@pytest.mark.timeout(120)
def test_without_a_secret_a_forged_replica_is_never_executed(processes, tmp_path):
    """No secret: values are unauthenticated (documented), so no snapshot is taken from the
    store at all (no replicas without a secret): the forged replica, rewritten every 0.2 s, is
    never read, let alone decoded, and the job resumes from the survivor's snapshot."""
    marker = tmp_path / "attacker-ran-code"
    cluster = Cluster(processes, tmp_path, "2:3", run_id="open")
    cluster.start(["A", "B", "C"], ["--max-steps", "100", *SLOW])
    forger = start_forger(processes, cluster, marker, "--only-replica")
    victim, survivors = kill_an_active_after(cluster, 35)
    codes = cluster.wait(survivors, 80)
    assert codes == {n: 0 for n in survivors}, cluster.logs() + forger.log()
    assert not marker.exists(), "a forged snapshot ran code"
    assert not [e for e in cluster.events_of("replica_received") if e["step"] >= 10_000], "a forged replica was kept"
    for name in survivors:
        assert cluster.result(name)["step"] == 100
    restored = cluster.events_of("restored")
    assert restored and restored[-1]["step"] < 100, cluster.logs()
    assert "no job secret" in cluster.logs()  # the one warning per process


@pytest.mark.timeout(120)
def test_a_reused_run_id_on_a_long_lived_store_trains_again(processes, tmp_path):
    """Case 2: a job that finished closed its run; a second job with the same run id on the
    same store (as a requeued SLURM job, whose run id is its job id) trains fully instead of
    inheriting "closed". A participant of the first job that starts only after that job
    ended exits 0 at once rather than waiting for a round."""
    first = Cluster(processes, tmp_path / "first", "2:3", run_id="reused")
    first.out.mkdir(parents=True)
    first.start_store(long_lived=True)
    for name in "AB":
        first.start_participant(name, ["--max-steps", "20"])
    late = first.start_participant("C", ["--max-steps", "20", "--sleep-before-fit", "1000"])
    assert first.wait(["A", "B"], 60) == {"A": 0, "B": 0}, first.logs()
    assert all(first.result(n)["step"] == 20 for n in "AB")
    # the late starter was started before the run closed; it joins only now
    assert late.popen.poll() is None
    late.signal(signal.SIGUSR1)  # ft_train.py: SIGUSR1 ends --sleep-before-fit
    assert wait_for(lambda: late.popen.poll() is not None, 30), first.logs()
    assert late.popen.returncode == 0, first.logs()
    assert not first.result("C")["trained"]

    second = Cluster(processes, tmp_path / "second", "2:2", run_id="reused", port=first.port)
    second.out.mkdir(parents=True)
    for name in ("D", "E"):
        second.start_participant(name, ["--max-steps", "20"])
    assert second.wait(["D", "E"], 60) == {"D": 0, "E": 0}, second.logs()
    for name in ("D", "E"):
        result = second.result(name)
        assert result["trained"] and result["step"] == 20, (name, result, second.logs())
