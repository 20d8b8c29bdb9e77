"""pytest plugin: run Lightning's own tests with every single-process CPU Trainer forced onto a strategy.

Loaded by ``run.py`` with ``-p force_strategy --force-strategy ddp|ddp_ft``. It wraps
``lightning.pytorch.Trainer.__init__``: a Trainer whose ``strategy`` was left at its default
(``"auto"``), whose accelerator resolves to the CPU (``"cpu"``, or ``"auto"`` while no CUDA, MPS or
XLA device is available, mocked ones included), with ``devices`` ``"auto"``/``1``/``"1"`` and
``num_nodes=1`` gets

- ``strategy="ddp"`` (Lightning's ``DDPStrategy``, world size 1), or
- ``FaultTolerantDDPStrategy(endpoint="127.0.0.1:<free port>", run_id=<unique per Trainer>,
  min_nodes=1, max_nodes=1, snapshot_root=<a private directory of this pytest run>)``: a 1:1 job,
  each Trainer its own run id and its own store endpoint. The settings go in as keyword arguments,
  not ``LIGHTNING_FT_*`` variables, so Lightning's ``restore_env_variables`` fixture (which fails
  a test that leaves a new environment variable behind) sees nothing of ours, and nothing of ours
  is left in the environment between Trainers.

Every other Trainer is left as the test built it. Lightning's conftest (its autouse fixtures:
``thread_police_duuu_daaa_duuu_daaa``, ``restore_env_variables``, ``leave_no_artifacts_behind``,
...) runs unchanged, so its after-test checks are part of the measurement.

Per test it records the outcome of setup, call and teardown, the first line of each error and how
many Trainers were forced / left alone, in ``--force-results`` (JSON lines), which ``run.py``
reads.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import os
import socket
import tempfile
import time
from typing import Any

import pytest

_state: dict[str, Any] = {
    "strategy": None,
    "current": None,  # nodeid of the running test
    "forced": {},  # nodeid -> Trainers forced onto the strategy
    "kept": {},  # nodeid -> Trainers left alone
    "counter": itertools.count(),
    "snapshot_root": None,
    "results": None,
    "records": {},
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("force-strategy")
    group.addoption("--force-strategy", choices=("ddp", "ddp_ft", "none"), default="none",
                    help="strategy forced on Trainers left at strategy='auto' that run one CPU process")
    group.addoption("--force-results", default=None, help="write one JSON line per test here")
    group.addoption("--observer-period", type=float, default=0.05,
                    help="sleep period of Lightning's child-process observer thread (its default: 5 s); <= 0: "
                         "leave it at Lightning's default")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_only_accelerator(accelerator: Any) -> bool:
    if isinstance(accelerator, str):
        name = accelerator.lower()
        if name == "cpu":
            return True
        if name != "auto":
            return False
    else:
        from lightning.pytorch.accelerators import CPUAccelerator

        return isinstance(accelerator, CPUAccelerator)
    # "auto": the CPU only when no other accelerator is available (tests mock CUDA/MPS/XLA)
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator, XLAAccelerator

    return not (CUDAAccelerator.is_available() or MPSAccelerator.is_available() or XLAAccelerator.is_available())


def _one_process(devices: Any, num_nodes: Any) -> bool:
    if num_nodes not in (1, "1"):
        return False
    return devices in ("auto", 1, "1") or (isinstance(devices, list | tuple) and len(devices) == 1)


def _make_strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    from lightning_ft import FaultTolerantDDPStrategy

    test = (_state["current"] or "outside-a-test").rsplit("/", 1)[-1]
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in test)[:80]
    run_id = f"compat-{os.getpid()}-{next(_state['counter'])}-{safe}"
    return FaultTolerantDDPStrategy(endpoint=f"127.0.0.1:{_free_port()}", run_id=run_id, min_nodes=1, max_nodes=1,
                                    snapshot_root=_state["snapshot_root"])


def _patch_trainer(name: str) -> None:
    from lightning.pytorch import Trainer

    original = Trainer.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # let Lightning raise its own error
        given = bound.arguments
        strategy = given.get("strategy", "auto")
        node = _state["current"]
        if (isinstance(strategy, str) and strategy == "auto"
                and _cpu_only_accelerator(given.get("accelerator", "auto"))
                and _one_process(given.get("devices", "auto"), given.get("num_nodes", 1))):
            kwargs = dict(kwargs)
            # strategy is keyword-only in Trainer.__init__
            kwargs["strategy"] = _make_strategy(name)
            _state["forced"][node] = _state["forced"].get(node, 0) + 1
        else:
            _state["kept"][node] = _state["kept"].get(node, 0) + 1
        return original(self, *args, **kwargs)

    Trainer.__init__ = __init__  # type: ignore[method-assign]


def _shorten_observer_period(period: float) -> None:
    """``strategy="ddp"`` with one device goes through Lightning's subprocess-script launcher, which
    starts a ``_ChildProcessObserver`` thread even with no child process; that thread sleeps 5 s
    before it notices there is nothing to observe, and Lightning's ``thread_police`` fixture joins
    it (timeout 10 s) after every test: 5 s per test, for a thread that watches nothing. Only its
    sleep period changes (it then ends within ``period`` of its start, exactly as it would after 5 s)."""
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    original = _ChildProcessObserver.__init__

    @functools.wraps(original)
    def __init__(self: Any, main_pid: int, child_processes: list, sleep_period: float = 5) -> None:
        original(self, main_pid, child_processes, sleep_period=min(sleep_period, period))  # type: ignore[arg-type]

    _ChildProcessObserver.__init__ = __init__  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--force-strategy")
    _state["strategy"] = name
    _state["results"] = config.getoption("--force-results")
    if _state["results"]:
        open(_state["results"], "w").close()
    period = config.getoption("--observer-period")
    if period > 0:
        _shorten_observer_period(period)
    if name == "none":
        return
    if name == "ddp_ft":
        import lightning_ft  # noqa: F401  (registers "ddp_ft")

        _state["snapshot_root"] = tempfile.mkdtemp(prefix="lft-compat-snapshots-")  # 0700
    _patch_trainer(name)


def pytest_report_header(config: pytest.Config) -> str:
    extra = f", snapshot_root={_state['snapshot_root']}" if _state["snapshot_root"] else ""
    return f"force-strategy: {_state['strategy']}{extra}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _state["current"] = item.nodeid
    _state["records"][item.nodeid] = {"nodeid": item.nodeid, "start": time.time()}
    try:
        return (yield)
    finally:
        _finish(item.nodeid)
        _state["current"] = None


def _first_line(report: pytest.TestReport) -> tuple[str, str]:
    """(first line of the error, 'path:line: message' where it was raised) of a failed phase."""
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        message = str(crash.message).strip().splitlines()
        where = f"{crash.path}:{crash.lineno}"
        return (message[0] if message else ""), where
    if isinstance(longrepr, tuple):  # (path, line, message) of a skip
        return str(longrepr[2]).splitlines()[0], f"{longrepr[0]}:{longrepr[1]}"
    text = str(longrepr).strip().splitlines()
    lines = [line for line in text if line.startswith("E ")]
    return ((lines[0][1:].strip() if lines else (text[-1] if text else "")), "")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _state["records"].setdefault(report.nodeid, {"nodeid": report.nodeid})
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    record[report.when] = outcome
    record[f"{report.when}_duration"] = round(report.duration, 3)
    if report.failed or (report.skipped and report.when != "teardown"):
        line, where = _first_line(report)
        record[f"{report.when}_error"] = line
        record[f"{report.when}_where"] = where
        if report.failed:
            text = str(report.longrepr)
            record[f"{report.when}_longrepr"] = text[-4000:]


def _finish(nodeid: str) -> None:
    record = _state["records"].pop(nodeid, {"nodeid": nodeid})
    record["forced"] = _state["forced"].get(nodeid, 0)
    record["kept"] = _state["kept"].get(nodeid, 0)
    record["strategy"] = _state["strategy"]
    if _state["results"]:
        with open(_state["results"], "a") as fh:
            fh.write(json.dumps(record) + "\n")
