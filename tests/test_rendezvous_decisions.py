"""Pure decision logic of the barrier rendezvous (no store, fake times)."""

import pytest

from lightning_ft.rendezvous.decisions import (
    Action,
    Arrival,
    RoundTimer,
    RoundView,
    arrivals_of_round,
    assign_ranks,
    can_form_active_set,
    decide_completion,
    split_extras,
)
from lightning_ft.rendezvous.liveness import HeartbeatTracker
from lightning_ft.rendezvous.participant import ParticipantInfo
from lightning_ft.rendezvous.settings import RendezvousConfigError, RendezvousSettings, settings_from_config
from lightning_ft.schema.run import ArrivalRecord, decode_arrival, encode_arrival


def info(n, infra=-1, domain="none"):
    return ParticipantInfo(addr=f"node{n}", pid=1000 + n, local_id=0, infra_rank=infra, domain_id=domain)


def arrival(position, n, **kw):
    i = info(n, **kw)
    return Arrival(position, i.participant_id, i.infra_rank, i.domain_id)


def record(n, seq=1, withdrawn=False):
    return decode_arrival(encode_arrival(seq, info(n), withdrawn))


def settings(**kw):
    base = dict(run_id="job", min_nodes=2, max_nodes=3, last_call_timeout=1.0, previous_active_grace=5.0)
    base.update(kw)
    return RendezvousSettings.of(**base)


def test_arrival_record_round_trip_and_garbage():
    who = info(3, infra=5, domain="rack-a")
    assert decode_arrival(encode_arrival(7, who, withdrawn=True)) == ArrivalRecord(True, 7, 5, "rack-a",
                                                                                    who.participant_id)
    assert decode_arrival(b"") is None
    assert decode_arrival(b"not a record") is None
    assert decode_arrival(b"\xff\xfe") is None


def test_withdrawn_and_unreadable_records_are_left_out():
    records = [record(0), record(1), None, record(3), record(3, seq=2, withdrawn=True), record(4)]
    assert [a.position for a in arrivals_of_round(records)] == [0, 1, 5]


def test_a_participant_counts_once_by_its_newest_record_and_replays_change_nothing():
    rejoined = [record(0), record(1), record(0, seq=2, withdrawn=True), record(0, seq=3)]
    assert [a.position for a in arrivals_of_round(rejoined)] == [1, 3]
    # an arrival replayed after the withdrawal (a copy of seq 1) does not bring node1 back
    replayed = [record(0), record(1), record(1, seq=2, withdrawn=True), record(1)]
    assert [a.participant_id for a in arrivals_of_round(replayed)] == [info(0).participant_id]
    # a copy of a live arrival later in the log does not move it back in the order
    assert [a.position for a in arrivals_of_round([record(0), record(1), record(0)])] == [0, 1]


def test_arrivals_past_max_nodes_are_extra():
    arrivals = arrivals_of_round([record(n) for n in range(5)])
    eligible, extra = split_extras(arrivals, 3)
    assert [a.position for a in eligible] == [0, 1, 2] and [a.position for a in extra] == [3, 4]
    # one that withdrew frees its place for the next
    arrivals = arrivals_of_round([record(0), record(1), record(2), record(1, seq=2, withdrawn=True), record(3)])
    assert split_extras(arrivals, 3)[1] == ()


def test_assignment_previous_actives_first_then_infra_rank_then_arrival():
    arrivals = [arrival(0, 0), arrival(1, 1, infra=9), arrival(2, 2, infra=1), arrival(3, 3)]
    previous = (info(3).participant_id,)
    result = assign_ranks(arrivals, previous, min_nodes=3)
    assert [a.position for a in result.active] == [3, 2, 1]
    assert [a.position for a in result.standby] == [0]
    assert result.rank_of(info(3).participant_id) == 0 and result.rank_of(info(0).participant_id) == -1


def test_previous_actives_keep_their_old_order():
    arrivals = [arrival(0, 5), arrival(1, 6), arrival(2, 7)]
    previous = (info(7).participant_id, info(5).participant_id)
    result = assign_ranks(arrivals, previous, min_nodes=2)
    assert [a.participant_id.split(":")[0] for a in result.active] == ["node7", "node5"]


def test_keep_ranks_puts_a_newcomer_in_the_dead_ranks_place():
    # ranks 0, 1, 2 were nodes 5, 6, 7; node 6 died; a spare (node 9) and a late node 8 arrived
    arrivals = [arrival(0, 7), arrival(1, 9, infra=3), arrival(2, 5), arrival(3, 8, infra=1)]
    previous = tuple(info(n).participant_id for n in (5, 6, 7))
    kept = assign_ranks(arrivals, previous, min_nodes=3, keep_ranks=True)
    assert [a.participant_id.split(":")[0] for a in kept.active] == ["node5", "node8", "node7"]
    assert [a.participant_id.split(":")[0] for a in kept.standby] == ["node9"]
    # without it the survivors close ranks: node 7's rank (and shard) moves from 2 to 1
    closed = assign_ranks(arrivals, previous, min_nodes=3)
    assert [a.participant_id.split(":")[0] for a in closed.active] == ["node5", "node7", "node8"]


