"""One live job per run id on a host (issue 46, item 6): two jobs of one run id wrote the same
snapshot files and the first to finish removed the other's. A process of a second job is refused
at once, naming the holder; processes of one job share the run; dead processes hold nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lightning_ft.checkpoint.memory.holders import RunHeldError, claim_run, holders_path, release_run

from proc_utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster

HOLDERS = REPO_ROOT / "lightning_ft" / "checkpoint" / "memory" / "holders.py"
#: another process claims (the module loaded from its file: no torch import); prints the outcome,
#: then waits for a line on stdin (holding its claim) unless told to exit at once
CLAIMER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("holders", {str(HOLDERS)!r})
holders = importlib.util.module_from_spec(spec); spec.loader.exec_module(holders)
try:
    holders.claim_run(sys.argv[1], sys.argv[2], sys.argv[3])
    print("claimed", flush=True)
except holders.RunHeldError as exc:
    print("refused:", exc, flush=True)
if sys.argv[4] == "hold":
    sys.stdin.readline()
"""


def claimer(root, run_id: str, job: str, hold: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLAIMER, str(root), run_id, job, "hold" if hold else "exit"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_second_job_of_a_run_id_is_refused_naming_the_holder_and_one_jobs_processes_share_it(tmp_path):
    holder = claimer(tmp_path, "run", "127.0.0.1:29500", hold=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        # this process, of another job: refused, with the holder's pid
        with pytest.raises(RunHeldError, match=f"pid {holder.pid} "):
            claim_run(str(tmp_path), "run", "127.0.0.1:29600")
        # of the same job (another rank on this host, a spare, a replacement): shares it
        claim_run(str(tmp_path), "run", "127.0.0.1:29500")
        # another run id is another directory
        claim_run(str(tmp_path), "other", "127.0.0.1:29600")
        release_run(str(tmp_path), "other")
        assert not os.path.exists(holders_path(str(tmp_path), "other"))
    finally:
        holder.kill()
        holder.wait(timeout=30)
    release_run(str(tmp_path), "run")  # the holder is dead, this process left: nobody holds it
    assert not os.path.exists(holders_path(str(tmp_path), "run"))


def test_a_dead_process_holds_nothing(tmp_path):
    dead = claimer(tmp_path, "run", "job-a", hold=True)
    try:
        assert dead.stdout.readline().strip() == "claimed"
    finally:
        dead.send_signal(signal.SIGKILL)  # killed: it never released its claim
        dead.wait(timeout=30)
    claim_run(str(tmp_path), "run", "job-b")  # its line is dropped: the run is this job's now
    late = claimer(tmp_path, "run", "job-a", hold=False)
    out, _ = late.communicate(timeout=30)
    assert out.startswith("refused:") and f"pid {os.getpid()} " in out, out
    release_run(str(tmp_path), "run")


def test_a_claim_waiting_while_the_last_holder_removes_the_file_lands_in_the_file_that_is_there(tmp_path):
    """The last holder to release unlinks the file under the lock; a claimer that opened it before
    and waited for the lock must not write its claim into the unlinked file, where the next job's
    claimer would never see it (then two jobs held one run id)."""
    import fcntl
    import time

    path = holders_path(str(tmp_path), "run")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as release_run holds it
    waiting = claimer(tmp_path, "run", "job-a", hold=True)
    try:
        deadline = time.monotonic() + 30
        while not any(os.path.realpath(f"/proc/{waiting.pid}/fd/{n}") == os.path.realpath(path)
                      for n in os.listdir(f"/proc/{waiting.pid}/fd")):  # it opened the file: it waits for the lock
            assert time.monotonic() < deadline and waiting.poll() is None, "the claimer never opened the file"
            time.sleep(0.01)
        os.unlink(path)  # the last holder left
        os.close(fd)
        assert waiting.stdout.readline().strip() == "claimed"
        with pytest.raises(RunHeldError, match=f"pid {waiting.pid} "):  # the next job sees the claim
            claim_run(str(tmp_path), "run", "job-b")
    finally:
        waiting.kill()
        waiting.wait(timeout=30)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_second_job_with_the_run_id_of_a_live_one_ends_83_at_once_and_the_first_finishes(
        processes, tmp_path):
    shared = tmp_path / "shm"  # one host's snapshot root, as /dev/shm is
    first = Cluster(processes, tmp_path / "first", "1:1", run_id="one-id")
    first.out.mkdir(parents=True)
    first.start_store()
    first.start_participant("A", ["--max-steps", "300", "--step-sleep", "0.03", "--snapshot-every", "10"],
                            LIGHTNING_FT_SNAPSHOT_DIR=str(shared))
    first.wait_for_step(10, 90)
    second = Cluster(processes, tmp_path / "second", "1:1", run_id="one-id")  # its own store and endpoint
    second.out.mkdir(parents=True)
    second.start_store("second-store")
    second.start_participant("B", ["--max-steps", "300", "--step-sleep", "0.03"], LIGHTNING_FT_SNAPSHOT_DIR=str(shared))
    assert second.wait(["B"], 90) == {"B": 83}, second.logs()
    log = second.procs["B"].log()
    assert f"held on this host by another live job: pid {first.procs['A'].pid} " in log, log
    assert "Traceback" not in log and not second.steps()["B"], log
    assert first.wait(["A"], 120) == {"A": 0}, first.logs()
    assert first.result("A")["step"] == 300
