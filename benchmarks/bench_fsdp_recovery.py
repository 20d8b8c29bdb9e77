"""fsdp_ft benchmark (issue 27): recovery onto a hot spare, shard transfer speed, shard-copy cost.

Real processes on 127.0.0.1 running ``tests/scripts/ft_train.py``, a standalone ``lightning-ft
store``, each participant with its own node identity (``LIGHTNING_FT_DOMAIN_ID``) and snapshot
root (``LIGHTNING_FT_SNAPSHOT_DIR``), as ``tests/test_fsdp_ft.py`` starts them. Three parts:

1. recovery: ``2:3`` (2 actives + 1 hot spare), small model, the strategy's default schedule
   (``--snapshot-every 0``: the overhead budget, the round-start snapshot and every snapshot
   after it copied to the other active's host; N: every N steps); SIGKILL the rank-1 active
   after step ``--kill-at`` and delete its snapshot root (its host is gone). Time from the kill
   to the first training step completed after it by the re-formed group (the ``steps-*.jsonl``
   records), plus the strategy's own ``first_step_after_recovery`` event. ``fsdp_ft`` (the lost
   rank's shards come from the copy on the other active's host) and, as the anchor in the same
   run, ``ddp_ft`` (replicated state, resumed from the survivor's live state) alternate,
   ``--repeats`` times each.
2. shard transfer: the same recovery with ``fsdp_ft`` and a larger model (``--hidden-large``):
   the ``snapshot_received`` event of the spare (bytes, seconds) -> GiB/s and s/GiB, and the
   ``shard_replica`` events before the kill (what each snapshot's copy moved, and took).
3. copy cost at the default schedule: ``2:2`` ``fsdp_ft``, the larger model, no snapshot
   interval given (``--snapshot-every 0``: the strategy's overhead-budget schedule),
   ``--replication-factor 1`` against ``0``, alternating; step times over the steady part
   (the first ``--skip`` share of the steps left out). The budget schedule snapshots about
   every 200-400 save durations (tens of seconds to minutes here), so a median step time
   cannot see a copy: the run with copies trains until ``--replica-copies`` scheduled copies
   happened, the run without trains as many steps, and the time the steps after each
   scheduled snapshot took above the median is reported per snapshot as well.

Absolute numbers on a shared 2-core machine mean little; the ratios measured in the same run
are the result. Snapshot roots live under ``--tmp-dir`` (default /dev/shm, as on a real host).

    python benchmarks/bench_fsdp_recovery.py [--repeats 3] [--kill-at 25] [--hidden-large 660000]
        [--replica-copies 1] [--replica-max-seconds 170] [--replica-repeats 1] [--smoke] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from ft_cluster import Cluster  # noqa: E402
from proc_utils import ProcessSet  # noqa: E402

GIB = 2**30
MIB = 2**20
#: log lines worth reporting (participants and store)
SUSPICIOUS = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|terminate called|Exception|Error:")
#: what differs between two otherwise equal log lines (timestamps, pids, ports, paths, numbers)
_VOLATILE = re.compile(r"^\[[^\]]*?pid=\d+ |/[\w./-]*bench_fsdp_recovery-\w+[\w./-]*|\b\d+(\.\d+)?\b")


def train_args(args, strategy: str, hidden: int, max_steps: int, snapshot_every: int,
               replication_factor: int = 1) -> list[str]:
    return ["--strategy", strategy, "--hidden", str(hidden), "--resumable-data", "--step-sleep", str(args.step_sleep),
            "--max-steps", str(max_steps), "--snapshot-every", str(snapshot_every),
            "--replication-factor", str(replication_factor), "--pg-timeout", str(args.pg_timeout), "--quiet"]


def start_cluster(procs: ProcessSet, root: Path, nnodes: str, names: str, argv: list[str], run_id: str) -> Cluster:
    """Store + participants, each with a fixed scheduler node index, its own domain and snapshot root."""
    cluster = Cluster(procs, root, nnodes, run_id=run_id)
    cluster.out.mkdir(parents=True, exist_ok=True)
    cluster.start_store()
    for index, name in enumerate(names):
        cluster.start_participant(name, [*argv, "--ft-option", f"infra_rank={index}"])
    return cluster


def suspicious_lines(cluster: Cluster, label: str, found: Counter) -> None:
    """Count the log lines of every process of ``cluster`` that look wrong, normalized."""
    for name, proc in [*cluster.stores.items(), *cluster.procs.items()]:
        role = "store" if name in cluster.stores else "participant"
        for line in proc.log().splitlines():
            if SUSPICIOUS.search(line):
                found[(f"{label}, {role}", _VOLATILE.sub("#", line.strip())[:300])] += 1


def first_step_after_kill(cluster: Cluster, names: list[str], kill_time: float) -> float | None:
    """Wall time of the first step record written after a training start that came after the
    kill (a survivor may still record the step it was finishing when its peer died)."""
    firsts = []
    for name in names:
        restarts = [s["t"] for s in cluster.starts(name) if s["t"] > kill_time]
        if not restarts:
            continue
        later = [r["t"] for r in cluster.steps()[name] if r["t"] > min(restarts)]
        if later:
            firsts.append(min(later))
    return min(firsts) if firsts else None


def run_recovery(args, root: Path, strategy: str, hidden: int, found: Counter, label: str) -> dict:
    """One ``2:3`` run: kill the rank-1 active after ``--kill-at``, its host's memory with it."""
    procs = ProcessSet(log_dir=root)
    finish = hidden == args.hidden  # the large model's runs stop once recovered (its final gather is slow)
    max_steps = args.max_steps if finish else args.transfer_max_steps
    kill_at = args.kill_at if finish else args.transfer_kill_at
    try:
        cluster = start_cluster(procs, root, "2:3", "ABC",
                                train_args(args, strategy, hidden, max_steps, args.snapshot_every),
                                run_id=f"bench-{strategy}")
        cluster.wait_for_step(kill_at, args.timeout)
        steps = cluster.steps()
        victim = next(name for name, records in steps.items() if records and records[-1]["rank"] == 1)
        killed_at_step = steps[victim][-1]["step"]
        kill_time = cluster.kill(victim)
        shutil.rmtree(root / f"shm-{victim}", ignore_errors=True)  # the host is gone, its memory with it
        survivors = [name for name in "ABC" if name != victim]
        codes: dict[str, int | None] = {}
        if finish:
            codes = cluster.wait(survivors, args.timeout)
            if any(code != 0 for code in codes.values()):
                raise RuntimeError(f"{strategy} run failed: {codes}\n{cluster.logs()}")
        else:
            deadline = time.monotonic() + args.timeout
            while not all(first_step_after_kill(cluster, [name], kill_time) for name in survivors):
                if time.monotonic() > deadline or any(cluster.procs[n].popen.poll() is not None for n in survivors):
                    raise RuntimeError(f"{strategy} (hidden {hidden}) did not recover\n{cluster.logs()}")
                time.sleep(0.05)
        first = first_step_after_kill(cluster, survivors, kill_time)
        after = [e for e in cluster.events_of("first_step_after_recovery") if e["t"] > kill_time]
        detected = [e["t"] for e in cluster.events_of("failure_detected") if e["t"] > kill_time]
        restored = [e["step"] for e in cluster.events_of("restored") if e["t"] > kill_time]
        received = [e for e in cluster.events_of("snapshot_received") if e["t"] > kill_time]
        replicas = [e for e in cluster.events_of("shard_replica") if e["t"] < kill_time]
        suspicious_lines(cluster, label, found)
        return {"seconds": None if first is None else first - kill_time,
                "event_seconds": min(e["t"] for e in after) - kill_time if after else None,
                "since_failure": min(after, key=lambda e: e["t"])["seconds_since_failure"] if after else None,
                "detection": min(detected) - kill_time if detected else None,
                "killed_at_step": killed_at_step, "resumed_step": min(restored) if restored else None,
                "received": [{k: e.get(k) for k in ("step", "from_rank", "bytes", "seconds")} for e in received],
                "replicas": [{k: e.get(k) for k in ("step", "bytes", "seconds")} for e in replicas],
                "codes": codes}
    finally:
        procs.kill_all()