def test_keep_ranks_is_refused_with_segments():
    arrivals = [arrival(0, 7)]
    previous = tuple(info(n).participant_id for n in (5, 6, 7))
    with pytest.raises(ValueError, match="segment"):
        assign_ranks(arrivals, previous, min_nodes=2, segment=2, keep_ranks=True)


def test_segments_keep_domains_whole():
    arrivals = [arrival(0, 0, domain="a"), arrival(1, 1, domain="b"), arrival(2, 2, domain="b"),
                arrival(3, 3, domain="a"), arrival(4, 4, domain="c")]
    result = assign_ranks(arrivals, (), min_nodes=4, segment=2)
    assert {a.domain_id for a in result.active[:2]} == {"a"}
    assert {a.domain_id for a in result.active[2:]} == {"b"}
    assert [a.domain_id for a in result.standby] == ["c"]
    assert not can_form_active_set(arrivals[:3] + arrivals[4:], 4, segment=2)
    assert can_form_active_set(arrivals, 4, segment=2)


def test_complete_immediately_at_max_nodes():
    view = RoundView(0, tuple(arrival(i, i) for i in range(3)))
    decision = decide_completion(view, settings(), RoundTimer(opened_at=0.0), now=0.0)
    assert decision.action is Action.COMPLETE


def test_last_call_after_min_nodes():
    timer = RoundTimer(opened_at=0.0)
    view = RoundView(0, (arrival(0, 0), arrival(1, 1)))
    assert decide_completion(view, settings(), timer, now=0.2).action is Action.WAIT
    assert timer.min_reached_at == 0.2
    assert decide_completion(view, settings(), timer, now=1.1).action is Action.WAIT
    assert decide_completion(view, settings(), timer, now=1.2).action is Action.COMPLETE


def test_an_elastic_jobs_first_round_waits_its_start_window_for_the_nodes_started_with_it():
    """Issue 46, item 4: 1:2 elastic, both nodes started together but the second's interpreter
    slower -- the first round waits for it (up to elastic_start_window from its opening) instead
    of forming with one after the 0.3 s last call and leaving the other standby until a grow."""
    elastic = settings(min_nodes=1, max_nodes=2, last_call_timeout=0.3, elastic=True, elastic_start_window=5.0)
    one = RoundView(0, (arrival(0, 0),))
    timer = RoundTimer(opened_at=0.0)
    waiting = decide_completion(one, elastic, timer, now=0.5)
    assert waiting.action is Action.WAIT and waiting.wake_at == 5.0
    assert decide_completion(one, elastic, timer, now=5.0).action is Action.COMPLETE  # the window bounds it
    both = RoundView(0, (arrival(0, 0), arrival(1, 1)))
    assert decide_completion(both, elastic, RoundTimer(opened_at=0.0), now=2.0).action is Action.COMPLETE
    # a later round (a grow, a recovery) and a job with hot spares keep the short last call
    spares = settings(min_nodes=1, max_nodes=2, last_call_timeout=0.3, elastic_start_window=5.0)
    for view, these in ((RoundView(3, (arrival(0, 0),)), elastic), (one, spares)):
        timer = RoundTimer(opened_at=0.0)
        assert decide_completion(view, these, timer, now=0.1).action is Action.WAIT
        assert decide_completion(view, these, timer, now=0.4).action is Action.COMPLETE


def test_previous_active_grace_holds_places_unless_dead():
    previous = (info(0).participant_id, info(1).participant_id)
    view = RoundView(1, (arrival(0, 1), arrival(1, 9)), previous_actives=previous)
    timer = RoundTimer(opened_at=0.0)
    decision = decide_completion(view, settings(), timer, now=2.0)
    assert decision.action is Action.WAIT and "survivor" in decision.reason
    assert decide_completion(view, settings(), timer, now=5.0).action is Action.COMPLETE
    dead_view = RoundView(1, view.arrivals, previous, dead_previous_actives=frozenset({previous[0]}))
    assert decide_completion(dead_view, settings(), RoundTimer(0.0, min_reached_at=0.0), now=1.5).action \
        is Action.COMPLETE


