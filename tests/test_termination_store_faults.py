"""A frozen (SIGSTOPped) rendezvous store while ``ddp_ft`` trains, with and without SIGTERM.

Real processes: a standalone ``lightning-ft store`` and two participants of
``tests/scripts/ft_train.py`` (``2:2``), each with its own node identity and snapshot root. No
timing asserts: "does not stall" means "reaches a later step before a generous deadline
while the store is still frozen"; the stated bounds are measured in
``benchmarks/bench_store_freeze.py``.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from lightning_ft.exit_codes import ExitCode

from proc_utils import REPO_ROOT, wait_for

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster

pytestmark = [pytest.mark.multiprocess]

SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def start(cluster: Cluster, max_steps: int):
    """Store first (the test freezes it), then both participants."""
    cluster.out.mkdir(parents=True, exist_ok=True)
    store = cluster.start_store()
    for name in ("A", "B"):
        cluster.start_participant(name, ["--max-steps", str(max_steps), *SLOW])
    return store


def last_step(cluster: Cluster, name: str) -> int:
    records = cluster.steps()[name]
    return records[-1]["step"] if records else -1


@pytest.mark.timeout(150)
def test_a_frozen_store_does_not_stall_training_and_the_run_finishes_after_it_thaws(processes, tmp_path):
    cluster = Cluster(processes, tmp_path, "2:2")
    store = start(cluster, max_steps=400)
    cluster.wait_for_step(30, 60)
    store.signal(signal.SIGSTOP)
    try:
        frozen_at = {name: last_step(cluster, name) for name in ("A", "B")}
        # before: the stop-step check asked the store at every step and both ranks sat at the
        # next step for the store's 300 s op timeout
        assert wait_for(lambda: all(last_step(cluster, n) >= frozen_at[n] + 60 for n in ("A", "B")), 60), \
            (frozen_at, {n: last_step(cluster, n) for n in ("A", "B")}, cluster.logs())
        assert process_state(store.pid) == "T"  # the steps above were trained while it was frozen
    finally:
        store.signal(signal.SIGCONT)
    assert cluster.wait(["A", "B"], 90) == {"A": 0, "B": 0}, cluster.logs()
    assert all(cluster.result(n)["step"] == 400 for n in ("A", "B"))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("second_signal_after", [0.0, 0.3])
def test_sigterm_while_the_store_is_frozen_stops_in_time_with_a_truthful_code(second_signal_after, processes,
                                                                               tmp_path):
    # 0.3 s: A holds at its step boundary, trying to propose the stop step, when B's signal
    # comes; B is then inside the next step's all-reduce, waiting for A, and learns of the
    # stop only when A's exit makes that collective fail (the exception path)
    cluster = Cluster(processes, tmp_path, "2:2")
    store = start(cluster, max_steps=100_000)
    cluster.wait_for_step(30, 60)
    store.signal(signal.SIGSTOP)
    try:
        cluster.wait_for_step(max(last_step(cluster, n) for n in ("A", "B")) + 5, 30)  # training goes on
        cluster.kill("A", signal.SIGTERM)
        time.sleep(second_signal_after)
        cluster.kill("B", signal.SIGTERM)
        # bounded by store_timeout_seconds (2 s) after the next step boundary plus the forced
        # exit (5 s after the decision); B on the exception path decides a few store timeouts
        # after A is gone; the deadline here is generous on purpose
        codes = cluster.wait(["A", "B"], 60)
        assert process_state(store.pid) == "T"  # decided and gone while the store was still frozen
    finally:
        store.signal(signal.SIGCONT)
    assert codes == {"A": ExitCode.PREEMPTED, "B": ExitCode.PREEMPTED}, cluster.logs()
    decisions = {event["who"]: event for event in cluster.events_of("termination_decision")}
    assert len(decisions) == 2, decisions
    for name in ("A", "B"):
        log = cluster.procs[name].log()
        # the frozen store either made the stop decision go without it, or was failed over first
        assert "the store does not answer" in log or "failed over to" in log, log[-4000:]
    steps = set()
    for event in decisions.values():
        assert event["exit_code"] == ExitCode.PREEMPTED and event["action"] == "save-then-exit", event
        steps.add(event["step"])
    assert len(steps) == 1, decisions  # both saved the step they had both completed
    step = steps.pop()
    for name in ("A", "B"):  # 81 only with a committed snapshot of that step
        assert list((tmp_path / f"shm-{name}").rglob(f"step-{step:012d}.snap")), name
    assert json.dumps(decisions)  # the reasons are in the event log, for `lightning-ft report`
