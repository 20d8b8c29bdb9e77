"""How long a training process takes to be gone after ``fit()`` returns: ``ddp_ft`` vs plain ``ddp``.

Both run ``tests/scripts/ft_train.py`` (the 16->1024->1 MLP of ``bench_overhead.py``, a few
dozen steps) with 2 training processes on 127.0.0.1:

* plain: ``torchrun --standalone --nproc-per-node=2 ... --strategy ddp`` (the script destroys
  the process group after ``fit()``, as ddp_ft does inside it);
* ddp_ft: a standalone ``lightning-ft store`` + 2 participants (``2:2``), default settings.

For every training process: ``fit() returned`` (the ``t`` of its result file, written right
after ``fit()``) and its last completed step, against the moment the harness sees it gone
(a zombie or reaped: ``/proc/<pid>/stat`` polled every 2 ms). For ddp_ft the time between the
last step and ``fit()`` returning is the end of the run (exit barrier, closing the rendezvous,
acknowledging, destroying the group): everything its peers and the store need. Rounds run both
variants in a rotated order; the ratio of each round's means is reported with its spread.

    python benchmarks/bench_exit.py [--repeats 6] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from ft_cluster import SCRIPT, Cluster, _read_jsonl, base_env  # noqa: E402
from proc_utils import ProcessSet  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def model_args(args) -> list[str]:
    return ["--max-steps", str(args.steps), "--hidden", "1024", "--batch-size", "128", "--no-snapshots", "--quiet"]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


class GoneWatcher:
    """Notes the wall-clock time each training process (found by its steps file) is gone."""

    def __init__(self, out: Path, count: int) -> None:
        self.out, self.count = out, count
        self.gone_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pids: set[int] = set()
        while not self._stop.is_set() and len(self.gone_at) < self.count:
            if len(pids) < self.count:
                pids = {int(p.stem.split("-", 1)[1]) for p in self.out.glob("steps-*.jsonl")}
            for pid in pids - set(self.gone_at):
                if gone(pid):
                    self.gone_at[pid] = time.time()
            time.sleep(0.002)

    def wait(self, timeout: float) -> dict[int, float]:
        self._thread.join(timeout)
        self._stop.set()
        return self.gone_at


def exit_times(out: Path, gone_at: dict[int, float]) -> list[dict]:
    rows = []
    for pid, at in gone_at.items():
        result = json.loads((out / f"result-{pid}.json").read_text())
        last_step = max(r["t"] for r in _read_jsonl(out / f"steps-{pid}.jsonl"))
        rows.append({"after_fit": at - result["t"], "after_last_step": at - last_step,
                     "end_of_run": result["t"] - last_step})
    if len(rows) != 2:
        raise RuntimeError(f"expected 2 training processes, saw {len(rows)}")
    return rows


def run_plain(args, root: Path) -> list[dict]:
    root.mkdir(parents=True)
    procs, out = ProcessSet(log_dir=root), root / "out"
    out.mkdir()
    try:
        watcher = GoneWatcher(out, 2)
        proc = procs.start("plain", [TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, "--out", str(out),
                                     "--strategy", "ddp", "--devices", "2", *model_args(args)], env=base_env())
        if proc.popen.wait(timeout=300) != 0:
            raise RuntimeError(f"plain ddp failed:\n{proc.log()[-5000:]}")
        return exit_times(out, watcher.wait(30))
    finally:
        procs.kill_all()


def run_ft(args, root: Path) -> list[dict]:
    procs = ProcessSet(log_dir=root)
    try:
        cluster = Cluster(procs, root, "2:2", run_id="exit")
        cluster.out.mkdir(parents=True)
        watcher = GoneWatcher(cluster.out, 2)
        cluster.start(["A", "B"], model_args(args))
        codes = cluster.wait(["A", "B"], 300)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"ddp_ft failed: {codes}\n{cluster.logs()}")
        return exit_times(cluster.out, watcher.wait(30))
    finally:
        procs.kill_all()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    variants = [("plain", run_plain), ("ddp_ft", run_ft)]
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    base = Path(tempfile.mkdtemp(prefix="bench_exit-"))
    for i in range(args.repeats):
        order = variants if i % 2 == 0 else variants[::-1]
        for name, run in order:
            rows = run(args, base / f"{name}-{i}")
            means = {key: statistics.fmean(r[key] for r in rows) for key in rows[0]}
            per_round[name].append(means)
            print(f"round {i} {name:7s}: fit() returned -> gone {means['after_fit']:.3f} s, last step -> gone "
                  f"{means['after_last_step']:.3f} s (last step -> fit() returned {means['end_of_run']:.3f} s)",
                  flush=True)
    summary = {}
    print()
    for key, label in (("after_fit", "fit() returned -> process gone"), ("after_last_step", "last step -> gone"),
                       ("end_of_run", "last step -> fit() returned")):
        plain = [r[key] for r in per_round["plain"]]
        ours = [r[key] for r in per_round["ddp_ft"]]
        ratios = sorted(o / p for o, p in zip(ours, plain, strict=True))
        print(f"{label}: plain {spread(plain)}, ddp_ft {spread(ours)}; ddp_ft / plain per round: median "
              f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        summary[key] = {"plain": plain, "ddp_ft": ours, "ratio_median": statistics.median(ratios)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