def test_after_a_loss_the_round_completes_once_every_live_participant_of_the_previous_round_arrived():
    """2:3, one active lost for good (a hand-over, a death): the survivor and the standby spare are all
    that is known to come, so no last call is waited out; while a survivor of the previous round is
    missing (and not dead), or its standby participant has not arrived yet, the round waits."""
    previous = (info(0).participant_id, info(1).participant_id)
    standby = (info(2).participant_id,)
    dead = frozenset({previous[1]})
    both = RoundView(1, (arrival(0, 0), arrival(1, 2)), previous_actives=previous, dead_previous_actives=dead,
                     lost_count=1, previous_standby=standby)
    decision = decide_completion(both, settings(), RoundTimer(opened_at=0.0), now=0.0)
    assert decision.action is Action.COMPLETE and "every live participant" in decision.reason
    survivor_missing = RoundView(1, (arrival(0, 2), arrival(1, 3)), previous_actives=previous,
                                 dead_previous_actives=dead, lost_count=1, previous_standby=standby)
    assert decide_completion(survivor_missing, settings(), RoundTimer(0.0), now=0.0).action is Action.WAIT
    # an elastic job that shrank to one: its newcomer (standby in the previous round) is waited for
    alone = RoundView(2, (arrival(0, 0),), previous_actives=(previous[0],), lost_count=1,
                      previous_standby=(info(5).participant_id,))
    assert decide_completion(alone, settings(min_nodes=1), RoundTimer(0.0), now=0.0).action is Action.WAIT
    no_previous = RoundView(0, (arrival(0, 0), arrival(1, 1)))
    assert decide_completion(no_previous, settings(), RoundTimer(0.0), now=0.0).action is Action.WAIT  # last call


def test_close_for_good_when_too_few_can_ever_arrive_after_waiting_for_a_replacement():
    view = RoundView(3, (arrival(0, 0),), lost_count=2)
    timer = RoundTimer(opened_at=0.0)
    waiting = decide_completion(view, settings(), timer, now=0.0)
    # a scheduler's restart loop brings a crashed node back within seconds: it is waited for
    assert waiting.action is Action.WAIT and "waiting up to 10.0s for a replacement" in waiting.reason
    assert decide_completion(view, settings(), timer, now=9.9).action is Action.WAIT
    decision = decide_completion(view, settings(), timer, now=10.0)
    assert decision.action is Action.CLOSE_FOR_GOOD
    assert "min_nodes=2" in decision.reason and "2 lost" in decision.reason
    # the wait counts from when the round first found itself short; enough nodes again resets it
    fresh = RoundTimer(opened_at=0.0)
    decide_completion(view, settings(), fresh, now=20.0)
    assert decide_completion(RoundView(3, (arrival(0, 0),), lost_count=1), settings(), fresh, 25.0).action \
        is Action.WAIT and fresh.short_since is None
    still_possible = RoundView(3, (arrival(0, 0),), lost_count=1)
    assert decide_completion(still_possible, settings(), RoundTimer(0.0), 0.0).action is Action.WAIT


def test_a_heartbeat_is_silent_once_it_stood_still_for_the_threshold():
    seen = HeartbeatTracker()
    assert seen.silent({"a": 1, "b": None}, 0.0, 1.0) == set()
    assert seen.silent({"a": 2, "b": None}, 0.9, 1.0) == set()
    assert seen.silent({"a": 2, "b": None}, 1.0, 1.0) == {"b"}
    assert seen.silent({"a": 2, "b": None}, 2.0, 1.0) == {"a", "b"}


def test_only_a_rising_heartbeat_counts_as_a_beat():
    seen = HeartbeatTracker()
    assert seen.silent({"a": 5}, 0.0, 1.0) == set()
    # a replayed older value, or one that failed its check (None), is silence
    assert seen.silent({"a": 3}, 0.6, 1.0) == set()
    assert seen.silent({"a": None}, 1.0, 1.0) == {"a"}
    assert seen.silent({"a": 6}, 1.1, 1.0) == set()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(min_nodes=3, max_nodes=2), "min_nodes (3) must not exceed max_nodes (2)"),
    (dict(min_nodes=0), "min_nodes must be a positive integer"),
    (dict(max_nodes=-1), "max_nodes must be a positive integer"),
    (dict(last_call_timeout=0), "last_call_timeout must be a positive number"),
    (dict(join_timeout=-5), "join_timeout must be a positive number"),
    (dict(store_grace_timeout=0.0), "store_grace_timeout"),
    (dict(run_id=""), "run_id"),
    (dict(min_nodes=3, max_nodes=4, segment=2), "multiple of segment"),
])
def test_bad_settings_name_the_setting(kwargs, needle):
    with pytest.raises(RendezvousConfigError, match=None) as err:
        settings(**kwargs)
    assert needle in str(err.value)


