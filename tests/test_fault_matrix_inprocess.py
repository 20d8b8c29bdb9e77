"""The fault matrix (tests/FAULTS.md) in one process: its decision paths, each in seconds.

Every participant is a thread of this process (tests/inprocess_cluster.py) built by the real
factory over one real TCPStore; the rendezvous, its coordinator, the round watchdog, the hot
spare's monitor, ``read_failure_facts`` and the pure decisions are the package's own. Training
is a counter whose steps meet in an in-process collective, so what is asserted is what the
protocol decided -- rounds, ranks, world sizes, who is active or standby, close reasons, the
decisions' enums and the exit status a process would have -- never a timing. The real-process
tests of the same cells stay (named in each docstring); these run on every change.

Peers' deaths are found as the package finds them: a killed peer's connections closing (the
collective fails), a silent heartbeat (the round watchdog, the coordinator's ``mark_lost``),
every active silent (the spare's monitor), a silent coordinator lease (a waiter takes over).
"""

from __future__ import annotations

import datetime
import gc
import re
import threading
import time

import pytest
import torch.distributed as dist

from lightning_ft.deadlines import BoundedStore
from lightning_ft.events import names as ev
from lightning_ft.rendezvous.barrier import BarrierRendezvous
from lightning_ft.runtime.decisions import Detector, EndAction, EndCause, FailureAction, FailureKind, Role
from lightning_ft.schema.run import CloseKind
from lightning_ft.schema.signing import SealedStore

from inprocess_cluster import STORE_WORKER_THREAD, Ending, InProcessCluster, InProcessParticipant

pytestmark = pytest.mark.timeout(120)

#: generous: a loaded 2-core machine; every wait ends as soon as what it waits for happened
WAIT = 45.0


@pytest.fixture
def make_cluster(request):
    """``make_cluster(min_nodes, max_nodes, **options)``: an :class:`InProcessCluster` for this test,
    closed at teardown (whoever is left is killed, every thread joined, the store dropped)."""
    made: list[InProcessCluster] = []

    def make(min_nodes: int, max_nodes: int, **options) -> InProcessCluster:
        run_id = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")
        cluster = InProcessCluster(run_id, min_nodes, max_nodes, **options)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


def wait_training(cluster: InProcessCluster, *participants: InProcessParticipant, round_id: int, steps: int = 3):
    """Wait until each of ``participants`` trained at least ``steps`` steps in round ``round_id``."""
    assert cluster.wait_until(lambda: all(p.steps_in.get(round_id, 0) >= steps for p in participants), WAIT), \
        f"not training in round {round_id}: {cluster.describe()}"


def wait_rounds(cluster: InProcessCluster, *participants: InProcessParticipant, round_id: int):
    """Wait until each of ``participants`` completed round ``round_id`` (active or standby)."""
    assert cluster.wait_until(lambda: all(p.result_of(round_id) is not None for p in participants), WAIT), \
        f"round {round_id} did not complete for {[p.name for p in participants]}: {cluster.describe()}"


def placement(*participants: InProcessParticipant, round_id: int) -> dict[str, tuple[int, int]]:
    """``name -> (rank, world size)`` in round ``round_id`` (rank -1: standby)."""
    results = {p.name: p.result_of(round_id) for p in participants}
    return {name: (r.rank, r.world_size) for name, r in results.items() if r is not None}


def only_decision(participant: InProcessParticipant):
    assert len(participant.decisions) == 1, participant
    return participant.decisions[0]


# ----------------------------------------------------------------- kill -9


