"""Snapshot replicas and a client of the store, with real processes (issue 24, findings 2-4).

A job of one active and one hot spare on other "hosts" (so rank 0 replicates each snapshot to
the spare through the store) and an attacker: a plain ``torch.distributed.TCPStore`` client on
127.0.0.1 that reaches the job's store (``tests/scripts/forge_replica.py``, or this test
process itself). Without a secret it plants a replica of the job's own state with every weight
42.0; with one it reads what a replica puts in the store; holding the secret, it plants
replicas of another model, of an absurd size and with a lying header. The in-process rules are
in ``test_checkpoint_replicas.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import sys
from pathlib import Path

import pytest
import torch

from lightning_ft.checkpoint.memory import format as fmt

from proc_utils import REPO_ROOT, wait_for, write_secret

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, base_env

pytestmark = [pytest.mark.multiprocess]

FORGE = str(REPO_ROOT / "tests" / "scripts" / "forge_replica.py")
SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]
_ABSENT = b"\0absent"


def start_job(processes, tmp_path: Path, run_id: str, args: list[str], **secret: str) -> Cluster:
    """One active and one hot spare (by arrival) and the store, with ``secret`` in every environment."""
    cluster = Cluster(processes, tmp_path, "1:2", run_id=run_id)
    cluster.out.mkdir(parents=True)
    cluster.start_store(**secret)
    for name in "AB":
        cluster.start_participant(name, [*args, *SLOW], **secret)
    return cluster


def held_at_the_first_step(tmp_path: Path) -> tuple[list[str], Path]:
    """ft_train arguments that hold the first training step while the returned file exists: the
    attacker plants while the round is formed and nothing trained yet, however slowly it starts."""
    gate = tmp_path / "hold-first-step"
    gate.touch()
    return ["--hold-first-step-while", str(gate)], gate


def the_active(cluster: Cluster) -> str:
    """The participant that took the round-start snapshot (before any step: the spare holds none)."""
    found = []
    assert wait_for(lambda: found.extend(cluster.root.glob(f"shm-*/{cluster.run_id}/rank0/step-*.snap")) or found,
                    90), cluster.logs()
    return found[0].relative_to(cluster.root).parts[0].removeprefix("shm-")


def start_forger(processes, cluster: Cluster, env: dict[str, str], *mode: str):
    return processes.start("forger", [sys.executable, FORGE, "--endpoint", f"127.0.0.1:{cluster.port}",
                                      "--run-id", cluster.run_id, *mode], env=base_env(**env))


def read_without_waiting(client, key: str) -> bytes:
    """A key's value, or b"" when it is gone (``get`` would wait for it; ``compare_set`` does not)."""
    value = client.compare_set(key, _ABSENT, _ABSENT)
    return b"" if value == _ABSENT else value


def parameter_bytes(snapshot: Path) -> dict[int, list[bytes]]:
    """{step: the first 64 float32 bytes of each parameter that has as many} of a plaintext snapshot file."""
    blob = snapshot.read_bytes()
    state = fmt.decode(blob, fmt.verify(blob, len(blob)))
    tensors = [t.numpy().tobytes()[:64] for t in state["state_dict"].values()]
    return {int(snapshot.stem.removeprefix("step-")): [t for t in tensors if len(t) == 64]}


@pytest.mark.timeout(150)
def test_without_a_secret_a_replica_planted_with_other_weights_is_never_resumed(processes, tmp_path):
    """Finding 2: a client re-encodes the job's own state with every weight 42.0 at step 10000+
    and plants it as the replica; the active is SIGKILLed. Without a secret no replica is taken
    from the store, so the spare starts from its own (no) snapshot and ends with weights it
    trained, not the planted ones; it says once why it took no replicas."""
    hold, gate = held_at_the_first_step(tmp_path)
    cluster = start_job(processes, tmp_path, "open-weights", ["--max-steps", "80", *hold])
    active = the_active(cluster)
    spare = "B" if active == "A" else "A"
    template = tmp_path / f"shm-{active}" / cluster.run_id / "rank0"
    forger = start_forger(processes, cluster, {}, "--reweight", str(template))
    assert wait_for(lambda: forger.log().count("planted") >= 5, 60), forger.log()
    gate.unlink()
    cluster.wait_for_step(30, 45)
    cluster.kill(active)
    assert cluster.wait([spare], 60) == {spare: 0}, cluster.logs()
    result = cluster.result(spare)
    assert result["trained"] and result["step"] == 80, result
    assert max(abs(w) for w in result["weights"]) < 20, "the spare resumed from the planted weights"
    assert all(e["step"] < 10_000 for e in cluster.events_of("restored")), cluster.events_of("restored")
    assert not cluster.events_of("replica_received")
    assert "snapshot replicas for hot spares are off" in cluster.procs[spare].log()


