"""EmergencyCheckpoint and MemoryCheckpointIO inside a real single-process Trainer."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os

import lightning.pytorch as pl
import pytest
import torch

from lightning_ft import EmergencyCheckpoint
from lightning_ft.checkpoint import MemoryCheckpointIO, SnapshotError, SnapshotStore
from lightning_ft.checkpoint.lightning import callback as callback_module
from lightning_ft.checkpoint.memory import copying
from lightning_ft.events import read_events

from ckpt_helpers import make_module, matches_snapshot, resume_probe, tensors_equal, trainer_kwargs


def fit(max_steps: int, callbacks: list, seed: int = 0, ckpt_path=None, plugins=None, hidden: int = 16,
        **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(**trainer_kwargs(max_steps=max_steps, callbacks=callbacks, plugins=plugins or [], **kwargs))
    trainer.fit(make_module(seed, hidden=hidden), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "shm")


def test_periodic_snapshots_then_auto_resume_continues_at_the_saved_step(root):
    fit(12, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="t")])
    store = SnapshotStore(root=root, run_id="t", rank=0)
    assert [i.step for i in store.list()] == [10, 5]
    snapshot = store.load()
    assert snapshot["global_step"] == 10 and snapshot["optimizer_states"][0]["state"]

    probe = resume_probe()
    trainer = fit(15, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="t"), probe], seed=7)
    assert probe.start_step == 10
    assert matches_snapshot(probe, snapshot)
    assert trainer.ckpt_path == "mem://10"
    assert trainer.global_step == 15
    assert [i.step for i in store.list()] == [15, 10]


def test_resumed_run_matches_an_uninterrupted_run(root):
    # snapshot at an epoch boundary (5 batches per epoch) so the plain DataLoader replays nothing
    straight = fit(15, [], seed=0)
    fit(12, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="t")], seed=0)
    resumed = fit(15, [EmergencyCheckpoint(root=root, run_id="t")], seed=3)
    assert tensors_equal(straight.lightning_module.state_dict(), resumed.lightning_module.state_dict())
    assert tensors_equal(straight.optimizers[0].state_dict(), resumed.optimizers[0].state_dict())


def test_ckpt_path_mem_latest_and_mem_step_through_checkpoint_io(root):
    fit(12, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="io")])
    store = SnapshotStore(root=root, run_id="io", rank=0)
    for path, step in (("mem://latest", 10), ("mem://5", 5)):
        probe = resume_probe()
        io = MemoryCheckpointIO(root=root, run_id="io")
        trainer = fit(step + 1, [probe], seed=5, ckpt_path=path, plugins=[io])
        assert probe.start_step == step
        assert matches_snapshot(probe, store.load(store.find(step)))
        assert trainer.global_step == step + 1


def test_checkpoint_io_passes_ordinary_paths_through_and_falls_back_to_disk(root, tmp_path):
    disk = tmp_path / "ckpts"
    trainer = fit(4, [])
    trainer.save_checkpoint(disk / "last.ckpt")
    io = MemoryCheckpointIO(root=root, run_id="none-yet", fallback_dir=disk)
    probe = resume_probe()
    fit(6, [probe], ckpt_path="mem://latest", plugins=[io])
    assert probe.start_step == 4
    probe = resume_probe()
    fit(6, [probe], ckpt_path=str(disk / "last.ckpt"), plugins=[MemoryCheckpointIO(root=root, run_id="none-yet")])
    assert probe.start_step == 4
    with pytest.raises(FileNotFoundError, match="no intact snapshot"):
        fit(6, [], ckpt_path="mem://latest", plugins=[MemoryCheckpointIO(root=root, run_id="none-yet")])


def test_auto_resume_prefers_the_newer_of_snapshot_and_user_checkpoint(root, tmp_path, caplog):
    disk = tmp_path / "d.ckpt"
    fit(7, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="pref")]).save_checkpoint(disk)
    # the user's checkpoint (step 7) is newer than the snapshot (step 5): keep it
    probe = resume_probe()
    with caplog.at_level(logging.INFO, logger="lightning_ft"):
        fit(8, [EmergencyCheckpoint(root=root, run_id="pref"), probe], ckpt_path=str(disk))
    assert probe.start_step == 7
    assert any("keeping ckpt_path" in r.message for r in caplog.records)
    # now a newer snapshot exists (10): it wins over the older disk checkpoint
    fit(12, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="pref2")])
    probe = resume_probe()
    fit(11, [EmergencyCheckpoint(root=root, run_id="pref2"), probe], ckpt_path=str(disk))
    assert probe.start_step == 10
    # no snapshot at all: the user's checkpoint is used unchanged
    probe = resume_probe()
    fit(8, [EmergencyCheckpoint(root=root, run_id="empty"), probe], ckpt_path=str(disk))
    assert probe.start_step == 7


def test_auto_resume_off_starts_fresh_and_drops_the_abandoned_snapshots(root):
    fit(10, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="off")])
    probe = resume_probe()
    fit(3, [EmergencyCheckpoint(root=root, run_id="off", auto_resume=False), probe])
    assert probe.start_step == 0
    assert SnapshotStore(root=root, run_id="off", rank=0).list() == []


def test_corrupt_newest_snapshot_resumes_from_the_previous_one(root):
    fit(10, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="bad")])
    store = SnapshotStore(root=root, run_id="bad", rank=0)
    newest = store.list()[0]
    os.truncate(newest.path, newest.nbytes // 2)
    probe = resume_probe()
    fit(6, [EmergencyCheckpoint(root=root, run_id="bad"), probe])
    assert probe.start_step == 5


class _SaveNowAt(pl.Callback):
    def __init__(self, emergency: EmergencyCheckpoint, step: int) -> None:
        self.emergency, self.step, self.info, self.estimates = emergency, step, None, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.estimates.append(self.emergency.estimated_save_seconds())
        if trainer.global_step == self.step:
            self.info = self.emergency.save_now(trainer, reason="sigterm")
            self.estimates.append(self.emergency.estimated_save_seconds())
            trainer.should_stop = True


def test_save_now_is_synchronous_and_feeds_the_estimate(root):
    emergency = EmergencyCheckpoint(root=root, run_id="now")
    assert emergency.estimated_save_seconds() is None
    trigger = _SaveNowAt(emergency, step=3)
    trainer = fit(20, [emergency, trigger])
    assert trigger.info.step == 3 and os.path.exists(trigger.info.path)
    assert trigger.estimates[0] is None and trigger.estimates[-1] > 0
    assert emergency.last_snapshot == trigger.info
    snapshot = SnapshotStore(root=root, run_id="now", rank=0).load()
    assert snapshot["global_step"] == 3 and trainer.global_step == 3
    assert tensors_equal(snapshot["state_dict"], trainer.lightning_module.state_dict())


def test_every_n_seconds_takes_snapshots(root):
    fit(12, [EmergencyCheckpoint(every_n_seconds=1e-9, root=root, run_id="sec", keep_last=3)])
    # an interval below one step time means every step once the step time is measured
    assert [i.step for i in SnapshotStore(root=root, run_id="sec", rank=0).list()] == [12, 11, 10]


def test_the_overhead_budget_schedule_measures_the_save_then_snapshots_within_the_budget(root, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("LIGHTNING_FT_EVENTS_DIR", str(tmp_path / "events"))
    callback = EmergencyCheckpoint(root=root, run_id="budget", keep_last=5, max_overhead=1.0)
    fit(40, [callback])
    schedule = callback.schedule
    # the first snapshot at step 8 measures the save; then every interval the budget allows,
    # agreed at the calibration steps 8, 16, 32 (a 100 % budget: about one save per step's time)
    assert schedule is not None and schedule.snapshot_interval >= 1 and schedule.persist_every is None
    steps = sorted(i.step for i in SnapshotStore(root=root, run_id="budget", rank=0).list())
    assert 40 - schedule.snapshot_interval < steps[-1] <= 40 and all(s >= 8 for s in steps)
    events = [e for e in read_events(tmp_path / "events") if e["event"] == "snapshot_schedule"]
    assert events and events[0]["step"] == 8 and events[0]["save_seconds"] > 0
    # a tiny budget: one snapshot, at step 8, and none after it within 40 steps
    fit(40, [tiny := EmergencyCheckpoint(root=root, run_id="tiny", max_overhead=1e-6)])
    assert [i.step for i in SnapshotStore(root=root, run_id="tiny", rank=0).list()] == [8]
    assert tiny.schedule.snapshot_interval >= 64


def test_without_a_schedule_the_overhead_budget_decides_and_none_means_none(root, caplog):
    """Protected by default: EmergencyCheckpoint() snapshots on the cost-based schedule, as the
    strategy's own does (the first at step 8); max_overhead=None turns periodic snapshots off,
    and a warning says the progress is unprotected."""
    fit(20, [EmergencyCheckpoint(root=root, run_id="budget-default")])
    assert [i.step for i in SnapshotStore(root=root, run_id="budget-default", rank=0).list()][-1:] == [8]
    from lightning_ft.checkpoint.lightning import callback as callback_module

    callback_module._unprotected_warned = False
    with caplog.at_level(logging.WARNING, logger="lightning_ft"):
        fit(20, [EmergencyCheckpoint(root=root, run_id="none", max_overhead=None)])
    assert SnapshotStore(root=root, run_id="none", rank=0).list() == []
    assert "leaves progress unprotected: no periodic snapshots" in caplog.text


def test_works_with_checkpointing_disabled_and_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_FT_SNAPSHOT_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("LIGHTNING_FT_RUN_ID", "envrun")
    callback = EmergencyCheckpoint()
    assert callback.root == str(tmp_path / "env") and callback.run_id == "envrun"
    fit(2, [callback])  # enable_checkpointing=False in trainer_kwargs: no Checkpoint subclass conflict


@pytest.mark.parametrize("kwargs, name", [
    (dict(every_n_steps=-1), "every_n_steps"),
    (dict(every_n_steps=0), "every_n_steps"),
    (dict(every_n_steps=2.5), "every_n_steps"),
    (dict(every_n_seconds=-3), "every_n_seconds"),
    (dict(keep_last=0), "keep_last"),
    (dict(auto_resume="yes"), "auto_resume"),
])
def test_bad_arguments_fail_at_construction(kwargs, name, root):
    with pytest.raises(ValueError, match=name):
        EmergencyCheckpoint(root=root, **kwargs)


def test_unwritable_root_fails_at_construction(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ValueError, match="root="):
        EmergencyCheckpoint(root=str(blocker / "x"))
    with pytest.raises(ValueError, match="root="):
        MemoryCheckpointIO(root=str(blocker / "x"))
    with pytest.raises(ValueError, match="keep_last"):
        MemoryCheckpointIO(root=str(tmp_path), keep_last=0)


class _StatefulLoader:
    """An iterable with state_dict/load_state_dict, which Lightning stores in the loop state."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(20, 8, generator=g)
        self.batches = [(x[i:i + 4], x[i:i + 4].sum(1, keepdim=True)) for i in range(0, 20, 4)]
        self.served = 0
        self.loaded: dict | None = None

    def __iter__(self):
        for batch in self.batches:
            self.served += 1
            yield batch

    def __len__(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def test_stateful_dataloader_state_is_snapshotted_and_restored(root):
    def run(max_steps, callbacks):
        loader = _StatefulLoader()
        trainer = pl.Trainer(**trainer_kwargs(max_steps=max_steps, callbacks=callbacks))
        trainer.fit(make_module(), train_dataloaders=loader)
        return loader

    run(7, [EmergencyCheckpoint(every_n_steps=7, root=root, run_id="dl")])
    snapshot = SnapshotStore(root=root, run_id="dl", rank=0).load()
    saved = snapshot["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved and saved[0]["served"] >= 7
    resumed = run(9, [EmergencyCheckpoint(root=root, run_id="dl")])
    assert resumed.loaded == saved[0]


class _SpareProbe(pl.Callback):
    def __init__(self, emergency: EmergencyCheckpoint) -> None:
        self.emergency = emergency
        self.spare_inode = None
        self.info = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            rank_dir = self.emergency.store.rank_dir
            spares = [n for n in os.listdir(rank_dir) if n.startswith(".tmp-spare-")]
            self.spare_inode = os.stat(os.path.join(rank_dir, spares[0])).st_ino if spares else None
            self.info = self.emergency.save_now(trainer, reason="sigterm")


def test_first_emergency_save_uses_the_preallocated_spare(root):
    emergency = EmergencyCheckpoint(root=root, run_id="spare")  # no periodic snapshots at all
    probe = _SpareProbe(emergency)
    fit(4, [emergency, probe])
    assert probe.spare_inode is not None
    assert os.stat(probe.info.path).st_ino == probe.spare_inode
    rank_dir = emergency.store.rank_dir
    assert not any(n.startswith(".tmp-") for n in os.listdir(rank_dir))  # teardown drops the spare
    assert [i.step for i in SnapshotStore(root=root, run_id="spare", rank=0).list()] == [2]


def test_a_failing_periodic_snapshot_does_not_stop_training(root, monkeypatch, caplog):
    import errno

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with caplog.at_level(logging.ERROR, logger="lightning_ft"):
        trainer = fit(6, [EmergencyCheckpoint(every_n_steps=2, root=root, run_id="full")])
    assert trainer.global_step == 6
    assert any("periodic snapshot at step 2 failed" in r.message for r in caplog.records)


def test_unused_per_batch_hooks_are_not_dispatched_but_subclass_overrides_are(root, monkeypatch):
    # Lightning wraps every hook of every callback in a profiler context per step; ours set the
    # per-batch hooks they do not implement to None so Lightning skips them (callable() check)
    from lightning.pytorch.trainer import call

    dispatched: list[str] = []
    original = call._call_callback_hooks

    def counting(trainer, hook_name, *args, **kwargs):
        for callback in trainer.callbacks:
            if isinstance(callback, EmergencyCheckpoint) and callable(getattr(callback, hook_name, None)):
                dispatched.append(hook_name)
        return original(trainer, hook_name, *args, **kwargs)

    monkeypatch.setattr(call, "_call_callback_hooks", counting)

    class Counting(EmergencyCheckpoint):
        backward_calls = 0

        def on_before_backward(self, trainer, pl_module, loss):
            super().on_before_backward(trainer, pl_module, loss)  # the base class's no-op still resolves
            self.backward_calls += 1

    plain, counted = EmergencyCheckpoint(every_n_steps=5, root=root, run_id="a"), Counting(root=root, run_id="b")
    assert plain.on_before_backward is None and plain.on_train_epoch_end is None
    trainer = fit(6, [plain, counted])
    assert trainer.global_step == 6
    assert counted.backward_calls == 6
    assert dispatched.count("on_train_batch_end") == 12 and dispatched.count("on_before_backward") == 6
    assert "on_before_zero_grad" not in dispatched and "on_train_epoch_start" not in dispatched
    assert [i.step for i in SnapshotStore(root=root, run_id="a", rank=0).list()] == [5]


# ------------------------------------------------------------------------------- whose snapshot it is


def test_auto_resume_skips_another_models_snapshot_says_why_and_starts_fresh(root, caplog):
    fit(10, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="job")], hidden=16)
    probe = resume_probe()
    with caplog.at_level(logging.WARNING, logger="lightning_ft"):
        trainer = fit(4, [EmergencyCheckpoint(root=root, run_id="job"), probe], hidden=32)
    assert probe.start_step == 0 and trainer.global_step == 4  # trained, from scratch, no size mismatch
    warning = next(r.message for r in caplog.records if "auto-resume skipped" in r.message)
    assert "step 10" in warning and "different model" in warning and "Starting fresh" in warning


