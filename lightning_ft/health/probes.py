"""Node-health probes: small checks that each answer healthy/unhealthy with a reason.

A probe is anything with a ``name`` and ``check(deadline) -> ProbeResult``, where
``deadline`` is an absolute :func:`time.monotonic` value. Probes must not raise; the
composite (:class:`lightning_ft.health.NodeHealthCheck`) still guards against it and
against probes that never return.

No Lightning import here; torch is imported only by :class:`AcceleratorProbe`, and only
when it runs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightning_ft._clock import monotonic
from lightning_ft.health.settings import HealthSettings
from lightning_ft.settings import load

_MIB = 1024 * 1024
_MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class ProbeResult:
    """What one probe found.

    ``healthy`` is ``None`` when the probe's answer was not awaited (the verdict was
    already unhealthy). ``overran`` marks a probe that did not answer by the deadline;
    whether that counts as unhealthy is the composite's policy.
    """

    name: str
    healthy: bool | None
    reason: str
    duration_s: float
    overran: bool = False


@runtime_checkable
class Probe(Protocol):
    """A node-health check. ``check`` must return by ``deadline`` (``monotonic()``)."""

    name: str

    def check(self, deadline: float) -> ProbeResult: ...


def _short(text: str) -> str:
    text = " ".join(text.strip().split())
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


class MarkerFileProbe:
    """Unhealthy while a marker file exists (node-problem-detector style).

    The file's content, if any, is reported as the reason. Several paths may be given;
    any existing one makes the node unhealthy.
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], name: str | None = None) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("MarkerFileProbe: `paths` must name at least one file")
        self.name = name or "marker:" + ",".join(str(p) for p in self.paths)

    def _describe(self, path: Path, content: str) -> str:
        return f"{path} exists: {content}" if content else f"{path} exists"

    def check(self, deadline: float) -> ProbeResult:
        start = monotonic()
        for path in self.paths:
            if not path.exists():
                continue
            try:
                content = _short(path.read_text(errors="replace")[:4096])
            except OSError as exc:  # exists but unreadable (e.g. a directory): still a marker
                content = f"(unreadable: {exc.strerror or exc})"
            return ProbeResult(self.name, False, self._describe(path, content), monotonic() - start)
        return ProbeResult(self.name, True, "no marker file", monotonic() - start)


class ShutdownMarkerProbe(MarkerFileProbe):
    """Unhealthy when the host is shutting down: ``/run/nologin`` or ``/var/run/nologin``.

    systemd creates that file while the machine goes down (and for scheduled shutdowns).
    Inside a container ``/run`` is the container's own; mount the host's ``/run`` and
    point ``host_root`` at the mount (e.g. ``host_root="/host"`` for ``/host/run``).
    """

    RELATIVE_PATHS = ("run/nologin", "var/run/nologin")

    def __init__(self, host_root: str | os.PathLike = "/") -> None:
        self.host_root = Path(host_root)
        super().__init__([self.host_root / rel for rel in self.RELATIVE_PATHS], name="shutdown-marker")

    def _describe(self, path: Path, content: str) -> str:
        suffix = f": {content}" if content else ""
        return f"host is shutting down ({path} exists){suffix}"

    def check(self, deadline: float) -> ProbeResult:
        result = super().check(deadline)
        if result.healthy:
            return ProbeResult(self.name, True, f"no shutdown marker under {self.host_root}", result.duration_s)
        return result


class DiskSpaceProbe:
    """Unhealthy when a filesystem has less than ``min_free_bytes`` free."""

    def __init__(self, path: str | os.PathLike, min_free_bytes: int) -> None:
        if min_free_bytes < 0:
            raise ValueError(f"DiskSpaceProbe: `min_free_bytes` must be >= 0, got {min_free_bytes}")
        self.path = Path(path)
        self.min_free_bytes = int(min_free_bytes)
        self.name = f"disk:{self.path}"

    def check(self, deadline: float) -> ProbeResult:
        start = monotonic()
        try:
            free = shutil.disk_usage(self.path).free
        except OSError as exc:
            return ProbeResult(self.name, False, f"cannot stat {self.path}: {exc}", monotonic() - start)
        healthy = free >= self.min_free_bytes
        reason = f"{free / _MIB:.0f} MiB free ({'>=' if healthy else '<'} {self.min_free_bytes / _MIB:.0f} MiB)"
        return ProbeResult(self.name, healthy, reason, monotonic() - start)


