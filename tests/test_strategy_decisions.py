"""Pure decisions of the ``ddp_ft`` strategy: hang timeout, blame, snapshot transfer, replica
placement, failure classification, recovery and end-of-rendezvous decisions, configuration."""

from __future__ import annotations

import pytest

from lightning_ft.checkpoint.policy import TransferPlan, plan_snapshot_transfer, replica_needed, should_pull_replica
from lightning_ft.runtime.decisions import (
    EndAction,
    EndCause,
    FailureAction,
    FailureFacts,
    FailureKind,
    PeerState,
    Role,
    classify_failure,
    decide_on_rendezvous_end,
    decide_recovery,
    find_stalled_ranks,
    hang_timeout,
    looks_like_collective_error,
    looks_like_peer_gone,
    parse_nnodes,
)
from lightning_ft.runtime.settings import LaunchMode, StrategyConfigError, resolve_launch_config
from lightning_ft.schema.run import CloseKind

# ------------------------------------------------------------------ hang timeout


def test_before_the_first_sample_the_floor_is_the_timeout():
    assert hang_timeout([], floor=5.0, safety_factor=10.0) == 5.0


def test_hang_timeout_scales_the_slowest_recent_step_with_a_floor():
    assert hang_timeout([0.01, 0.02], floor=5.0, safety_factor=10.0) == 5.0
    assert hang_timeout([0.5, 2.0, 0.7], floor=5.0, safety_factor=10.0) == 20.0


# ------------------------------------------------------------------ blame


def test_silent_peer_is_blamed_first():
    peers = [PeerState(1, 10, silent_seconds=2.0), PeerState(2, 9, silent_seconds=0.0)]
    verdict = find_stalled_ranks(0, 10, peers, dead_after=0.4)
    assert verdict.stalled == (1,)
    assert "silent" in verdict.reason


def test_alive_peer_behind_the_others_is_blamed():
    peers = [PeerState(1, 10, 0.0), PeerState(2, 9, 0.0)]
    assert find_stalled_ranks(0, 10, peers, dead_after=0.4).stalled == (2,)


def test_nobody_is_blamed_when_everyone_is_alive_and_level():
    peers = [PeerState(1, 10, 0.1), PeerState(2, 10, 0.0)]
    verdict = find_stalled_ranks(0, 10, peers, dead_after=0.4)
    assert verdict.stalled == ()
    assert "same step" in verdict.reason


def test_a_rank_never_blames_itself():
    verdict = find_stalled_ranks(0, 9, [PeerState(1, 10, 0.0), PeerState(0, 9, 5.0)], dead_after=0.4)
    assert verdict.stalled == ()
    assert "behind" in verdict.reason


# ------------------------------------------------------------------ snapshot transfer


def test_fresh_start_has_no_transfer():
    assert plan_snapshot_transfer([[], []]) is None
    assert plan_snapshot_transfer([]) is None


def test_newest_snapshot_any_rank_holds_goes_to_the_ranks_that_lack_it():
    assert plan_snapshot_transfer([[20, 30], [], [30]]) == TransferPlan(30, 0, (1,))
    assert plan_snapshot_transfer([[10], [10, 20], [10]]) == TransferPlan(20, 1, (0, 2))


def test_nothing_to_send_when_every_rank_has_the_newest():
    assert plan_snapshot_transfer([[10, 20], [20]]) == TransferPlan(20, 0, ())


# ------------------------------------------------------------------ replica placement


def test_actives_on_distinct_domains_need_no_extra_copy():
    assert not replica_needed(["hostA", "hostB"], factor=1)


def test_actives_sharing_one_domain_need_a_copy_elsewhere():
    assert replica_needed(["hostA", "hostA"], factor=1)
    assert should_pull_replica("hostB", ["hostA", "hostA"], factor=1, spare_index=5)


def test_spare_in_a_covered_domain_pulls_only_while_copies_are_short():
    # one active: one copy short, the first spare keeps it
    assert should_pull_replica("hostA", ["hostA"], factor=1, spare_index=0)
    assert not should_pull_replica("hostA", ["hostA"], factor=1, spare_index=1)
    # two actives, same domain, factor 1: copy count is fine, domain count is not -> only other domains
    assert not should_pull_replica("hostA", ["hostA", "hostA"], factor=1, spare_index=0)


def test_factor_zero_disables_replication():
    assert not replica_needed(["hostA"], factor=0)
    assert not should_pull_replica("hostB", ["hostA"], factor=0, spare_index=0)


