"""Pure SIGTERM-path logic: decisions (fake clock), grace resolution, store agreement, exit records, signals."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

import pytest

from lightning_ft.deadlines import call_with_timeout
from lightning_ft.exit_codes import ExitCode
from lightning_ft.termination.coordination import LocalStopCoordinator, StopRequest, StoreStopCoordinator
from lightning_ft.termination.decision import (
    Action,
    BoundaryAction,
    budget_left,
    decide_at_boundary,
    decide_on_termination,
    not_saved_exit_code,
    resolve_grace_seconds,
)
from lightning_ft.termination.exit_records import (
    launcher_status,
    read_exit_records,
    run_and_summarize,
    summarize_exit_codes,
    write_exit_record,
)
from lightning_ft.termination.signals import SignalListener
from lightning_ft.termination.watcher import StopWatcher


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def decide(clock: FakeClock, signal_time: float, estimate: float | None, *, healthy: bool = True,
           has_checkpoint: bool = True, grace: float = 30.0, reserve: float = 1.0):
    left = budget_left(grace_s=grace, signal_time=signal_time, now=clock.now, exit_reserve_s=reserve)
    return decide_on_termination(healthy=healthy, health_reasons=["memory: 3 MiB available"],
                                 has_emergency_checkpoint=has_checkpoint, budget_left_s=left,
                                 estimated_save_s=estimate, save_safety_factor=1.5)


def test_unhealthy_node_exits_without_saving_whatever_the_budget():
    clock = FakeClock()
    decision = decide(clock, clock.now, estimate=0.01, healthy=False)
    assert decision.action is Action.EXIT_WITHOUT_SAVE
    assert decision.exit_code == ExitCode.UNHEALTHY_NODE
    assert "memory: 3 MiB available" in decision.reasons


def test_healthy_node_saves_while_the_measured_cost_fits():
    clock = FakeClock()
    signal_time = clock.now
    clock.advance(5.0)  # waited 5 s for the stop step: 30 - 5 - 1 = 24 s left
    fits = decide(clock, signal_time, estimate=15.0)  # 22.5 s needed
    assert fits.action is Action.SAVE_THEN_EXIT and fits.exit_code == ExitCode.PREEMPTED
    clock.advance(2.0)  # 22 s left < 22.5 s
    late = decide(clock, signal_time, estimate=15.0)
    assert late.action is Action.EXIT_WITHOUT_SAVE
    assert late.exit_code == 128 + signal.SIGTERM
    assert "would not fit" in late.reasons[0]


def test_unknown_cost_is_tried_but_an_exhausted_budget_is_not():
    clock = FakeClock()
    signal_time = clock.now
    assert decide(clock, signal_time, estimate=None).action is Action.SAVE_THEN_EXIT
    clock.advance(29.5)
    decision = decide(clock, signal_time, estimate=None)
    assert decision.action is Action.EXIT_WITHOUT_SAVE and decision.exit_code == 143


def test_without_emergency_checkpoint_the_code_says_nothing_was_saved():
    clock = FakeClock()
    decision = decide(clock, clock.now, estimate=None, has_checkpoint=False)
    assert decision.action is Action.EXIT_WITHOUT_SAVE
    assert decision.exit_code == not_saved_exit_code(signal.SIGTERM) == 143
    assert not_saved_exit_code(signal.SIGUSR1) == 128 + signal.SIGUSR1


def test_grace_seconds_resolution():
    assert resolve_grace_seconds(12.0, "grace_seconds") == (12.0, "grace_seconds")
    assert resolve_grace_seconds(None, "") == (30.0, "default")
    # torchrun SIGKILLs its workers after its shutdown timeout: it caps the grace period
    grace, source = resolve_grace_seconds(None, "", ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "10"))
    assert grace == 10.0 and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in source
    assert resolve_grace_seconds(60.0, "grace_seconds", ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120"))[0] == 60.0
    with pytest.raises(ValueError, match="PET_SHUTDOWN_TIMEOUT"):
        resolve_grace_seconds(None, "", ("PET_SHUTDOWN_TIMEOUT", "soon"))


def test_grace_seconds_setting_from_the_environment_and_torchrun(monkeypatch):
    from lightning_ft import GracefulTermination

    for key in ("LIGHTNING_FT_GRACE_SECONDS", "TORCHELASTIC_RUN_ID", "PET_SHUTDOWN_TIMEOUT",
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    assert (GracefulTermination(probes=[]).grace_seconds, GracefulTermination(probes=[]).grace_source) == \
        (30.0, "default")
    monkeypatch.setenv("LIGHTNING_FT_GRACE_SECONDS", "90")
    assert GracefulTermination(probes=[]).grace_source == "LIGHTNING_FT_GRACE_SECONDS"
    assert GracefulTermination(probes=[]).grace_seconds == 90.0
    assert GracefulTermination(probes=[], grace_seconds=12).grace_seconds == 12.0
    # under torchrun (TORCHELASTIC_RUN_ID) its worker shutdown timeout caps the grace period
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5")
    assert GracefulTermination(probes=[]).grace_seconds == 90.0  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert GracefulTermination(probes=[]).grace_seconds == 5.0
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "3")
    assert GracefulTermination(probes=[]).grace_seconds == 3.0
    monkeypatch.setenv("LIGHTNING_FT_GRACE_SECONDS", "soon")
    with pytest.raises(ValueError, match="LIGHTNING_FT_GRACE_SECONDS must be a number"):
        GracefulTermination(probes=[])


def test_first_proposal_wins_and_every_rank_sees_it(tcp_store):
    import torch.distributed as dist

    prefix = dist.PrefixStore("t/", tcp_store)
    rank0, rank1 = StoreStopCoordinator(prefix, 0, 2), StoreStopCoordinator(prefix.clone(), 1, 2)
    assert rank0.poll() is None
    agreed = rank1.propose(12, signal.SIGTERM, "rank 1: SIGTERM received")
    assert agreed == StopRequest(12, 1, signal.SIGTERM, "rank 1: SIGTERM received")
    assert rank0.propose(14, signal.SIGTERM, "rank 0: SIGTERM received") == agreed  # loses the compare_set
    assert rank0.poll() == agreed
    assert not rank0.any_peer_unhealthy()

    rank1.announce_unhealthy(11, signal.SIGTERM, ["marker: xid 79"])
    assert rank0.any_peer_unhealthy()
    assert rank0.unhealthy_peers() == {1: ["marker: xid 79"]}
    assert rank1.unhealthy_peers() == {}  # its own notice is not a peer's


@pytest.mark.parametrize(("step", "stop", "unhealthy", "confirmed", "expected"), [
    (10, 12, False, False, BoundaryAction.CONTINUE),  # two steps before the stop: nothing to wait for yet
    (11, 12, False, False, BoundaryAction.HOLD),  # before training the stop step, every rank must know it
    (11, 12, False, True, BoundaryAction.CONTINUE),
    (12, 12, False, False, BoundaryAction.STOP),  # at the stop step: everyone who trained it knew it
    (13, 12, False, True, BoundaryAction.STOP),  # past it (a confirmation that was forged): stop now
    (5, 12, True, False, BoundaryAction.STOP),  # a peer left unhealthy: our next collective fails
])
def test_boundary_actions(step, stop, unhealthy, confirmed, expected):
    assert decide_at_boundary(step=step, stop_step=stop, peer_unhealthy=unhealthy,
                              all_confirmed=confirmed) is expected


def test_bounded_call_returns_the_value_the_error_or_that_it_took_too_long():
    assert call_with_timeout(lambda: 42, 1.0, "answering").value == 42
    failed = call_with_timeout(lambda: 1 / 0, 1.0, "dividing")
    assert not failed.ok and "dividing failed: ZeroDivisionError" in failed.problem
    never = threading.Event()
    stuck = call_with_timeout(lambda: never.wait(60), 0.05, "asking a frozen store")
    assert not stuck.ok and "did not finish within 0.05 s" in stuck.problem
    never.set()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_the_stop_watcher_learns_a_peers_stop_and_unhealthy_exit_and_confirms(tcp_store):
    import torch.distributed as dist

    prefix = dist.PrefixStore("w/", tcp_store)
    rank0, rank1 = StoreStopCoordinator(prefix, 0, 2), StoreStopCoordinator(prefix.clone(), 1, 2)
    learned: list[tuple[StopRequest, str]] = []
    watcher = StopWatcher(rank1, on_stop=lambda stop: learned.append((stop, threading.current_thread().name)),
                          close_timeout=5.0)
    watcher.start()
    try:
        assert watcher.request is None and not rank0.all_confirmed()
        agreed = rank0.propose(7, signal.SIGTERM, "rank 0: SIGTERM received")  # confirms, wakes everyone
        # two effects of one wake-up, in this order: the request is published (and confirmed),
        # then on_stop runs -- wait for the later one before asserting both
        assert wait_until(lambda: bool(learned))
        assert watcher.request == agreed and learned == [(agreed, "lightning-ft-stop-watcher")]
        assert rank0.wait_until_all_confirmed(10.0)  # rank 1's watcher confirmed for it
        assert not watcher.peer_unhealthy

        rank0.announce_unhealthy(7, signal.SIGTERM, ["marker: xid 79"])
        assert wait_until(lambda: watcher.peer_unhealthy)
        assert watcher.unhealthy == {0: ["marker: xid 79"]} and len(learned) == 1
    finally:
        watcher.close(rank1)
    assert not [t for t in threading.enumerate() if t.name == "lightning-ft-stop-watcher"]


def test_confirmations_time_out_when_a_rank_never_learns_the_stop(tcp_store):
    import torch.distributed as dist

    prefix = dist.PrefixStore("c/", tcp_store)
    rank0 = StoreStopCoordinator(prefix, 0, 2)
    rank0.propose(3, signal.SIGTERM, "rank 0: SIGTERM received")
    assert not rank0.wait_until_all_confirmed(0.1)  # rank 1 has no watcher
    StoreStopCoordinator(prefix.clone(), 1, 2).confirm()
    assert rank0.wait_until_all_confirmed(0.1)


def test_local_coordinator_is_its_own_authority():
    local = LocalStopCoordinator()
    assert local.poll() is None
    assert local.propose(7, 15, "x").step == 7
    assert local.propose(9, 15, "y").step == 7
    assert local.unhealthy_peers() == {}


@pytest.mark.parametrize(("records", "launcher", "expected"), [
    ([], 1, 1),  # no records: nothing of ours happened
    ([81, 81], 1, 81),
    ([81, 82], 1, 82),
    ([143, 81], 1, 143),
    ([81], 0, 0),
])
def test_node_exit_code_from_rank_records(records, launcher, expected):
    assert summarize_exit_codes(records, launcher) == expected


def test_wrapper_exits_with_the_recorded_code(tmp_path):
    # another job's (or an earlier attempt's) records in the same --dir never speak for this launch
    write_exit_record(tmp_path, 3, 81, "save-then-exit", ["stale"], 1)
    write_exit_record(tmp_path / "launch-other-job", 0, 81, "save-then-exit", ["other job"], 1)
    script = (f"import sys; sys.path.insert(0, {str(__import__('proc_utils').REPO_ROOT)!r});"
              "from lightning_ft.termination.exit_records import write_exit_record as w;"
              "import os; d = os.environ['LIGHTNING_FT_EXIT_RECORD_DIR'];"
              "w(d, 0, 81, 'save-then-exit', [], 5); w(d, 1, 82, 'exit-without-save', ['xid'], 5);"
              "sys.exit(1)")
    assert run_and_summarize([sys.executable, "-c", script], tmp_path) == ExitCode.UNHEALTHY_NODE
    [launch] = [d for d in tmp_path.glob("launch-*") if d.name != "launch-other-job"]
    assert oct(launch.stat().st_mode & 0o777) == "0o700"
    assert sorted(r["rank"] for r in read_exit_records(launch)) == [0, 1]
    # a crashed launch (exit 1, no record of its own) is not made 81 by another job's record
    assert run_and_summarize([sys.executable, "-c", "import sys; sys.exit(1)"], tmp_path) == 1


def test_a_launcher_ended_by_a_signal_gives_128_plus_the_signal(tmp_path):
    """``Popen`` reports a death by SIGTERM as -15; the wrapper used to exit with it (241 as a
    process status, which no requeue rule matches). A real signal, a real child."""
    script = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert run_and_summarize([sys.executable, "-c", script], tmp_path) == 128 + signal.SIGTERM
    assert launcher_status(-9) == 137 and launcher_status(0) == 0 and launcher_status(1) == 1


def test_exit_record_is_not_written_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    records = tmp_path / "records"
    records.mkdir()
    (records / f".rank-0.{os.getpid()}.tmp").symlink_to(victim)
    with pytest.raises(OSError):
        write_exit_record(records, 0, 81, "save-then-exit", [], 1)
    assert victim.read_text() == "keep"


def test_an_exit_record_is_written_only_into_a_private_directory_of_this_user(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ValueError, match=r"exit record directory '.*theirs' is owned by uid 65534.*plant or swap exit"):
        write_exit_record(theirs, 0, 81, "save-then-exit", [], 1)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="writable by its group and other users"):
        write_exit_record(shared, 0, 81, "save-then-exit", [], 1)
    assert list(theirs.iterdir()) == list(shared.iterdir()) == []
    written = write_exit_record(tmp_path / "new" / "records", 0, 81, "save-then-exit", [], 1)
    assert oct(written.parent.stat().st_mode & 0o777) == "0o700"


def test_signal_listener_records_in_the_handler_and_acts_in_a_thread():
    seen: list[tuple[int, float, str, bool]] = []
    main_blocked = threading.Event()
    done = threading.Event()

    def on_signal(signum: int, when: float) -> None:
        seen.append((signum, when, threading.current_thread().name, main_blocked.is_set()))
        done.set()

    before = signal.getsignal(signal.SIGUSR2)
    listener = SignalListener([signal.SIGUSR2], on_signal)
    assert listener.install()
    try:
        assert signal.getsignal(signal.SIGUSR2) == listener._handler
        # The main thread sits in a C call that retries EINTR itself (glibc system() ->
        # waitpid), so the Python-level handler cannot run until it returns; the watcher
        # is woken through the wakeup fd regardless.
        libc = ctypes.CDLL(None)
        threading.Timer(0.2, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)).start()
        main_blocked.set()
        libc.system(b"sleep 2")
        main_blocked.clear()
        assert done.wait(5)
        signum, _, thread_name, during_block = seen[0]
        assert signum == signal.SIGUSR2 and thread_name == "lightning-ft-signal-watcher"
        assert during_block, "the watcher only reacted after the main thread's C call returned"
        assert listener.received is not None
    finally:
        listener.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == before
    assert signal.set_wakeup_fd(-1) == -1  # nothing of ours left behind
    assert len(seen) == 1


def test_a_first_ctrl_c_is_recorded_and_a_second_raises_keyboard_interrupt_at_once():
    """Issue 46, item 8: the first SIGINT starts the whole job's orderly stop (recorded, like
    SIGTERM); a second is the user wanting out now -- Python's own KeyboardInterrupt."""
    from lightning_ft.termination.decision import hands_over_on

    seen = threading.Event()
    listener = SignalListener([signal.SIGINT], lambda signum, when: seen.set())
    assert listener.install()
    try:
        signal.raise_signal(signal.SIGINT)  # recorded: no exception here
        assert seen.wait(5) and listener.received is not None and listener.received[0] == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        listener.uninstall()
    assert not hands_over_on(signal.SIGINT) and hands_over_on(signal.SIGTERM) and hands_over_on(signal.SIGUSR1)


