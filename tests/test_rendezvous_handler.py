"""The torch-facing handler: registry lookup, configuration errors, standalone store server."""

from __future__ import annotations

import signal
import threading
import time
from importlib.metadata import entry_points

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousGracefulExitError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from lightning_ft.launch.torchrun import LightningFTRendezvousHandler
from lightning_ft.rendezvous import RendezvousConfigError
from lightning_ft.store.tcp import parse_endpoint

from proc_utils import free_port, wait_for

pytestmark = pytest.mark.timeout(150)


def params(port, run_id="h", min_nodes=1, max_nodes=2, **conf):
    conf.setdefault("heartbeat_interval", "0.05")
    conf.setdefault("last_call_timeout", "0.1")
    return RendezvousParameters(backend="lightning_ft", endpoint=f"127.0.0.1:{port}", run_id=run_id,
                                min_nodes=min_nodes, max_nodes=max_nodes, **conf)


def test_entry_point_is_registered_for_torchrun():
    names = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert names.get("lightning_ft") == "lightning_ft.launch.torchrun:torchrun_handler_creator"


#: run by the test below: imports torch alone (no module of ours, nothing of torch.distributed.elastic),
#: then forks one child per module named in its arguments; each child imports that module first and
#: says whether torch's registry has our backend (exit 0, else 3; 4: the import raised); its stderr
#: goes to the file named after the module. Prints {module: exit code} as JSON.
IMPORT_FIRST = r"""
import json, os, sys
import torch
early = [m for m in sys.modules if m.startswith(("lightning_ft", "torch.distributed.elastic"))]
assert not early, early
codes = {}
for module, log in zip(sys.argv[1::2], sys.argv[2::2]):
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        code = 4
        try:
            __import__(module)
            from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r
            code = 0 if r._registry.get("lightning_ft") is not None else 3
        except BaseException:
            import traceback
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(code)
    codes[module] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(codes))
"""


@pytest.mark.multiprocess
def test_our_backend_registers_whichever_of_our_modules_is_imported_first(tmp_path):
    """torch's rendezvous package imports our torchrun handler while it initializes; a module of
    ours imported first that triggers that load must not leave the handler's imports half done
    (torch then logs an ImportError and drops the backend). Each in a process of its own that had
    imported only torch before (forked from one interpreter that imported torch once: torch's import
    involves neither our modules nor its rendezvous package, so it cannot change their order)."""
    import json
    import os
    import subprocess
    import sys

    modules = ("lightning_ft.store.tcp", "lightning_ft.failover.switchboard", "lightning_ft.rendezvous.barrier",
               "lightning_ft.runtime.fit_loop", "lightning_ft.launch.factory")
    logs = {module: tmp_path / f"{module}.err" for module in modules}
    proc = subprocess.Popen([sys.executable, "-c", IMPORT_FIRST, *(str(a) for m in modules for a in (m, logs[m]))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)  # it waits for each child before it forks the next
    except BaseException:  # its forked children too (its process group: it is not reaped yet)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert proc.returncode == 0, stdout + stderr[-2000:]
    codes = json.loads(stdout.strip().splitlines()[-1])
    for module in modules:
        stderr = logs[module].read_text()
        assert codes[module] == 0 and "ImportError" not in stderr, (module, codes[module], stderr[-2000:])


def test_registry_builds_our_handler_and_a_round_completes(port):
    handler = get_rendezvous_handler(params(port, store_grace_timeout="0.5"))
    try:
        assert isinstance(handler, LightningFTRendezvousHandler)
        assert handler.get_backend() == "lightning_ft"
        assert handler.get_run_id() == "h"
        assert handler.rendezvous.is_store_host
        assert handler.rendezvous.settings.timeouts.store_grace_timeout == 0.5
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_port > 0
        assert handler.num_nodes_waiting() == 0
    finally:
        handler.rendezvous.stop_heartbeat()
        handler.shutdown()


def test_torchrun_timeout_becomes_join_timeout(port):
    handler = get_rendezvous_handler(params(port, timeout=42))
    try:
        assert handler.rendezvous.settings.timeouts.join_timeout == 42
    finally:
        handler.rendezvous.stop_heartbeat()


@pytest.mark.parametrize("conf, needle", [
    (dict(last_cal_timeout="1"), "unknown setting(s) 'last_cal_timeout' (did you mean 'last_call_timeout'?)"),
    (dict(join_timeout="0"), "join_timeout must be a positive number"),
    (dict(is_host="maybe"), "is_host must be true or false"),
    (dict(segment="3"), "multiple of segment"),
])
def test_bad_configuration_fails_at_once_naming_the_setting(port, conf, needle):
    with pytest.raises(RendezvousConfigError) as err:
        get_rendezvous_handler(params(port, min_nodes=2, max_nodes=3, **conf))
    assert needle in str(err.value)


def test_min_greater_than_max_is_rejected(port):
    with pytest.raises(ValueError, match="must be greater than or equal to the minimum"):
        get_rendezvous_handler(params(port, min_nodes=3, max_nodes=2))


@pytest.mark.parametrize("endpoint, needle", [("", "endpoint is empty"), ("host:abc", "not a number"),
                                              ("host:70000", "1..65535")])
def test_bad_endpoint(endpoint, needle):
    with pytest.raises(RendezvousConfigError, match=needle):
        parse_endpoint(endpoint)


def test_unreachable_endpoint_fails_quickly_with_a_clear_message():
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="cannot reach the rendezvous store"):
        get_rendezvous_handler(params(port, is_host="false", connect_timeout="1"))
    assert time.monotonic() - start < 30


