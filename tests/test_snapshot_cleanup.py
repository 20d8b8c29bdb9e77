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