def test_settings_from_rdzv_conf():
    parsed = settings_from_config("j", 2, 3, {"last_call_timeout": "0.25", "segment": "1",
                                              "health_check": "true"})
    assert parsed.timeouts.last_call_timeout == 0.25 and parsed.health_check is True
    with pytest.raises(RendezvousConfigError, match="unknown setting.*'last_cal_timeout'.*did you mean "
                                                    "'last_call_timeout'"):
        settings_from_config("j", 2, 3, {"last_cal_timeout": "1"})
    with pytest.raises(RendezvousConfigError, match="join_timeout must be a number, got 'soon'"):
        settings_from_config("j", 2, 3, {"join_timeout": "soon"})
    with pytest.raises(RendezvousConfigError, match="unknown setting.*'init_timeout'"):
        settings_from_config("j", 2, 3, {"init_timeout": "5"})  # a bound of the strategy only


def test_the_store_load_of_waiters_and_heartbeats_stays_bounded_as_the_job_grows():
    from lightning_ft.rendezvous.liveness import HEARTBEATS_PER_SECOND
    from lightning_ft.rendezvous.settings import REQUESTS_PER_WAKE, WAKE_REQUESTS_PER_SECOND

    small, large = settings(max_nodes=8), settings(min_nodes=2, max_nodes=10_000)
    # small jobs keep the configured timing
    assert small.heartbeat_every == pytest.approx(0.1) and small.dead_after == pytest.approx(0.4)
    assert small.tick_interval == pytest.approx(0.05)
    # large ones slow their heartbeats and ticks so the sums stay near their budgets
    assert large.max_nodes / large.heartbeat_every == pytest.approx(HEARTBEATS_PER_SECOND)
    assert large.dead_after == pytest.approx(4 * large.heartbeat_every)
    assert large.max_nodes * REQUESTS_PER_WAKE / large.tick_interval == pytest.approx(WAKE_REQUESTS_PER_SECOND)
    # the coordinator alone polls (one small request), whatever the size
    assert small.poll_interval == large.poll_interval == pytest.approx(0.01)
    # spares poll; they are few, so their interval follows their number, not the job's
    assert small.standby_poll_interval == pytest.approx(0.05)
    assert settings(min_nodes=9_000, max_nodes=10_000).standby_poll_interval == pytest.approx(0.6)


def test_a_participant_judged_dead_is_back_once_its_heartbeat_rose_past_where_it_stood_still():
    from lightning_ft.rendezvous.liveness import came_back
    from lightning_ft.schema.run import LostRecord, decode_lost, encode_lost

    judged = decode_lost(encode_lost("b", "heartbeat silent for 0.40s", silent_at=7).encode())
    assert judged == LostRecord("b", "heartbeat silent for 0.40s", 7)
    assert not came_back(judged, 7) and not came_back(judged, None) and came_back(judged, 8)
    # one that left for good itself never comes back, whatever its heartbeat does
    withdrew = decode_lost(encode_lost("c", "withdrew: SIGTERM").encode())
    assert withdrew == LostRecord("c", "withdrew: SIGTERM", None) and not came_back(withdrew, 10 ** 6)
    # a separator in the reason cannot forge the number
    assert decode_lost(encode_lost("d", "x\x1f99").encode()).silent_at is None


def test_a_process_start_time_is_exact_to_the_clock_tick():
    """The start time decides whether a process belongs to a run that closed (a late starter) or
    to a new launch of its run id: /proc/stat's whole-second btime made it up to 1 s early, and
    a participant started just after the previous launch closed trained nothing (issue 37, 8)."""
    import subprocess
    import sys
    import time

    code = ("import time; first = time.time()\n"
            "from lightning_ft.rendezvous.participant import process_start_time\n"
            "print(first, process_start_time())")
    launched = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    first_line, started = (float(word) for word in out.stdout.split())
    # between the launch and the script's first line (however long a loaded machine takes to start
    # an interpreter), to the clock tick (10 ms): never after the first line, never before the launch
    assert launched - 0.02 <= started <= first_line + 0.02, (launched, started, first_line, out.stderr[-500:])


def test_the_previous_actives_come_back_from_the_rank_answers_that_survived_a_fail_over():
    """After a store fail-over the round's list of actives may be gone; the rank answers that the
    survivors kept name them, in rank order; answers of another round, standby answers and the
    answers nobody kept name nobody."""
    from lightning_ft.rendezvous.decisions import actives_from_answers
    from lightning_ft.schema.run import RankAnswer

    answers = [("b", RankAnswer(4, 1, 2)), ("a", None), ("c", RankAnswer(4, -1, 2)), ("d", RankAnswer(3, 0, 2)),
               ("e", RankAnswer(4, 0, 2))]
    assert actives_from_answers(4, answers) == ("e", "b")
    assert actives_from_answers(5, answers) == ()