@pytest.mark.multiprocess
def test_standalone_store_server_outlives_nodes_and_exits_after_the_run(processes, port):
    server = processes.python("store", ["-m", "lightning_ft.cli", "store", "--host", "127.0.0.1",
                                        "--port", str(port), "--run-id", "srv", "--grace-timeout", "60",
                                        "--linger", "0"])
    assert wait_for(lambda: "listening" in server.log(), 30), server.log()
    handlers = [get_rendezvous_handler(params(port, run_id="srv", min_nodes=1, max_nodes=2, is_host="false",
                                              local_id=str(i)))  # two participants of one process
                for i in range(2)]
    try:
        assert not any(h.rendezvous.is_store_host for h in handlers)
        results = {}

        def join(i):
            try:
                results[i] = handlers[i].next_rendezvous()
            except RendezvousGracefulExitError as exc:
                results[i] = exc
                # what torch's launch_agent does in its ``finally`` for a spare that was not
                # needed: the spare may have seen the exit barrier before the closing, and then
                # acknowledges only here
                handlers[i].shutdown()

        threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        # one is active (min_nodes=1), the other waits as a spare
        assert wait_for(lambda: len(results) == 1, 20)
        active = handlers[next(iter(results))]
        active.rendezvous.store.set(active.rendezvous.keys.exit_barrier(0), "x")  # "workers done"
        active.shutdown()
        for t in threads:
            t.join(timeout=20)
        assert any(isinstance(r, RendezvousGracefulExitError) for r in results.values())
        # exits by itself once both acknowledged -- not at the end of its grace
        assert server.popen.wait(timeout=90) == 0
        assert "acknowledged shutdown" in server.log()
    finally:
        for h in handlers:
            h.rendezvous.stop_heartbeat()


@pytest.mark.multiprocess
def test_store_server_stops_on_sigterm(processes, port):
    server = processes.python("store", ["-m", "lightning_ft.cli", "store", "--host", "127.0.0.1",
                                        "--port", str(port)])
    assert wait_for(lambda: "listening" in server.log(), 30), server.log()
    server.signal(signal.SIGTERM)
    assert server.popen.wait(timeout=10) == 0


def test_store_server_rejects_bad_arguments():
    from lightning_ft.launch.store_server import main

    assert main(["--host", "127.0.0.1", "--port", "70000"]) == 2
    assert main(["--host", "127.0.0.1", "--grace-timeout", "0"]) == 2
    assert main(["--host", "127.0.0.1", "--linger", "-1"]) == 2
    with pytest.raises(SystemExit) as missing_host:  # it listens only where it is told to
        main(["--port", "29400"])
    assert missing_host.value.code == 2


def test_unhealthy_node_is_counted_and_excluded(port, tmp_path, monkeypatch):
    from lightning_ft.rendezvous import UnhealthyNodeError

    marker = tmp_path / "node-problem"
    marker.write_text("ECC errors on gpu 3")
    monkeypatch.setenv("LIGHTNING_FT_HEALTH_MARKERS", str(marker))
    handler = get_rendezvous_handler(params(port, run_id="sick", health_check="true"))
    try:
        with pytest.raises(UnhealthyNodeError, match="failed its health check"):
            handler.next_rendezvous()
        lost = handler.rendezvous.records.lost()
        assert len(lost) == 1 and "ECC errors on gpu 3" in next(iter(lost.values()))
        handler.shutdown()
        assert not handler.is_closed()  # an excluded node does not end the job
    finally:
        handler.rendezvous.stop_heartbeat()


@pytest.mark.multiprocess
def test_a_frozen_store_fails_the_agents_rendezvous_call_within_store_timeout(processes):
    """Intended change of issue 22: the torchrun handler's store connection is bounded like every
    other (it was a plain TCPStore client, which waits for a frozen server for good)."""
    import os
    import sys

    port = free_port()
    store = processes.start("store", [sys.executable, "-m", "lightning_ft.cli", "store", "--host", "127.0.0.1",
                                      "--port", str(port)])
    assert wait_for(lambda: "listening" in store.log(), 60), store.log()
    handler = get_rendezvous_handler(params(port, is_host="false", store_timeout="2", min_nodes=2, max_nodes=2))
    os.kill(store.pid, signal.SIGSTOP)
    outcome: list[BaseException | str] = []

    def join() -> None:
        try:
            handler.next_rendezvous()
            outcome.append("returned")
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            outcome.append(exc)

    try:
        start = time.monotonic()
        worker = threading.Thread(target=join, daemon=True)
        worker.start()
        worker.join(60)  # the old, unbounded client would still be waiting here
        elapsed = time.monotonic() - start
    finally:
        os.kill(store.pid, signal.SIGCONT)
        handler.rendezvous.stop_heartbeat()
    assert outcome and isinstance(outcome[0], RuntimeError), outcome
    # the store did not answer within its bound; with the store fail-over (issue 25) the message
    # then says that no participant could take it over (none is known before round 0)
    assert "not answer" in str(outcome[0]), outcome
    assert elapsed < 30, elapsed
