"""``lightning-ft snapshots``: what runs left under a snapshot root, and removing it."""

import os
import time

import pytest

from lightning_ft.checkpoint.memory.cleanup import main, parse_age, runs_under


def _run_dir(root, name, size, age_seconds):
    path = root / name / "rank0"
    path.mkdir(parents=True)
    snapshot = path / "step-8.snap"
    snapshot.write_bytes(b"x" * size)
    when = time.time() - age_seconds
    os.utime(snapshot, (when, when))
    os.utime(path, (when, when))
    os.utime(path.parent, (when, when))


def test_lists_removes_a_run_with_its_later_fits_and_the_stale_ones(tmp_path, capsys):
    root = tmp_path / "shm"
    _run_dir(root, "job-1", 2048, age_seconds=3 * 86400)
    _run_dir(root, "job-1-fit1", 10, age_seconds=3 * 86400)
    _run_dir(root, "job-2", 4096, age_seconds=60)
    _run_dir(root, "job-3", 5, age_seconds=7200)
    (root / "a-link").symlink_to(tmp_path)  # never followed, never removed
    (root / "not-a-run" / "data").mkdir(parents=True)  # no rank<N> inside: never listed or removed
    old = time.time() - 9 * 86400
    os.utime(root / "not-a-run", (old, old))
    runs = {run.name: run for run in runs_under(str(root))}
    assert sorted(runs) == ["job-1", "job-1-fit1", "job-2", "job-3"]
    assert (runs["job-2"].bytes, runs["job-2"].files) == (4096, 1) and 50 < runs["job-2"].idle_seconds < 600

    assert main(["--root", str(root), "list"]) == 0
    listing = capsys.readouterr().out
    assert "job-2" in listing and "4.0 KiB" in listing and "a-link" not in listing

    assert main(["--root", str(root), "remove", "job-1"]) == 0
    assert sorted(os.listdir(root)) == ["a-link", "job-2", "job-3", "not-a-run"]
    assert main(["--root", str(root), "remove", "--older-than", "1h"]) == 0
    assert sorted(os.listdir(root)) == ["a-link", "job-2", "not-a-run"]
    assert "removed" in capsys.readouterr().out
    assert main(["--root", str(root), "remove", "--older-than", "1d"]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    assert tmp_path.is_dir()


@pytest.mark.parametrize("argv", [["remove"], ["remove", "job-1", "--older-than", "1d"],
                                  ["remove", "--older-than", "soon"]])
def test_a_bad_remove_is_a_usage_error(tmp_path, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--root", str(tmp_path), *argv])
    assert exit_.value.code == 2 and "lightning-ft snapshots" in capsys.readouterr().err


def test_ages():
    assert [parse_age(a) for a in ("90s", "30m", "12h", "2d", "5")] == [90, 1800, 43200, 172800, 5]
    with pytest.raises(ValueError):
        parse_age("²d")


CHURN = """
import os, sys, time
run = sys.argv[1]
end = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < end:  # a job writing snapshots: a new file, the older one removed
    n += 1
    os.makedirs(os.path.join(run, "rank0"), exist_ok=True)
    with open(os.path.join(run, "rank0", f"step-{n}.snap"), "wb") as f:
        f.write(b"x")
    try:
        os.unlink(os.path.join(run, "rank0", f"step-{n - 1}.snap"))
    except FileNotFoundError:
        pass
"""


def test_entries_vanishing_under_it_are_passed_over(tmp_path, capsys):
    """Issue 47, item 5: ``remove --older-than`` crashed with FileNotFoundError while a job wrote
    snapshots (a file listed, then replaced before it was looked at)."""
    import subprocess
    import sys

    root = tmp_path / "shm"
    for i in range(20):
        _run_dir(root, f"old-{i}", 10, age_seconds=3 * 86400)
    writer = subprocess.Popen([sys.executable, "-c", CHURN, str(root / "busy"), "30"])
    try:
        for _ in range(300):
            assert main(["--root", str(root), "list"]) == 0
            assert main(["--root", str(root), "remove", "--older-than", "1h"]) == 0
    finally:
        writer.kill()
        writer.wait(timeout=30)
    capsys.readouterr()
    assert sorted(os.listdir(root)) == ["busy"]


def test_remove_takes_only_run_directories_by_the_jobs_own_name_and_never_a_held_one(tmp_path, capsys):
    """Issue 47, item 5: ``--root ~ remove src`` removed ~/src; ``remove exp/42`` missed the job's
    ``exp_42``; a run of a live but idle (or SIGSTOPped) job was removed."""
    import signal
    import subprocess
    import sys

    home = tmp_path / "home"
    (home / "src").mkdir(parents=True)
    (home / "src" / "main.py").write_text("print()")
    assert main(["--root", str(home), "remove", "src"]) == 0
    assert (home / "src" / "main.py").exists() and "nothing to remove" in capsys.readouterr().out

    root = tmp_path / "shm"
    _run_dir(root, "exp_42", 10, age_seconds=3 * 86400)
    assert main(["--root", str(root), "remove", "exp/42"]) == 0
    assert not (root / "exp_42").exists() and "removed" in capsys.readouterr().out

    _run_dir(root, "live", 10, age_seconds=3 * 86400)
    _run_dir(root, "live-fit1", 10, age_seconds=3 * 86400)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from lightning_ft.checkpoint.memory.holders import claim_run; "
         "claim_run(sys.argv[1], 'live', 'job'); print('claimed', flush=True); sys.stdin.readline()", str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        holder.send_signal(signal.SIGSTOP)  # frozen, not gone
        for argv in (["remove", "live"], ["remove", "--older-than", "1h"]):
            assert main(["--root", str(root), *argv]) == 0
            out = capsys.readouterr().out
            assert f"held by the live process(es) {holder.pid}" in out and "removed" not in out, out
        assert (root / "live").is_dir() and (root / "live-fit1").is_dir()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert main(["--root", str(root), "remove", "live"]) == 0  # its job is gone now
    assert not (root / "live").exists() and not (root / "live-fit1").exists()
