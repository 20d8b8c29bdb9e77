"""Rendezvous benchmark: time to complete one round, lightning_ft vs torch's c10d backend.

Both run N participants as threads in this process, each with its own TCPStore client of
one real TCPStore server (client creation is not timed). Also times the coordinator's full
re-read of a round's arrivals log of 10,000 records against a raw ``get`` of it. Prints ratios measured
in the same run; absolute times on a shared 2-core machine mean little.

    python benchmarks/bench_rendezvous.py [--sizes 16 64 256] [--c10d-timeout 240]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from lightning_ft.rendezvous import BarrierRendezvous, ParticipantInfo, RendezvousSettings
from lightning_ft.rendezvous.records import RunRecords

logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)


def new_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=600))


def clients(server, n: int) -> list[dist.TCPStore]:
    # torch's TCPStore server stalls ~5 s on every ~25th new connection: connect in parallel
    with ThreadPoolExecutor(max_workers=min(n, 64)) as pool:
        return list(pool.map(lambda _: dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                     timeout=datetime.timedelta(seconds=600)), range(n)))


def run_together(calls, timeout: float) -> float | None:
    """Start all calls at once; seconds until the last returned (None: timed out)."""
    start_gate = threading.Barrier(len(calls) + 1)
    errors: list[BaseException] = []

    def run(call):
        start_gate.wait()
        try:
            call()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    start_gate.wait()
    start = time.perf_counter()
    deadline = start + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.perf_counter()))
    if any(t.is_alive() for t in threads):
        return None
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def ours(n: int, run: int) -> float | None:
    server = new_server()
    stores = clients(server, n)
    settings = RendezvousSettings(run_id=f"bench{run}", min_nodes=n, max_nodes=n)
    rdzvs = [BarrierRendezvous(stores[i], settings, ParticipantInfo(f"node{i}", 1000 + i)) for i in range(n)]
    try:
        return run_together([r.join_round for r in rdzvs], timeout=120)
    finally:
        for r in rdzvs:
            r.stop_heartbeat()


def c10d(n: int, run: int, timeout: float) -> float | None:
    server = new_server()
    stores = clients(server, n)
    handlers = []
    for store in stores:
        params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{server.port}",
                                      run_id=f"c10d{run}", min_nodes=n, max_nodes=n, join_timeout=str(int(timeout)))
        handlers.append(create_handler(store, C10dRendezvousBackend(store, f"c10d{run}"), params))
    try:
        return run_together([h.next_rendezvous for h in handlers], timeout=timeout)
    finally:
        for h in handlers:
            try:
                h._stop_heartbeats()
            except Exception:  # noqa: BLE001
                pass


def reread(slots: int, repeats: int) -> dict[str, float]:
    server = new_server()
    store = clients(server, 1)[0]
    settings = RendezvousSettings(run_id="reread", min_nodes=slots, max_nodes=slots)
    rdzv = BarrierRendezvous(store, settings, ParticipantInfo("reader", 1))
    keys = rdzv.keys
    # arrivals as participants append them: sealed records (unsealed without a job secret)
    for i in range(slots):
        rdzv.records.append_arrival(0, 1, ParticipantInfo(f"node{i}", 1000 + i, infra_rank=i))
    timings: dict[str, list[float]] = {"raw get": [], "re-read (cold decode)": [], "re-read (warm)": []}
    for _ in range(repeats):
        t = time.perf_counter()
        store.get(keys.arrivals(0))
        timings["raw get"].append(time.perf_counter() - t)
        cold = RunRecords(store, rdzv.signer, keys)
        t = time.perf_counter()
        arrivals = cold.arrivals(0)
        timings["re-read (cold decode)"].append(time.perf_counter() - t)
        assert len(arrivals) == slots
        t = time.perf_counter()
        cold.arrivals(0)
        timings["re-read (warm)"].append(time.perf_counter() - t)
    return {name: statistics.median(values) for name, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--c10d-timeout", type=float, default=240.0)
    parser.add_argument("--slots", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    print(f"{'N':>5} {'lightning_ft (s)':>17} {'c10d (s)':>12} {'c10d / ours':>12}")
    for run, n in enumerate(args.sizes):
        mine = ours(n, run)
        theirs = c10d(n, run, args.c10d_timeout)
        theirs_text = f"{theirs:.3f}" if theirs is not None else f">{args.c10d_timeout:.0f}"
        ratio = (theirs if theirs is not None else args.c10d_timeout) / mine
        print(f"{n:>5} {mine:>17.3f} {theirs_text:>12} {('≥' if theirs is None else '') + f'{ratio:.1f}x':>12}",
              flush=True)

    medians = reread(args.slots, args.repeats)
    base = medians["raw get"]
    print(f"\nfull re-read of an arrivals log of {args.slots} records (median of {args.repeats}):")
    for name, value in medians.items():
        print(f"  {name:<24} {value * 1000:8.2f} ms  {value / base:5.2f}x raw get")


if __name__ == "__main__":
    main()
