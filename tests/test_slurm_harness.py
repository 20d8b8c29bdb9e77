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
        calls.append(argv[1])
        stdout.write(b"E: Unable to locate package slurm-wlm\n")
        return subprocess.CompletedProcess(argv, 100)

    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster.subprocess, "run", fake_run)
    with pytest.raises(SlurmUnavailable, match="Unable to locate package slurm-wlm"):
        ensure_installed(tmp_path / "apt.log")
    assert calls == ["install", "update", "install"]


def test_scontrol_one_line_records_keep_reasons_with_spaces():
    record = parse_record("NodeName=localhost State=IDLE+DRAIN Reason=Epilog error [root@1795420605]\n")
    assert record == {"NodeName": "localhost", "State": "IDLE+DRAIN", "Reason": "Epilog error [root@1795420605]"}
