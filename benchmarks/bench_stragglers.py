"""Stragglers (issue 28): eviction to a hot spare, false positives, and what measuring costs.

Every run is ``tests/scripts/ft_train.py`` under ``ddp_ft`` in real processes on 127.0.0.1 with
a standalone ``lightning-ft store``; participant A trains from the start (an active) and is the
one made slow (``FT_TRAIN_SLOW="STEP:FACTOR"`` multiplies its step sleep from STEP on); B is the
other active; C (a hot spare) is started once A and B train.

* ``evict``: 2 actives + 1 spare, A 4x slower from ``--slow-from`` (default 100) of ``--steps``
  (400); measured: the step at which A was evicted (its ``evicted`` event) minus ``--slow-from``
  -- the target is at most the window + 10 steps -- and the job's wall time (first to last
  completed step of the job). Anchors in the same run: the same perturbation with
  ``straggler_factor=None`` (nobody evicted: every step at A's pace from then on), and an
  unperturbed run. Reported: the ratios of the wall times.
* ``false positives``: ``--fp-runs`` (10) runs, 2 actives + 1 spare, A 1.25x slower for the
  whole run of ``--fp-steps`` (200) steps; counted: ``straggler`` events and evictions (target 0).
* ``hook``: DDP steps with the meter (its gradient hooks, closure wrapper and step record) against
  the same without, in two plain gloo processes (no Lightning), alternating blocks of 50 steps:
  the meter's whole cost without whole-job noise.
* ``overhead``: 2 actives, no perturbation, a heavier step (``--hidden``, ``--batch-size``,
  no sleep), straggler watch on (default) vs off, alternating, ``--repeats`` times; the median
  step time on rank 0 after ``--warmup`` steps, and the median of the per-pair ratios (target
  <= 1 % above 1.00).

    python benchmarks/bench_stragglers.py [--repeats 3] [--steps 400] [--slow-from 100] [--fp-runs 10]
        [--only evict,fp,overhead,hook]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from ft_cluster import Cluster, _read_jsonl  # noqa: E402
from proc_utils import ProcessSet  # noqa: E402

WINDOW = 25  # the default straggler_window


def _run(root: Path, *, nnodes: str, spare: bool, args: list[str], slow: str | None, timeout: float) -> dict:
    """One job; returns every participant's exit code, completed-step records and events."""
    root.mkdir(parents=True, exist_ok=True)
    procs = ProcessSet(log_dir=root)
    try:
        cluster = Cluster(procs, root, nnodes, run_id="bench-stragglers")
        cluster.start_store()
        cluster.out.mkdir(parents=True, exist_ok=True)
        cluster.start_participant("A", args, **({"FT_TRAIN_SLOW": slow} if slow else {}))
        cluster.start_participant("B", args)
        cluster.wait_for_step(2, 120, among=["A", "B"])
        names = ["A", "B"]
        if spare:
            cluster.start_participant("C", args)
            names.append("C")
        codes = cluster.wait(names, timeout)
        records = [{**r, "pid": proc.pid} for proc in procs.procs.values()
                   for r in _read_jsonl(cluster.out / f"steps-{proc.pid}.jsonl")]
        return {"codes": codes, "records": records, "straggler": cluster.events_of("straggler"),
                "evicted": cluster.events_of("evicted")}
    finally:
        procs.kill_all()


def _wall(records: list[dict]) -> float:
    """First to last completed step of the job (any participant)."""
    times = [r["t"] for r in records]
    return max(times) - min(times)


def _per_step(records: list[dict], warmup: int, field: str) -> list[float]:
    """Rank 0's ``field`` (``t``: wall clock, ``pcpu``: the process's CPU time) between consecutive steps."""
    pid = next(r["pid"] for r in records if r["rank"] == 0)  # one process: CPU clocks are per process
    ordered = sorted((r for r in records if r["pid"] == pid), key=lambda r: r["t"])
    return [b[field] - a[field] for a, b in zip(ordered, ordered[1:], strict=False) if a["step"] >= warmup]


def _meter_cost(repeats: int = 200_000) -> float:
    """Seconds of Python the meter adds to one step besides its gradient hooks (one clock read per
    parameter), measured in a loop in this process: the closure wrapper and recording the step."""
    import time

    from lightning_ft.stragglers.meter import WorkMeter

    meter = WorkMeter(WINDOW)
    meter.begin()
    start = time.perf_counter()
    for step in range(repeats):
        meter._ready = meter.clock()  # what a gradient hook does
        meter.timed_closure(lambda: None)()
        meter.step_finished(step)
    return (time.perf_counter() - start) / repeats