# ------------------------------------------------------------------ hand-over (issue 38)


def test_the_signalled_hand_over_when_enough_spares_are_ready():
    from lightning_ft.termination.decision import decide_hand_over

    verdict = decide_hand_over(world_size=4, signalled={2}, unhealthy=(), spares_ready=1)
    assert verdict.leavers == (2,) and verdict.hands_over
    verdict = decide_hand_over(world_size=4, signalled={1}, unhealthy={3}, spares_ready=2)
    assert verdict.leavers == (1, 3)


@pytest.mark.parametrize(("signalled", "unhealthy", "spares", "why"), [
    ({0, 1}, (), 5, "every active"),            # scancel, a time limit: the whole job stops (81)
    ({0}, {1}, 5, "every active"),              # the last one unhealthy counts as leaving too
    ({0, 1}, (), 1, "every active"),
    ({1}, (), 0, "0 hot spare(s) are ready"),  # no spare: stop (elastic would shrink)
    ({1, 2}, (), 1, "1 hot spare(s) are ready"),
    ((), (), 3, "no rank says it was signalled"),
    ({1}, (), None, "cannot re-form in-process"),  # plain DDP, torchrun's agent
])
def test_without_a_place_for_every_leaver_the_whole_job_stops(signalled, unhealthy, spares, why):
    from lightning_ft.termination.decision import decide_hand_over

    world = 2 if why == "every active" else 3
    verdict = decide_hand_over(world_size=world, signalled=signalled, unhealthy=unhealthy, spares_ready=spares)
    assert not verdict.hands_over and verdict.leavers == () and why in verdict.reason, verdict


