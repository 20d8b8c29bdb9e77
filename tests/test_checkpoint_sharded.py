"""Sharded state in snapshots (issue 27): DTensor shards as plain records, back into live shards."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_ft.checkpoint.sharded import (
    SHARD_MARK,
    ShardLayoutError,
    count_shards,
    decode_placements,
    dtensors_to_shards,
    is_shard_record,
)

from proc_utils import REPO_ROOT, child_env


def test_a_checkpoint_without_dtensors_is_returned_as_it_is():
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [{"state": {}}], "epoch": 1}
    assert dtensors_to_shards(checkpoint) is checkpoint
    assert count_shards(checkpoint) == 0


def test_records_are_recognised_and_bad_placements_refused():
    record = {SHARD_MARK: 1, "local": torch.zeros(1), "global_shape": [2], "placements": ["S0"],
              "mesh_shape": [2], "coordinate": [0]}
    assert is_shard_record(record) and not is_shard_record({"local": 1})
    assert count_shards({"a": [record, (record,)], "b": record}) == 3
    with pytest.raises(ShardLayoutError, match="unknown placement"):
        decode_placements(["P"])


def test_the_newest_step_with_every_shard_wins_and_each_rank_receives_its_own():
    from lightning_ft.checkpoint.policy import ShardTransferPlan, plan_shard_transfers

    assert plan_shard_transfers([[], []]) is None
    assert plan_shard_transfers([]) is None
    # a relaunch placed the participants in the other order: each holds the other's shards
    assert plan_shard_transfers([[(1, 8)], [(0, 8)]]) == ShardTransferPlan(8, ((1, 0), (0, 1)))
    # in place: nothing moves
    assert plan_shard_transfers([[(0, 4), (0, 8)], [(1, 4), (1, 8)]]) == ShardTransferPlan(8, ())
    # rank 1's shard of step 12 is lost (its holder died): step 8 is the newest whole model
    assert plan_shard_transfers([[(0, 8), (0, 12)], [(1, 8)]]) == ShardTransferPlan(8, ())
    # a new rank 1 (a spare) gets rank 1's shard from the rank that keeps a replica of it
    assert plan_shard_transfers([[(0, 8), (1, 8)], [], [(2, 8)]]) == ShardTransferPlan(8, ((0, 1),))
    # the lowest holder sends; shards of ranks beyond this world are nobody's
    assert plan_shard_transfers([[(0, 8)], [(0, 8), (1, 8), (5, 8)]]) == ShardTransferPlan(8, ())
    assert plan_shard_transfers([[(1, 8)], [(0, 8)], [(0, 8), (2, 8)]]) == ShardTransferPlan(8, ((1, 0), (0, 1)))
    # a shard missing everywhere: no whole model, nothing to resume
    assert plan_shard_transfers([[(0, 8)], [(0, 8)]]) is None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_ranks_snapshot_their_own_shards_and_restore_them(processes, tmp_path):
    # the script forks its two ranks itself; it is started from the preloaded server (tests/prefork.py)
    script = REPO_ROOT / "tests" / "scripts" / "sharded_codec.py"
    proc = processes.python("sharded", [str(script), str(tmp_path / "shm")], env=child_env())
    assert processes.wait_all(timeout=100) == {"sharded": 0}, processes.dump_logs()
    assert sorted(re.findall(r"OK (\d)", proc.log())) == ["0", "1"], processes.dump_logs()


def _run(processes, name: str, root, run_id: str, steps: int, tmp_path) -> None:
    out = tmp_path / f"{name}.json"
    processes.python(name, [str(REPO_ROOT / "tests" / "scripts" / "model_parallel_resume.py"), "--root", str(root),
                            "--run-id", run_id, "--max-steps", str(steps), "--out", str(out)])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_model_parallel_strategy_resumes_each_rank_from_its_own_shards_exactly(processes, tmp_path):
    """Lightning's ModelParallelStrategy (FSDP2 on CPU/gloo, 2 ranks, Adam) with EmergencyCheckpoint:
    each rank snapshots only its own shards; a new launch resumes from them and ends with the
    same full weights as an uninterrupted run."""
    import json

    _run(processes, "first", tmp_path / "shm", "mp", 8, tmp_path)
    _run(processes, "uninterrupted", tmp_path / "shm-other", "mp-other", 12, tmp_path)
    codes = processes.wait_all(timeout=110)
    assert codes == {"first": 0, "uninterrupted": 0}, processes.dump_logs()
    for rank in (0, 1):
        assert sorted(p.name for p in (tmp_path / "shm" / "mp" / f"rank{rank}").glob("*.snap")) == \
            ["step-000000000004.snap", "step-000000000008.snap"]
    _run(processes, "resumed", tmp_path / "shm", "mp", 12, tmp_path)
    assert processes.wait_all(timeout=110)["resumed"] == 0, processes.dump_logs()
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    uninterrupted = json.loads((tmp_path / "uninterrupted.json").read_text())
    assert resumed["resumed"] == 8 and resumed["step"] == uninterrupted["step"] == 12, resumed
    assert resumed["digest"] == uninterrupted["digest"], (resumed, uninterrupted)


def test_a_restore_after_setup_is_used_once_and_a_leftover_is_dropped():
    import lightning.pytorch as pl

    from lightning_ft._lightning.checkpointing import drop_pending_restore, restore_after_setup

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    connector = trainer._checkpoint_connector
    used: list[str] = []
    checkpoint = {"global_step": 8}
    restore_after_setup(trainer, checkpoint, "mem://8", lambda: used.append("used"),
                        lambda path: used.append(f"passed over {path}"))
    connector.resume_start(None)  # what Lightning calls after setup when no ckpt_path was given
    assert used == ["used"] and connector._loaded_checkpoint is checkpoint and connector._ckpt_path == "mem://8"
    assert "resume_start" not in vars(connector)  # once: the next fit() loads as Lightning does
    restore_after_setup(trainer, checkpoint, "mem://8", lambda: used.append("again"), lambda path: None)
    drop_pending_restore(trainer)  # that fit() ended before Lightning loaded anything
    connector.resume_start(None)
    assert used == ["used"]


def test_the_module_template_rebuilds_fresh_children_as_fit_received_them():
    """What a sharded round's survivor puts in place of its sharded children: new objects with the
    same structure, parameters allocated (values come from the snapshot), tied ones still tied,
    ``requires_grad`` and every buffer -- a non-persistent one too -- as at fit() start; the
    template itself holds no parameter memory (meta)."""
    from torch import nn

    from lightning_ft._lightning.module_template import ModuleTemplate

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.norm = nn.BatchNorm1d(3)
            self.frozen = nn.Linear(3, 3)
            self.frozen.requires_grad_(False)
            self.register_buffer("cache", torch.arange(3.0), persistent=False)

    root = nn.Module()
    root.net = Net()
    root.net.norm.running_mean.fill_(7.0)
    template = ModuleTemplate.capture(root)
    assert all(p.is_meta for child in template.children.values() for p in child.parameters())
    old = root.net
    root.net.cache.fill_(-1.0)  # changes during training are not what fit() received
    assert template.rebuild_problem(root) is None
    template.rebuild(root, torch.device("cpu"))
    net = root.net
    assert net is not old and isinstance(net, Net)
    assert net.head.weight is net.embed.weight and not net.embed.weight.is_meta
    assert [p.requires_grad for p in net.frozen.parameters()] == [False, False]
    assert torch.equal(net.cache, torch.arange(3.0)) and torch.equal(net.norm.running_mean, torch.full((3,), 7.0))
    assert {n: p.shape for n, p in net.named_parameters()} == {n: p.shape for n, p in old.named_parameters()}
    root.extra = nn.Linear(1, 1)
    assert "submodules changed" in template.rebuild_problem(root)
