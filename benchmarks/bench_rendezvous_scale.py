"""Rendezvous at scale: one round of N participants spread over many processes, as users see it.

Each participant is a torchrun rendezvous handler made through torch's public registry
(``--rdzv-backend=lightning_ft``, ``is_host=false``, its own ``local_id``), with its own store
connections. ``--per-process`` of them run as threads of one process (forked from this one
after the imports: pages are shared, no process imports torch twice); all call
``next_rendezvous()`` at one wall-clock instant. The store is a plain TCPStore server in a
process of its own, so its CPU time is measured apart (``/proc/<pid>/stat``).

Reported per N: time until the last participant returned (and the first), store requests per
participant in the round by kind (counted in each client: every call through lightning_ft's
bounded store), the store process's CPU seconds, and -- with ``--c10d`` -- torch's c10d backend
in the same run (same processes, same store server kind). ``--fail``: after the first round,
one active handler of the last process is stopped for good (its heartbeat ends, it never comes
back) and a round with a spare (``max_nodes = N + 1``) is timed from the moment the others ask
for the next round.

    python benchmarks/bench_rendezvous_scale.py [--sizes 256 1024 4096] [--per-process 128] [--c10d]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import logging
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# the handler sets lightning_ft's level from this variable when it attaches its log output
os.environ["LIGHTNING_FT_LOG_LEVEL"] = os.environ.get("BENCH_LOG_LEVEL", "ERROR")

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import lightning_ft.launch.torchrun  # noqa: F401 - registers the backend
from lightning_ft.deadlines import BoundedStore

logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
logging.getLogger("lightning_ft").setLevel(os.environ.get("BENCH_LOG_LEVEL", "ERROR"))

STORE_SERVER = """
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=900))
print(store.port, flush=True)
sys.stdin.read()
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ counting store requests

_COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()
_COUNT_LOCK = threading.Lock()


def key_family(args: tuple) -> str:
    """What a request touched, without the run, round, participant or decision in it."""
    key = args[0] if args else ""
    if isinstance(key, list):
        key = key[0] if key else ""
    if not isinstance(key, str):
        return "?"
    return _family_of(key)


@functools.lru_cache(maxsize=65536)  # counting must not cost the clients' CPU it reports
def _family_of(key: str) -> str:
    parts = []
    for part in key.split("/"):
        if re.fullmatch(r"r\d+", part):
            parts.append("r#")
        elif re.fullmatch(r"[A-Za-z_]+", part):
            parts.append(part)
        else:
            parts.append("*")
    return "/".join(parts[2:]) if parts[:1] == ["lightning_ft"] else "/".join(parts)


_MARKS: dict[str, list[float]] = collections.defaultdict(list)


def mark_phases() -> None:
    """Wall-clock marks of each arrival and of the round's completion (the coordinator's)."""
    from lightning_ft.rendezvous.coordinator import Coordinator
    from lightning_ft.rendezvous.records import RunRecords

    append, complete = RunRecords.append_arrival, Coordinator._complete

    def appended(self, *args, **kwargs):
        append(self, *args, **kwargs)
        _MARKS["arrived"].append(time.time())

    def completed(self, *args, **kwargs):
        complete(self, *args, **kwargs)
        _MARKS["completed"].append(time.time())

    RunRecords.append_arrival = appended  # type: ignore[method-assign]
    Coordinator._complete = completed  # type: ignore[method-assign]
    if os.environ.get("BENCH_PHASES"):  # when each step of a join ends, for finding where time goes
        from lightning_ft.failover import candidates
        from lightning_ft.rendezvous import barrier, beats

        def timed(owner, name):
            original = getattr(owner, name)

            def wrapper(*args, **kwargs):
                try:
                    return original(*args, **kwargs)
                finally:
                    _MARKS[name].append(time.time())

            setattr(owner, name, wrapper)

        for owner, name in ((barrier.BarrierRendezvous, "_start_heartbeat"),
                            (barrier.BarrierRendezvous, "_read_result"),
                            (barrier.BarrierRendezvous, "_tick_connection"),
                            (RunRecords, "claim_coordinator"), (RunRecords, "current_round"),
                            (candidates.FailoverParticipant, "track_round"), (beats.TickWaiter, "wait"),
                            (barrier.BarrierRendezvous, "_is_ready")):
            timed(owner, name)