@pytest.mark.parametrize("keep_ranks", [False, True], ids=["ranks close up", "keep_ranks"])
def test_a_killed_active_is_replaced_by_the_hot_spare(make_cluster, keep_ranks):
    """kill -9 x training step (strategy_multiprocess: test_sigkill_active_the_survivor_and_the_spare_resume_at_the_
    step_in_flight). The survivor's collective fails as the victim's connections close; it decides PEER_LOST ->
    RECOVER and opens round 1; the coordinator finds the victim's heartbeat silent and gives it no place; the spare
    steps in and both resume at the step in flight. Ranks close up (the survivor, rank 0, keeps it), or with
    keep_ranks the survivor keeps rank 1 and the spare takes the lost rank 0."""
    cluster = make_cluster(2, 3, keep_ranks=keep_ranks)
    a, b, c = cluster.start("A", "B", "C")
    wait_rounds(cluster, a, b, c, round_id=0)
    assert placement(a, b, c, round_id=0) == {"A": (0, 2), "B": (1, 2), "C": (-1, 2)}
    wait_training(cluster, a, b, round_id=0)
    victim, survivor = (a, b) if keep_ranks else (b, a)
    victim.kill()

    wait_rounds(cluster, survivor, c, round_id=1)
    expected = {"B": (1, 2), "C": (0, 2)} if keep_ranks else {"A": (0, 2), "C": (1, 2)}
    assert placement(survivor, c, round_id=1) == expected, cluster.describe()
    decision = only_decision(survivor)
    assert (decision.kind, decision.detector, decision.outcome.action) == (
        FailureKind.PEER_LOST, Detector.COLLECTIVE, FailureAction.RECOVER)
    assert decision.facts.is_collective_error and decision.facts.peer_gone
    assert "heartbeat silent" in cluster.records.lost()[victim.participant_id]
    # the snapshot exchange: the spare starts from the survivor's step, the step the failure struck at
    wait_training(cluster, survivor, c, round_id=1)
    assert c.start_step[1] == survivor.start_step[1] == survivor.start_step[0] + survivor.steps_in[0] > 0

    cluster.finish()
    assert cluster.wait_for_ends(a, b, c) == {victim.name: -9, survivor.name: 0, "C": 0}, cluster.describe()
    assert survivor.end.ending is Ending.FINISHED and c.end.ending is Ending.FINISHED
    assert c.decisions == [] and cluster.records.closed_for_good() is not None


def test_without_a_spare_the_next_round_cannot_form_and_the_run_closes_too_few_nodes(make_cluster):
    """kill -9 x training step, no hot spare left (2:2). The survivor decides RECOVER and opens round 1; its
    coordinator judges the victim dead, one of max_nodes=2 can still take part, fewer than min_nodes: the run closes
    TOO_FEW_NODES and the survivor's end is NO_RESTART (exit 83)."""
    cluster = make_cluster(2, 2)
    a, b = cluster.start("A", "B")
    wait_training(cluster, a, b, round_id=0)
    b.kill()
    assert cluster.wait_for_ends(a, b) == {"A": 83, "B": -9}, cluster.describe()
    decision = only_decision(a)
    assert (decision.kind, decision.outcome.action) == (FailureKind.PEER_LOST, FailureAction.RECOVER)
    assert a.result_of(1) is None, "round 1 completed without min_nodes"
    end = a.end
    assert (end.ending, end.role, end.cause, end.action) == (
        Ending.LEFT_RENDEZVOUS, Role.TRAINED, EndCause.CLOSED, EndAction.NO_RESTART), end
    assert end.closed is not None and end.closed.kind is CloseKind.TOO_FEW_NODES, end
    assert "no hot spare left" in end.text


def test_when_every_active_is_killed_the_spare_monitor_opens_the_next_round(make_cluster):
    """kill -9 of every active at once, training step: no survivor opens round 1. The spares' monitors find every
    active's heartbeat silent and open it; the spares form it (its coordinator judges both actives dead) and train."""
    cluster = make_cluster(2, 4)
    a, b, c, d = cluster.start("A", "B", "C", "D")
    wait_rounds(cluster, a, b, c, d, round_id=0)
    assert placement(a, b, c, d, round_id=0) == {"A": (0, 2), "B": (1, 2), "C": (-1, 2), "D": (-1, 2)}
    wait_training(cluster, a, b, round_id=0)
    a.kill(reset_connections=False)
    b.kill(reset_connections=False)

    wait_rounds(cluster, c, d, round_id=1)
    assert placement(c, d, round_id=1) == {"C": (0, 2), "D": (1, 2)}, cluster.describe()
    opened = [e for p in (c, d) for e in p.events.of(ev.ROUND_OPEN)]
    assert opened and all(e["round"] == 1 and "every active of round 0 is silent" in e["reason"] for e in opened)
    lost = cluster.records.lost()
    assert all("heartbeat silent" in lost[p.participant_id] for p in (a, b)), lost
    wait_training(cluster, c, d, round_id=1)
    cluster.finish()
    assert cluster.wait_for_ends(a, b, c, d) == {"A": -9, "B": -9, "C": 0, "D": 0}, cluster.describe()