def test_auto_resume_takes_this_models_older_snapshot_over_another_models_newer_one(root, caplog):
    fit(5, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="job", keep_last=5)], hidden=16)
    store = SnapshotStore(root=root, run_id="job", rank=0)
    other = SnapshotStore(root=root + "-b", run_id="job", rank=0)
    other.save({"state_dict": make_module(hidden=32).state_dict(), "global_step": 10}, step=10)
    store.write_bytes(other.read_bytes(other.list()[0]))  # a newer snapshot of another model, same run id
    probe = resume_probe()
    with caplog.at_level(logging.WARNING, logger="lightning_ft"):
        fit(7, [EmergencyCheckpoint(root=root, run_id="job", keep_last=5), probe], hidden=16)
    assert probe.start_step == 5
    assert any("Resuming from this run's step 5 instead" in r.message for r in caplog.records)


def test_without_a_run_id_snapshots_are_written_but_never_resumed(root, monkeypatch, caplog):
    for var in ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(callback_module, "_no_run_id_warned", False)
    with caplog.at_level(logging.WARNING, logger="lightning_ft"):
        fit(10, [EmergencyCheckpoint(every_n_steps=5, root=root)], seed=1)
        probe = resume_probe()
        fit(10, [EmergencyCheckpoint(every_n_steps=5, root=root), probe], seed=2)  # another job, same script
    assert probe.start_step == 0
    warnings = [r.message for r in caplog.records if "no run id is set" in r.message]
    assert len(warnings) == 1 and f"{root}/default" in warnings[0] and "LIGHTNING_FT_RUN_ID" in warnings[0]
    assert [i.step for i in SnapshotStore(root=root, rank=0).list()] == [10, 5]
    with pytest.raises(ValueError, match="no run id is set"):
        fit(11, [], ckpt_path="mem://10", plugins=[MemoryCheckpointIO(root=root)])
    with pytest.raises(FileNotFoundError, match="no run id is set"):
        fit(11, [], ckpt_path="mem://latest", plugins=[MemoryCheckpointIO(root=root)])