def scheduled_steps(schedule: list[dict], max_steps: int) -> list[int]:
    """Periodic snapshot steps of the agreed schedule (``snapshot_schedule`` events of rank 0):
    the steps whose snapshot is copied (the budget schedule's first calibration save, at step 8,
    is not one unless the interval divides 8)."""
    return [step for step in range(1, max_steps + 1)
            if (every := interval_at(schedule, step)) and step % every == 0]


def run_steady(args, root: Path, factor: int, found: Counter, stop_at: int | None = None) -> dict:
    """One ``2:2`` fsdp_ft run at the default snapshot schedule with ``factor`` shard copies.

    ``stop_at`` None: train until ``--replica-copies`` scheduled copies happened and
    ``--margin`` steps after the last (at most ``--replica-max-seconds`` of training, at most
    ``--replica-max-steps``); else exactly ``stop_at`` steps (the paired run without copies).
    The processes are killed at the last step (the script's final gather of the weights is slow
    with this model and measures nothing here)."""
    procs = ProcessSet(log_dir=root)
    cap = stop_at or args.replica_max_steps
    try:
        cluster = start_cluster(procs, root, "2:2", "AB",
                                train_args(args, "fsdp_ft", args.hidden_large, cap, 0, factor),
                                run_id=f"bench-steady-{factor}")
        cluster.wait_for_step(1, args.timeout, among=["A", "B"])
        trained_since = time.monotonic()
        while True:
            last = min((r[-1]["step"] if r else 0) for r in cluster.steps().values())
            if stop_at is not None:
                done = last >= stop_at
            else:
                # scheduled copies only: not the round start's (step 0) nor the measured save's (step 8)
                copied = sorted({e["step"] for e in cluster.events_of("shard_replica") if e["step"] > 8})
                done = (len(copied) >= args.replica_copies and last >= copied[args.replica_copies - 1] + args.margin) \
                    or last >= cap or time.monotonic() - trained_since > args.replica_max_seconds
            if done:
                break
            if any(p.popen.poll() is not None for p in cluster.procs.values()):
                raise RuntimeError(f"steady run rf={factor} ended early\n{cluster.logs()}")
            if time.monotonic() - trained_since > args.replica_max_seconds + args.timeout:
                raise RuntimeError(f"steady run rf={factor} did not reach step {stop_at}\n{cluster.logs()}")
            time.sleep(0.1)
        procs.kill_all()  # stops both at once; their records up to here are complete lines
        steps = cluster.steps()
        total = stop_at or min(r[-1]["step"] for r in steps.values())
        rank0 = next(name for name, recs in steps.items() if recs[-1]["rank"] == 0)
        t = {r["step"]: r["t"] for r in steps[rank0]}
        skip = max(2, math.ceil(args.skip * total))
        durations = {s: t[s] - t[s - 1] for s in range(skip + 1, total + 1) if s in t and s - 1 in t}
        median = statistics.median(durations.values())
        mean = (t[total] - t[skip]) / (total - skip)
        schedule = cluster.events_of("snapshot_schedule")
        scheduled = scheduled_steps(schedule, total)
        snaps = sorted({8, *scheduled}) if total >= 8 else scheduled  # with the first calibration's save
        replicas = [e for e in cluster.events_of("shard_replica") if e["step"] <= total]
        # what a scheduled snapshot costs on the training timeline (rank 0's records): the two steps after
        # it -- the background copy is committed and the shards copied in the next optimizer
        # step; a holder still writing the copy it received delays the step after -- above two
        # median steps
        excess = {s: t[s + 2] - t[s] - 2 * median for s in scheduled if s > skip and s + 2 in t}
        suspicious_lines(cluster, f"steady rf={factor}", found)
        return {"median": median, "mean": mean, "steps": total, "steady_steps": total - skip,
                "first_steady_step": skip, "snapshots": snaps, "scheduled": scheduled,
                "schedule": [{k: e.get(k) for k in ("step", "snapshot_every_n_steps", "seconds_per_step",
                                                    "save_seconds")} for e in schedule],
                "replicas": [{k: e.get(k) for k in ("step", "bytes", "seconds")} for e in replicas],
                "excess": excess, "interval": interval_at(schedule, max(excess) if excess else total)}
    finally:
        procs.kill_all()