def test_a_coordinator_killed_while_deciding_is_taken_over_and_gets_no_place(make_cluster):
    """kill -9 x rendezvous (rendezvous_faults: the same name). The first arrival coordinates round 0 and is killed
    right after it wrote its rank answers, before the round's ``ready``. Its lease stops rising, a waiter takes the
    round over, judges it by its silent heartbeat and decides without it."""
    cluster = make_cluster(2, 3)
    [a] = cluster.start("A")
    struck = cluster.inject(a, SealedStore, "multi_put", "kill",
                            when=lambda values, names, _values: any("/decision/" in name for name in names))
    b, c = cluster.start("B", "C")
    wait_rounds(cluster, b, c, round_id=0)
    assert struck.is_set() and a.killed
    assert placement(a, b, c, round_id=0) == {"B": (0, 2), "C": (1, 2)}, cluster.describe()
    assert "coordinator of this round that went silent" in cluster.records.lost()[a.participant_id]
    wait_training(cluster, b, c, round_id=0)
    cluster.finish()
    assert cluster.wait_for_ends(a, b, c) == {"A": -9, "B": 0, "C": 0}, cluster.describe()


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_the_survivor_lost_while_it_opens_the_next_round(make_cluster, fault):
    """kill -9 / SIGSTOP x recovery (fault_matrix: test_kill9_of_the_survivor_while_it_opens_the_next_round,
    test_sigstop_of_the_survivor_...). B dies; A, recovering, is lost right after it opened round 1. The spares
    form round 1 without both (their heartbeats are silent). A frozen survivor that thaws joins round 1 as a spare
    and leaves with exit 0 when the job finishes."""
    cluster = make_cluster(2, 4)
    a, b, c, d = cluster.start("A", "B", "C", "D")
    wait_rounds(cluster, a, b, c, d, round_id=0)
    assert placement(a, b, c, d, round_id=0) == {"A": (0, 2), "B": (1, 2), "C": (-1, 2), "D": (-1, 2)}
    wait_training(cluster, a, b, round_id=0)
    struck = cluster.inject(a, BarrierRendezvous, "open_next_round", fault)
    b.kill()

    wait_rounds(cluster, c, d, round_id=1)
    assert struck.is_set()
    assert placement(c, d, round_id=1) == {"C": (0, 2), "D": (1, 2)}, cluster.describe()
    lost = cluster.records.lost()
    assert all("heartbeat silent" in lost[p.participant_id] for p in (a, b)), lost
    assert only_decision(a).outcome.action is FailureAction.RECOVER
    if fault == "freeze":
        a.thaw()
        wait_rounds(cluster, a, round_id=1)
        assert placement(a, round_id=1) == {"A": (-1, 2)}, cluster.describe()
    wait_training(cluster, c, d, round_id=1)
    cluster.finish()
    codes = cluster.wait_for_ends(a, b, c, d)
    assert codes == {"A": -9 if fault == "kill" else 0, "B": -9, "C": 0, "D": 0}, cluster.describe()
    if fault == "freeze":
        assert (a.end.role, a.end.action) == (Role.TRAINED, EndAction.RETURN), a.end


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_an_active_lost_after_fit_returned(make_cluster, fault):
    """kill -9 / SIGSTOP x shutdown (fault_matrix: test_an_active_lost_after_fit_returned[kill|stop]). Both actives
    passed the exit barrier; B is lost before its shutdown. A closes the run FINISHED and the spare leaves: nobody
    waits for B. A frozen B that thaws finds the run finished and ends 0."""
    cluster = make_cluster(2, 3)
    a, b, c = cluster.start("A", "B", "C")
    wait_rounds(cluster, a, b, c, round_id=0)
    wait_training(cluster, a, b, round_id=0)
    struck = cluster.inject(b, BarrierRendezvous, "shutdown", fault, before=True)
    cluster.finish()
    assert cluster.wait_for_ends(a, c) == {"A": 0, "C": 0}, cluster.describe()
    assert cluster.wait_until(struck.is_set, WAIT)
    assert a.end.ending is Ending.FINISHED and c.end.action is EndAction.RETURN
    assert cluster.records.closed_for_good() is not None
    if fault == "freeze":
        b.thaw()
    assert cluster.wait_for_ends(b) == {"B": -9 if fault == "kill" else 0}, cluster.describe()
    assert a.decisions == [] and b.decisions == []