def test_a_rank_outside_the_world_never_counts_as_a_leaver():
    from lightning_ft.termination.decision import decide_hand_over

    verdict = decide_hand_over(world_size=2, signalled={1, 7, -1}, unhealthy=(), spares_ready=1)
    assert verdict.leavers == (1,)


def test_a_damaged_hand_over_verdict_decodes_as_none():
    from lightning_ft.schema.termination import HandOverVerdict

    assert HandOverVerdict.decode(HandOverVerdict((1,), "x").encode()) == HandOverVerdict((1,), "x")
    for raw in (b"", b"[]", b'{"leavers": [-1], "reason": ""}', b'{"leavers": [true], "reason": ""}',
                b'{"leavers": [1]}', b'{"leavers": "1", "reason": ""}', b"\xff"):
        assert HandOverVerdict.decode(raw) is None, raw


def test_signalled_ranks_and_the_first_published_verdict_are_what_every_rank_reads(tcp_store):
    import torch.distributed as dist

    from lightning_ft.schema.termination import HandOverVerdict

    prefix = dist.PrefixStore("h/", tcp_store)
    rank0, rank1, rank2 = (StoreStopCoordinator(prefix.clone(), r, 3) for r in range(3))
    rank1.propose(5, signal.SIGTERM, "rank 1: SIGTERM received", signalled=True)
    rank2.mark_signalled()
    rank1.mark_signalled()  # twice: still one rank
    assert rank0.signalled_ranks() == {1, 2}
    assert rank0.hand_over_verdict() is None
    first = rank2.publish_hand_over(HandOverVerdict((1, 2), "two leave"))
    assert rank0.publish_hand_over(HandOverVerdict((), "the job stops")) == first  # loses the compare_set
    assert rank1.hand_over_verdict() == first == HandOverVerdict((1, 2), "two leave")


