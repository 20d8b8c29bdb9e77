"""Steady-state overhead of ``ddp_ft`` (strategy + periodic in-memory snapshots) vs plain ``ddp``.

Both run ``tests/scripts/ft_train.py`` with 2 training processes on 127.0.0.1 and the same
model, data and step count:

* plain: ``torchrun --standalone --nproc-per-node=2 ... --strategy ddp``, no snapshots;
* ddp_ft: a standalone ``lightning-ft store`` + 2 participants (``2:2``), round watchdog and
  hang detection on, ``EmergencyCheckpoint(every_n_steps=--snapshot-every)``;
* ddp_ft + spare (``--with-spare``): the same plus a hot spare waiting on the same 2 cores.

Step time = wall time between consecutive completed steps on rank 0 after ``--warmup`` steps;
the mean includes the snapshot steps. Runs alternate (plain then ddp_ft, then ddp_ft then
plain, ...) and each ddp_ft run is compared with the plain run next to it, which cancels the
slow drift of the load other users put on this shared 2-core machine and the order effect;
the median of those per-pair ratios is the result (absolute times mean little here).

    python benchmarks/bench_overhead.py [--repeats 5] [--steps 400]
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

from ft_cluster import SCRIPT, Cluster, _read_jsonl, base_env  # noqa: E402
from proc_utils import ProcessSet  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def model_args(args) -> list[str]:
    return ["--max-steps", str(args.steps), "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
            "--quiet"]


def plain_snapshots(args) -> list[str]:
    if args.plain_snapshots:  # diagnosis: the same EmergencyCheckpoint on the plain side
        return ["--snapshot-every", str(args.snapshot_every)]
    return ["--no-snapshots"]


def step_times(records: list[dict], warmup: int) -> list[float]:
    rank0 = sorted((r for r in records if r["rank"] == 0), key=lambda r: r["step"])
    return [b["t"] - a["t"] for a, b in zip(rank0, rank0[1:]) if a["step"] >= warmup and b["step"] == a["step"] + 1]


def run_plain(args, root: Path) -> list[float]:
    root.mkdir(parents=True)
    procs = ProcessSet(log_dir=root)
    out = root / "out"
    try:
        proc = procs.start("plain", [TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, "--out", str(out),
                                     "--strategy", "ddp", "--devices", "2", *plain_snapshots(args), *model_args(args)],
                           env=base_env(LIGHTNING_FT_SNAPSHOT_DIR=str(root / "shm")))
        if proc.popen.wait(timeout=600) != 0:
            raise RuntimeError(f"plain ddp failed:\n{proc.log()[-5000:]}")
        records = [r for p in out.glob("steps-*.jsonl") for r in _read_jsonl(p)]
        return step_times(records, args.warmup)
    finally:
        procs.kill_all()


def run_ft(args, root: Path, spare: bool) -> list[float]:
    procs = ProcessSet(log_dir=root)
    try:
        names = ["A", "B", "C"] if spare else ["A", "B"]
        cluster = Cluster(procs, root, "2:3" if spare else "2:2", run_id="overhead")
        extra = [f"--ft-option={option}" for option in args.ft_option]
        cluster.start(names, [*model_args(args), "--snapshot-every", str(args.snapshot_every),
                              "--hang-floor", "60", *extra])
        codes = cluster.wait(names, 600)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"ddp_ft failed: {codes}\n{cluster.logs()}")
        records = [r for recs in cluster.steps().values() for r in recs]
        return step_times(records, args.warmup)
    finally:
        procs.kill_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--snapshot-every", type=int, default=50)
    parser.add_argument("--with-spare", action="store_true", help="also measure ddp_ft with a hot spare")
    parser.add_argument("--plain-snapshots", action="store_true",
                        help="diagnosis: give the plain run the same EmergencyCheckpoint")
    parser.add_argument("--ft-option", action="append", default=[], metavar="KEY=VALUE",
                        help="FaultTolerantDDPStrategy argument for the ddp_ft runs (for experiments)")
    args = parser.parse_args()
    variants = [("plain", lambda a, r: run_plain(a, r)), ("ddp_ft", lambda a, r: run_ft(a, r, spare=False))]
    if args.with_spare:
        variants.append(("ddp_ft+spare", lambda a, r: run_ft(a, r, spare=True)))
    means: dict[str, list[float]] = {name: [] for name, _ in variants}
    medians: dict[str, list[float]] = {name: [] for name, _ in variants}
    base = Path(tempfile.mkdtemp(prefix="bench_overhead-"))
    try:
        for i in range(args.repeats):
            # alternate the order too: on this machine the second of two back-to-back runs is
            # ~2% faster on average (A/A test of plain against plain)
            for name, run in (variants if i % 2 == 0 else variants[::-1]):
                times = run(args, base / f"{name}-{i}")
                means[name].append(statistics.fmean(times))
                medians[name].append(statistics.median(times))
                print(f"run {i} {name:13s}: mean step {means[name][-1] * 1e3:.3f} ms, "
                      f"median {medians[name][-1] * 1e3:.3f} ms over {len(times)} steps", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    plain = statistics.median(means["plain"])
    summary = {"plain_mean_ms": plain * 1e3}
    for name, _ in variants[1:]:
        ours = statistics.median(means[name])
        ratio = statistics.median(o / p for o, p in zip(means[name], means["plain"]))
        median_ratio = statistics.median(o / p for o, p in zip(medians[name], medians["plain"]))
        summary[f"{name}_mean_ms"] = ours * 1e3
        summary[f"{name}_ratio"] = ratio
        summary[f"{name}_median_step_ratio"] = median_ratio
        print(f"\n{name}: mean step {ours * 1e3:.3f} ms vs plain ddp {plain * 1e3:.3f} ms (medians of runs); "
              f"median per-pair ratio of mean step time {ratio:.4f} ({(ratio - 1) * 100:+.2f}%; goal <= +2%), "
              f"of median step time {median_ratio:.4f}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