# ----------------------------------------------------------------- SIGSTOP


def test_a_frozen_active_is_found_by_its_silent_heartbeat_and_replaced(make_cluster):
    """SIGSTOP x training step (strategy_multiprocess: test_sigstopped_active_is_detected_as_hung_and_replaced;
    rendezvous_faults: test_a_peer_frozen_in_the_first_steps_of_a_round_is_detected_by_its_silent_heartbeat). The
    hang timeout is far away (60 s): A's round watchdog finds B's heartbeat silent while A cannot progress, writes
    the verdict, opens round 1 and breaks the group; A decides PEER_LOST -> RECOVER, the spare replaces B. Thawed,
    B reads the verdict, decides alike and waits as a spare of round 1; it leaves with exit 0."""
    cluster = make_cluster(2, 3)
    a, b, c = cluster.start("A", "B", "C")
    wait_rounds(cluster, a, b, c, round_id=0)
    assert placement(a, b, c, round_id=0) == {"A": (0, 2), "B": (1, 2), "C": (-1, 2)}
    wait_training(cluster, a, b, round_id=0)
    b.freeze()

    wait_rounds(cluster, a, c, round_id=1)
    assert placement(a, c, round_id=1) == {"A": (0, 2), "C": (1, 2)}, cluster.describe()
    [detected] = a.events.of(ev.FAILURE_DETECTED)
    assert detected["detector"] == Detector.HANG.value and "silent" in detected["error"], detected
    decision = only_decision(a)
    assert (decision.kind, decision.detector, decision.outcome.action) == (
        FailureKind.PEER_LOST, Detector.HANG, FailureAction.RECOVER)
    assert decision.facts.hang_detected
    assert "heartbeat silent" in cluster.records.lost()[b.participant_id]

    b.thaw()
    wait_rounds(cluster, b, round_id=1)
    assert placement(b, round_id=1) == {"B": (-1, 2)}, cluster.describe()
    b_decision = only_decision(b)
    assert (b_decision.kind, b_decision.outcome.action) == (FailureKind.PEER_LOST, FailureAction.RECOVER)
    wait_training(cluster, a, c, round_id=1)
    cluster.finish()
    assert cluster.wait_for_ends(a, b, c) == {"A": 0, "B": 0, "C": 0}, cluster.describe()
    assert (b.end.role, b.end.action) == (Role.TRAINED, EndAction.RETURN), b.end


def test_an_active_judged_frozen_that_thaws_while_the_round_is_short_takes_part_again(make_cluster):
    """A live process starved for seconds on an overloaded machine looks frozen: a peer's watchdog
    records it lost by its silent heartbeat (seen with devices=2 on CI, at the first step). With no
    spare the next round is short of min_nodes; once it arrives with its heartbeat risen, it takes
    part and the job goes on -- before, the round counted it lost though it had arrived and the
    job ended 81 for want of a node it had."""
    cluster = make_cluster(2, 2)
    a, b = cluster.start("A", "B")
    wait_rounds(cluster, a, b, round_id=0)
    wait_training(cluster, a, b, round_id=0)
    b.freeze()
    assert cluster.wait_until(lambda: b.participant_id in cluster.records.lost()
                              and cluster.records.current_round() == 1, WAIT), cluster.describe()
    assert "heartbeat silent" in cluster.records.lost()[b.participant_id]
    time.sleep(1.5)  # A coordinates round 1 and finds B lost, missing and silent (it waits for a replacement)
    b.thaw()
    wait_rounds(cluster, a, b, round_id=1)
    assert sorted(placement(a, b, round_id=1).values()) == [(0, 2), (1, 2)], cluster.describe()
    assert cluster.records.closed_for_good() is None
    wait_training(cluster, a, b, round_id=1)
    cluster.finish()
    assert cluster.wait_for_ends(a, b) == {"A": 0, "B": 0}, cluster.describe()