def test_higher_factor_asks_for_more_domains():
    assert replica_needed(["hostA", "hostB"], factor=2)
    assert should_pull_replica("hostC", ["hostA", "hostB"], factor=2, spare_index=3)


# ------------------------------------------------------------------ failure classification


def facts(**kw):
    base = dict(exception_type="RuntimeError", is_collective_error=True)
    base.update(kw)
    return FailureFacts(**base)


def test_plain_bug_is_a_local_error():
    assert classify_failure(facts(exception_type="ValueError", is_collective_error=False)) is FailureKind.LOCAL_ERROR


def test_deliberate_stop_passes_through():
    assert classify_failure(facts(is_stop=True, is_collective_error=False)) is FailureKind.STOP


def test_collective_error_with_a_peers_own_error_is_not_recovered():
    assert classify_failure(facts(peer_error="rank 1: ValueError: bug")) is FailureKind.PEER_ERROR


def test_collective_error_with_rendezvous_evidence_is_a_lost_peer():
    assert classify_failure(facts(newer_round=True)) is FailureKind.PEER_LOST
    assert classify_failure(facts(dead_members=("h:1:0",))) is FailureKind.PEER_LOST
    assert classify_failure(facts(is_collective_error=False, hang_detected=True)) is FailureKind.PEER_LOST


def test_peer_closing_its_connection_is_a_lost_peer():
    assert classify_failure(facts(peer_gone=True)) is FailureKind.PEER_LOST
    assert looks_like_peer_gone([("RuntimeError", "[pair.cc:553] Connection closed by peer [1.2.3.4]:5")])
    assert not looks_like_peer_gone([("RuntimeError", "Timed out waiting 2000ms for recv")])


def test_collective_error_without_evidence_is_a_broken_group():
    assert classify_failure(facts()) is FailureKind.GROUP_BROKEN


@pytest.mark.parametrize("chain, expected", [
    ([("RuntimeError", "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [1.2.3.4]:5")], True),
    ([("DistBackendError", "anything")], True),
    ([("RuntimeError", "Timed out waiting 2000ms for recv operation to complete")], True),
    ([("ValueError", "Connection closed by peer")], False),  # user code's own ValueError
    ([("RuntimeError", "CUDA out of memory")], False),
    ([("KeyError", "x"), ("RuntimeError", "Connection reset by peer")], True),  # raised during handling
])
def test_collective_errors_are_recognised_through_the_chain(chain, expected):
    assert looks_like_collective_error(chain) is expected


# ------------------------------------------------------------------ recovery decision


def test_recoverable_failures_recover():
    decision = decide_recovery(FailureKind.PEER_LOST, 1, 2, recoveries=0, max_recoveries=None)
    assert decision.action is FailureAction.RECOVER


def test_repeated_failures_without_progress_stop():
    decision = decide_recovery(FailureKind.GROUP_BROKEN, 3, 2, recoveries=2, max_recoveries=None)
    assert decision.action is FailureAction.NO_RESTART
    assert "without a completed training step" in decision.reason


def test_recovery_cap():
    assert decide_recovery(FailureKind.PEER_LOST, 1, 2, 3, 3).action is FailureAction.NO_RESTART


def test_peer_error_is_no_restart_and_local_error_raises():
    assert decide_recovery(FailureKind.PEER_ERROR, 1, 2, 0, None).action is FailureAction.NO_RESTART
    assert decide_recovery(FailureKind.LOCAL_ERROR, 1, 2, 0, None).action is FailureAction.RAISE
    assert decide_recovery(FailureKind.STOP, 1, 2, 0, None).action is FailureAction.RAISE


def test_a_strategy_that_cannot_reform_ends_the_job_with_its_reason():
    for kind in (FailureKind.PEER_LOST, FailureKind.GROUP_BROKEN, FailureKind.DEADLOCK):
        decision = decide_recovery(kind, 1, 2, 0, None, cannot_reform="sharded state")
        assert decision.action is FailureAction.NO_RESTART and decision.close is CloseKind.FAILED
        assert decision.reason == f"{kind.value}: sharded state"
    # a bug or a stop is still what it is
    assert decide_recovery(FailureKind.LOCAL_ERROR, 1, 2, 0, None, "sharded").action is FailureAction.RAISE
    assert "error of its own" in decide_recovery(FailureKind.PEER_ERROR, 1, 2, 0, None, "sharded").reason


