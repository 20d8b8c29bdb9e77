"""The SLURM test harness fails with a reason when SLURM cannot be installed (never a silent skip)."""

from __future__ import annotations

import subprocess

import pytest

import slurm_cluster
from slurm_cluster import SlurmUnavailable, ensure_installed, parse_record


@pytest.fixture
def nothing_installed(monkeypatch):
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)


def test_not_root_says_what_to_install(nothing_installed, monkeypatch, tmp_path):
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SlurmUnavailable, match="not root.*apt-get install slurm-wlm munge"):
        ensure_installed(tmp_path / "apt.log")


def test_apt_failure_is_the_reason_after_reading_the_index_once(nothing_installed, monkeypatch, tmp_path):
    calls = []

    def fake_run(argv, stdout, **kwargs):
        # apt waits for another dpkg user instead of failing at once
        assert argv[1:3] == ["-o", f"DPkg::Lock::Timeout={slurm_cluster._DPKG_LOCK_WAIT_S}"]
        calls.append(argv[3])
        stdout.write(b"E: Unable to locate package slurm-wlm\n")
        return subprocess.CompletedProcess(argv, 100)

    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster.subprocess, "run", fake_run)
    with pytest.raises(SlurmUnavailable, match="Unable to locate package slurm-wlm"):
        ensure_installed(tmp_path / "apt.log")
    assert calls == ["install", "update", "install"]


def test_concurrent_installers_take_turns_and_the_second_finds_it_installed(nothing_installed, monkeypatch,
                                                                             tmp_path):
    # two pytest-xdist workers needing SLURM at once: one installs, the other waits for it
    # (apt itself would refuse the second: "Could not get lock /var/lib/dpkg/lock-frontend")
    import fcntl
    import threading

    monkeypatch.setattr(slurm_cluster, "_INSTALL_LOCK", tmp_path / "install.lock")
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    installed = threading.Event()
    monkeypatch.setattr(slurm_cluster, "missing_commands", lambda: [] if installed.is_set() else ["slurmctld"])
    calls = []
    monkeypatch.setattr(slurm_cluster.subprocess, "run",
                        lambda argv, **kwargs: calls.append(argv) or installed.set() or
                        subprocess.CompletedProcess(argv, 0))
    with open(tmp_path / "install.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # another worker is installing
        waiter = threading.Thread(target=ensure_installed, args=(tmp_path / "apt.log",))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and calls == []  # waits for the lock, runs no apt meanwhile
        installed.set()  # the other worker's install finished
    waiter.join(5)
    assert not waiter.is_alive() and calls == []  # found the commands: nothing to install


def test_scontrol_one_line_records_keep_reasons_with_spaces():
    record = parse_record("NodeName=localhost State=IDLE+DRAIN Reason=Epilog error [root@1795420605]\n")
    assert record == {"NodeName": "localhost", "State": "IDLE+DRAIN", "Reason": "Epilog error [root@1795420605]"}
