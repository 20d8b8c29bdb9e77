"""Steady-state overhead of ``ddp_ft`` (strategy + periodic in-memory snapshots) vs plain ``ddp``.

Both run ``tests/scripts/ft_train.py`` with 2 training processes on 127.0.0.1 and the same
model, data and step count:

* plain: ``torchrun --standalone --nproc-per-node=2 ... --strategy ddp``, no snapshots;
* ddp_ft: a standalone ``lightning-ft store`` + 2 participants (``2:2``), round watchdog and
  hang detection on, ``EmergencyCheckpoint(every_n_steps=--snapshot-every)``;
* ddp_ft + spare (``--with-spare``): the same plus a hot spare waiting on the same 2 cores;
* plain again (``--control``): an A/A control, whose ratio to plain is the noise floor of
  this run.

Step time = wall time between consecutive completed steps on rank 0 after ``--warmup`` steps;
the mean includes the snapshot steps. Each round runs every variant once, in a rotated order,
and each ddp_ft run is compared with the plain run of its round, which cancels the slow drift
of the load other users put on this shared 2-core machine and the order effect; the median of
those per-round ratios is the result (absolute times mean little here). ``--count-steps``
adds a deterministic figure: Python calls per steady-state step, counted by cProfile.

    python benchmarks/bench_overhead.py [--repeats 5] [--steps 400] [--control] [--pin-cpu] [--count-steps 300]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from ft_cluster import SCRIPT, Cluster, _read_jsonl, base_env  # noqa: E402
from proc_utils import ProcessSet  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def model_args(args) -> list[str]:
    return ["--max-steps", str(args.steps), "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
            "--quiet"]


def plain_snapshots(args) -> list[str]:
    if args.plain_snapshots and args.snapshot_every:  # diagnosis: the same EmergencyCheckpoint on the plain side
        return ["--snapshot-every", str(args.snapshot_every)]
    return ["--no-snapshots"]


def ft_snapshots(args) -> list[str]:
    # 0: no EmergencyCheckpoint of the script's own; the strategy adds its default (snapshots within 0.5 % of step time)
    return ["--snapshot-every", str(args.snapshot_every)] if args.snapshot_every else ["--no-snapshots"]


def step_deltas(records: list[dict], warmup: int, rank: int, field: str) -> list[float]:
    """Per-step differences of ``field`` (wall ``t``, training-thread ``cpu``, process ``pcpu``) on ``rank``."""
    ranked = sorted((r for r in records if r["rank"] == rank), key=lambda r: r["step"])
    return [b[field] - a[field] for a, b in itertools.pairwise(ranked)
            if a["step"] >= warmup and b["step"] == a["step"] + 1]


def step_times(records: list[dict], warmup: int) -> list[float]:
    return step_deltas(records, warmup, 0, "t")


def cpu_per_step(records: list[dict], warmup: int) -> tuple[float, float]:
    """Mean CPU seconds per step: rank 0's training thread, and both training processes (all threads).

    A resource figure beside the wall time: other users' load on the shared machine moves
    wall time by several percent between runs, CPU time much less.
    """
    thread = statistics.fmean(step_deltas(records, warmup, 0, "cpu"))
    process = sum(statistics.fmean(step_deltas(records, warmup, rank, "pcpu")) for rank in (0, 1))
    return thread, process


def run_plain(args, root: Path) -> list[dict]:
    root.mkdir(parents=True)
    procs = ProcessSet(log_dir=root)
    out = root / "out"
    try:
        proc = procs.start("plain", [TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, "--out", str(out),
                                     "--strategy", "ddp", "--devices", "2", *plain_snapshots(args), *model_args(args)],
                           env=base_env(LIGHTNING_FT_SNAPSHOT_DIR=str(root / "shm")))
        if proc.popen.wait(timeout=600) != 0:
            raise RuntimeError(f"plain ddp failed:\n{proc.log()[-5000:]}")
        return [r for p in out.glob("steps-*.jsonl") for r in _read_jsonl(p)]
    finally:
        procs.kill_all()


def run_ft(args, root: Path, spare: bool) -> list[dict]:
    procs = ProcessSet(log_dir=root)
    try:
        names = ["A", "B", "C"] if spare else ["A", "B"]
        cluster = Cluster(procs, root, "2:3" if spare else "2:2", run_id="overhead")
        extra = [f"--ft-option={option}" for option in args.ft_option]
        cluster.start(names, [*model_args(args), *ft_snapshots(args), "--hang-floor", "60", *extra])
        codes = cluster.wait(names, 600)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"ddp_ft failed: {codes}\n{cluster.logs()}")
        return [r for recs in cluster.steps().values() for r in recs]
    finally:
        procs.kill_all()


def python_calls_per_step(args, base: Path) -> dict[str, float]:
    """Python function calls per training step (cProfile), plain vs ddp_ft: a deterministic count.

    Each variant runs at two lengths; the difference of the totals divided by the difference
    of the step counts is the steady-state count per step, free of setup and teardown.
    """
    import pstats

    counts: dict[str, dict[int, float]] = {"plain": {}, "ddp_ft": {}}
    lengths = (args.count_steps, 2 * args.count_steps)
    for steps in lengths:
        sized = argparse.Namespace(**{**vars(args), "steps": steps})
        for name, run in (("plain", run_plain), ("ddp_ft", lambda a, r: run_ft(a, r, spare=False))):
            profile_dir = base / f"profile-{name}-{steps}"
            profile_dir.mkdir(parents=True)
            os.environ["FT_TRAIN_PROFILE"] = str(profile_dir)
            try:
                run(sized, base / f"count-{name}-{steps}")
            finally:
                del os.environ["FT_TRAIN_PROFILE"]
            totals = [sum(v[1] for v in pstats.Stats(str(f)).stats.values()) for f in profile_dir.glob("*.prof")]
            counts[name][steps] = statistics.fmean(totals)  # mean over the 2 ranks
    return {name: (c[lengths[1]] - c[lengths[0]]) / (lengths[1] - lengths[0]) for name, c in counts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--snapshot-every", type=int, default=50,
                        help="ddp_ft: EmergencyCheckpoint every N steps (a worst case); 0 = the strategy's "
                             "default configuration (snapshots within 0.5 %% of step time)")
    parser.add_argument("--with-spare", action="store_true", help="also measure ddp_ft with a hot spare")
    parser.add_argument("--control", action="store_true",
                        help="also run plain ddp a second time per round (A/A noise floor)")
    parser.add_argument("--pin-cpu", action="store_true",
                        help="pin every thread of rank r to core r (both variants): less scheduler noise")
    parser.add_argument("--count-steps", type=int, default=0, metavar="N",
                        help="also count Python calls per step under cProfile (runs of N and 2N steps)")
    parser.add_argument("--plain-snapshots", action="store_true",
                        help="diagnosis: give the plain run the same EmergencyCheckpoint")
    parser.add_argument("--ft-option", action="append", default=[], metavar="KEY=VALUE",
                        help="FaultTolerantDDPStrategy argument for the ddp_ft runs (for experiments)")
    args = parser.parse_args()
    if args.pin_cpu:
        os.environ["FT_TRAIN_PIN_CPU"] = "1"  # read by ft_train.py in both variants
    variants = [("plain", lambda a, r: run_plain(a, r)), ("ddp_ft", lambda a, r: run_ft(a, r, spare=False))]
    if args.with_spare:
        variants.append(("ddp_ft+spare", lambda a, r: run_ft(a, r, spare=True)))
    if args.control:
        variants.append(("plain-control", lambda a, r: run_plain(a, r)))
    means: dict[str, list[float]] = {name: [] for name, _ in variants}
    medians: dict[str, list[float]] = {name: [] for name, _ in variants}
    thread_cpu: dict[str, list[float]] = {name: [] for name, _ in variants}
    process_cpu: dict[str, list[float]] = {name: [] for name, _ in variants}
    base = Path(tempfile.mkdtemp(prefix="bench_overhead-"))
    summary: dict[str, float] = {}
    try:
        for i in range(args.repeats):
            # rotate the order: on this machine the position of a run in a round matters by a
            # few percent (A/A runs of plain against plain), so every variant takes every place
            shift = i % len(variants)
            for name, run in variants[shift:] + variants[:shift]:
                records = run(args, base / f"{name}-{i}")
                times = step_times(records, args.warmup)
                means[name].append(statistics.fmean(times))
                medians[name].append(statistics.median(times))
                thread, process = cpu_per_step(records, args.warmup)
                thread_cpu[name].append(thread)
                process_cpu[name].append(process)
                print(f"run {i} {name:13s}: mean step {means[name][-1] * 1e3:.3f} ms, "
                      f"median {medians[name][-1] * 1e3:.3f} ms over {len(times)} steps; CPU per step: training "
                      f"thread {thread * 1e3:.3f} ms, both processes {process * 1e3:.3f} ms", flush=True)
        if args.count_steps:
            calls = python_calls_per_step(args, base)
            extra = calls["ddp_ft"] - calls["plain"]
            summary.update(plain_calls_per_step=calls["plain"], ddp_ft_calls_per_step=calls["ddp_ft"])
            print(f"\nPython calls per step (cProfile, steady state): plain {calls['plain']:.1f}, "
                  f"ddp_ft {calls['ddp_ft']:.1f} ({extra:+.1f}, {extra / calls['plain'] * 100:+.2f}%)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    plain = statistics.median(means["plain"])
    summary["plain_mean_ms"] = plain * 1e3
    for name, _ in variants[1:]:
        ours = statistics.median(means[name])
        ratios = sorted(o / p for o, p in zip(means[name], means["plain"], strict=True))
        ratio = statistics.median(ratios)
        pooled = statistics.fmean(means[name]) / statistics.fmean(means["plain"])
        median_ratio = statistics.median(o / p for o, p in zip(medians[name], medians["plain"], strict=True))
        summary[f"{name}_mean_ms"] = ours * 1e3
        summary[f"{name}_ratio"] = ratio
        summary[f"{name}_pooled_ratio"] = pooled
        summary[f"{name}_median_step_ratio"] = median_ratio
        goal = "noise floor" if name == "plain-control" else "goal <= +1%"
        print(f"\n{name}: mean step {ours * 1e3:.3f} ms vs plain ddp {plain * 1e3:.3f} ms (medians of runs); "
              f"median per-round ratio of mean step time {ratio:.4f} ({(ratio - 1) * 100:+.2f}%; {goal}), "
              f"range {ratios[0]:.3f}..{ratios[-1]:.3f}; pooled (all runs) {pooled:.4f}; "
              f"of median step time {median_ratio:.4f}")
    if args.control:
        # both plain runs of a round are anchors: compare ddp_ft with their mean
        anchors = [(p + c) / 2 for p, c in zip(means["plain"], means["plain-control"], strict=True)]
        pooled = statistics.fmean(means["ddp_ft"]) / statistics.fmean(anchors)
        low, high = bootstrap_interval(means["ddp_ft"], anchors)
        summary.update(ddp_ft_vs_both_plain=pooled, ddp_ft_vs_both_plain_ci90=[low, high])
        print(f"\nddp_ft vs both plain runs of each round: pooled {pooled:.4f} ({(pooled - 1) * 100:+.2f}%), "
              f"90% bootstrap interval {low:.4f}..{high:.4f}")
        control = statistics.fmean(means["plain-control"]) / statistics.fmean(means["plain"])
        summary["control_vs_plain"] = control
        print(f"A/A control: plain-control / plain pooled {control:.4f} ({(control - 1) * 100:+.2f}%)")
    for key, label, values in (("thread", "training-thread CPU per step", thread_cpu),
                               ("process", "CPU per step, both training processes", process_cpu)):
        anchors = [statistics.fmean([values["plain"][i]] + ([values["plain-control"][i]] if args.control else []))
                   for i in range(len(values["plain"]))]
        for name, _ in variants[1:]:
            if name == "plain-control":
                continue
            pooled = statistics.fmean(values[name]) / statistics.fmean(anchors)
            low, high = bootstrap_interval(values[name], anchors)
            summary[f"{name}_{key}_cpu_ratio"] = pooled
            print(f"{label}: {name} {statistics.fmean(values[name]) * 1e3:.3f} ms vs plain "
                  f"{statistics.fmean(anchors) * 1e3:.3f} ms: {(pooled - 1) * 100:+.2f}% "
                  f"(90% bootstrap interval {(low - 1) * 100:+.2f}..{(high - 1) * 100:+.2f}%)")
    print(json.dumps(summary))
    return 0


def bootstrap_interval(ours: list[float], anchors: list[float], level: float = 0.90,
                       samples: int = 5000) -> tuple[float, float]:
    """Interval of sum(ours)/sum(anchors) when whole rounds are resampled (seeded: repeatable)."""
    rng = random.Random(0)
    n = len(ours)
    ratios = []
    for _ in range(samples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(ours[i] for i in picks) / sum(anchors[i] for i in picks))
    ratios.sort()
    tail = int(samples * (1 - level) / 2)
    return ratios[tail], ratios[samples - 1 - tail]


if __name__ == "__main__":
    sys.exit(main())