# ------------------------------------------------------------------ end of the rendezvous


def test_exit_zero_only_for_a_finished_job_or_a_spare_that_lost_the_store():
    for role in Role:
        assert decide_on_rendezvous_end(role, EndCause.CLOSED, CloseKind.FINISHED) is EndAction.RETURN
        for kind in (CloseKind.FAILED, CloseKind.TOO_FEW_NODES, CloseKind.CLOSED, None):
            assert decide_on_rendezvous_end(role, EndCause.CLOSED, kind) is EndAction.NO_RESTART, (role, kind)
    assert decide_on_rendezvous_end(Role.STANDBY, EndCause.STORE_LOST) is EndAction.RETURN
    assert decide_on_rendezvous_end(Role.TRAINED, EndCause.STORE_LOST) is EndAction.NO_RESTART
    # nothing trained yet and the store is gone: never "finished"
    assert decide_on_rendezvous_end(Role.UNASSIGNED, EndCause.STORE_LOST) is EndAction.NO_RESTART
    # without a secret a spare may see the actives finish before the close is written (was 83)
    assert decide_on_rendezvous_end(Role.STANDBY, EndCause.ACTIVES_FINISHED, None) is EndAction.RETURN
    assert decide_on_rendezvous_end(Role.STANDBY, EndCause.ACTIVES_FINISHED, CloseKind.FINISHED) is EndAction.RETURN
    assert decide_on_rendezvous_end(Role.STANDBY, EndCause.ACTIVES_FINISHED, CloseKind.FAILED) is EndAction.NO_RESTART


def test_a_stop_anywhere_is_143_for_everyone():
    for role in Role:
        assert decide_on_rendezvous_end(role, EndCause.SIGTERM) is EndAction.STOPPED
        assert decide_on_rendezvous_end(role, EndCause.CLOSED, CloseKind.STOPPED) is EndAction.STOPPED


def test_join_timeout_is_no_restart():
    for role in Role:
        assert decide_on_rendezvous_end(role, EndCause.TIMED_OUT) is EndAction.NO_RESTART


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize("text, expected", [("3", (3, 3)), ("2:3", (2, 3)), (" 1:1 ", (1, 1))])
def test_parse_nnodes(text, expected):
    assert parse_nnodes(text, "X") == expected


@pytest.mark.parametrize("text", ["", "a", "3:2", "0:1", "1:2:3"])
def test_parse_nnodes_rejects_and_names_the_source(text):
    with pytest.raises(ValueError, match="LIGHTNING_FT_NNODES"):
        parse_nnodes(text, "LIGHTNING_FT_NNODES")


def test_config_from_environment():
    env = {"LIGHTNING_FT_ENDPOINT": "10.0.0.1:29400", "LIGHTNING_FT_RUN_ID": "job7", "LIGHTNING_FT_NNODES": "2:3"}
    config = resolve_launch_config(None, None, None, None, env)
    assert (config.mode, config.host, config.port, config.run_id) == (LaunchMode.RENDEZVOUS, "10.0.0.1", 29400, "job7")
    assert (config.min_nodes, config.max_nodes) == (2, 3)


def test_arguments_win_when_they_agree_with_the_environment():
    env = {"LIGHTNING_FT_NNODES": "2:3"}
    config = resolve_launch_config("h:1", "r", 2, 3, env)
    assert (config.min_nodes, config.max_nodes) == (2, 3)
    assert resolve_launch_config("h:1", "r", 4, None, {}).max_nodes == 4


def test_missing_settings_are_all_named():
    with pytest.raises(StrategyConfigError) as info:
        resolve_launch_config(None, None, None, None, {})
    text = str(info.value)
    for name in ("LIGHTNING_FT_ENDPOINT", "LIGHTNING_FT_RUN_ID", "LIGHTNING_FT_NNODES"):
        assert name in text


@pytest.mark.parametrize("args, env, needle", [
    (("h:1", "r", 2, 3), {"LIGHTNING_FT_NNODES": "2:4"}, "LIGHTNING_FT_NNODES"),
    (("h:1", "r", 2, 3), {"LIGHTNING_FT_ENDPOINT": "other:2"}, "LIGHTNING_FT_ENDPOINT"),
    (("h:1", "r", 2, 3), {"LIGHTNING_FT_RUN_ID": "s"}, "LIGHTNING_FT_RUN_ID"),
    (("h:notaport", "r", 2, 3), {}, "port"),
    (("h:1", "a/b", 2, 3), {}, "run_id"),
    (("h:1", "r", 3, 2), {}, "max_nodes"),
    (("h:1", "r", None, 2), {}, "min_nodes"),
    (("h:1", "r", 0, 2), {}, "min_nodes"),
])
def test_bad_or_contradictory_settings_name_the_setting(args, env, needle):
    with pytest.raises(StrategyConfigError, match=needle):
        resolve_launch_config(*args, env)


