"""A frozen rendezvous store (SIGSTOP of ``lightning-ft store``) while ``ddp_ft`` trains, then SIGTERM.

Two participants (``2:2``) of ``tests/scripts/ft_train.py`` with a ~30 ms step and a standalone
store. Per run:

1. train 30 steps, SIGSTOP the store; for ``--frozen-seconds`` compare the step times while it
   is frozen with the 30 steps before (the longest step and the median);
2. still frozen, SIGTERM both participants and measure, per participant, signal ->
   ``termination_decision`` (its event, wall clock) and signal -> process gone, with the exit
   code and the reason it logged;
3. SIGCONT the store.

``--stagger S`` sends the second SIGTERM S seconds after the first: the second participant is
then waiting in a collective for the first, which holds at its step boundary, and learns of
the stop when that collective fails (the exception path).

    python benchmarks/bench_store_freeze.py [--repeats 3] [--frozen-seconds 3] [--stagger 0.3]
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from ft_cluster import Cluster  # noqa: E402
from proc_utils import ProcessSet  # noqa: E402

NAMES = ("A", "B")


def gaps(records: list[dict], since: float, until: float) -> list[float]:
    times = sorted(r["t"] for r in records if since <= r["t"] <= until)
    return [b - a for a, b in itertools.pairwise(times)]


def one_run(root: Path, frozen_seconds: float, stagger: float) -> dict:
    procs = ProcessSet(log_dir=root)
    try:
        cluster = Cluster(procs, root, "2:2", run_id="freeze")
        cluster.out.mkdir(parents=True)
        store = cluster.start_store()
        for name in NAMES:
            cluster.start_participant(name, ["--max-steps", "100000", "--step-sleep", "0.03", "--snapshot-every", "10",
                                             "--quiet"])
        cluster.wait_for_step(30, 120)
        frozen_at = time.time()
        store.signal(signal.SIGSTOP)
        try:
            time.sleep(frozen_seconds)
            thawed_check = time.time()
            sent = {}
            for i, name in enumerate(NAMES):
                if i:
                    time.sleep(stagger)
                sent[name] = time.time()
                cluster.kill(name, signal.SIGTERM)
            gone: dict[str, float] = {}
            deadline = time.monotonic() + 60
            while len(gone) < len(NAMES) and time.monotonic() < deadline:
                for name in NAMES:
                    if name not in gone and cluster.procs[name].popen.poll() is not None:
                        gone[name] = time.time()
                time.sleep(0.005)
        finally:
            store.signal(signal.SIGCONT)
        steps = cluster.steps()
        rank0 = next(records for records in steps.values() if records and records[0]["rank"] == 0)
        before = gaps(rank0, frozen_at - 30 * 0.05, frozen_at)
        during = gaps(rank0, frozen_at, thawed_check)
        decisions = {event["who"]: event for event in cluster.events_of("termination_decision")}
        result = {"steps_before": len(before), "steps_frozen": len(during),
                  "median_step_before": statistics.median(before), "median_step_frozen": statistics.median(during),
                  "longest_step_frozen": max(during), "participants": {}}
        for name in NAMES:
            proc = cluster.procs[name]
            decision = next((e for e in decisions.values() if e["pid"] == proc.pid), None)
            result["participants"][name] = {
                "code": proc.popen.poll(),
                "decision_s": decision["t"] - sent[name] if decision else None,
                "gone_s": gone[name] - sent[name] if name in gone else None,
                "step": decision["step"] if decision else None,
                "why": decision["reasons"][0] if decision else None}
        return result
    finally:
        procs.kill_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frozen-seconds", type=float, default=3.0)
    parser.add_argument("--stagger", type=float, default=0.0)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench_store_freeze-"))
    decisions, gones, longest = [], [], []
    for i in range(args.repeats):
        run = one_run(base / f"run-{i}", args.frozen_seconds, args.stagger)
        longest.append(run["longest_step_frozen"])
        print(f"run {i}: store frozen {args.frozen_seconds:g} s: {run['steps_frozen']} steps trained meanwhile, "
              f"median step {run['median_step_frozen'] * 1e3:.1f} ms (before: {run['median_step_before'] * 1e3:.1f} "
              f"ms), longest {run['longest_step_frozen'] * 1e3:.1f} ms")
        for name, p in run["participants"].items():
            decisions.append(p["decision_s"])
            gones.append(p["gone_s"])
            print(f"  {name}: exit {p['code']}, signal -> decision {p['decision_s']:.2f} s, -> gone "
                  f"{p['gone_s']:.2f} s; stopped at step {p['step']}: {p['why']}")
    print(f"\nlongest step while frozen: {max(longest) * 1e3:.1f} ms; signal -> decision: median "
          f"{statistics.median(decisions):.2f} s ({min(decisions):.2f}-{max(decisions):.2f}); signal -> gone: median "
          f"{statistics.median(gones):.2f} s ({min(gones):.2f}-{max(gones):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