def test_explicit_mem_path_to_another_models_snapshot_fails_clearly(root):
    fit(10, [EmergencyCheckpoint(every_n_steps=5, root=root, run_id="job")], hidden=16)
    with pytest.raises(SnapshotError) as err:
        fit(12, [], ckpt_path="mem://10", plugins=[MemoryCheckpointIO(root=root, run_id="job")], hidden=32)
    message = str(err.value)
    assert "mem://10: refusing to load the snapshot at step 10" in message and "different model" in message
    with pytest.raises(FileNotFoundError, match="different model"):
        fit(12, [], ckpt_path="mem://latest", plugins=[MemoryCheckpointIO(root=root, run_id="job")], hidden=32)
    probe = resume_probe()  # the same model still resumes
    fit(12, [probe], ckpt_path="mem://10", plugins=[MemoryCheckpointIO(root=root, run_id="job")], hidden=16)
    assert probe.start_step == 10


def test_a_true_half_precision_run_resumes_through_an_explicit_mem_path(root):
    # the explicit path restores before the precision plugin casts the module to bf16: the
    # fingerprint counts float kinds, not widths, so this is still the same model
    fit(6, [EmergencyCheckpoint(every_n_steps=3, root=root, run_id="half")], precision="bf16-true")
    probe = resume_probe()
    trainer = fit(8, [probe], ckpt_path="mem://6", plugins=[MemoryCheckpointIO(root=root, run_id="half")],
                  precision="bf16-true")
    assert probe.start_step == 6 and trainer.global_step == 8
    assert next(trainer.lightning_module.parameters()).dtype == torch.bfloat16


