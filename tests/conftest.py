from __future__ import annotations

import datetime
import json
import os
import sys
import time
import zlib

import pytest
from loopback_dns import ensure_fast_loopback_reverse_lookup

import characterization
from prefork import DISABLE_ENV as DISABLE_PREFORK
from prefork import TIMELINE_ENV
from proc_utils import ProcessSet, child_env, free_port, launcher

#: modules whose tests take longest (``--durations``): they start first
LONGEST_MODULES = ("test_recovery_fidelity.py", "test_whole_script.py", "test_examples_demo.py",
                   "test_termination_processes.py")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once, in the controller, before any worker starts
        config._loopback_dns = ensure_fast_loopback_reverse_lookup()
        _compile_the_package()
    elif not os.environ.get(DISABLE_PREFORK):
        # each worker's fork servers for the environments most of its processes use start importing
        # now, beside the first tests, instead of when the first process is needed (prefork.py)
        from ft_cluster import base_env

        for env in (child_env(), base_env()):
            launcher().server_for(env)


def _compile_the_package() -> None:
    """Write lightning_ft's bytecode once. Where PYTHONDONTWRITEBYTECODE is set (this machine
    sets it) no process writes it, so each of the suite's few hundred processes would compile
    the package from source on import (0.1 to 0.25 CPU-s each, measured); read-only caching of a
    .pyc written here is still allowed."""
    import compileall
    from pathlib import Path

    compileall.compile_dir(str(Path(__file__).resolve().parents[1] / "lightning_ft"), quiet=1)


def pytest_report_header(config):
    return f"loopback reverse lookup from /etc/hosts: {getattr(config, '_loopback_dns', '?')}"


def pytest_itemcollected(item):
    """The inner loop (``-m "not slow"``) is every test that starts no process: ``slow`` is every
    ``multiprocess`` test (marked here, before ``-m`` deselects)."""
    if item.get_closest_marker("multiprocess") and not item.get_closest_marker("slow"):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which adds each test's xdist_group to its node id
def pytest_collection_modifyitems(config, items):
    """Longest first, so that pytest-xdist's workers end together instead of one of them
    finishing a long test alone: SLURM scenarios (and mypy), then the longest modules, then the
    other tests that start processes, mixed across modules, then the rest (a stable sort). xdist
    hands out groups with more tests first anyway.

    Also a check that xdist honours the groups (a too new pytest makes it ignore them silently)."""
    if getattr(config.option, "loadgroup", False):
        ignored = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if ignored:
            raise pytest.UsageError(f"pytest-xdist ignored the xdist_group of {ignored[0]} (and {len(ignored) - 1} "
                                    "more): this pytest is too new for it (pyproject.toml pins pytest < 9.2)")

    def rank(item) -> tuple[int, int]:
        if item.get_closest_marker("slurm") or item.path.name == "test_typecheck.py":
            return 0, 0
        if item.path.name in LONGEST_MODULES:
            return 1 + LONGEST_MODULES.index(item.path.name), 0
        if item.get_closest_marker("multiprocess"):
            # mixed, not module by module: a module's tests often wait alike (frozen stores and
            # peers, bounded timeouts), and a stretch of them left both cores idle; crc32, not
            # hash(): every worker must collect the same order
            return 10, zlib.crc32(item.nodeid.encode())
        return 20, 0

    items.sort(key=rank)


#: a file to append one JSON line per test to (worker, node id, start, end, the worker's own CPU):
#: where the suite's wall time goes; the fork servers add one line per process with its CPU
#: (tests/prefork.py)


def _own_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(TIMELINE_ENV)
    started, cpu_before = time.time(), _own_cpu()
    result = yield
    if path:
        record = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "-"), "test": item.nodeid,
                  "start": round(started, 3), "end": round(time.time(), 3),
                  "cpu": round(_own_cpu() - cpu_before, 3)}
        with open(path, "a") as timeline:
            timeline.write(json.dumps(record) + "\n")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After a test that made a ``Cluster`` passed: its participants' exit codes and decisions
    against tests/characterization.json (tests/characterization.py); a difference fails it."""
    characterization.ft_cluster.CREATED.clear()
    result = yield
    characterization.check(item.nodeid, list(characterization.ft_cluster.CREATED))
    return result


#: what a C++ stack or abort in a process's output looks like (torch's c10 backtraces, std::terminate)
CPP_BACKTRACE_MARKERS = ("frame #", "terminate called")


@pytest.fixture
def processes(tmp_path):
    """Real processes for a test; all are killed (whole sessions, by pid) at teardown. Then their
    output is scanned: a C++ backtrace in a user's log looks like a crash, whatever the outcome
    (issue 36: quiet logs on every fault path), so any makes the test fail."""
    procs = ProcessSet(log_dir=tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()
    noisy = []
    for proc in procs.procs.values():
        try:
            text = proc.log_path.read_text(errors="replace")
        except OSError:
            continue
        lines = [line for line in text.splitlines() if any(marker in line for marker in CPP_BACKTRACE_MARKERS)]
        if lines:
            noisy.append(f"{proc.name}: {len(lines)} line(s), first: {lines[0][:200]}")
    if noisy:
        pytest.fail("C++ backtrace lines in the processes' output:\n" + "\n".join(noisy))


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (``moto_server`` from ``moto[server]``) on 127.0.0.1 with a free
    port for the whole session, killed (by pid) at session end. Yields the environment a job
    needs to reach it the way a user's job reaches S3 (``AWS_ENDPOINT_URL`` and credentials);
    the bucket ``lightning-ft-test`` exists. If moto is not installed the tests fail with the
    install command (never skipped)."""
    import shutil
    import signal
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    server = Path(sys.executable).with_name("moto_server")
    if not server.exists():
        server = shutil.which("moto_server")
    if not server:
        pytest.fail("no moto_server for the S3 tests: pip install 'moto[server]' s3fs (the dev extra)", pytrace=False)
    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start:\n{log_path.read_text()}", pytrace=False)
                time.sleep(0.1)
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing").mkdir("lightning-ft-test")
        yield env
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