def test_an_arrival_no_process_stands_behind_gets_no_place(make_cluster):
    """Issue 47, item 3: one forged arrival record (any store client without a secret; with one, a
    replayed record of a dead participant) put a phantom rank in the round, and no step came for
    the group's 60 s init timeout. An arrival is placed only with a heartbeat of its own."""
    from types import SimpleNamespace

    cluster = make_cluster(2, 3)
    ghost = SimpleNamespace(participant_id="ghost:1:0", infra_rank=0, domain_id="ghost-host")
    cluster.records.append_arrival(0, 1, ghost)  # first in the log: it would have been rank 0
    a, b = cluster.start("A", "B")
    wait_rounds(cluster, a, b, round_id=0)
    assert sorted(placement(a, b, round_id=0).values()) == [(0, 2), (1, 2)], cluster.describe()
    assert ghost.participant_id not in cluster.records.ranked_actives(0)
    wait_training(cluster, a, b, round_id=0)
    cluster.finish()
    assert cluster.wait_for_ends(a, b) == {"A": 0, "B": 0}, cluster.describe()


def test_a_frozen_coordinator_is_taken_over_and_joins_as_standby_when_it_thaws(make_cluster):
    """SIGSTOP x rendezvous (rendezvous_faults: the same name). The coordinator of round 0 freezes after writing
    its answers; a waiter takes over and decides without it. Thawed, it loses the race for ``ready``, finds no
    answer of its own and waits as a spare (-1 of 2); it leaves with exit 0 when the job finishes."""
    cluster = make_cluster(2, 3)
    [a] = cluster.start("A")
    struck = cluster.inject(a, SealedStore, "multi_put", "freeze",
                            when=lambda values, names, _values: any("/decision/" in name for name in names))
    b, c = cluster.start("B", "C")
    wait_rounds(cluster, b, c, round_id=0)
    assert struck.is_set()
    assert placement(b, c, round_id=0) == {"B": (0, 2), "C": (1, 2)}, cluster.describe()
    a.thaw()
    wait_rounds(cluster, a, round_id=0)
    assert placement(a, round_id=0) == {"A": (-1, 2)}, cluster.describe()
    wait_training(cluster, b, c, round_id=0)
    cluster.finish()
    assert cluster.wait_for_ends(a, b, c) == {"A": 0, "B": 0, "C": 0}, cluster.describe()
    assert (a.end.role, a.end.action) == (Role.STANDBY, EndAction.RETURN), a.end


# ----------------------------------------------------------------- SIGTERM


def test_a_sigterm_to_a_waiting_spare_withdraws_it_and_training_goes_on(make_cluster):
    """SIGTERM x rendezvous, a hot spare (strategy_multiprocess: the same name). The spare withdraws (recorded lost,
    the run stays open: without it 2 of max_nodes=3 can still take part) and stops with 143; the actives never
    notice: no failure, no new round."""
    cluster = make_cluster(2, 3)
    a, b, c = cluster.start("A", "B", "C")
    wait_rounds(cluster, a, b, c, round_id=0)  # C waits as a spare of round 0
    wait_training(cluster, a, b, round_id=0)
    c.terminate()
    assert cluster.wait_for_ends(c) == {"C": 143}, cluster.describe()
    assert (c.end.role, c.end.cause, c.end.action) == (Role.STANDBY, EndCause.SIGTERM, EndAction.STOPPED), c.end
    assert "withdrew" in cluster.records.lost()[c.participant_id]
    assert cluster.records.closed_for_good() is None
    steps = a.steps_in[0]
    assert cluster.wait_until(lambda: a.steps_in[0] >= steps + 5, WAIT), cluster.describe()
    cluster.finish()
    assert cluster.wait_for_ends(a, b) == {"A": 0, "B": 0}, cluster.describe()
    assert a.decisions == [] and b.decisions == [] and [len(p.rounds) for p in (a, b)] == [1, 1]


def test_a_sigterm_while_round_0_forms_stops_everyone_with_143(make_cluster):
    """SIGTERM x rendezvous, round 0 forming (exit_truth: test_sigterm_while_round_0_forms_stops_everyone_with_143).
    Without the stopped participant fewer than min_nodes=3 can take part: it closes the run STOPPED (a preemption,
    not TOO_FEW_NODES) and everyone stops with 143."""
    cluster = make_cluster(3, 3)
    a, b = cluster.start("A", "B")
    a.terminate()
    assert cluster.wait_for_ends(a, b) == {"A": 143, "B": 143}, cluster.describe()
    assert (a.end.role, a.end.cause) == (Role.UNASSIGNED, EndCause.SIGTERM), a.end
    assert (b.end.role, b.end.cause) == (Role.UNASSIGNED, EndCause.CLOSED), b.end
    assert b.end.closed is not None and b.end.closed.kind is CloseKind.STOPPED, b.end
    assert a.rounds == [] and b.rounds == []