def interval_at(schedule: list[dict], step: int) -> int | None:
    agreed = [e for e in schedule if e["step"] <= step]
    return agreed[-1]["snapshot_every_n_steps"] if agreed else None


def cleanup(args, root: Path) -> None:
    if args.keep:
        for snapshots in root.glob("**/shm-*"):  # the logs and events stay, the snapshots' memory goes
            shutil.rmtree(snapshots, ignore_errors=True)
        print(f"kept {root}", flush=True)
    else:
        shutil.rmtree(root, ignore_errors=True)


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="recovery runs per strategy (part 1)")
    parser.add_argument("--hidden", type=int, default=32, help="small model (part 1)")
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="parts 1 and 2 (0: the strategy's default schedule, as a user's job gets it)")
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--hidden-large", type=int, default=660_000,
                        help="larger model (parts 2 and 3); a rank's snapshot is about 102-114 bytes x hidden")
    parser.add_argument("--transfer-kill-at", type=int, default=25)
    parser.add_argument("--transfer-max-steps", type=int, default=200)
    parser.add_argument("--replica-copies", type=int, default=1,
                        help="part 3: the run with copies trains until this many scheduled copies happened")
    parser.add_argument("--margin", type=int, default=10, help="part 3: steps trained after the last of them")
    parser.add_argument("--replica-max-seconds", type=float, default=170.0,
                        help="part 3: the run with copies stops after this much training whatever happened")
    parser.add_argument("--replica-max-steps", type=int, default=2000)
    parser.add_argument("--replica-repeats", type=int, default=1, help="part-3 pairs (with copies, then without)")
    parser.add_argument("--skip", type=float, default=0.2, help="share of the first steps left out of part 3")
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="bound of each wait in a run")
    parser.add_argument("--tmp-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--parts", default="123", help="which parts to run, e.g. 13")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories (logs, events)")
    parser.add_argument("--smoke", action="store_true", help="one short run of each part (checks the script)")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.replica_repeats, args.hidden_large, args.replica_max_seconds = 1, 1, 200_000, 15
    base = Path(tempfile.mkdtemp(prefix="bench_fsdp_recovery-", dir=args.tmp_dir))
    found: Counter = Counter()
    recovery: dict[str, list[dict]] = {"fsdp_ft": [], "ddp_ft": []}
    transfer: dict | None = None
    steady: dict[int, list[dict]] = {1: [], 0: []}
    started = time.monotonic()
    try:
        if "1" in args.parts:
            for i in range(args.repeats):
                for strategy in ("fsdp_ft", "ddp_ft"):
                    root = base / f"recovery-{strategy}-{i}"
                    outcome = run_recovery(args, root, strategy, args.hidden, found, f"recovery {strategy}")
                    cleanup(args, root)
                    recovery[strategy].append(outcome)
                    print(f"run {i} {strategy}: kill (after step {outcome['killed_at_step']}) -> first step "
                          f"{outcome['seconds']:.3f}s (event {outcome['event_seconds']:.3f}s, "
                          f"seconds_since_failure {outcome['since_failure']}, detected after "
                          f"{outcome['detection']:.3f}s), resumed from step {outcome['resumed_step']}", flush=True)
        if "2" in args.parts:
            root = base / "transfer"
            transfer = run_recovery(args, root, "fsdp_ft", args.hidden_large, found, "transfer fsdp_ft")
            cleanup(args, root)
            print(f"transfer run: kill -> first step {transfer['seconds']:.3f}s, received {transfer['received']}, "
                  f"{len(transfer['replicas'])} shard copies before the kill", flush=True)
        if "3" in args.parts:
            for i in range(args.replica_repeats):
                stop_at = None
                for factor in (1, 0):  # the run with copies decides how long both train
                    root = base / f"steady-rf{factor}-{i}"
                    outcome = run_steady(args, root, factor, found, stop_at)
                    stop_at = outcome["steps"]
                    cleanup(args, root)
                    steady[factor].append(outcome)
                    print(f"run {i} replication_factor={factor}: median step {outcome['median'] * 1e3:.2f} ms, "
                          f"mean {outcome['mean'] * 1e3:.2f} ms over steps {outcome['first_steady_step'] + 1}-"
                          f"{outcome['steps']}; snapshots at {outcome['snapshots']}, "
                          f"{len(outcome['replicas'])} copy events; two steps after each scheduled one above "
                          f"two median steps: { {s: round(x * 1e3, 1) for s, x in outcome['excess'].items()} } ms",
                          flush=True)
    finally:
        cleanup(args, base)
    print(f"\n(all runs: {time.monotonic() - started:.0f} s)\n")
    report(args, recovery, transfer, steady, found)
    return 0