class _RecordAtSteps(pl.Callback):
    """Copies of the module's and the optimizer's state at the end of the given steps' batches."""

    def __init__(self, steps, change_in_place_at=None) -> None:
        self.steps, self.change_in_place_at, self.states = set(steps), change_in_place_at, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in self.steps and step not in self.states:
            self.states[step] = ({k: v.clone() for k, v in pl_module.state_dict().items()},
                                 trainer.optimizers[0].state_dict())
            self.states[step] = tuple(torch.utils._pytree.tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) else t, s) for s in self.states[step])
        if step == self.change_in_place_at:
            with torch.no_grad():
                next(pl_module.parameters()).mul_(1.0)  # e.g. a weight clamp outside the optimizer


@pytest.fixture
def started(monkeypatch) -> list[int]:
    """The steps of the snapshots started in the background (SnapshotStore.save_in_background);
    these small test models' tensors are copied on the helper thread as large ones are."""
    monkeypatch.setattr(copying, "BACKGROUND_MIN_BYTES", 0)
    steps = []
    begin = SnapshotStore.save_in_background

    def spy(self, state, step, defer, reason=""):
        steps.append(step)
        return begin(self, state, step, defer, reason)

    monkeypatch.setattr(SnapshotStore, "save_in_background", spy)
    return steps


