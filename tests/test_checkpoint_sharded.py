"""Sharded state in snapshots (issue 27): DTensor shards as plain records, back into live shards."""

from __future__ import annotations

import re
import subprocess
import sys

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


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_ranks_snapshot_their_own_shards_and_restore_them(tmp_path):
    script = REPO_ROOT / "tests" / "scripts" / "sharded_codec.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "shm")], capture_output=True, text=True,
                          env=child_env(), timeout=100, start_new_session=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(re.findall(r"OK (\d)", proc.stdout)) == ["0", "1"], proc.stdout + proc.stderr
