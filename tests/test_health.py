"""Node-health probes, the composite check and ``lightning-ft health`` (in-process, fast)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from lightning_ft.exit_codes import ExitCode
from lightning_ft.health import (
    CommandProbe,
    DiskSpaceProbe,
    MarkerFileProbe,
    MemoryProbe,
    NodeHealthCheck,
    ProbeResult,
    ShutdownMarkerProbe,
    default_probes,
)
from lightning_ft.health import cli as health_cli
from lightning_ft.health.probes import available_memory_bytes

from proc_utils import wait_for


def far() -> float:
    return time.monotonic() + 10


class StaticProbe:
    def __init__(self, name: str, healthy: bool, reason: str = "") -> None:
        self.name, self.healthy, self.reason = name, healthy, reason

    def check(self, deadline: float) -> ProbeResult:
        return ProbeResult(self.name, self.healthy, self.reason or ("fine" if self.healthy else "broken"), 0.0)


class HangingProbe:
    """Never answers (until released at the end of the test)."""

    def __init__(self, name: str = "hangs") -> None:
        self.name = name
        self.release = threading.Event()

    def check(self, deadline: float) -> ProbeResult:
        self.release.wait(60)
        return ProbeResult(self.name, True, "late", 60.0)


class RaisingProbe:
    name = "raises"

    def check(self, deadline: float) -> ProbeResult:
        raise OSError("device gone")


def test_marker_file_probe_reports_content_as_reason(tmp_path):
    marker = tmp_path / "npd-condition"
    probe = MarkerFileProbe(marker)
    assert probe.check(far()).healthy is True
    marker.write_text("  KernelDeadlock:\n task blocked for more than 120 seconds \n")
    result = probe.check(far())
    assert result.healthy is False
    assert "KernelDeadlock: task blocked for more than 120 seconds" in result.reason
    assert str(marker) in result.reason


def test_shutdown_marker_probe_uses_configurable_host_root(tmp_path):
    probe = ShutdownMarkerProbe(host_root=tmp_path)
    assert probe.check(far()).healthy is True
    (tmp_path / "var" / "run").mkdir(parents=True)
    (tmp_path / "var" / "run" / "nologin").write_text("System is going down.")
    result = probe.check(far())
    assert result.healthy is False
    assert "shutting down" in result.reason and "System is going down." in result.reason


def test_disk_and_memory_thresholds(tmp_path):
    assert DiskSpaceProbe(tmp_path, min_free_bytes=1).check(far()).healthy is True
    assert DiskSpaceProbe(tmp_path, min_free_bytes=2**62).check(far()).healthy is False
    assert DiskSpaceProbe(tmp_path / "missing", 1).check(far()).healthy is False
    assert MemoryProbe(min_available_bytes=1).check(far()).healthy is True
    assert MemoryProbe(min_available_bytes=2**62).check(far()).healthy is False
    with pytest.raises(ValueError, match="min_free_bytes"):
        DiskSpaceProbe(tmp_path, -1)


def test_available_memory_is_capped_by_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100000 kB\nMemAvailable: 80000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert available_memory_bytes(str(meminfo), str(cgroup)) == 80000 * 1024
    (cgroup / "memory.max").write_text(f"{50_000_000}\n")
    (cgroup / "memory.current").write_text(f"{30_000_000}\n")
    assert available_memory_bytes(str(meminfo), str(cgroup)) == 20_000_000
    (cgroup / "memory.max").write_text("max\n")
    assert available_memory_bytes(str(meminfo), str(cgroup)) == 80000 * 1024


def test_command_probe_exit_status_and_output():
    ok = CommandProbe([sys.executable, "-c", "print('all links up')"]).check(far())
    assert ok.healthy is True and ok.reason == "all links up"
    bad = CommandProbe([sys.executable, "-c", "import sys; print('ib0 down'); sys.exit(3)"]).check(far())
    assert bad.healthy is False and "exit status 3" in bad.reason and "ib0 down" in bad.reason
    missing = CommandProbe(["/nonexistent/health-check"]).check(far())
    assert missing.healthy is False


def test_command_probe_is_killed_at_the_deadline(tmp_path):
    pid_file = tmp_path / "pid"
    probe = CommandProbe([sys.executable, "-c",
                          f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"])
    result = probe.check(time.monotonic() + 1.0)
    assert result.healthy is False and result.overran
    pid = int(pid_file.read_text())
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=5)


def test_composite_returns_by_the_deadline_when_a_probe_hangs():
    hanging = HangingProbe()
    try:
        check = NodeHealthCheck([StaticProbe("ok", True), hanging], timeout_s=0.5)
        report = check.run()
        assert report.healthy is False
        by_name = {r.name: r for r in report.results}
        assert by_name["hangs"].overran and by_name["hangs"].healthy is False
        assert "no answer within 0.5 s" in by_name["hangs"].reason

        lenient = NodeHealthCheck([StaticProbe("ok", True), hanging], timeout_s=0.5, overrun_is_unhealthy=False)
        report = lenient.run()
        assert report.healthy is True
        assert {r.name: r for r in report.results}["hangs"].overran
    finally:
        hanging.release.set()


def test_composite_stops_at_the_first_unhealthy_answer_and_kills_commands(tmp_path):
    pid_file = tmp_path / "pid"
    slow = CommandProbe([sys.executable, "-c",
                         f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"],
                        name="slow")
    # the marker answers at once; the command is still starting when the verdict is known
    check = NodeHealthCheck([StaticProbe("broken", False, "xid 79"), slow], timeout_s=30)
    report = check.run()
    assert report.healthy is False
    assert report.reasons == ["broken: xid 79"]
    assert {r.name: r for r in report.results}["slow"].healthy is None
    assert wait_for(lambda: not slow._running, timeout=5)  # killed and reaped, even if cancelled before it ran
    if pid_file.exists():
        pid = int(pid_file.read_text())
        assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=5)


def test_a_probe_that_raises_counts_as_unhealthy():
    report = NodeHealthCheck([RaisingProbe(), StaticProbe("ok", True)], timeout_s=5,
                             stop_at_first_unhealthy=False).run()
    assert report.healthy is False
    assert "OSError: device gone" in report.reasons[0]
    assert report.to_dict()["probes"][0]["name"] == "raises"


def test_bad_configuration_names_the_argument():
    with pytest.raises(ValueError, match="timeout_s"):
        NodeHealthCheck([], timeout_s=0)
    with pytest.raises(ValueError, match="duplicate"):
        NodeHealthCheck([StaticProbe("a", True), StaticProbe("a", True)])
    with pytest.raises(TypeError, match="probes"):
        NodeHealthCheck([object()])
    with pytest.raises(ValueError, match="LIGHTNING_FT_HEALTH_MIN_FREE_DISK_MB"):
        default_probes({"LIGHTNING_FT_HEALTH_MIN_FREE_DISK_MB": "lots"})


def test_default_probes_from_the_environment(tmp_path):
    env = {
        "LIGHTNING_FT_HOST_ROOT": str(tmp_path),
        "LIGHTNING_FT_HEALTH_MARKERS": os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]),
        "LIGHTNING_FT_HEALTH_COMMAND": "true --flag",
        "LIGHTNING_FT_HEALTH_MIN_FREE_DISK_MB": "0",
        "LIGHTNING_FT_HEALTH_MIN_AVAILABLE_MEMORY_MB": "50",
    }
    probes = default_probes(env)
    names = [p.name for p in probes]
    assert names == ["shutdown-marker", "accelerator", "memory", f"marker:{tmp_path / 'a'}",
                     f"marker:{tmp_path / 'b'}", "command:true"]
    assert probes[0].host_root == tmp_path
    assert probes[-1].argv == ["true", "--flag"]
    assert NodeHealthCheck.from_env({"LIGHTNING_FT_HEALTH_TIMEOUT": "2.5"}).timeout_s == 2.5
    os.environ["LIGHTNING_FT_HEALTH_TIMEOUT"] = "1.5"
    try:
        assert NodeHealthCheck([]).timeout_s == 1.5
    finally:
        del os.environ["LIGHTNING_FT_HEALTH_TIMEOUT"]


def test_cli_reports_and_exits_non_zero_when_unhealthy(tmp_path, capsys):
    common = ["--no-accelerator", "--host-root", str(tmp_path), "--disk-path", str(tmp_path)]
    assert health_cli.main(common) == 0
    assert "node: healthy" in capsys.readouterr().out

    marker = tmp_path / "marker"
    marker.write_text("NVLink errors")
    assert health_cli.main(common + ["--marker", str(marker)]) == ExitCode.UNHEALTHY_NODE
    out = capsys.readouterr().out
    assert "FAIL" in out and "NVLink errors" in out and "UNHEALTHY" in out

    code = health_cli.main(common + ["--json", "--command", f"{sys.executable} -c 'import time; time.sleep(30)'",
                                     "--timeout", "0.5"])
    report = json.loads(capsys.readouterr().out)
    assert code == ExitCode.UNHEALTHY_NODE and report["healthy"] is False
    assert health_cli.main(common + ["--command", "sleep 30", "--timeout", "0.5", "--overrun-healthy"]) == 0
    capsys.readouterr()

    assert health_cli.main(["--min-free-disk-mb", "-1"]) == 2
    assert health_cli.main(["--no-such-flag"]) == 2