# ----------------------------------------------------------------- late starters, extras


def test_a_late_starter_after_the_job_finished_leaves_as_not_needed(make_cluster):
    """late starter x shutdown (exit_truth: test_a_participant_that_starts_after_its_job_finished_exits_0). A
    participant of the same launch (its process started before the close) arrives after the run closed FINISHED:
    it was never needed and leaves with 0."""
    cluster = make_cluster(2, 3)
    a, b = cluster.start("A", "B")
    wait_training(cluster, a, b, round_id=0)
    cluster.finish()
    assert cluster.wait_for_ends(a, b) == {"A": 0, "B": 0}, cluster.describe()
    [late] = cluster.start("Late")
    assert cluster.wait_for_ends(late) == {"Late": 0}, cluster.describe()
    end = late.end
    assert (end.ending, end.role, end.cause, end.action) == (
        Ending.LEFT_RENDEZVOUS, Role.UNASSIGNED, EndCause.CLOSED, EndAction.RETURN), end
    assert end.closed is not None and end.closed.kind is CloseKind.FINISHED and late.rounds == []


def test_an_extra_participant_beyond_max_nodes_is_excluded_and_the_job_goes_on(make_cluster):
    """late starter x rendezvous, past max_nodes (rendezvous_protocol: test_extra_participant_gets_clear_error_and_
    job_goes_on, here with the whole fit loop). The fourth participant of a 2:3 run has no place: it leaves with 0
    and a clear reason; the run stays open and the actives train on."""
    cluster = make_cluster(2, 3)
    a, b, c = cluster.start("A", "B", "C")
    wait_rounds(cluster, a, b, c, round_id=0)
    wait_training(cluster, a, b, round_id=0)
    [d] = cluster.start("D")
    assert cluster.wait_for_ends(d) == {"D": 0}, cluster.describe()
    assert d.end.ending is Ending.EXCLUDED and "more than max_nodes=3" in d.end.text and d.rounds == [], d.end
    assert cluster.records.closed_for_good() is None
    assert d.participant_id not in {x.participant_id for x in cluster.records.arrivals(0)}  # it withdrew
    steps = a.steps_in[0]
    assert cluster.wait_until(lambda: a.steps_in[0] >= steps + 5, WAIT), cluster.describe()
    cluster.finish()
    assert cluster.wait_for_ends(a, b, c) == {"A": 0, "B": 0, "C": 0}, cluster.describe()
    assert a.decisions == [] and b.decisions == []


# ----------------------------------------------------------------- the store lost


def test_the_store_lost_before_the_first_round_formed_ends_83(make_cluster):
    """store killed x rendezvous (fault_matrix: test_store_killed_before_the_first_round_formed). Nothing trained
    and nothing can form: NO_RESTART (83), saying the store was lost."""
    cluster = make_cluster(2, 2)
    [a] = cluster.start("A")
    cluster.lose_store()
    assert cluster.wait_for_ends(a) == {"A": 83}, cluster.describe()
    assert (a.end.role, a.end.cause, a.end.action) == (Role.UNASSIGNED, EndCause.STORE_LOST, EndAction.NO_RESTART)
    assert "lost the rendezvous store" in a.end.text, a.end


def test_the_store_lost_while_training_the_job_still_finishes(make_cluster):
    """store killed x training step and x shutdown (exit_truth: test_store_lost_while_training_the_job_still_
    succeeds). Training needs no store: the actives train on and finish (the exit barrier and the close fail at
    once) with 0; the spare leaves with 0 (the actives report the outcome), not 83."""
    cluster = make_cluster(2, 3)
    a, b, c = cluster.start("A", "B", "C")
    wait_rounds(cluster, a, b, c, round_id=0)  # C waits as a spare of round 0
    wait_training(cluster, a, b, round_id=0)
    cluster.lose_store()
    assert cluster.wait_for_ends(c) == {"C": 0}, cluster.describe()
    assert (c.end.role, c.end.cause, c.end.action) == (Role.STANDBY, EndCause.STORE_LOST, EndAction.RETURN), c.end
    steps = a.steps_in[0]
    assert cluster.wait_until(lambda: a.steps_in[0] >= steps + 5, WAIT), cluster.describe()
    cluster.finish()
    assert cluster.wait_for_ends(a, b) == {"A": 0, "B": 0}, cluster.describe()
    assert a.end.ending is Ending.FINISHED and a.decisions == [] and b.decisions == []


