"""Real processes: SIGKILL during a snapshot write, 2-rank DDP snapshot + resume under torchrun, and
which snapshots a job resumes (other jobs', other models', planted links, foreign directories)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ft.checkpoint import SnapshotStore

from proc_utils import REPO_ROOT, child_env, wait_for

HELPERS = str(REPO_ROOT / "tests" / "ckpt_helpers.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
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
    env = child_env()  # the explicit run id names the run (one that contradicted
    # LIGHTNING_FT_RUN_ID would be refused: tests/test_settings.py)
    proc = processes.start(name, argv, env=env)
    try:
        code = proc.popen.wait(timeout=110)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not finish\n{processes.dump_logs()}")
    assert code == 0, processes.dump_logs()
    results = {}
    for path in result_dir.glob("rank*.json"):
        result = json.loads(path.read_text())
        results[result["rank"]] = result
    assert sorted(results) == [0, 1], processes.dump_logs()
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(360)  # three torchrun jobs of fresh interpreters: 115 s alone, 150 s beside the suite
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


# ------------------------------------------------------------------------------- whose snapshot a job resumes

JOB = str(REPO_ROOT / "tests" / "scripts" / "snapshot_job.py")
RUN_ID_VARS = ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def _job(processes, name: str, tmp_path: Path, root: Path, args: list[str], expect_code: int = 0,
         wait: bool = True):
    """Run snapshot_job.py as a process of its own (no run id in its environment unless given)."""
    env = child_env()
    for var in RUN_ID_VARS:
        env.pop(var, None)
    out = tmp_path / f"out-{name}"
    proc = processes.python(name, [JOB, "--out", str(out), "--root", str(root), *args], env=env)
    if not wait:
        return proc, out
    try:
        code = proc.popen.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not finish\n{processes.dump_logs()}")
    assert code == expect_code, processes.dump_logs()
    result = json.loads((out / "result.json").read_text()) if code == 0 else None
    return result, proc.log()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_jobs_without_a_run_id_never_resume_each_others_snapshots(processes, tmp_path):
    """Issue 10, case 3: another script (other lr and seed) resumed the first one's weights and ran 0
    steps; a script with another model crashed with a state_dict size mismatch."""
    root = tmp_path / "shm"
    first, _ = _job(processes, "first", tmp_path, root, ["--lr", "0.01", "--seed", "1", "--max-steps", "20"])
    assert (first["start_step"], first["trained_steps"]) == (0, 20)
    assert sorted(p.name for p in (root / "default" / "rank0").iterdir()) == \
        ["step-000000000015.snap", "step-000000000020.snap"]  # written, where docs/snapshots.md says

    second, log = _job(processes, "other-lr-seed", tmp_path, root, ["--lr", "0.1", "--seed", "2", "--max-steps", "20"])
    assert (second["start_step"], second["trained_steps"]) == (0, 20), log  # trained, from scratch
    assert "no run id is set" in log and "never resumed" in log and "LIGHTNING_FT_RUN_ID" in log

    third, log = _job(processes, "other-model", tmp_path, root, ["--hidden", "48", "--max-steps", "20"])
    assert (third["start_step"], third["trained_steps"]) == (0, 20), log
    assert "size mismatch" not in log and "no run id is set" in log


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_same_job_resumes_and_another_model_under_its_run_id_does_not(processes, tmp_path):
    root = tmp_path / "shm"
    first, _ = _job(processes, "first", tmp_path, root, ["--run-id", "job-7", "--max-steps", "20"])
    assert first["end_step"] == 20

    again, log = _job(processes, "restart", tmp_path, root, ["--run-id", "job-7", "--max-steps", "30", "--seed", "9"])
    assert (again["start_step"], again["trained_steps"]) == (20, 10), log  # no regression: it resumes

    # an explicit mem:// path naming the other model's snapshot fails with the reason, before training
    _, log = _job(processes, "explicit-other-model", tmp_path, root,
                  ["--run-id", "job-7", "--hidden", "48", "--max-steps", "40", "--ckpt-path", "mem://30"],
                  expect_code=1)
    assert "mem://30: refusing to load the snapshot at step 30" in log and "different model" in log, log
    assert "size mismatch" not in log

    # auto-resume skips it with a warning that says which and why, and trains from scratch
    other, log = _job(processes, "auto-other-model", tmp_path, root,
                      ["--run-id", "job-7", "--hidden", "48", "--max-steps", "30"])
    assert (other["start_step"], other["trained_steps"]) == (0, 30), log
    assert "auto-resume skipped snapshots of another job or model: step 30" in log
    assert "different model" in log and "Starting fresh" in log


def _private_files(directory: Path) -> dict[str, str]:
    """name -> octal mode of every entry (links as 'link')."""
    return {p.name: "link" if p.is_symlink() else oct(stat.S_IMODE(p.lstat().st_mode)) for p in directory.iterdir()}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_planted_symlinks_are_never_followed_by_a_running_job(processes, tmp_path):
    """Issue 10, case 4: reusing a file followed a symlink; a planted link made a job overwrite one
    of its own config files. Links are planted where the next save recycles a file, where the spare
    goes, and as a 'newer' snapshot; the job resumes its real snapshot and writes nothing through them."""
    root = tmp_path / "shm"
    victim = tmp_path / "config.yaml"
    victim.write_text("lr: 0.1\n")
    first, _ = _job(processes, "first", tmp_path, root, ["--run-id", "j", "--max-steps", "10"])
    rank_dir = root / "j" / "rank0"
    assert _private_files(rank_dir) == {"step-000000000005.snap": "0o600", "step-000000000010.snap": "0o600"}

    go = tmp_path / "go"
    proc, out = _job(processes, "second", tmp_path, root, ["--run-id", "j", "--max-steps", "22", "--wait-for", str(go)],
                     wait=False)
    older = rank_dir / "step-000000000005.snap"
    older.unlink()
    older.symlink_to(victim)                                             # the next save would recycle it
    (rank_dir / f".tmp-spare-{proc.pid}.snap").symlink_to(victim)       # where this job's spare goes
    (rank_dir / "step-000000000099.snap").symlink_to(rank_dir / "step-000000000010.snap")  # a "newer" one
    go.touch()
    assert proc.popen.wait(timeout=90) == 0, processes.dump_logs()
    result = json.loads((out / "result.json").read_text())
    log = proc.log()

    assert (result["start_step"], result["end_step"]) == (10, 22), log   # its real snapshot, not "99"
    assert victim.read_text() == "lr: 0.1\n"
    assert "is a symbolic link" in log
    files = _private_files(rank_dir)
    assert files.pop("step-000000000005.snap") == "link" and files.pop("step-000000000099.snap") == "link"
    assert files == {"step-000000000020.snap": "0o600", "step-000000000015.snap": "0o600"}, files
    assert oct(stat.S_IMODE(rank_dir.lstat().st_mode)) == oct(stat.S_IMODE((root / "j").lstat().st_mode)) == "0o700"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_run_directory_of_another_user_or_writable_by_others_stops_the_job(processes, tmp_path):
    """Issue 10, case 4: another local user could swap run directories so a job resumed foreign
    weights. A run directory the job does not own, or that others can write, is an error naming it."""
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    run_dir = root / "j"
    (run_dir / "rank0").mkdir(parents=True, mode=0o755)
    for path in (run_dir, run_dir / "rank0"):
        os.chown(path, 65534, 65534)
    _, log = _job(processes, "foreign", tmp_path, root, ["--run-id", "j", "--max-steps", "4"], expect_code=1)
    assert f"run directory '{run_dir}' is owned by uid 65534" in log and "drwxr-xr-x" in log, log
    assert "Remove it (as its owner or root) or choose another snapshot root" in log

    for path in (run_dir, run_dir / "rank0"):
        os.chown(path, os.getuid(), os.getgid())
    os.chmod(run_dir, 0o777)
    _, log = _job(processes, "shared", tmp_path, root, ["--run-id", "j", "--max-steps", "4"], expect_code=1)
    assert f"run directory '{run_dir}' is writable by its group and other users" in log and "chmod go-w" in log
    os.chmod(run_dir, 0o700)
    done, _ = _job(processes, "fixed", tmp_path, root, ["--run-id", "j", "--max-steps", "4"])
    assert done["trained_steps"] == 4