def evict(args, base: Path) -> None:
    common = ["--step-sleep", str(args.step_sleep), "--snapshot-every", "50", "--quiet", "--max-steps",
              str(args.steps)]
    slow = f"{args.slow_from}:4"
    rows: dict[str, list[float]] = {"evicted": [], "not evicted": [], "unperturbed": []}
    latency: list[int] = []
    for repeat in range(args.repeats):
        for name, extra, perturb in (("evicted", [], slow), ("not evicted", ["--ft-option", "straggler_factor=null"],
                                                             slow), ("unperturbed", [], None)):
            result = _run(base / f"evict-{repeat}-{name.replace(' ', '-')}", nnodes="2:3", spare=True,
                          args=[*common, *extra], slow=perturb, timeout=args.steps * args.step_sleep * 6 + 120)
            rows[name].append(_wall(result["records"]))
            if name == "evicted":
                if result["codes"].get("A") != 84 or not result["evicted"]:
                    print(f"  repeat {repeat}: A was not evicted: codes {result['codes']}")
                else:
                    latency.append(result["evicted"][0]["step"] - args.slow_from)
            print(f"  repeat {repeat} {name:<12} wall {rows[name][-1]:.2f} s, codes {result['codes']}", flush=True)
    medians = {name: statistics.median(values) for name, values in rows.items()}
    print(f"\n### A 4x slower from step {args.slow_from} of {args.steps} (2 actives + 1 spare, "
          f"{args.step_sleep} s steps), {args.repeats} repeats\n")
    print("| run | wall time, median (min-max) | vs evicted |")
    print("|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {medians[name]:.2f} s ({min(values):.2f}-{max(values):.2f}) | "
              f"{medians[name] / medians['evicted']:.2f}x |")
    if latency:
        print(f"\nevicted {statistics.median(latency):.0f} steps after it became slow (median; "
              f"{min(latency)}-{max(latency)}; target <= window {WINDOW} + 10 = {WINDOW + 10})")


def false_positives(args, base: Path) -> None:
    common = ["--step-sleep", str(args.step_sleep), "--snapshot-every", "50", "--quiet", "--max-steps",
              str(args.fp_steps)]
    found, evictions = 0, 0
    for run in range(args.fp_runs):
        result = _run(base / f"fp-{run}", nnodes="2:3", spare=True, args=common, slow="0:1.25",
                      timeout=args.fp_steps * args.step_sleep * 6 + 120)
        found += len(result["straggler"])
        evictions += len(result["evicted"])
        print(f"  run {run}: codes {result['codes']}, straggler events {len(result['straggler'])}", flush=True)
    print(f"\n### False positives: A 1.25x slower for all {args.fp_steps} steps, {args.fp_runs} runs "
          f"(2 actives + 1 spare)\n\nstraggler events {found}, evictions {evictions} (target 0)")


def overhead(args, base: Path) -> None:
    common = ["--hidden", str(args.hidden), "--batch-size", str(args.batch_size), "--snapshot-every", "100",
              "--quiet", "--max-steps", str(args.steps)]
    figures: dict[str, dict[str, list[float]]] = {"on": {"t": [], "pcpu": []}, "off": {"t": [], "pcpu": []}}
    ratios: dict[str, list[float]] = {"t": [], "pcpu": []}
    for repeat in range(args.repeats):
        pair: dict[str, dict[str, float]] = {}
        order = (("on", []), ("off", ["--ft-option", "straggler_factor=null"]))
        for name, extra in (order if repeat % 2 == 0 else order[::-1]):
            result = _run(base / f"overhead-{repeat}-{name}", nnodes="2:2", spare=False, args=[*common, *extra],
                          slow=None, timeout=600)
            pair[name] = {f: statistics.median(_per_step(result["records"], args.warmup, f)) for f in ("t", "pcpu")}
            for field in ("t", "pcpu"):
                figures[name][field].append(pair[name][field])
        for field in ("t", "pcpu"):
            ratios[field].append(pair["on"][field] / pair["off"][field])
        print(f"  repeat {repeat}: wall on {pair['on']['t'] * 1e3:.2f} / off {pair['off']['t'] * 1e3:.2f} ms, "
              f"CPU on {pair['on']['pcpu'] * 1e3:.2f} / off {pair['off']['pcpu'] * 1e3:.2f} ms", flush=True)
    cost = _meter_cost()
    print(f"\n### What measuring costs (2 actives, hidden {args.hidden}, batch {args.batch_size}, "
          f"{args.steps} steps, {args.repeats} pairs)\n")
    print("| straggler watch | median step, wall | median step, process CPU (rank 0) |")
    print("|---|---|---|")
    for name, label in (("on", "on (default)"), ("off", "off (`straggler_factor=None`)")):
        print(f"| {label} | {statistics.median(figures[name]['t']) * 1e3:.2f} ms | "
              f"{statistics.median(figures[name]['pcpu']) * 1e3:.2f} ms |")
    for field, label in (("t", "wall"), ("pcpu", "process CPU")):
        print(f"\nratio on/off ({label}), median of the pairs: {statistics.median(ratios[field]):.4f} "
              f"(pairs {', '.join(f'{r:.3f}' for r in ratios[field])})")
    step = statistics.median(figures["off"]["t"])
    print(f"\nthe meter's own Python work per step, in a loop here: {cost * 1e6:.2f} us = "
          f"{100 * cost / step:.3f} % of the median step without it ({step * 1e3:.2f} ms)")