def count_requests() -> None:
    original = BoundedStore._call

    def counted(self, name, *args):
        with _COUNT_LOCK:
            _COUNTS[(name, key_family(args))] += 1
        return original(self, name, *args)

    BoundedStore._call = counted  # type: ignore[method-assign]


# ------------------------------------------------------------------ one worker process


def make_handlers(backend: str, endpoint: str, run_id: str, n: int, max_nodes: int, first: int, count: int,
                  timeout: float) -> list:
    # more --rdzv-conf keys, e.g. BENCH_RDZV_CONF="heartbeat_interval=5" (to see what heartbeats cost)
    extra_conf = dict(kv.split("=", 1) for kv in os.environ.get("BENCH_RDZV_CONF", "").split())

    def make(local_id: int):
        if backend == "lightning_ft":
            params = RendezvousParameters(backend="lightning_ft", endpoint=endpoint, run_id=run_id, min_nodes=n,
                                          max_nodes=max_nodes, local_id=str(local_id), is_host="false",
                                          join_timeout=str(int(timeout)),
                                          store_failover=os.environ.get("BENCH_STORE_FAILOVER", "true"),
                                          **extra_conf)
            return get_rendezvous_handler(params)
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        host, port = endpoint.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
        params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=n,
                                      max_nodes=max_nodes, join_timeout=str(int(timeout)))
        return create_handler(store, C10dRendezvousBackend(store, run_id), params)

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(make, range(first, first + count)))


