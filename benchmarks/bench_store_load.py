"""Store load before and after a fail-over, at N participants of the barrier rendezvous.

N participants (threads spread over ``--processes`` worker processes, each with its own
``StoreSwitchboard`` and connections, exactly as a ``ddp_ft`` process or torchrun agent has)
join one round of a run on a standalone ``lightning-ft store``: N/2 are active (they keep
their heartbeat and the fail-over's candidate refresher running), N/2 wait as hot spares
(polling for a newer round). The store requests every participant makes are counted for
``--window`` seconds; then the store is SIGKILLed, the participants fail over to the first of
them, and the requests are counted again for the same window. Reported: requests/s and per
participant, before and after (the ratio is the result), and the fail-over's own duration.

    python benchmarks/bench_store_load.py [--participants 64] [--processes 4] [--window 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def worker(args) -> int:
    """One worker process: ``args.count`` participants as threads; prints a JSON line per second."""
    from lightning_ft.failover import candidates, connection, switchboard
    from lightning_ft.rendezvous.barrier import BarrierRendezvous
    from lightning_ft.rendezvous.participant import local_participant
    from lightning_ft.rendezvous.settings import RendezvousSettings
    from lightning_ft.schema.signing import job_signer
    from lightning_ft.store.tcp import connect_store, parse_endpoint

    calls = [0]
    original = connection.FailoverStore._call

    def counted(self, name, *call_args):
        result = original(self, name, *call_args)
        calls[0] += 1  # the GIL makes a lost update rare; the count is a rate, not an audit
        return result

    connection.FailoverStore._call = counted
    settings = RendezvousSettings.of("load", args.participants // 2, args.participants, join_timeout=120,
                                     last_call_timeout=1.0)
    endpoint = parse_endpoint(args.endpoint)
    boards: list[switchboard.StoreSwitchboard] = []

    def participant(local_id: int) -> None:
        first, _ = connect_store(endpoint, False, settings.timeouts)
        info = local_participant(local_id=local_id, domain_id=f"d{local_id}")
        board = switchboard.StoreSwitchboard(endpoint, first, False, info.participant_id, settings.timeouts,
                                          job_signer())
        boards.append(board)
        store = connection.FailoverStore(board, settings.timeouts.store_timeout, first)
        rendezvous = BarrierRendezvous(store, settings, info, heartbeat_store_factory=store.clone)
        candidates.FailoverParticipant(board, rendezvous)
        result = rendezvous.join_round()
        if not result.is_active:
            try:
                rendezvous.wait_while_standby(result.round)
            except Exception as exc:  # noqa: BLE001 - reported; the benchmark goes on
                print(json.dumps({"error": str(exc)[:200]}), flush=True)

    for i in range(args.count):
        threading.Thread(target=participant, args=(args.first + i,), daemon=True).start()
    while True:
        time.sleep(1.0)
        epochs = [b.epoch for b in boards]
        seconds = [b.failovers[-1][1] for b in boards if b.failovers]
        print(json.dumps({"t": time.time(), "calls": calls[0], "joined": len(boards), "epochs": epochs,
                          "failover_seconds": max(seconds) if seconds else None}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--participants", type=int, default=64)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    env = {**os.environ, "PYTHONPATH": str(REPO), "LIGHTNING_FT_LOG_LEVEL": "ERROR"}
    store = subprocess.Popen([sys.executable, "-m", "lightning_ft.cli", "store", "--host", "127.0.0.1", "--port", "0"],
                             stdout=subprocess.PIPE, text=True, env=env)
    line = store.stdout.readline() if store.stdout else ""
    endpoint = line.strip().rsplit(" ", 1)[-1]
    per = args.participants // args.processes
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", "--endpoint", endpoint, "--participants",
                                 str(args.participants), "--first", str(i * per), "--count", str(per)],
                                stdout=subprocess.PIPE, text=True, env=env) for i in range(args.processes)]
    latest: dict[int, dict] = {}

    def read(index: int, proc: subprocess.Popen) -> None:
        for text in proc.stdout or ():
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                continue  # not one of ours (a library printing on stdout)
            if "error" in record:
                print(f"worker {index}: {record['error']}", flush=True)
            else:
                latest[index] = record

    for index, proc in enumerate(workers):
        threading.Thread(target=read, args=(index, proc), daemon=True).start()

    def total() -> int:
        return sum(r["calls"] for r in latest.values())

    def epochs() -> list[int]:
        return [e for r in latest.values() for e in r["epochs"]]

    def window(settle: float) -> float:
        time.sleep(settle)  # reconnections after a fail-over are not steady state
        begin, t0 = total(), time.monotonic()
        time.sleep(args.window)
        return (total() - begin) / (time.monotonic() - t0)

    try:
        deadline = time.monotonic() + 300
        while len(epochs()) < args.participants and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5.0)  # every round complete, spares waiting
        before = window(1.0)
        killed = time.monotonic()
        store.send_signal(signal.SIGKILL)
        while not (epochs() and all(e >= 1 for e in epochs())) and time.monotonic() < killed + 60:
            time.sleep(0.2)
        moved = time.monotonic() - killed
        after = window(5.0)
        failover = max((r["failover_seconds"] or 0.0) for r in latest.values())
        n = args.participants
        print(f"N={n} ({args.processes} processes): before {before:.0f} requests/s ({before / n:.1f} per "
              f"participant); after the fail-over {after:.0f} requests/s ({after / n:.1f} per participant); "
              f"ratio after/before {after / before:.2f}; every participant on the new store {moved:.1f} s after "
              f"the kill (longest fail-over {failover:.2f} s)")
        print(json.dumps({"participants": n, "before_rps": before, "after_rps": after, "ratio": after / before,
                          "all_moved_s": moved, "longest_failover_s": failover}))
    finally:
        for proc in [*workers, store]:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