def report(args, recovery: dict[str, list[dict]], transfer: dict | None, steady: dict[int, list[dict]],
           found: Counter) -> None:
    if recovery["fsdp_ft"]:
        print(f"### 1. kill -> first step after recovery (2 actives + 1 hot spare, hidden {args.hidden}, "
              f"kill after step {args.kill_at}, snapshots every {args.snapshot_every}, "
              f"{len(recovery['fsdp_ft'])} runs each; median (min-max))\n")
        print("| strategy | kill -> first step (steps records) | kill -> first_step_after_recovery event "
              "| event seconds_since_failure | kill -> failure_detected | resumed from step (killed after) |")
        print("|---|---|---|---|---|---|")
        for strategy, runs in recovery.items():
            resumed = ", ".join(f"{r['resumed_step']} ({r['killed_at_step']})" for r in runs)
            print(f"| {strategy} | {spread([r['seconds'] for r in runs])} s "
                  f"| {spread([r['event_seconds'] for r in runs])} s "
                  f"| {spread([r['since_failure'] for r in runs])} s | {spread([r['detection'] for r in runs])} s "
                  f"| {resumed} |")
        ours = statistics.median(r["seconds"] for r in recovery["fsdp_ft"])
        anchor = statistics.median(r["seconds"] for r in recovery["ddp_ft"])
        print(f"\nratio fsdp_ft / ddp_ft (medians, steps records): **{ours / anchor:.2f}**; "
              f"target fsdp_ft <= 1 s: {'met' if ours <= 1.0 else 'NOT met'} ({ours:.3f} s)\n")
    if transfer is not None:
        print(f"### 2. shard transfer (fsdp_ft, hidden {args.hidden_large}, kill after step "
              f"{transfer['killed_at_step']}, resumed from step {transfer['resumed_step']})\n")
        print("| what | step | bytes | MiB | seconds | GiB/s | s/GiB |")
        print("|---|---|---|---|---|---|---|")
        for kind, events in (("snapshot_received (recovery, to the spare)", transfer["received"]),
                             ("shard_replica (per snapshot, per rank)", transfer["replicas"])):
            for e in events:
                rate = e["bytes"] / GIB / e["seconds"] if e["seconds"] else float("nan")
                print(f"| {kind} | {e['step']} | {e['bytes']} | {e['bytes'] / MIB:.1f} | {e['seconds']:.4f} "
                      f"| {rate:.2f} | {1 / rate:.2f} |")
        print(f"\nkill -> first step after recovery with this model: {transfer['seconds']:.3f} s "
              f"(event seconds_since_failure {transfer['since_failure']})\n")
    if steady[1] and steady[0]:
        print(f"### 3. shard copies at the default schedule (fsdp_ft, 2 actives, hidden {args.hidden_large}, "
              f"step sleep {args.step_sleep}s; the run with copies trains until {args.replica_copies} scheduled "
              f"cop(ies) + {args.margin} steps (at most {args.replica_max_seconds:g} s), the run without as many "
              f"steps; steady part: after the first {100 * args.skip:g} % of the steps)\n")
        print("| pair | replication_factor | steady steps | median step ms | mean step ms | snapshot steps "
              "(interval) | copies per rank | bytes per copy | copy seconds (event) "
              "| 2 steps after each scheduled snapshot (steady part) above 2 median steps, ms |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for i, pair in enumerate(zip(steady[1], steady[0], strict=False)):
            for factor, r in zip((1, 0), pair, strict=True):
                copies = r["replicas"]
                print(f"| {i} | {factor} | {r['first_steady_step'] + 1}-{r['steps']} | {r['median'] * 1e3:.2f} "
                      f"| {r['mean'] * 1e3:.2f} | {r['snapshots']} ({r['interval']}) "
                      f"| {len({e['step'] for e in copies})} "
                      f"| {', '.join(str(b) for b in sorted({e['bytes'] for e in copies})) or '-'} "
                      f"| {', '.join(format(e['seconds'], '.3f') for e in copies) or '-'} "
                      f"| {', '.join(f'{s}: {x * 1e3:.1f}' for s, x in r['excess'].items()) or '-'} |")
        print()
        for i, (with_copies, without) in enumerate(zip(steady[1], steady[0], strict=False)):
            line = (f"pair {i}: median step {100 * (with_copies['median'] / without['median'] - 1):+.2f} %, "
                    f"mean step {100 * (with_copies['mean'] / without['mean'] - 1):+.2f} % with copies")
            if with_copies["excess"] and with_copies["interval"]:
                extra = statistics.median(with_copies["excess"].values())
                base = statistics.median(without["excess"].values()) if without["excess"] else None
                per_copy = extra - (base or 0.0)
                interval_s = with_copies["interval"] * with_copies["median"]
                what = "snapshot + copy" if base is None else "copy (minus the same steps without copies)"
                line += (f"; per scheduled snapshot {extra * 1e3:.1f} ms above the median with copies"
                         f"{'' if base is None else f', {base * 1e3:.1f} ms without'}: the {what} costs "
                         f"{per_copy * 1e3:.1f} ms every {with_copies['interval']} steps "
                         f"({interval_s:.1f} s of training) = {100 * per_copy / interval_s:.2f} % of training time")
            print(line)
        print("(target <= 1 %)")
        for factor in (1, 0):
            for r in steady[factor]:
                print(f"schedule rf={factor}: {r['schedule']}")
        print()
    print("### participants' and store's log lines with WARNING/ERROR/Traceback (normalized, counts)\n")
    if not found:
        print("none")
    for (label, line), count in sorted(found.items()):
        print(f"- [{label}] x{count}: {line}")
    print()
    print(json.dumps({"recovery": recovery, "transfer": transfer, "steady": {str(k): v for k, v in steady.items()}},
                     default=str))


if __name__ == "__main__":
    sys.exit(main())