def test_the_agreement_waits_out_the_settle_time_and_counts_signals_that_arrived_meanwhile(tcp_store):
    import torch.distributed as dist

    from lightning_ft._clock import monotonic
    from lightning_ft.termination.handover import HandOverAgreement, SeatCensus

    class Seat:
        told: list = []

        def census(self):
            return SeatCensus(1)

        def hand_over(self, leaving, reason):
            self.told.append((leaving, reason))

        def min_world_size(self):
            return None

    prefix = dist.PrefixStore("s/", tcp_store)
    rank0, rank1 = StoreStopCoordinator(prefix.clone(), 0, 2), StoreStopCoordinator(prefix.clone(), 1, 2)
    seat = Seat()
    agreement = HandOverAgreement(rank0, seat, settle_s=0.3, timeout_s=5.0)
    rank1.mark_signalled()
    started = monotonic()
    # rank 0 is signalled too, 0.1 s after rank 1, while the settle time runs
    threading.Timer(0.1, rank0.mark_signalled).start()
    events = []

    class Log:
        def emit(self, event, **fields):
            events.append((event, fields))

    verdict = agreement.settle(started, 7, self_signalled=False, unhealthy=(), events=Log())
    assert monotonic() - started >= 0.3
    assert not verdict.hands_over and "every active" in verdict.reason  # both signalled: the job stops
    assert seat.told == [] and events[0][1]["hands_over"] is False
    # rank 1 reads the same verdict without deciding again
    assert HandOverAgreement(rank1, seat, 0.3, 5.0).verdict(started, True) == verdict