class _PendingAtBackward(pl.Callback):
    """global_step -> the store's pending snapshot step when that step's backward finished."""

    def __init__(self, checkpoint: EmergencyCheckpoint) -> None:
        self.checkpoint, self.seen = checkpoint, {}

    def on_after_backward(self, trainer, pl_module) -> None:
        self.seen[trainer.global_step] = self.checkpoint.store.pending_step


def test_background_snapshots_overlap_the_next_backward_and_hold_their_steps_state(root, started):
    record = _RecordAtSteps([4, 8])
    checkpoint = EmergencyCheckpoint(every_n_steps=4, root=root, run_id="bg")
    probe = _PendingAtBackward(checkpoint)
    fit(10, [checkpoint, record, probe], hidden=64)
    assert started == [4, 8]
    # Lightning runs forward and backward inside optimizer.step(closure): the snapshot is
    # committed after the closure, not before it (the copy overlaps the next step's work)
    assert probe.seen[4] == 4 and probe.seen[8] == 8 and probe.seen[5] is None
    store = SnapshotStore(root=root, run_id="bg", rank=0)
    for step in (4, 8):
        snapshot = store.load(store.find(step))
        module_state, optimizer_state = record.states[step]
        assert tensors_equal(snapshot["state_dict"], module_state)
        assert tensors_equal(snapshot["optimizer_states"][0], optimizer_state)