def threads_by_name() -> dict[str, list[float]]:
    """CPU seconds and context switches of this process's threads, summed by thread name (since start)."""
    names = {t.native_id: t.name.split("-")[0] if t.name.startswith("Thread-") else t.name
             for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, list[float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if "ctxt" in line)
        except OSError:
            continue
        row = out.setdefault(names.get(int(tid), "(not Python)"), [0, 0.0, 0, 0])
        row[0] += 1
        row[1] += (int(fields[11]) + int(fields[12])) / ticks
        row[2] += int(status["voluntary_ctxt_switches"])
        row[3] += int(status["nonvoluntary_ctxt_switches"])
    return out


def worker(conn, backend: str, endpoint: str, run_id: str, n: int, max_nodes: int, first: int, count: int,
           timeout: float, rounds: int) -> None:
    """Runs ``count`` participants; each returns its rounds to the parent as ``("ret", round, time, rank)``.

    Messages from the parent: ``("go", round, start_at)``, ``("kill", index)`` (that participant
    stops beating and never calls again: a lost node), ``("stats",)`` (request counts and CPU
    since the last ``go``), ``("end",)``."""
    try:
        if os.environ.get("BENCH_SWITCH_INTERVAL"):
            sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
        count_requests()
        mark_phases()
        handlers = make_handlers(backend, endpoint, run_id, n, max_nodes, first, count, timeout)
        send_lock = threading.Lock()

        def send(message) -> None:
            with send_lock:
                conn.send(message)

        send(("ready", None))
        go = [threading.Event() for _ in range(rounds)]
        start_at = [0.0] * rounds
        killed: set[int] = set()

        def loop(index: int, handler) -> None:
            next_round = 0
            while next_round < rounds:
                go[next_round].wait()
                if index in killed:
                    return
                time.sleep(max(0.0, start_at[next_round] - time.time()))
                try:
                    info = handler.next_rendezvous()
                except Exception as exc:  # noqa: BLE001 - reported
                    send(("error", next_round, f"{type(exc).__name__}: {str(exc)[:200]}"))
                    return
                done = handler.rendezvous.last_result.round if backend == "lightning_ft" else next_round
                send(("ret", done, time.time(), info.rank, index))
                next_round = done + 1

        for index, handler in enumerate(handlers):
            threading.Thread(target=loop, args=(index, handler), daemon=True).start()
        cpu_start, sys_start = time.process_time(), os.times().system
        while True:
            message = conn.recv()
            if message[0] == "go":
                _, round_no, at = message
                with _COUNT_LOCK:
                    _COUNTS.clear()
                    _MARKS.clear()
                cpu_start, sys_start = time.process_time(), os.times().system
                if os.environ.get("BENCH_PROFILE") and first == 0 and round_no == 0:
                    import yappi  # a local profiling aid, not a dependency

                    yappi.set_clock_type("cpu")
                    yappi.start()
                start_at[round_no] = at
                go[round_no].set()
            elif message[0] == "kill":
                killed.add(message[1])
                handlers[message[1]].rendezvous.stop_heartbeat()  # silent from now on, never back
            elif message[0] == "stats":
                if os.environ.get("BENCH_PROFILE") and first == 0:
                    import yappi

                    yappi.stop()
                    yappi.get_func_stats().save(os.environ["BENCH_PROFILE"], type="pstat")
                if os.environ.get("BENCH_THREADS"):  # CPU and context switches by thread name
                    send(("threads", threads_by_name()))
                with _COUNT_LOCK:
                    counts = {f"{k[0]} {k[1]}": v for k, v in _COUNTS.items()}
                    marks = {k: [min(v), statistics.median(v), max(v)] for k, v in _MARKS.items() if v}
                send(("stats", {"counts": counts, "cpu": time.process_time() - cpu_start,
                                "sys": os.times().system - sys_start, "marks": marks}))
            else:
                break
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        os._exit(0)  # the handlers' threads and connections go with the process


# ------------------------------------------------------------------ one measurement


def measure(backend: str, n: int, per_process: int, timeout: float, fail_one: bool, tag: str) -> list[dict]:
    from multiprocessing.connection import wait as wait_for_messages

    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    port = int(server.stdout.readline())
    endpoint = f"127.0.0.1:{port}"
    max_nodes = n + 1 if fail_one else n
    rounds = 2 if fail_one else 1
    context = multiprocessing.get_context("fork")
    workers = []
    try:
        for first in range(0, max_nodes, per_process):
            parent, child = context.Pipe()
            proc = context.Process(target=worker, args=(child, backend, endpoint, tag, n, max_nodes, first,
                                                        min(per_process, max_nodes - first), timeout, rounds))
            proc.start()
            workers.append((proc, parent, first))
        for _, conn, _ in workers:
            kind, detail = conn.recv()
            if kind != "ready":
                raise RuntimeError(f"worker failed: {detail}")
        time.sleep(float(os.environ.get("BENCH_IDLE", "0")))  # to look at idle participants (threads, CPU)
        results = []
        #: per round: (worker, when, rank, local index) of each participant that returned in it
        returns: dict[int, list[tuple[int, float, int, int]]] = {r: [] for r in range(rounds)}
        errors: list[str] = []
        owner = {conn: w for w, (_, conn, _) in enumerate(workers)}
        for round_no in range(rounds):
            if round_no == 1:  # lose one active of round 0 for good
                w, index = next((w, i) for w, _t, rank, i in returns[0] if rank >= 0)
                workers[w][1].send(("kill", index))
            cpu_before = cpu_seconds(server.pid)
            start_at = time.time() + 1.0
            for _, conn, _ in workers:
                conn.send(("go", round_no, start_at))
            expected = n  # round 0: the actives (the spare returns in round 1); round 1: survivors + spare
            deadline = time.time() + timeout + 10
            while len(returns[round_no]) < expected and time.time() < deadline and len(errors) < 3 * n:
                for conn in wait_for_messages([c for _, c, _ in workers], timeout=1.0):
                    message = conn.recv()
                    if message[0] == "ret":
                        _, done, at, rank, index = message
                        returns.setdefault(done, []).append((owner[conn], at, rank, index))
                    elif message[0] == "error":
                        errors.append(message[2])
                    elif message[0] == "failed":
                        raise RuntimeError(f"worker failed: {message[1]}")
            cpu = cpu_seconds(server.pid) - cpu_before
            stats = []
            for _, conn, _ in workers:
                conn.send(("stats",))
            for _, conn, _ in workers:
                while True:
                    message = conn.recv()
                    if message[0] == "threads":
                        for name, row in message[1].items():
                            print(f"  threads of worker {owner[conn]}: {name:<40} n={row[0]:4d} cpu={row[1]:6.2f} s "
                                  f"switches={row[2]}+{row[3]}", flush=True)
                        continue
                    if message[0] == "stats":
                        stats.append(message[1])
                        break
                    if message[0] == "ret":
                        returns.setdefault(message[1], []).append((owner[conn], *message[2:]))
            counts: collections.Counter[str] = collections.Counter()
            for st in stats:
                counts.update(st["counts"])
            marks: dict[str, list[float]] = {}
            for st in stats:
                for key, (lo, _mid, hi) in st["marks"].items():
                    held = marks.setdefault(key, [lo, hi])
                    held[0], held[1] = min(held[0], lo), max(held[1], hi)
            got = returns[round_no]
            results.append({
                "last_arrived": marks["arrived"][1] - start_at if "arrived" in marks else None,
                "completed": marks["completed"][0] - start_at if "completed" in marks else None,
                "last": max((at for _, at, _, _ in got), default=start_at) - start_at,
                "first": min(at for _, at, _, _ in got) - start_at if got else None,
                "returned": len(got), "active": sum(1 for _, _, rank, _ in got if rank >= 0),
                "errors": errors[:3], "error_count": len(errors),
                "store_cpu": cpu, "clients_cpu": sum(st["cpu"] for st in stats),
                "clients_sys": sum(st["sys"] for st in stats), "requests": dict(counts),
                "phases": {k: [lo - start_at, hi - start_at] for k, (lo, hi) in marks.items()}})
        return results
    finally:
        for _, conn, _ in workers:
            try:
                conn.send(("end",))
            except OSError:
                pass
        for proc, _, _ in workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        server.kill()
        server.wait()


def report(n: int, backend: str, result: dict, kinds: bool) -> None:
    requests = sum(result["requests"].values())
    per = requests / max(1, n)
    first = f"{result['first']:.2f}" if result["first"] is not None else "-"
    print(f"{n:>6} {backend:<13} {result['last']:>8.2f} {first:>8} {result['returned']:>6} "
          f"{per:>10.1f} {result['store_cpu']:>9.2f}", flush=True)
    if result["error_count"]:
        print(f"       {result['error_count']} error(s), e.g. {result['errors']}", flush=True)
    completed = f"{result['completed']:.2f}" if result["completed"] is not None else "-"
    arrived = f"{result['last_arrived']:.2f}" if result["last_arrived"] is not None else "-"
    print(f"       last arrival at {arrived} s, completed at {completed} s; participants' "
          f"processes used {result['clients_cpu']:.1f} CPU s "
          f"({result['clients_sys']:.1f} s in the kernel)", flush=True)
    if os.environ.get("BENCH_PHASES"):
        for name, (lo, hi) in sorted(result["phases"].items(), key=lambda kv: kv[1][1]):
            print(f"         {name:<22} ends {lo:6.2f} s .. {hi:6.2f} s")
    if kinds and requests:
        for kind, count in sorted(result["requests"].items(), key=lambda kv: -kv[1])[:12]:
            print(f"         {count / n:8.2f}/participant  {kind}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--per-process", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--c10d", action="store_true", help="also torch's c10d backend, same N")
    parser.add_argument("--fail", action="store_true", help="also a failure round (one active lost, a spare in)")
    parser.add_argument("--kinds", action="store_true", help="print requests per participant by kind")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--no-failover", action="store_true", help="participants without store fail-over")
    args = parser.parse_args()
    if args.no_failover:
        os.environ["BENCH_STORE_FAILOVER"] = "false"  # read by the forked workers

    print(f"{'N':>6} {'backend':<13} {'last (s)':>8} {'first':>8} {'ret':>6} {'req/part':>10} {'store cpu':>9}")
    raw = []
    for n in args.sizes:
        rounds = measure("lightning_ft", n, args.per_process, args.timeout, args.fail, f"scale{n}")
        report(n, "lightning_ft", rounds[0], args.kinds)
        if args.fail:
            report(n, "  failure", rounds[1], args.kinds)
        raw.append({"n": n, "backend": "lightning_ft", "rounds": rounds})
        if args.c10d:
            theirs = measure("c10d", n, args.per_process, args.timeout, False, f"c10d{n}")
            report(n, "c10d", theirs[0], False)
            raw.append({"n": n, "backend": "c10d", "rounds": theirs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    lf = [(r["n"], sum(r["rounds"][0]["requests"].values())) for r in raw if r["backend"] == "lightning_ft"]
    if len(lf) >= 2:
        xs, ys = [x for x, _ in lf], [y for _, y in lf]
        slope = statistics.linear_regression(xs, ys).slope
        print(f"\nstore requests of a round vs N: fitted slope {slope:.1f} requests per participant")


if __name__ == "__main__":
    main()