def test_an_elastic_job_without_spares_shrinks_down_to_min_nodes_but_not_below():
    from lightning_ft.termination.decision import decide_hand_over

    verdict = decide_hand_over(world_size=4, signalled={3}, unhealthy=(), spares_ready=0, min_world_size=2)
    assert verdict.leavers == (3,) and "shrinks to 3" in verdict.reason
    verdict = decide_hand_over(world_size=4, signalled={1, 2}, unhealthy=(), spares_ready=1, min_world_size=3)
    assert verdict.leavers == (1, 2) and "shrinks to 3" in verdict.reason
    below = decide_hand_over(world_size=4, signalled={1, 2, 3}, unhealthy=(), spares_ready=0, min_world_size=2)
    assert not below.hands_over and "0 hot spare(s)" in below.reason
    every = decide_hand_over(world_size=2, signalled={0, 1}, unhealthy=(), spares_ready=0, min_world_size=1)
    assert not every.hands_over and "every active" in every.reason


@pytest.mark.parametrize(("leavers", "rank", "own_reason", "problem"), [
    ((1,), 1, True, None),                       # the signalled rank leaves
    ((1,), 0, False, None),                      # this rank stays: re-forms with a spare
    ((0,), 0, False, "neither signalled nor found unhealthy"),
    ((0, 1), 1, True, "every active would leave"),
    ((1, 5), 1, True, "outside the world"),
    ((), 0, False, None),                        # the whole job stops: always acceptable
])
def test_a_hand_over_verdict_is_acted_on_only_within_its_invariants(leavers, rank, own_reason, problem):
    from lightning_ft.schema.termination import HandOverVerdict
    from lightning_ft.termination.decision import hand_over_verdict_problem

    found = hand_over_verdict_problem(HandOverVerdict(leavers, "x"), world_size=2, rank=rank,
                                      own_reason_to_leave=own_reason)
    assert (found is None) if problem is None else (problem in found), found


