"""One configuration model (issue 22): the loader, the resolvers, and the settings every entry point shares."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import pytest

from lightning_ft.settings import SettingsError, Timeouts, describe, group, load, setting
from lightning_ft.settings.environment import resolve_domain_id, resolve_run_id, scheduler_node_index
from lightning_ft.settings.fields import number, parse_flag


@dataclass(frozen=True)
class Inner:
    depth: int = setting(2, "how deep", rule=number(integer=True), env="T_DEPTH")


@dataclass(frozen=True)
class Outer:
    speed: float = setting(1.0, "how fast", rule=number(), env="T_SPEED")
    budget: float | None = setting(0.5, "a share; None: no budget", rule=number(allow_none=True))
    target: str | None = setting(None, "where", env="T_TARGET", parse=str)
    verbose: bool = setting(False, "say more", rule=lambda v: None if isinstance(v, bool) else "True or False",
                            env="T_VERBOSE", parse=parse_flag)
    inner: Inner = group(Inner, prefix="inner_")

    def validate(self) -> None:
        if self.speed > 100:
            raise SettingsError("speed must stay below 100")


def test_a_setting_comes_from_its_argument_else_its_variable_else_its_default():
    assert load(Outer, {}, env={}) == Outer()
    env = {"T_SPEED": "3", "T_DEPTH": "5", "T_TARGET": "/x", "T_VERBOSE": "yes"}
    loaded = load(Outer, {}, env=env)
    assert (loaded.speed, loaded.inner.depth, loaded.target, loaded.verbose) == (3.0, 5, "/x", True)
    assert load(Outer, {"speed": 7, "inner_depth": 1}, env=env).speed == 7
    sources: dict[str, str] = {}
    load(Outer, {"speed": 7}, env=env, sources=sources)
    assert sources["speed"] == "speed" and sources["inner_depth"] == "T_DEPTH"


def test_none_is_not_given_unless_it_means_something_of_its_own():
    env = {"T_SPEED": "3", "T_TARGET": "/x"}
    assert load(Outer, {"speed": None, "target": None}, env=env).speed == 3.0  # the rule refuses None
    assert load(Outer, {"target": None}, env=env).target == "/x"  # the default is None
    assert load(Outer, {"budget": None}, env=env).budget is None  # None = no budget


def test_bad_values_unknown_names_and_cross_rules_are_named():
    with pytest.raises(SettingsError, match=r"^x: speed must be a number > 0, got -1$"):
        load(Outer, {"speed": -1}, env={}, prefix="x: ")
    with pytest.raises(SettingsError, match=r"speed \(from T_SPEED='-2'\) must be a number > 0"):
        load(Outer, {}, env={"T_SPEED": "-2"})
    with pytest.raises(SettingsError, match="T_SPEED must be a number, got 'fast'"):
        load(Outer, {}, env={"T_SPEED": "fast"})
    with pytest.raises(SettingsError, match="T_VERBOSE must be true or false"):
        load(Outer, {}, env={"T_VERBOSE": "perhaps"})
    with pytest.raises(SettingsError, match="unknown setting.*'sped' \\(did you mean 'speed'\\?\\)"):
        load(Outer, {"sped": 1}, env={})
    with pytest.raises(ValueError, match="speed must stay below 100"):
        load(Outer, {"speed": 500}, env={}, error=ValueError)


def test_describe_lists_each_setting_once_with_its_variable():
    names = [(info.name, info.env) for info in describe(Outer)]
    assert names == [("speed", "T_SPEED"), ("budget", None), ("target", "T_TARGET"), ("verbose", "T_VERBOSE"),
                     ("inner_depth", "T_DEPTH")]


def test_every_bound_is_a_named_positive_field_of_one_timeouts_object():
    timeouts = Timeouts()
    assert timeouts.join_timeout_for(was_active=True) == timeouts.rejoin_timeout
    with pytest.raises(SettingsError, match="store_timeout must be a positive number of seconds"):
        Timeouts(store_timeout=0)
    assert load(Timeouts, {}, env={"LIGHTNING_FT_HEALTH_TIMEOUT": "2.5"}).health_timeout == 2.5


def test_the_run_id_and_the_domain_are_resolved_alike_for_every_entry_point():
    assert resolve_run_id(None, {"SLURM_JOB_ID": "77"}) == ("77", "SLURM_JOB_ID")
    assert resolve_run_id(None, {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"})[0] == "77"
    assert resolve_run_id(None, {"LIGHTNING_FT_RUN_ID": "a", "SLURM_JOB_ID": "77"})[0] == "a"
    assert resolve_run_id("a", {"LIGHTNING_FT_RUN_ID": "a"}) == ("a", "run_id")
    with pytest.raises(ValueError, match="contradictory settings: run_id='b' but LIGHTNING_FT_RUN_ID='a'"):
        resolve_run_id("b", {"LIGHTNING_FT_RUN_ID": "a"})
    assert resolve_run_id(None, {}) == (None, "")
    assert resolve_domain_id(None, {}) == socket.gethostname()
    assert resolve_domain_id(None, {"LIGHTNING_FT_DOMAIN_ID": "rack-3"}) == "rack-3"
    assert resolve_domain_id("explicit", {"LIGHTNING_FT_DOMAIN_ID": "rack-3"}) == "explicit"
    assert scheduler_node_index({"SLURM_NODEID": "4", "SLURM_PROCID": "9"}) == 4
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX"):
        scheduler_node_index({"JOB_COMPLETION_INDEX": "x"})


def test_the_torchrun_backend_and_ddp_ft_share_their_defaults(monkeypatch):
    """Intended change of issue 22: the torchrun participant's domain was "none" (all nodes one
    domain for segments and replica placement); it is the host name now, as under ddp_ft."""
    from lightning_ft.rendezvous.participant import local_participant
    from lightning_ft.rendezvous.settings import torchrun_config
    from lightning_ft.runtime.settings import resolve_settings

    monkeypatch.delenv("LIGHTNING_FT_DOMAIN_ID", raising=False)
    assert local_participant().domain_id == socket.gethostname()
    options, rendezvous = torchrun_config("job", 2, 3, {})
    strategy = resolve_settings({"LIGHTNING_FT_ENDPOINT": "h:1", "LIGHTNING_FT_RUN_ID": "job",
                                 "LIGHTNING_FT_NNODES": "2:3"})
    assert rendezvous == strategy.rendezvous_settings()
    assert local_participant(domain_id=options.domain_id).domain_id == strategy.domain_id == socket.gethostname()
    monkeypatch.setenv("LIGHTNING_FT_DOMAIN_ID", "rack-1")
    assert local_participant().domain_id == "rack-1"


def test_strategy_arguments_that_are_no_setting_are_named_not_handed_to_ddp():
    from lightning_ft.runtime.settings import StrategyConfigError
    from lightning_ft.strategy.ddp import split_strategy_kwargs

    given, ddp = split_strategy_kwargs({"replication_factor": 2, "find_unused_parameters": True})
    assert given == {"replication_factor": 2} and ddp == {"find_unused_parameters": True}
    with pytest.raises(StrategyConfigError, match="'replicaton_factor' \\(did you mean 'replication_factor'\\?\\)"):
        split_strategy_kwargs({"replicaton_factor": 2})


def test_every_snapshot_and_persist_setting_is_a_strategy_argument(tmp_path, monkeypatch):
    """The strategy's snapshot_* and persist_* settings configure the EmergencyCheckpoint it adds;
    with one of the user's own they are an error, and the user's takes the strategy's run id."""
    from types import SimpleNamespace

    from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
    from lightning_ft.runtime.fit_loop import add_default_callbacks
    from lightning_ft.runtime.settings import StrategyConfigError, resolve_settings

    for key in ("LIGHTNING_FT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LIGHTNING_FT_PERSIST_TO"):
        monkeypatch.delenv(key, raising=False)
    env = {"LIGHTNING_FT_ENDPOINT": "h:1", "LIGHTNING_FT_NNODES": "2:3"}
    settings = resolve_settings(env, run_id="job", snapshot_every_n_steps=7, snapshot_root=str(tmp_path / "shm"),
                                persist_to=str(tmp_path / "durable"), persist_keep_last=3, graceful_termination=False)
    trainer = SimpleNamespace(callbacks=[])
    add_default_callbacks(trainer, settings)
    (added,) = trainer.callbacks
    assert isinstance(added, EmergencyCheckpoint)
    assert (added.every_n_steps, added.root, added.run_id) == (7, str(tmp_path / "shm"), "job")
    assert added.durable_settings.persist_to == str(tmp_path / "durable")
    assert added.durable_settings.keep_last == 3 and added.max_overhead == 0.005

    own = EmergencyCheckpoint(every_n_steps=3, root=str(tmp_path / "own"))
    assert own.run_id == "default"  # nothing in the environment names the run
    add_default_callbacks(SimpleNamespace(callbacks=[own]), resolve_settings(env, run_id="job"))
    assert own.run_id == "job"  # one run id for the strategy and its snapshots
    with pytest.raises(StrategyConfigError, match="persist_keep_last, persist_to, snapshot_every_n_steps, "
                                                  "snapshot_root configure the EmergencyCheckpoint"):
        add_default_callbacks(SimpleNamespace(callbacks=[own]), settings)
    with pytest.raises(ValueError, match="run_id='mine' but the strategy's run id is 'job'"):
        EmergencyCheckpoint(root=str(tmp_path / "own"), run_id="mine").adopt_run_id("job")


