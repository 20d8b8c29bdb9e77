"""Job identity in snapshots: run id, rank, step and model fingerprint; resumes accept only their own."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from torch import nn

from lightning_ft.checkpoint import SnapshotError, SnapshotStore
from lightning_ft.checkpoint.identity import (
    ExpectedIdentity,
    SnapshotIdentity,
    identity_mismatch,
    model_fingerprint,
    state_dict_fingerprint,
)


def _net(hidden: int = 16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.Linear(hidden, 1))


def test_fingerprint_tells_models_apart_not_weights_or_float_width():
    base = state_dict_fingerprint(_net().state_dict())
    assert len(base) == 16
    assert state_dict_fingerprint(_net(seed=5).state_dict()) == base       # other weights: same model
    assert state_dict_fingerprint(_net().to(torch.bfloat16).state_dict()) == base  # precision plugins cast
    assert state_dict_fingerprint(_net(hidden=32).state_dict()) != base     # other shapes
    renamed = {f"model.{k}": v for k, v in _net().state_dict().items()}
    assert state_dict_fingerprint(renamed) != base                           # other names
    ints = dict(_net().state_dict())
    ints["2.bias"] = ints["2.bias"].long()
    assert state_dict_fingerprint(ints) != base                              # other kind of number
    assert model_fingerprint({"state_dict": _net().state_dict()}) == base
    assert model_fingerprint({"w": torch.ones(2)}) == "" == model_fingerprint([1, 2])


MINE = SnapshotIdentity(run_id="job", rank=0, step=10, model="abc")


@pytest.mark.parametrize("found, expected, reason", [
    (MINE, ExpectedIdentity("job"), None),
    (MINE, ExpectedIdentity("job", model="abc", rank=0), None),
    (MINE, ExpectedIdentity("other"), "belongs to run 'job', not to this run 'other'"),
    (MINE, ExpectedIdentity("job", model="xyz"), "different model"),
    (MINE, ExpectedIdentity("job", rank=1), "rank 0's state, not rank 1's"),
    (SnapshotIdentity("", 0, 10, "abc"), ExpectedIdentity("job"), "written without a run id"),
    (MINE, ExpectedIdentity(""), "no run id is configured"),
])
def test_identity_mismatch(found, expected, reason):
    found_reason = identity_mismatch(found, expected)
    assert (found_reason is None) if reason is None else (reason in found_reason)


def state(hidden: int = 16) -> dict:
    return {"state_dict": _net(hidden).state_dict(), "global_step": 1}


def test_snapshots_record_run_rank_step_and_model(tmp_path, monkeypatch):
    store = SnapshotStore(root=tmp_path, run_id="job", rank=3)
    info = store.save(state(), step=7)
    assert store.identity(info) == SnapshotIdentity("job", 3, 7, state_dict_fingerprint(_net().state_dict()))
    for var in ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    nameless = SnapshotStore(root=tmp_path, rank=0)
    assert nameless.run_id == "default" and nameless.configured_run_id is None
    info = nameless.save(state(), step=1)
    assert info.path.startswith(os.path.join(str(tmp_path), "default", "rank0"))
    assert nameless.identity(info).run_id == ""
    assert nameless.readable_steps(expect=nameless.expected_identity()) == []  # never resumed
    assert nameless.readable_steps() == [1]  # still a valid file for whoever loads it by hand


def test_expected_identity_filters_other_runs_and_models(tmp_path, caplog):
    mine = SnapshotStore(root=tmp_path, run_id="job", rank=0)
    fingerprint = model_fingerprint(state())
    mine.save(state(), step=5)
    mine.save(state(hidden=32), step=9)  # same run id, another model (e.g. a changed script)
    foreign = SnapshotStore(root=tmp_path / "b", run_id="other-job", rank=0)
    copied = foreign.save(state(), step=12)
    shutil.copy(copied.path, os.path.join(mine.rank_dir, os.path.basename(copied.path)))  # a swapped-in file

    expect = mine.expected_identity(model=fingerprint)
    scan = mine.scan(expect=expect)
    assert scan.readable == [5]
    assert [(info.step, "different model" in why or "other-job" in why) for info, why in scan.foreign] == \
        [(12, True), (9, True)]
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        assert mine.readable_steps(expect=expect) == [5]
        assert mine.latest(expect=expect).step == 5
        assert mine.find(9, expect=expect) is None
    assert any("belongs to run 'other-job'" in r.message for r in caplog.records)
    assert mine.readable_steps(expect=mine.expected_identity()) == [5, 9]  # run id only: any model
    with pytest.raises(SnapshotError, match="different model"):
        mine.load(mine.find(9), expect=expect)
    assert mine.load(expect=expect)["global_step"] == 1


def test_a_renamed_file_is_not_taken_for_another_step(tmp_path, caplog):
    store = SnapshotStore(root=tmp_path, run_id="job", rank=0, keep_last=5)
    store.save(state(), step=3)
    old = store.save(state(), step=4)
    os.rename(old.path, old.path.replace("000000000004", "000000000400"))  # an old state dressed as newer
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        assert store.readable_steps() == [3]
    assert any("file name says step 400 but its header says step 4" in r.message for r in caplog.records)
    with pytest.raises(SnapshotError, match="header says step 4"):
        store.load(store.list()[0])
    with pytest.raises(SnapshotError, match="header says step 4"):
        store.read_bytes(store.list()[0])


def test_received_copies_keep_the_identity_they_were_taken_with(tmp_path):
    source = SnapshotStore(root=tmp_path / "a", run_id="job", rank=0)
    receiver = SnapshotStore(root=tmp_path / "b", run_id="job", rank=1)
    blob = source.read_bytes(source.save(state(), step=6))
    info = receiver.write_bytes(blob)
    assert (info.rank, receiver.identity(info).rank) == (1, 0)  # in rank1's directory, taken by rank 0
    assert receiver.identity(info) == source.identity(source.find(6))
    stranger = SnapshotStore(root=tmp_path / "c", run_id="another-job", rank=1)
    with pytest.raises(SnapshotError, match="belongs to run 'job', not to 'another-job'"):
        stranger.write_bytes(blob)
    assert stranger.list() == []