class _Seat:
    def census(self):
        from lightning_ft.termination.handover import SeatCensus

        return SeatCensus(spares_ready=1)

    def hand_over(self, leaving, reason):
        raise AssertionError("not asked here")

    def min_world_size(self):
        return None


@pytest.mark.parametrize("forged", [[0, 1], [0]])
def test_a_hand_over_verdict_a_store_client_published_cannot_make_a_healthy_rank_leave(tcp_store, forged, caplog):
    """Issue 47, item 2: without a secret a store client published ``leavers=[0, 1]`` during the
    settle; both actives left with exit 0 and the job was lost with no requeue. Rank 0 -- not
    signalled, healthy -- now refuses any verdict that has it leave, or every active leave: it
    takes the whole-job stop (save, 81); a reason with terminal escapes is logged escaped."""
    import time

    import torch.distributed as dist

    from lightning_ft.schema.signing import Signer
    from lightning_ft.schema.termination import HandOverVerdict
    from lightning_ft.termination.handover import HandOverAgreement

    prefix = dist.PrefixStore("forged/", tcp_store)
    unsigned = Signer(None)
    rank0 = StoreStopCoordinator(prefix.clone(), 0, 2, signer=unsigned)
    StoreStopCoordinator(prefix.clone(), 1, 2, signer=unsigned).mark_signalled()
    attacker = StoreStopCoordinator(prefix.clone(), 1, 2, signer=unsigned)  # any client of the store
    attacker.publish_hand_over(HandOverVerdict(tuple(forged), "\x1b]0;pwned\x07 leave now"))
    agreement = HandOverAgreement(rank0, _Seat(), settle_s=0.0, timeout_s=10.0)
    verdict = agreement.verdict(time.monotonic(), self_signalled=False)
    assert not verdict.hands_over and "refused" in verdict.reason, verdict
    assert "\x1b" not in caplog.text and "\\x1b]0;pwned\\x07" in caplog.text