def test_under_torchrun_the_agent_owns_the_rendezvous():
    env = {"TORCHELASTIC_RUN_ID": "job7"}
    assert resolve_launch_config(None, None, None, None, env).mode is LaunchMode.TORCHELASTIC
    assert resolve_launch_config(None, "job7", None, None, env).run_id == "job7"
    with pytest.raises(StrategyConfigError, match="LIGHTNING_FT_ENDPOINT"):
        resolve_launch_config(None, None, None, None, {**env, "LIGHTNING_FT_ENDPOINT": "h:1"})
    with pytest.raises(StrategyConfigError, match="min_nodes"):
        resolve_launch_config(None, None, 2, 3, env)
    with pytest.raises(StrategyConfigError, match="rdzv-id"):
        resolve_launch_config(None, "other", None, None, env)


def test_every_rank_waiting_in_a_collective_and_still_is_a_deadlock():
    peers = [PeerState(1, 150, 0.0, waiting="reduce from model_checkpoint.py:750", still_seconds=3.0)]
    verdict = find_stalled_ranks(0, 150, peers, dead_after=0.4, own_waiting="broadcast from loop.py:265",
                                 confirm_seconds=1.0)
    assert verdict.deadlock and verdict.stalled == ()
    assert "rank 0: broadcast from loop.py:265" in verdict.reason and "rank 1: reduce" in verdict.reason


@pytest.mark.parametrize("own_waiting, peer_waiting, still", [
    (None, "reduce", 3.0),            # this rank is busy outside a collective (a long save)
    ("barrier", None, 3.0),           # a peer is busy outside a collective
    ("barrier", "reduce", 0.5),       # the peer's position moved recently
])
def test_no_deadlock_while_some_rank_works_or_moves(own_waiting, peer_waiting, still):
    peers = [PeerState(1, 150, 0.0, waiting=peer_waiting, still_seconds=still)]
    verdict = find_stalled_ranks(0, 150, peers, dead_after=0.4, own_waiting=own_waiting, confirm_seconds=1.0)
    assert not verdict.deadlock and verdict.stalled == ()


def test_a_detected_deadlock_is_recovered_like_a_broken_group_until_it_repeats():
    facts = FailureFacts("RuntimeError", is_collective_error=True, deadlock_detected=True)
    assert classify_failure(facts) is FailureKind.DEADLOCK
    assert decide_recovery(FailureKind.DEADLOCK, 1, 2, 0, None).action is FailureAction.RECOVER
    again = decide_recovery(FailureKind.DEADLOCK, 3, 2, 1, None)
    assert again.action is FailureAction.NO_RESTART and "deadlock" in again.reason


# ------------------------------------------------------------------ decide, then execute


def test_the_first_decision_leaves_at_once_only_for_this_nodes_own_failures():
    from lightning_ft.runtime.decisions import decide_on_failure

    unhealthy = decide_on_failure(FailureKind.NODE_FAULT)
    assert unhealthy.action is FailureAction.UNHEALTHY and unhealthy.close is None
    bug = decide_on_failure(FailureKind.LOCAL_ERROR)
    assert (bug.action, bug.close, bug.publish_error) == (FailureAction.RAISE, CloseKind.FAILED, True)
    stop = decide_on_failure(FailureKind.STOP)
    assert (stop.action, stop.close, stop.publish_error) == (FailureAction.RAISE, CloseKind.STOPPED, False)
    for kind in (FailureKind.PEER_LOST, FailureKind.GROUP_BROKEN, FailureKind.DEADLOCK, FailureKind.PEER_ERROR):
        assert decide_on_failure(kind).action is FailureAction.INTERRUPT