def available_memory_bytes(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Memory this process could still get: MemAvailable, capped by a cgroup v2 limit."""
    available: int | None = None
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:  # a container's limit is invisible in /proc/meminfo
        limit = Path(cgroup_root, "memory.max").read_text().strip()
        if limit != "max":
            used = int(Path(cgroup_root, "memory.current").read_text().strip())
            headroom = max(0, int(limit) - used)
            available = headroom if available is None else min(available, headroom)
    except (OSError, ValueError):
        pass
    return available


class MemoryProbe:
    """Unhealthy when less than ``min_available_bytes`` of memory is available."""

    name = "memory"

    def __init__(self, min_available_bytes: int) -> None:
        if min_available_bytes < 0:
            raise ValueError(f"MemoryProbe: `min_available_bytes` must be >= 0, got {min_available_bytes}")
        self.min_available_bytes = int(min_available_bytes)

    def check(self, deadline: float) -> ProbeResult:
        start = monotonic()
        available = available_memory_bytes()
        if available is None:
            return ProbeResult(self.name, True, "available memory unknown (no /proc/meminfo)",
                               monotonic() - start)
        healthy = available >= self.min_available_bytes
        reason = (f"{available / _MIB:.0f} MiB available "
                  f"({'>=' if healthy else '<'} {self.min_available_bytes / _MIB:.0f} MiB)")
        return ProbeResult(self.name, healthy, reason, monotonic() - start)


class AcceleratorProbe:
    """CUDA device query when CUDA is present; healthy on a CPU-only node.

    Each visible device is asked for its free memory (a driver round trip that does not
    wait for queued kernels). A device that errors is unhealthy; one that hangs is left
    to the composite's deadline. ``require_cuda=True`` makes a node without usable CUDA
    devices unhealthy (for GPU jobs whose driver may have vanished).
    """

    name = "accelerator"

    def __init__(self, require_cuda: bool = False) -> None:
        self.require_cuda = bool(require_cuda)

    def check(self, deadline: float) -> ProbeResult:
        start = monotonic()
        try:
            import torch  # here, not at the top: the other probes and `lightning-ft health` need no torch

            if not torch.cuda.is_available():
                if self.require_cuda:
                    return ProbeResult(self.name, False, "CUDA required but no usable CUDA device",
                                       monotonic() - start)
                return ProbeResult(self.name, True, "no CUDA devices (CPU node)", monotonic() - start)
            count = torch.cuda.device_count()
            for index in range(count):
                free, total = torch.cuda.mem_get_info(index)
            return ProbeResult(self.name, True, f"{count} CUDA device(s) answered", monotonic() - start)
        except Exception as exc:  # noqa: BLE001 - a driver error is exactly what this probe looks for
            return ProbeResult(self.name, False, f"CUDA query failed: {type(exc).__name__}: {_short(str(exc))}",
                               monotonic() - start)


class CommandProbe:
    """Runs an external command: exit status 0 = healthy, anything else = unhealthy.

    The command runs in its own session without a shell and is killed (the whole
    session, SIGKILL) at the deadline; its last output line is the reason.
    """

    def __init__(self, command: str | Sequence[str], name: str | None = None) -> None:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise ValueError("CommandProbe: `command` must not be empty")
        self.argv = argv
        self.name = name or f"command:{argv[0]}"
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._cancelled_at = float("-inf")

    def cancel(self) -> None:
        """Kill a command that is still running (used when nobody waits for it any more).

        Also covers a check that has started but not yet spawned its command.
        """
        with self._lock:
            self._cancelled_at = monotonic()
            running = list(self._running)
        for proc in running:
            _kill_session(proc)

    def check(self, deadline: float) -> ProbeResult:
        start = monotonic()
        try:
            proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            return ProbeResult(self.name, False, f"cannot run {self.argv[0]!r}: {exc}", monotonic() - start)
        with self._lock:
            self._running.add(proc)
            cancelled = self._cancelled_at >= start
        if cancelled:
            _kill_session(proc)
        try:
            try:
                output, _ = proc.communicate(timeout=max(0.0, deadline - monotonic()))
            except subprocess.TimeoutExpired:
                _kill_session(proc)
                proc.communicate()
                return ProbeResult(self.name, False, "killed at the deadline (no answer in time)",
                                   monotonic() - start, overran=True)
        finally:
            with self._lock:
                self._running.discard(proc)
        lines = output.decode(errors="replace").strip().splitlines()
        last = _short(lines[-1]) if lines else ""
        if proc.returncode == 0:
            return ProbeResult(self.name, True, last or "exit status 0", monotonic() - start)
        status = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                  else f"exit status {proc.returncode}")
        return ProbeResult(self.name, False, f"{status}: {last}" if last else status, monotonic() - start)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def default_probes(
    env: Mapping[str, str] | None = None,
    *,
    accelerator: bool = True,
    **settings: Any,
) -> list[Probe]:
    """The built-in probe set: each setting of :class:`~lightning_ft.health.settings.HealthSettings`
    (``host_root``, ``markers``, ``command``, ``disk_paths``, ``min_free_disk_mb``,
    ``min_available_memory_mb``, ``require_cuda``) given here (None: not given) or else from its
    ``LIGHTNING_FT_HEALTH_*`` environment variable (in ``env``, default the process's);
    ``accelerator=False`` leaves out the CUDA query.
    """
    config = load(HealthSettings, {k: v for k, v in settings.items() if v is not None}, env=env)
    probes: list[Probe] = [ShutdownMarkerProbe(config.host_root)]
    if accelerator:
        probes.append(AcceleratorProbe(require_cuda=config.require_cuda))
    if config.min_available_memory_mb > 0:
        probes.append(MemoryProbe(int(config.min_available_memory_mb * _MIB)))
    if config.min_free_disk_mb > 0:
        paths = list(config.disk_paths) or [_tempdir()]
        probes.extend(DiskSpaceProbe(path, int(config.min_free_disk_mb * _MIB)) for path in paths)
    probes.extend(MarkerFileProbe(path) for path in config.markers)
    if config.command:
        probes.append(CommandProbe(config.command))
    return probes


def _tempdir() -> str:
    return tempfile.gettempdir()


__all__ = [
    "AcceleratorProbe", "CommandProbe", "DiskSpaceProbe", "MarkerFileProbe", "MemoryProbe", "Probe",
    "ProbeResult", "ShutdownMarkerProbe", "available_memory_bytes", "default_probes",
]
