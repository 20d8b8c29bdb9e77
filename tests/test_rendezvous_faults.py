"""Faults while a round forms and in its first steps, every participant a process of its own
(issue 11, cases 3 and 4).

The coordinator of a round (its first arrival) decides the ranks. It can die or freeze at any
point; whoever takes over decides again, and a dead coordinator gets no place in the round. A
peer that freezes before the round has step times is found by its silent heartbeat.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import sys

import pytest
import torch.distributed as dist

from proc_utils import REPO_ROOT, wait_for

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, base_env

pytestmark = [pytest.mark.multiprocess]

PARTICIPANT = str(REPO_ROOT / "tests" / "scripts" / "rdzv_participant.py")


def start(processes, cluster: Cluster, name: str, *extra: str):
    return processes.start(name, [sys.executable, PARTICIPANT, "--endpoint", f"127.0.0.1:{cluster.port}",
                                  "--run-id", cluster.run_id, "--name", name, *extra], env=base_env())


def arrived(cluster: Cluster) -> int:
    from lightning_ft.rendezvous.records import RunRecords
    from lightning_ft.schema.run import RunKeys
    from lightning_ft.schema.signing import Signer

    store = dist.TCPStore("127.0.0.1", cluster.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return len(RunRecords(store, Signer(None), RunKeys(cluster.run_id, 0)).arrivals(0))


def result(proc) -> tuple[int, int] | None:
    found = re.search(r"RESULT rank=(-?\d+) world=(\d+)", proc.log())
    return (int(found[1]), int(found[2])) if found else None


@pytest.mark.timeout(150)
def test_a_coordinator_killed_while_deciding_is_taken_over_and_gets_no_place(processes, tmp_path):
    """Was: it had claimed the round's decision, so the one that took over backed off, nobody
    marked the round ready, and everyone waited for join_timeout, then exited 83."""
    cluster = Cluster(processes, tmp_path, "2:3", run_id="faults")
    cluster.start_store(long_lived=True)
    doomed = start(processes, cluster, "P0", "--die-deciding")
    assert wait_for(lambda: arrived(cluster) == 1, 30), doomed.log()  # P0 holds slot 0: it coordinates
    others = [start(processes, cluster, name) for name in ("P1", "P2")]
    assert wait_for(lambda: doomed.popen.poll() is not None, 30), doomed.log()
    assert doomed.popen.returncode == -signal.SIGKILL and "dying while deciding" in doomed.log()
    assert wait_for(lambda: all(p.popen.poll() is not None for p in others), 30), [p.log() for p in others]
    assert [p.popen.returncode for p in others] == [0, 0], [p.log() for p in others]
    assert sorted(result(p) for p in others) == [(0, 2), (1, 2)]
    assert "took over coordinating round 0" in "".join(p.log() for p in others)


@pytest.mark.timeout(150)
def test_a_frozen_coordinator_is_taken_over_and_joins_as_standby_when_it_thaws(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:3", run_id="faults")
    cluster.start_store(long_lived=True)
    frozen = start(processes, cluster, "P0")
    assert wait_for(lambda: arrived(cluster) == 1, 30), frozen.log()
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        others = [start(processes, cluster, name) for name in ("P1", "P2")]
        assert wait_for(lambda: all(p.popen.poll() is not None for p in others), 30), [p.log() for p in others]
        assert sorted(result(p) for p in others) == [(0, 2), (1, 2)], [p.log() for p in others]
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    # the round was decided without it: it finds no answer for its slot and waits as a spare
    assert wait_for(lambda: frozen.popen.poll() is not None, 30), frozen.log()
    assert frozen.popen.returncode == 0 and result(frozen) == (-1, 2), frozen.log()


@pytest.mark.timeout(180)
def test_a_peer_frozen_in_the_first_steps_of_a_round_is_detected_by_its_silent_heartbeat(processes, tmp_path):
    """No step times yet, so the hang timeout is at its floor (60 s here); the frozen peer's
    silent heartbeat is what gives it away, within seconds, and the spare takes its place."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.start(["A", "B", "C"], ["--max-steps", "40", "--step-sleep", "0.2", "--snapshot-every", "10",
                                    "--hang-floor", "60", "--pg-timeout", "120"])
    victim = cluster.wait_for_step(1, 60)
    os.kill(cluster.procs[victim].pid, signal.SIGSTOP)
    others = [n for n in "ABC" if n != victim]
    try:
        codes = cluster.wait(others, 45)  # far below the 60 s floor and the 120 s group timeout
    finally:
        os.kill(cluster.procs[victim].pid, signal.SIGKILL)
    assert codes == {n: 0 for n in others}, cluster.logs()
    [failure] = cluster.events_of("failure_detected")
    assert failure["detector"] == "hang" and failure["step"] <= 3, failure
    assert all(cluster.result(n)["step"] == 40 for n in others)


@pytest.mark.timeout(120)
def test_an_endpoint_port_held_by_another_program_is_reported_at_once(processes, tmp_path):
    """Issue 36 item 7: the endpoint's port is held by a program that is not a store (here one
    that answers every connection like a web server). The participant cannot host the store there
    and says so at once, naming the port -- it does not wait out connect_timeout (60 s) and end
    with "is the store host running?"."""
    from test_store_endpoint import listener

    with listener(b"HTTP/1.0 400 Bad Request\r\n\r\n") as port:
        cluster = Cluster(processes, tmp_path, "2:2", run_id="held-port")
        cluster.port = port
        cluster.out.mkdir(parents=True)
        proc = cluster.start_participant("A", ["--max-steps", "5"])  # a user's script: no store started
        assert wait_for(lambda: proc.popen.poll() is not None, 90), proc.log()
    assert proc.popen.returncode not in (0, None), proc.log()
    assert f"127.0.0.1:{port} is held by a program that is not a rendezvous store" in proc.log(), proc.log()
    assert "within connect_timeout" not in proc.log(), proc.log()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("held_by", ["silent", "echo"])
def test_an_endpoint_held_by_a_silent_or_echoing_program_ends_83_in_seconds_in_one_line(processes, tmp_path, held_by):
    """Issue 46 item 5: a port held by a program that accepts and says nothing (the ping's 2 s plus
    6 s) or that echoes the ping (5 s for the first store request): the participant ends with 83
    and one line naming the port -- no traceback, no wait for connect_timeout or store_timeout."""
    import time

    from test_store_endpoint import ECHO_LAST_4, listener

    with listener(None if held_by == "silent" else ECHO_LAST_4) as port:
        cluster = Cluster(processes, tmp_path, "2:2", run_id="held-port")
        cluster.port = port
        cluster.out.mkdir(parents=True)
        proc = cluster.start_participant("A", ["--max-steps", "5"])
        started = time.monotonic()
        assert wait_for(lambda: proc.popen.poll() is not None, 90), proc.log()
        waited = time.monotonic() - started
    log = proc.log()
    assert proc.popen.returncode == 83, log
    assert f"port {port}" in log and "Traceback" not in log, log
    assert waited < 60, (waited, log)  # 8 s or 5 s, and the interpreter's start: never a 60 s bound