def test_after_the_interruption_a_termination_stops_else_the_recovery_rules_decide():
    from lightning_ft.runtime.decisions import decide_after_interruption

    stopping = decide_after_interruption(FailureKind.PEER_LOST, True, 1, 2, 0, None)
    assert (stopping.action, stopping.close) == (FailureAction.RAISE, CloseKind.STOPPED)
    assert decide_after_interruption(FailureKind.PEER_LOST, False, 1, 2, 0, None).action is FailureAction.RECOVER
    gave_up = decide_after_interruption(FailureKind.PEER_ERROR, False, 1, 2, 0, None)
    assert (gave_up.action, gave_up.close) == (FailureAction.NO_RESTART, CloseKind.FAILED)


def test_a_sharded_job_starts_over_only_if_every_rank_that_trained_could():
    from lightning_ft.runtime.decisions import START_OVER_NO, START_OVER_UNKNOWN, START_OVER_YES, may_start_over

    assert may_start_over([START_OVER_YES, START_OVER_UNKNOWN, START_OVER_YES])  # the spare has no say
    assert not may_start_over([START_OVER_YES, START_OVER_NO])  # one had copied (or resumed): more was lost
    assert not may_start_over([START_OVER_UNKNOWN, START_OVER_UNKNOWN])  # nobody knows the start state
    assert not may_start_over([])


def test_a_fit_whose_run_finished_at_its_limits_is_not_trained_again():
    from lightning_ft.runtime.decisions import fit_already_finished

    assert not fit_already_finished(None, 100, None)  # nothing recorded
    assert fit_already_finished((100, 3), 100, None)  # finished at max_steps
    assert fit_already_finished((100, 3), 80, None)
    assert not fit_already_finished((100, 3), 120, None)  # asked for more: trains on
    assert fit_already_finished((100, 3), -1, 3)  # by epochs
    assert not fit_already_finished((100, 3), -1, 5)
    assert not fit_already_finished((100, 3), -1, None)  # no limit at all: nothing says it is done


# ------------------------------------------------------------------ elastic with BatchNorm

def test_an_elastic_model_with_batchnorm_is_warned_about_once_naming_its_layers(caplog):
    """Elastic keeps the global batch, not each micro-batch's samples: BatchNorm's batch statistics
    differ from the uninterrupted run's while the world is smaller (0.41 relative measured), so
    the job says so at the start, naming the layers; a model without them hears nothing."""
    import lightning.pytorch as pl
    import torch

    from lightning_ft._lightning.elastic import ElasticBatches

    class WithNorms(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.LayerNorm(4))
            self.head = torch.nn.Linear(4, 1)

    class WithoutBatchNorm(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GroupNorm(2, 4), torch.nn.Dropout(0.1))

    callback, model = ElasticBatches(), WithNorms()
    with caplog.at_level("WARNING", logger="lightning_ft"):
        callback.on_fit_start(None, WithoutBatchNorm())  # type: ignore[arg-type]
        assert not caplog.records
        callback.on_fit_start(None, model)  # type: ignore[arg-type]
        callback.on_fit_start(None, model)  # type: ignore[arg-type]  (a recovery runs the stage again)
    assert len(caplog.records) == 1, caplog.text
    assert "body.1 normalises with each batch's statistics (BatchNorm)" in caplog.text
    assert "LayerNorm" in caplog.text and "body.2" not in caplog.text


@pytest.mark.parametrize("name", ["fsdp_ft", "ddp_ft"])
def test_the_runtime_lines_and_errors_name_the_strategy_the_user_chose(name, caplog):
    """An ``fsdp_ft`` job's lines and configuration errors say ``fsdp_ft:``, not ``ddp_ft:`` (issue 46)."""
    import logging

    import lightning_ft  # noqa: F401 - registers both strategies
    from lightning_ft._logging import StrategyLog, set_strategy_name
    from lightning_ft.strategy.ddp import FaultTolerantDDPStrategy
    from lightning_ft.strategy.fsdp import FaultTolerantFSDPStrategy

    strategy = {"fsdp_ft": FaultTolerantFSDPStrategy, "ddp_ft": FaultTolerantDDPStrategy}[name]
    try:
        with pytest.raises(StrategyConfigError, match=rf"^{name}: run_id must be a non-empty string"):
            strategy(endpoint="127.0.0.1:29400", run_id="a/b", min_nodes=1, max_nodes=1)
        with caplog.at_level(logging.INFO, logger="strategy-log-test"):
            StrategyLog(logging.getLogger("strategy-log-test"), {}).info("round %d re-forms", 3)
        assert caplog.messages == [f"{name}: round 3 re-forms"]
    finally:
        set_strategy_name("ddp_ft")