def test_the_last_batch_of_an_epoch_or_of_training_is_snapshotted_synchronously(root, started):
    # Lightning's WeightAveraging copies the average into the parameters through .data in
    # on_train_end (unseen by version counters): a snapshot still copying then would mix them
    from lightning.pytorch.callbacks import WeightAveraging

    record = _RecordAtSteps([10])
    fit(10, [record, WeightAveraging(), EmergencyCheckpoint(every_n_steps=5, root=root, run_id="wa"),
             EmergencyCheckpoint(every_n_steps=2, root=root, run_id="wa2")])
    assert started == [2, 4, 6, 8]  # 5 batches per epoch: steps 5 and 10 end one, 10 ends training
    for run_id in ("wa", "wa2"):
        store = SnapshotStore(root=root, run_id=run_id, rank=0)
        snapshot = store.load(store.find(10))
        assert tensors_equal(snapshot["current_model_state"], record.states[10][0])


@pytest.mark.usefixtures("started")
def test_a_parameter_changed_outside_the_optimizer_abandons_that_snapshot_and_later_ones_are_synchronous(root, caplog):
    record = _RecordAtSteps([8], change_in_place_at=4)
    checkpoint = EmergencyCheckpoint(every_n_steps=4, root=root, run_id="bg")
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.lightning"):
        fit(10, [checkpoint, record])
    assert "background snapshot of step 4 abandoned" in caplog.text
    assert "copied synchronously from now on" in caplog.text
    store = SnapshotStore(root=root, run_id="bg", rank=0)
    assert [i.step for i in store.list()] == [8]
    assert tensors_equal(store.load(store.find(8))["state_dict"], record.states[8][0])


