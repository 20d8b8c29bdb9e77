"""The rendezvous at scale: 256 torch rendezvous handlers (``--rdzv-backend=lightning_ft``) in 8
real processes, one real TCPStore server, store fail-over on (the default). Round 0: every
participant gets a distinct rank of 256. Then a hot spare arrives (standby), one active is lost
(it stops beating and never calls again) and the other 255 ask for the next round, as torch's
agents do after a failure: round 1 forms with the spare in the lost one's place, ranks 0..255.

How long a round takes is measured by ``benchmarks/bench_rendezvous_scale.py``, not here.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_messages

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

PROCESSES = 8
PER_PROCESS = 32
N = PROCESSES * PER_PROCESS
#: how long the test waits for a round's returns (a loaded CI machine: generous; no timing is asserted)
ROUND_LIMIT = 120.0


def _participants(conn: Connection, endpoint: str, run_id: str, first: int) -> None:
    """Runs ``PER_PROCESS`` handlers as threads (the last process one more: the spare, index ``N``);
    reports ``(index, round, rank, world_size)`` per return. Messages: ``("go",)`` -- all but
    the spare call ``next_rendezvous``; ``("spare",)`` -- the spare calls it; ``("lose", index)``
    -- that participant stops beating for good; ``("again",)`` -- the others of round 0 call it
    once more."""
    try:
        os.environ["LIGHTNING_FT_LOG_LEVEL"] = "ERROR"
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        import lightning_ft.launch.torchrun  # noqa: F401 - registers the backend

        handlers = {}
        last = first + PER_PROCESS + (1 if first + PER_PROCESS == N else 0)
        for index in range(first, last):
            params = RendezvousParameters(backend="lightning_ft", endpoint=endpoint, run_id=run_id, min_nodes=N,
                                          max_nodes=N + 1, local_id=str(index), is_host="false", join_timeout="120")
            handlers[index] = get_rendezvous_handler(params)
        lock = threading.Lock()
        lost: set[int] = set()

        def join(index: int) -> None:
            handler = handlers[index]
            try:
                info = handler.next_rendezvous()
                message = ("ret", index, handler.rendezvous.last_result.round, info.rank, info.world_size)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                message = ("error", index, f"{type(exc).__name__}: {exc}")
            with lock:
                conn.send(message)

        conn.send(("ready",))
        while True:
            command = conn.recv()
            if command[0] == "lose":
                lost.add(command[1])
                handlers[command[1]].rendezvous.stop_heartbeat()
            elif command[0] in ("go", "again"):
                for index in handlers:
                    if index not in lost and index != N:
                        threading.Thread(target=join, args=(index,), daemon=True).start()
            elif command[0] == "spare" and N in handlers:
                threading.Thread(target=join, args=(N,), daemon=True).start()
            else:
                break
    except Exception as exc:  # noqa: BLE001 - reported to the test
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        os._exit(0)  # handler threads and connections go with the process


def _collect(conns: list[Connection], expected: int) -> dict[int, tuple[int, int, int]]:
    returns: dict[int, tuple[int, int, int]] = {}
    deadline = time.monotonic() + ROUND_LIMIT
    while len(returns) < expected:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {len(returns)} of {expected} participants returned within {ROUND_LIMIT:g}s"
        for conn in wait_for_messages(conns, timeout=min(remaining, 1.0)):
            message = conn.recv()
            assert message[0] == "ret", f"a participant failed: {message}"
            returns[message[1]] = message[2:]
    return returns


def test_256_participants_in_8_processes_form_a_round_and_a_failure_round(tcp_store):
    endpoint = f"127.0.0.1:{tcp_store.port}"
    context = multiprocessing.get_context("fork")
    procs, conns = [], []
    try:
        for p in range(PROCESSES):
            parent, child = context.Pipe()
            proc = context.Process(target=_participants, args=(child, endpoint, "scale256", p * PER_PROCESS))
            proc.start()
            procs.append(proc)
            conns.append(parent)
        for conn in conns:
            assert conn.poll(ROUND_LIMIT), "a process did not create its handlers"
            assert conn.recv() == ("ready",)

        for conn in conns:
            conn.send(("go",))
        first = _collect(conns, N)
        assert {r[0] for r in first.values()} == {0}
        assert sorted(r[1] for r in first.values()) == list(range(N))
        assert {r[2] for r in first.values()} == {N}

        conns[-1].send(("spare",))  # round 0 is complete: the spare waits as standby
        lost = next(index for index, r in first.items() if r[1] == 17)
        conns[lost // PER_PROCESS].send(("lose", lost))
        for conn in conns:
            conn.send(("again",))
        second = _collect(conns, N)
        assert lost not in second and N in second
        assert {r[0] for r in second.values()} == {1}
        assert sorted(r[1] for r in second.values()) == list(range(N))
        assert {r[2] for r in second.values()} == {N}
    finally:
        for conn in conns:
            try:
                conn.send(("end",))
            except OSError:
                pass
        for proc in procs:
            proc.join(5)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