# ----------------------------------------------------------------- found while building this tier


def test_a_dropped_store_connection_leaves_no_thread_behind(tcp_store):
    """Every BoundedStore has a worker thread; one whose store was dropped ends (it used to serve it for
    the life of the process: a thread per clone, each round's watchdog and each join's spare monitor)."""
    def workers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == STORE_WORKER_THREAD}

    before = workers()
    store = BoundedStore(dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False,
                                       timeout=datetime.timedelta(seconds=10)), 10.0)
    store.set("key", "value")
    clone = store.clone()
    assert clone.get("key") == b"value"
    # this test's own workers: other tests of this process may drop (and end) theirs meanwhile
    ours = workers() - before
    assert len(ours) == 2
    del store, clone
    gc.collect()
    never = threading.Event()
    for _ in range(10):  # up to 1 s for the workers to end
        if not any(t.is_alive() for t in ours):
            break
        never.wait(0.1)
    assert not any(t.is_alive() for t in ours)


def test_a_spare_that_is_slow_to_arrive_is_waited_for_when_a_peer_dies(make_cluster):
    """The control of the test below: B is a spare that was never lost. It is frozen while C dies; the coordinator
    of round 1 judges C dead, still counts B among those who can take part (2 of max_nodes=3), waits, and B,
    thawed, steps in."""
    cluster = make_cluster(2, 3)
    a, c, b = cluster.start("A", "C", "B")
    wait_rounds(cluster, a, c, b, round_id=0)
    assert placement(a, c, b, round_id=0) == {"A": (0, 2), "C": (1, 2), "B": (-1, 2)}, cluster.describe()
    wait_training(cluster, a, c, round_id=0)
    b.freeze()
    c.kill()
    assert cluster.wait_until(lambda: c.participant_id in cluster.records.lost(), WAIT), cluster.describe()
    b.thaw()
    wait_rounds(cluster, a, b, round_id=1)
    assert placement(a, b, round_id=1) == {"A": (0, 2), "B": (1, 2)}, cluster.describe()
    cluster.finish()
    assert cluster.wait_for_ends(a, b, c) == {"A": 0, "B": 0, "C": -9}, cluster.describe()


def test_a_spare_that_came_back_after_it_was_lost_is_waited_for_when_a_peer_dies(make_cluster):
    """As the control above, but B came back after it was recorded lost: it froze while it coordinated round 0, was
    judged dead by the coordinator that took over, and waits as a spare since it thawed (the real-process test
    test_a_frozen_coordinator_is_taken_over_and_joins_as_standby_when_it_thaws stops there)."""
    cluster = make_cluster(2, 3)
    [b] = cluster.start("B")
    cluster.inject(b, SealedStore, "multi_put", "freeze",
                   when=lambda values, names, _values: any("/decision/" in name for name in names))
    a, c = cluster.start("A", "C")
    wait_rounds(cluster, a, c, round_id=0)
    assert "went silent" in cluster.records.lost()[b.participant_id]
    b.thaw()
    wait_rounds(cluster, b, round_id=0)
    assert placement(a, c, b, round_id=0) == {"A": (0, 2), "C": (1, 2), "B": (-1, 2)}, cluster.describe()
    wait_training(cluster, a, c, round_id=0)
    b.freeze()
    c.kill()
    assert cluster.wait_until(lambda: c.participant_id in cluster.records.lost(), WAIT), cluster.describe()
    # B's heartbeat rose past the number it stood still at when it was judged dead: it is back and
    # counts as able to take part, so the coordinator waits for it (it would close the run TOO_FEW_NODES
    # at once otherwise); B thaws after this bound
    cluster.wait_until(lambda: cluster.records.closed_for_good() is not None, 5.0)
    b.thaw()
    # ends as soon as round 1 completed or the run closed
    assert cluster.wait_until(lambda: len(placement(a, b, round_id=1)) == 2 or a.end is not None, WAIT), \
        cluster.describe()
    assert placement(a, b, round_id=1) == {"A": (0, 2), "B": (1, 2)}, cluster.describe()