def test_none_given_for_a_setting_whose_default_was_overridden_is_a_value():
    assert load(Outer, {"target": None}, env={}, defaults={"target": "/d"}).target is None
    assert load(Outer, {}, env={}, defaults={"target": "/d"}).target == "/d"


def test_every_liveness_threshold_follows_from_the_heartbeat_interval():
    from lightning_ft.rendezvous.liveness import LivenessThresholds

    small = LivenessThresholds(0.1, 3)
    assert small.dead_after == pytest.approx(0.4)
    assert (small.takeover_after, small.frozen_peer_after, small.all_silent_after) == (2.0, 2.0, 3.0)  # the floors
    slow = LivenessThresholds(1.0, 3)
    assert slow.dead_after == 4.0 and slow.takeover_after == 4.0 and slow.frozen_peer_after == 20.0
    assert slow.all_silent_after == 4.0
    large = LivenessThresholds(0.1, 1024)
    assert large.heartbeat_every == pytest.approx(1024 / 2500) and large.dead_after == pytest.approx(4 * 1024 / 2500)


def test_internal_constants_are_no_settings_but_stay_constructible():
    from lightning_ft.runtime.settings import StrategySettings
    from lightning_ft.settings.fields import internal_constants, setting_names

    names = setting_names(StrategySettings)
    internal = {info.name for info in internal_constants(Timeouts)}
    assert {"failover_timeout", "probe_timeout", "exit_timeout", "flush_timeout"} <= internal
    assert not internal & names
    with pytest.raises(SettingsError, match="unknown setting.*probe_timeout"):
        load(Timeouts, {"probe_timeout": 1.0})
    assert Timeouts(probe_timeout=0.2).probe_timeout == 0.2  # code and tests may still pass one


