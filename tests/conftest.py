from __future__ import annotations

import datetime
import os

import pytest

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from proc_utils import ProcessSet, free_port  # noqa: E402


@pytest.fixture
def processes(tmp_path):
    """Real processes for a test; all are killed (whole sessions, by pid) at teardown."""
    procs = ProcessSet(log_dir=tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()


@pytest.fixture
def tcp_store():
    """A real TCPStore server on 127.0.0.1 with a free port."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    yield store


@pytest.fixture
def port():
    return free_port()


@pytest.fixture(scope="session")
def slurm():
    """A real SLURM (munged, slurmctld, slurmd) on 127.0.0.1 for the whole session, started on first use.

    Installs Debian's slurm-wlm and munge first when they are missing. If SLURM cannot be
    installed or started, the tests that need it fail with the reason (never skipped).
    """
    from slurm_cluster import SlurmCluster, SlurmUnavailable

    try:
        cluster = SlurmCluster.start()
    except SlurmUnavailable as exc:
        pytest.fail(f"no SLURM for the SLURM tests: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


def pytest_terminal_summary(terminalreporter):
    # from the reports (user_properties), so it works with and without pytest-xdist workers
    measured = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == "slurm_timing":
                    name, seconds = value
                    measured[name] = seconds
    if measured:
        terminalreporter.write_sep("-", "SLURM scenarios: event -> job end state (measured)")
        for name, seconds in measured.items():
            terminalreporter.write_line(f"{seconds:6.1f} s  {name}")


@pytest.fixture
def small_tmpfs(tmp_path):
    """``small_tmpfs(name, size)``: a tmpfs of ``size`` (e.g. ``"40k"``) mounted at ``tmp_path/name``
    (mode 0700), unmounted at teardown -- a node whose /dev/shm fills up. Needs root (the test
    command runs as root); if the mount fails the test fails with the reason (never skipped)."""
    import subprocess

    mounted = []

    def mount(name: str, size: str):
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"cannot mount a {size} tmpfs at {path}: {done.stderr.strip()}", pytrace=False)
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