@pytest.mark.timeout(150)
def test_with_a_secret_a_store_client_finds_no_weights_in_a_replica(processes, tmp_path):
    """Finding 3: with a secret, a client that lists and reads every replica key of the store
    (as anyone who sees its traffic could) finds none of the parameters' bytes of any snapshot
    the job holds, although a replica of one of those steps is there; the spare still keeps
    (decrypts) its copies."""
    import torch.distributed as dist

    cluster = start_job(processes, tmp_path, "sealed-weights", ["--max-steps", "200"],
                        LIGHTNING_FT_SECRET_FILE=write_secret(tmp_path))
    cluster.wait_for_step(20, 45)
    assert wait_for(lambda: cluster.events_of("replica_received"), 30), cluster.logs()
    client = dist.TCPStore("127.0.0.1", cluster.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    replica_keys = [key for key in client.list_keys() if "/replica/" in key]
    stored = b"".join(read_without_waiting(client, key) for key in replica_keys)
    plaintext: dict[int, list[bytes]] = {}
    for snapshot in tmp_path.glob(f"shm-*/{cluster.run_id}/rank*/step-*.snap"):
        with contextlib.suppress(OSError, fmt.SnapshotError):  # recycled while we read it: the others suffice
            plaintext.update(parameter_bytes(snapshot))
    found = [step for step, tensors in plaintext.items() if any(t in stored for t in tensors)]
    assert not found, f"the weights of step(s) {found} are readable in the store"
    published = {int(key.split("/")[-2]) for key in replica_keys if "/replica/blob/" in key}
    assert published & set(plaintext), (published, sorted(plaintext))  # the search was for the right steps
    assert cluster.wait(["A", "B"], 60) == {"A": 0, "B": 0}, cluster.logs()
    spare = next(name for name in "AB" if not cluster.result(name)["trained"])
    assert cluster.left_cleanly(spare), cluster.procs[spare].log()  # it pulled replicas until it left


@pytest.mark.timeout(150)
def test_a_foreign_replica_is_refused_before_it_is_read_and_the_job_resumes_from_its_own_newest_step(
        processes, tmp_path):
    """Finding 4: a client holding the secret plants step-100000 replicas: one of another model
    (4 KiB), one announcing 1 TiB, one whose 4 KiB claim 1 GiB of data in their header. The
    spare refuses the first two from their meta alone (no byte read) and the third at its first
    chunk (nothing allocated), keeps none, and after the active's SIGKILL resumes from the
    newest copy of the job's own that it holds -- not step 0, not 100000."""
    secret = {"LIGHTNING_FT_SECRET_FILE": write_secret(tmp_path)}
    hold, gate = held_at_the_first_step(tmp_path)
    cluster = start_job(processes, tmp_path, "foreign", ["--max-steps", "200", *hold], **secret)
    active = the_active(cluster)
    spare = "B" if active == "A" else "A"
    forger = start_forger(processes, cluster, secret, "--foreign")

    def refusals() -> dict[str, str]:
        return {e["error"]: e["stage"] for e in cluster.events_of("replica_refused")}

    assert wait_for(lambda: len(refusals()) >= 3, 60), cluster.logs() + forger.log()
    forger.signal(signal.SIGKILL)
    gate.unlink()
    stopped = max(e["t"] for e in cluster.events_of("replica_refused"))
    stages = sorted((stage, next(word for word in ("model", "replica_max_bytes", "size") if word in error))
                    for error, stage in refusals().items())
    assert stages == [("header", "size"), ("meta", "model"), ("meta", "replica_max_bytes")], refusals()
    assert not [e for e in cluster.events_of("replica_received") if e["step"] >= 100_000], "a foreign copy was kept"

    def newest_genuine_since_the_forger_stopped() -> int:
        return max((e["step"] for e in cluster.events_of("replica_received") if e["t"] > stopped), default=0)

    assert wait_for(lambda: newest_genuine_since_the_forger_stopped() >= 30, 45), cluster.logs()
    newest_kept = newest_genuine_since_the_forger_stopped()
    cluster.kill(active)
    assert cluster.wait([spare], 60) == {spare: 0}, cluster.logs()
    assert cluster.result(spare)["step"] == 200 and cluster.result(spare)["trained"]
    restored = cluster.events_of("restored")[-1]["step"]
    assert 30 <= newest_kept <= restored < 100_000 and restored % 10 == 0, (restored, newest_kept)
    assert torch.tensor(cluster.result(spare)["weights"]).abs().max() < 20