def test_the_strategy_has_about_twenty_public_settings():
    from lightning_ft.runtime.settings import LAUNCH_ARGUMENTS, StrategySettings

    public = [info.name for info in describe(StrategySettings) if info.tier == "public"]
    assert len(public) + len(LAUNCH_ARGUMENTS) <= 20, public


def test_straggler_eviction_can_be_turned_off_from_the_environment():
    from lightning_ft.runtime.settings import resolve_settings

    env = {"LIGHTNING_FT_ENDPOINT": "127.0.0.1:29400", "LIGHTNING_FT_RUN_ID": "r", "LIGHTNING_FT_NNODES": "1:2"}
    assert resolve_settings(env).stragglers.straggler_factor == 2.0
    for off in ("off", "None", " OFF "):
        assert resolve_settings({**env, "LIGHTNING_FT_STRAGGLER_FACTOR": off}).stragglers.straggler_factor is None
    assert resolve_settings({**env, "LIGHTNING_FT_STRAGGLER_FACTOR": "3"}).stragglers.straggler_factor == 3.0
    # an argument wins over the variable
    assert resolve_settings({**env, "LIGHTNING_FT_STRAGGLER_FACTOR": "off"},
                            straggler_factor=2.5).stragglers.straggler_factor == 2.5
    with pytest.raises(SettingsError, match="LIGHTNING_FT_STRAGGLER_FACTOR"):
        resolve_settings({**env, "LIGHTNING_FT_STRAGGLER_FACTOR": "fast"})


def test_a_misspelt_variable_is_named_with_the_closest_known_one(caplog):
    """``LIGHTNING_FT_PERIST_TO`` (sic) was silently ignored: the durable tier was off."""
    from lightning_ft.settings.environment import unknown_variables, warn_unknown_variables

    env = {"LIGHTNING_FT_PERIST_TO": "/mnt/ckpt", "LIGHTNING_FT_RUN_ID": "r", "LIGHTNING_FT_XYZZY": "1", "HOME": "/"}
    assert unknown_variables(env) == [("LIGHTNING_FT_PERIST_TO", "LIGHTNING_FT_PERSIST_TO"),
                                      ("LIGHTNING_FT_XYZZY", None)]
    with caplog.at_level("WARNING", logger="lightning_ft.settings.environment"):
        warn_unknown_variables(env)
        warn_unknown_variables(env)  # once per name and process
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "did you mean LIGHTNING_FT_PERSIST_TO?" in lines[0], lines


def test_every_variable_the_package_reads_is_known():
    """The list of known variables follows the code: every ``LIGHTNING_FT_*`` name in the package."""
    import re

    from lightning_ft.settings.environment import KNOWN_VARIABLES

    from proc_utils import REPO_ROOT

    named = {m for path in (REPO_ROOT / "lightning_ft").rglob("*.py")
             for m in re.findall(r"\"(LIGHTNING_FT_[A-Z0-9_]*[A-Z0-9])\"", path.read_text())}
    assert named and named <= KNOWN_VARIABLES, sorted(named - KNOWN_VARIABLES)