class _Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class _OptimConfig:
    lr: float = 0.01
    betas: tuple = (0.9, 0.99)
    mode: _Mode = _Mode.FAST


def _configured_module(config):
    """A module whose saved hyperparameters hold what Hydra and typed-config users pass."""
    module = make_module(0)
    module.save_hyperparameters(config)
    return module


def test_hydra_dataclass_enum_and_path_hyperparameters_snapshot_and_resume(root, tmp_path):
    from omegaconf import OmegaConf

    config = OmegaConf.create({"model": {"hidden": 16, "layers": [8, 16]}, "data": {"root": "${oc.env:HOME,/x}"},
                               "optim": OmegaConf.structured(_OptimConfig)})
    config.out = str(tmp_path)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=7, callbacks=[EmergencyCheckpoint(every_n_steps=5, root=root,
                                                                                       run_id="hydra")]))
    trainer.fit(_configured_module(config))
    snapshot = SnapshotStore(root=root, run_id="hydra", rank=0).load()
    saved = snapshot["hyper_parameters"]
    # the snapshot holds the config as plain data, interpolations as written
    assert saved["model"] == {"hidden": 16, "layers": [8, 16]} and saved["data"] == {"root": "${oc.env:HOME,/x}"}
    assert saved["optim"] == {"lr": 0.01, "betas": (0.9, 0.99), "mode": "fast"} and saved["out"] == str(tmp_path)
    assert snapshot["hparams_type"] == "omegaconf.dictconfig.DictConfig"
    probe = resume_probe()
    again = pl.Trainer(**trainer_kwargs(max_steps=9, callbacks=[EmergencyCheckpoint(root=root, run_id="hydra"),
                                                                  probe]))
    again.fit(_configured_module(config))
    assert probe.start_step == 5 and again.global_step == 9


def test_plain_data_converts_what_configs_hold_and_keeps_the_rest():
    import argparse
    from pathlib import PurePosixPath

    from lightning_ft.checkpoint.hparams import plain_data, with_plain_hyperparameters

    value = {"cfg": _OptimConfig(), "ns": argparse.Namespace(a=1, p=PurePosixPath("/d")), "tags": {"x"},
             "pair": (1, _Mode.FAST), "none": None, "tensor": torch.ones(2)}
    plain = plain_data(value)
    assert plain["cfg"] == {"lr": 0.01, "betas": (0.9, 0.99), "mode": "fast"}
    assert plain["ns"] == {"a": 1, "p": "/d"} and plain["tags"] == {"x"} and plain["pair"] == (1, "fast")
    assert plain["none"] is None and plain["tensor"] is value["tensor"]
    checkpoint = {"state_dict": {"w": torch.ones(1)}, "hyper_parameters": value}
    converted = with_plain_hyperparameters(checkpoint)
    assert converted["state_dict"] is checkpoint["state_dict"] and converted["hyper_parameters"]["cfg"]["lr"] == 0.01
    assert with_plain_hyperparameters({"state_dict": {}}) == {"state_dict": {}}


@pytest.mark.parametrize("hidden", [16, 512])
def test_the_size_estimate_runs_no_hook_and_is_close_to_the_snapshot(root, hidden):
    """The room check and the spare file are sized before the first snapshot without making one
    (a snapshot runs the user's checkpoint hooks): the estimate is near the real file."""
    from lightning_ft.checkpoint.lightning.state import estimate_state_bytes

    callback = EmergencyCheckpoint(every_n_steps=4, root=root, run_id="size")
    trainer = fit(4, [callback], hidden=hidden)
    [info] = SnapshotStore(root=root, run_id="size", rank=0).list()
    saves = []
    module = trainer.lightning_module
    module.on_save_checkpoint = lambda checkpoint: saves.append(checkpoint)
    estimate = estimate_state_bytes(trainer)
    assert saves == []
    assert info.nbytes * 0.9 <= estimate <= info.nbytes * 1.2 + 2**20, (estimate, info.nbytes)