def _hook_worker(rank: int, port: int, iterations: int, hidden: int, batch: int) -> None:
    """One of two processes: alternate blocks of DDP steps without and with the meter (its gradient
    hooks, the closure wrapper, recording the step); print the medians."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_ft.stragglers.meter import WorkMeter

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
    dist.init_process_group("gloo", rank=rank, world_size=2, store=store)
    torch.manual_seed(0)
    models = {}
    for name in ("builtin", "meter"):
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(),
                                                                nn.Linear(hidden, 1)))
        meter = WorkMeter(WINDOW)
        if name == "meter":
            meter.watch_gradients(ddp.module)
        models[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), meter)
    x = torch.randn(batch, hidden)
    times: dict[str, list[float]] = {"builtin": [], "meter": []}
    for block in range(iterations // 50):
        for name in (("builtin", "meter") if block % 2 == 0 else ("meter", "builtin")):
            ddp, optimizer, meter = models[name]
            for _ in range(50):
                start = time.perf_counter()
                step = meter.timed_closure(lambda ddp=ddp: ddp(x).pow(2).mean().backward())
                step()
                optimizer.step()
                optimizer.zero_grad()
                meter.step_finished(0)
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({name: statistics.median(values[len(values) // 5:]) for name, values in times.items()}))
    dist.destroy_process_group()


def hook(args) -> None:
    """DDP steps with the meter against the same without, in two processes, alternating blocks."""
    import subprocess

    from ft_cluster import free_port

    port = free_port()
    argv = [sys.executable, __file__, "--hook-worker", "{rank}", str(port), str(args.hook_iterations),
            str(args.hidden), str(args.batch_size)]
    procs = [subprocess.Popen([a.format(rank=rank) for a in argv], stdout=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        out = [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    medians = json.loads(out[0].strip().splitlines()[-1])
    ratio = medians["meter"] / medians["builtin"]
    print(f"\n### DDP steps with the meter against without (2 processes, hidden {args.hidden}, "
          f"batch {args.batch_size}, {args.hook_iterations} steps each, alternating blocks of 50)\n")
    print(f"median step: without {medians['builtin'] * 1e3:.3f} ms, with the meter {medians['meter'] * 1e3:.3f} ms, "
          f"ratio {ratio:.4f} ({100 * (ratio - 1):+.2f} %)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--slow-from", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--fp-runs", type=int, default=10)
    parser.add_argument("--fp-steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--hook-iterations", type=int, default=2000)
    parser.add_argument("--only", default="evict,fp,overhead,hook")
    if len(sys.argv) > 1 and sys.argv[1] == "--hook-worker":
        rank, port, iterations, hidden, batch = (int(v) for v in sys.argv[2:7])
        _hook_worker(rank, port, iterations, hidden, batch)
        return 0
    args = parser.parse_args()
    parts = set(args.only.split(","))
    base = Path(tempfile.mkdtemp(prefix="bench_stragglers-", dir="/dev/shm"))
    try:
        if "evict" in parts:
            evict(args, base)
        if "fp" in parts:
            false_positives(args, base)
        if "overhead" in parts:
            overhead(args, base)
        if "hook" in parts:
            hook(args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
