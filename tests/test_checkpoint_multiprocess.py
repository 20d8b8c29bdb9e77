"""Real processes: SIGKILL during a snapshot write, and 2-rank DDP snapshot + resume under torchrun."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from proc_utils import REPO_ROOT, child_env, wait_for

from lightning_ft.checkpoint import SnapshotStore

HELPERS = str(REPO_ROOT / "tests" / "ckpt_helpers.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_kill_9_during_a_snapshot_write_leaves_the_previous_snapshot(processes, tmp_path):
    root = tmp_path / "shm"
    rank_dir = root / "k9" / "rank0"
    writer = processes.python("writer", [HELPERS, "write-big", str(root), "k9"])
    assert wait_for(lambda: "committed 1" in writer.log() or writer.popen.poll() is not None, 45), processes.dump_logs()

    def temp_files():
        return [n for n in os.listdir(rank_dir) if n.startswith(".tmp-")] if rank_dir.exists() else []

    assert wait_for(lambda: temp_files() or writer.popen.poll() is not None, 30, interval=0.001), processes.dump_logs()
    writer.signal(signal.SIGKILL)
    assert writer.popen.wait(timeout=10) == -signal.SIGKILL
    assert "committed 2" not in writer.log(), "the write finished before the kill; the test proves nothing"

    leftovers = temp_files()
    assert leftovers, "the torn write should have left its temp file"
    reader = SnapshotStore(root=root, run_id="k9", rank=0)  # also removes temps of dead writers
    latest = reader.latest()
    assert latest is not None and latest.step == 1
    assert reader.load(latest)["w"].sum().item() == 16
    assert [i.step for i in reader.list()] == [1]
    assert temp_files() == []


def _torchrun(processes, name: str, root: Path, max_steps: int, mode: str):
    result_dir = root.parent / f"results-{name}"
    result_dir.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            HELPERS, "ddp", str(root), "ddp-run", str(max_steps), mode, str(result_dir)]
    env = child_env(OMP_NUM_THREADS="1", LIGHTNING_FT_RUN_ID="ignored-explicit-run-id-wins")
    proc = processes.start(name, argv, env=env)
    try:
        code = proc.popen.wait(timeout=90)
    except Exception:
        pytest.fail(f"{name} did not finish\n{processes.dump_logs()}")
    assert code == 0, processes.dump_logs()
    results = {}
    for path in result_dir.glob("rank*.json"):
        result = json.loads(path.read_text())
        results[result["rank"]] = result
    assert sorted(results) == [0, 1], processes.dump_logs()
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ddp_two_ranks_snapshot_then_resume_at_the_same_step(processes, tmp_path):
    root = tmp_path / "shm"
    first = _torchrun(processes, "train", root, 12, "auto")
    for rank in (0, 1):
        assert first[rank]["start_step"] == 0 and first[rank]["end_step"] == 12
        assert first[rank]["snapshots"] == [12, 8]  # each rank wrote its own directory

    second = _torchrun(processes, "resume-auto", root, 16, "auto")
    for rank in (0, 1):
        assert second[rank]["start_step"] == 12, second
        assert second[rank]["matched"] is True  # weights + optimizer + scheduler equal the snapshot
        assert second[rank]["end_step"] == 16

    # step 16 is unusable for the ranks together: torn on rank 0, missing on rank 1.
    # They must agree on the newest common step (12), through ckpt_path="mem://latest".
    store0 = SnapshotStore(root=root, run_id="ddp-run", rank=0)
    newest0 = store0.list()[0]
    assert newest0.step == 16
    os.truncate(newest0.path, newest0.nbytes - 1)
    SnapshotStore(root=root, run_id="ddp-run", rank=1).delete(
        SnapshotStore(root=root, run_id="ddp-run", rank=1).list()[0])
    third = _torchrun(processes, "resume-mem", root, 14, "mem")
    for rank in (0, 1):
        assert third[rank]["start_step"] == 12 and third[rank]["matched"] is True, third
